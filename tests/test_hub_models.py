"""Models by hub id (:mod:`epdserve.models.hub`): ``--model-path org/name`` against a stand-in hub on 127.0.0.1
(``tests/hub_stub.py``, through ``HF_ENDPOINT``), the Hugging Face cache in a temp ``HF_HOME``.

- ``epdserve launch --model-path org/tiny-vl`` downloads once, serves under the id, and answers a photo request
  token for token as the launch of the local directory does; a second launch with ``HF_HUB_OFFLINE=1`` and the
  stand-in stopped starts from the cache;
- every bad input (no such repo, a gated one without a token, an unknown revision, no network and nothing cached,
  an architecture epdserve does not serve, no safetensors, no tokenizer) is one line and a non-zero exit, before
  any stage.

huggingface_hub reads ``HF_ENDPOINT`` / ``HF_HOME`` / ``HF_HUB_OFFLINE`` when it is imported, so everything runs
in subprocesses with those set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launched
from hub_stub import HubStub
from test_e2e import _chat, _openai_messages, _resolve

ID = "org/tiny-vl"


@pytest.fixture(scope="module")
def repos(tiny_model_path, tmp_path_factory) -> dict[str, Path]:
    """The stand-in hub's repos: the tiny checkpoint as ``org/tiny-vl`` (and as a gated copy), a Llama config
    (an architecture epdserve does not serve) and a checkpoint without weights."""
    root = tmp_path_factory.mktemp("hub")
    llama = root / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    shutil.copy(next(Path(tiny_model_path).glob("*.safetensors")), llama / "model.safetensors")
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(Path(tiny_model_path) / "config.json", no_weights / "config.json")
    no_tokenizer = root / "no-tokenizer"
    shutil.copytree(tiny_model_path, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    return {ID: Path(tiny_model_path), "org/gated-vl": Path(tiny_model_path), "org/llama": llama,
            "org/no-weights": no_weights, "org/no-tokenizer": no_tokenizer}


def _env(endpoint: str, hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def _download(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve", "download", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_launch_by_hub_id_downloads_once_and_serves_under_the_id(repos, server, photo_paths, tmp_path,
                                                                  monkeypatch):
    hf_home = tmp_path / "hf"
    messages = _openai_messages(_resolve("one_photo", photo_paths))
    with HubStub(repos) as hub:
        for key, value in _env(hub.url, hf_home).items():
            monkeypatch.setenv(key, value)
        (tmp_path / "by-id").mkdir()
        with launched(ID, tmp_path / "by-id") as (url, _):
            got = _chat(url, ID, messages)
        downloads = [r for r in hub.requests if r.startswith("GET") and "/resolve/" in r]
    assert got["model"] == ID
    tiny = repos[ID]
    files = {p.name for p in tiny.iterdir() if p.is_file()}
    assert len(downloads) == len(files), f"each file once (one download for the four stages): {hub.requests}"
    url_local, _ = server  # the same checkpoint from its local directory
    want = _chat(url_local, str(tiny), messages)
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    # The stand-in is gone: offline, the launch starts from the cache.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "offline").mkdir()
    with launched(ID, tmp_path / "offline") as (url, _):
        assert _chat(url, ID, messages)["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


def test_download_prints_the_cached_directory(repos, tmp_path):
    with HubStub(repos) as hub:
        out = _download(_env(hub.url, tmp_path / "hf"), ID)
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip().splitlines()[-1])
    assert (path / "config.json").read_bytes() == (repos[ID] / "config.json").read_bytes()
    assert str(path).startswith(str(tmp_path / "hf"))


@pytest.mark.parametrize("args,extra_env,says", [
    (["org/missing"], {}, "no such model repository"),
    (["org/gated-vl"], {}, "gated repository"),
    ([ID, "--revision", "v9"], {}, "no revision 'v9'"),
    (["org/llama"], {}, "is a 'llama' model; epdserve serves"),
    (["org/no-weights"], {}, "no safetensors weights"),
    (["org/no-tokenizer"], {}, "has no tokenizer (tokenizer.json)"),
    ([ID], {"HF_HUB_OFFLINE": "1"}, "is not in the Hugging Face cache"),
])
def test_bad_hub_inputs_are_one_line_and_a_nonzero_exit(repos, tmp_path, args, extra_env, says):
    with HubStub(repos, gated={"org/gated-vl"}) as hub:
        out = _download(_env(hub.url, tmp_path / "hf", **extra_env), *args)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and err, out.stderr
    assert err[-1].startswith("epdserve download: ") and says in err[-1], out.stderr
    assert "Traceback" not in out.stderr


def test_no_network_and_nothing_cached(repos, tmp_path):
    from epdserve.wire.ports import free_port

    out = _download(_env(f"http://127.0.0.1:{free_port()}", tmp_path / "hf"), ID)  # nothing listens there
    assert out.returncode == 2 and "cannot be reached" in out.stderr.strip().splitlines()[-1], out.stderr


def test_a_stage_with_a_bad_hub_id_stops_before_loading(repos, tmp_path):
    with HubStub(repos) as hub:
        out = subprocess.run([sys.executable, "-m", "epdserve", "prefill", "--model-path", "org/missing",
                              "--device", "cpu", "--port", "0"], env=_env(hub.url, tmp_path / "hf"),
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("epdserve prefill: org/missing: no such model")
