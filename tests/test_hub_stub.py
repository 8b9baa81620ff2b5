"""The stand-in hub (tests/hub_stub.py) works with the installed huggingface_hub: snapshot_download fetches a
served folder byte for byte, the cache answers offline, allow_patterns filters, and the hub's errors raise
huggingface_hub's own exception classes. Everything talks to the stub on 127.0.0.1 only."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_stub import HubStub
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

FILES = {
    "config.json": json.dumps({"model_type": "tiny"}).encode(),
    "model.safetensors": bytes(range(256)) * 16,  # 4 KiB: an LFS file
    "tokenizer.json": b'{"version": "1.0"}',
    "nested/notes.txt": b"a file in a subfolder\n",
}


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def stub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "tiny"
    for rel, data in FILES.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    with HubStub({"org/tiny": folder, "org/gated": folder}, gated={"org/gated"}) as hub:
        yield hub


def download(stub: HubStub, tmp_path: Path, repo_id: str = "org/tiny", **kwargs) -> Path:
    kwargs.setdefault("token", False)  # anonymous unless a test says otherwise (no token from ~/.cache)
    return Path(snapshot_download(repo_id, endpoint=stub.url, cache_dir=tmp_path / "cache", **kwargs))


def test_snapshot_download_gets_identical_bytes(stub, tmp_path):
    path = download(stub, tmp_path)
    assert tree(path) == FILES
    commit = path.name
    assert len(commit) == 40 and stub.requests[0] == "GET /api/models/org/tiny/revision/main"
    assert stub.requests[1].startswith(f"GET /api/models/org/tiny/tree/{commit}?recursive=")
    for rel in FILES:  # one metadata HEAD and one GET per file, at the resolved commit
        assert {f"HEAD /org/tiny/resolve/{commit}/{rel}", f"GET /org/tiny/resolve/{commit}/{rel}"} <= set(stub.requests)
    # The LFS file is cached under its sha256, as X-Linked-Etag named it.
    blob = Path(os.path.realpath(path / "model.safetensors"))
    assert blob.name == hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    # The commit id is a revision too.
    assert download(stub, tmp_path, revision=commit) == path


def test_cached_snapshot_needs_no_request(stub, tmp_path):
    path = download(stub, tmp_path)
    stub.requests.clear()
    assert download(stub, tmp_path, local_files_only=True) == path
    assert stub.requests == []


def test_allow_patterns_fetches_only_matches(stub, tmp_path):
    path = download(stub, tmp_path, allow_patterns=["*.json"])
    assert set(tree(path)) == {"config.json", "tokenizer.json"}
    assert not [r for r in stub.requests if "resolve" in r and not r.endswith(".json")]


def test_errors_raise_the_hubs_exception_classes(stub, tmp_path):
    with pytest.raises(RepositoryNotFoundError) as e:
        download(stub, tmp_path, "org/missing")
    assert e.type is RepositoryNotFoundError and e.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError) as e:
        download(stub, tmp_path, "org/missing", token="x")
    assert e.type is RepositoryNotFoundError and e.value.response.status_code == 404
    with pytest.raises(RevisionNotFoundError) as e:
        download(stub, tmp_path, revision="nope")
    assert e.type is RevisionNotFoundError
    with pytest.raises(RevisionNotFoundError):
        download(stub, tmp_path, revision="0" * 40)
    with pytest.raises(RemoteEntryNotFoundError) as e:
        hf_hub_download("org/tiny", "missing.bin", endpoint=stub.url, cache_dir=tmp_path / "cache", token=False)
    assert e.type is RemoteEntryNotFoundError


def test_gated_repo_needs_a_token(stub, tmp_path):
    with pytest.raises(GatedRepoError) as e:
        download(stub, tmp_path, "org/gated")
    assert e.type is GatedRepoError and e.value.response.status_code == 401
    assert tree(download(stub, tmp_path, "org/gated", token="x")) == FILES


def test_hf_endpoint_in_a_subprocess(stub, tmp_path):
    env = {**os.environ, "HF_ENDPOINT": stub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_ETAG_TIMEOUT": "5",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    code = "import huggingface_hub as h; print(h.snapshot_download('org/tiny', token=False))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert tree(Path(out.stdout.strip().splitlines()[-1])) == FILES
