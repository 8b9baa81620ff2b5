"""Shared fixtures: the tiny checkpoints (built once per test session), the shared photos, and one
`epdserve launch` of all four servers (test_e2e.py, test_observability.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

IMAGES_DIR = Path(__file__).resolve().parents[2] / "shared" / "images"


# A GPU test that hangs (a kernel, a collective, a graph capture) fails after this long with every thread's stack
# (pytest-timeout, where installed) instead of running on: the GPU suite runs on lent machines of limited time.
GPU_TEST_TIMEOUT_S = 300


def pytest_collection_modifyitems(config, items):
    """Give each ``gpu``-marked test without a ``timeout`` mark of its own a :data:`GPU_TEST_TIMEOUT_S` one."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny Qwen2.5-VL checkpoint (random weights, seed 0) in a session temp dir."""
    from epdserve.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2.5-vl")))


@pytest.fixture(scope="session")
def tiny_qwen2_vl_path(tmp_path_factory) -> str:
    """A tiny Qwen2-VL checkpoint (the older architecture and vision tower)."""
    from epdserve.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-vl"), arch="qwen2_vl"))


def pytest_generate_tests(metafunc):
    """Parametrize every test taking ``gpu_model`` over :func:`gpu_models.gpu_model_ids` (one test per model, so
    ``--durations`` and a failure name the model)."""
    if "gpu_model" in metafunc.fixturenames:
        from gpu_models import gpu_model_ids

        metafunc.parametrize("gpu_model", gpu_model_ids(), indirect=True)


@pytest.fixture(scope="session")
def _gpu_model_paths() -> dict[str, str]:
    """Path of each GPU test model by test id, filled on first use (a CPU run skips the GPU tests before any
    model is built)."""
    return {}


def _gpu_model_path(model_id: str, cache: dict[str, str], tmp_path_factory) -> str:
    """The checkpoint of ``model_id`` (an id of :func:`gpu_models.gpu_model_ids`), built or copied once."""
    from gpu_models import SMALL_MODELS, env_models, gpu_model_ids, kept_layers, shallow_copy

    if model_id not in cache:
        if model_id in SMALL_MODELS:
            from epdserve.models.tiny import make_tiny_model

            path = make_tiny_model(tmp_path_factory.mktemp(model_id), arch=SMALL_MODELS[model_id], size="small")
        else:
            src = env_models()[gpu_model_ids().index(model_id) - len(SMALL_MODELS)]
            layers = kept_layers(src)
            path = shallow_copy(src, tmp_path_factory.mktemp(model_id), layers) if layers else src
        cache[model_id] = str(path)
    return cache[model_id]


@pytest.fixture(scope="session")
def gpu_model(request, _gpu_model_paths, tmp_path_factory) -> str:
    """One checkpoint the GPU tests run on (tests taking it are parametrized over all, see
    :func:`pytest_generate_tests`): the ``small`` random Qwen2.5-VL and Qwen3-VL checkpoints (~100M parameters,
    head dim 128), and each directory listed in ``EPDSERVE_GPU_TEST_MODELS`` (comma-separated; e.g. the
    ``qwen2.5-vl-3b`` preset written by ``epdserve make-tiny-model --preset``) cut to its first
    ``EPDSERVE_GPU_TEST_LAYERS`` LM layers (default 4, 0 keeps all; :func:`gpu_models.shallow_copy`): the real
    shapes at a ninth of the 3B's depth, which is what a graph-equals-eager or kernel test needs."""
    return _gpu_model_path(request.param, _gpu_model_paths, tmp_path_factory)


@pytest.fixture(scope="session")
def gpu_test_models(_gpu_model_paths, tmp_path_factory) -> list[str]:
    """Every :func:`gpu_model` checkpoint, in order, for a test that loops over them itself."""
    from gpu_models import gpu_model_ids

    return [_gpu_model_path(i, _gpu_model_paths, tmp_path_factory) for i in gpu_model_ids()]


@pytest.fixture(scope="session")
def photo_paths() -> dict[str, Path]:
    """The CC0 photos in ../shared/images, by file stem."""
    paths = {p.stem: p for p in sorted(IMAGES_DIR.glob("*")) if p.suffix in (".png", ".jpg")}
    if not paths:  # a silent skip would hide most of the suite
        pytest.fail(f"no photos in {IMAGES_DIR}: the tests expect the repository's sibling folder shared/images")
    return paths


@pytest.fixture(scope="session")
def tiny_qwen3_vl_path(tmp_path_factory) -> str:
    """The tiny Qwen3-VL checkpoint, written through the command line (``--arch qwen3-vl``)."""
    from epdserve.entry.cli import main

    path = tmp_path_factory.mktemp("tiny-qwen3-vl")
    assert main(["make-tiny-model", str(path), "--arch", "qwen3-vl"]) == 0
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen3_5_path(tmp_path_factory) -> str:
    """The tiny Qwen3.5 checkpoint (hybrid LM: DeltaNet, DeltaNet, attention, DeltaNet), written through the command
    line (``--arch qwen3.5``)."""
    from epdserve.entry.cli import main

    path = tmp_path_factory.mktemp("tiny-qwen3.5")
    assert main(["make-tiny-model", str(path), "--arch", "qwen3.5"]) == 0
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe_path(tmp_path_factory) -> str:
    """The tiny Qwen3-VL-MoE checkpoint (every layer sparse, 32 experts top-2, the released transposed expert
    layout), written through the command line (``--arch qwen3-vl-moe``)."""
    from epdserve.entry.cli import main

    path = tmp_path_factory.mktemp("tiny-qwen3-vl-moe")
    assert main(["make-tiny-model", str(path), "--arch", "qwen3-vl-moe"]) == 0
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_path(tmp_path_factory) -> str:
    """The tiny Qwen3.5-MoE checkpoint (the tiny Qwen3.5's layers, every MLP 16 experts top-2 plus a shared expert,
    experts fused as released), written through the command line (``--arch qwen3.5-moe``)."""
    from epdserve.entry.cli import main

    path = tmp_path_factory.mktemp("tiny-qwen3.5-moe")
    assert main(["make-tiny-model", str(path), "--arch", "qwen3.5-moe"]) == 0
    return str(path)


def hf_reference_model(path: str, expect: str | None = None):
    """transformers' ``(processor, model)`` of the checkpoint at ``path``, the model in float32 and eval mode: the
    reference the parity tests compare with. ``expect``: the model class name it must have."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert expect is None or type(model).__name__ == expect
    return AutoProcessor.from_pretrained(path), model


@contextlib.contextmanager
def launched(model_path: str, log_dir: Path, *args: str, num_encoders: int = 1):
    """`epdserve launch` of ``model_path`` on a free port with DEBUG logs as JSON lines and ``args`` added; yields
    (base_url, log_path) once ready. On exit, Ctrl-C must stop every server cleanly (exit 0, the port closed)."""
    from epdserve.wire.ports import free_port

    port = free_port()
    log_path = log_dir / "launch.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "epdserve", "--log-level", "DEBUG", "--log-format", "json", "launch",
         "--model-path", model_path, "--port", str(port), "--num-encoders", str(num_encoders), *args],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while "metrics: gateway=" not in log_path.read_text():  # logged right after "epdserve ready"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"launch did not get ready:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.3)
    assert len(re.findall(r"encoder ready on 127\.0\.0\.1:\d+", log_path.read_text())) == num_encoders
    yield url, log_path
    proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the launcher stops all four servers and exits 0
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    log.close()
    assert code == 0, f"launch did not stop cleanly on Ctrl-C:\n{log_path.read_text()[-3000:]}"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "the gateway port is still open after Ctrl-C"


@pytest.fixture(scope="session")
def server(tiny_model_path, tmp_path_factory):
    """`epdserve launch` with the tiny model and two encoders (:func:`launched`); yields (base_url, log_path).
    Launched once per session: the tests using it send requests one test at a time.

    Two encoders, so every test using it also runs through the gateway's content-hash routing between them; and
    the shared KV hand-off (on the CPU the prefill pool in /dev/shm, which decode maps and copies from), so the
    protocol the GPU's CUDA IPC path uses is checked against transformers too.
    """
    with launched(tiny_model_path, tmp_path_factory.mktemp("launch"), "--kv-transfer", "shared",
                  num_encoders=2) as out:
        yield out


def launch_metrics_urls(log_path: Path) -> dict[str, str]:
    """The ``/metrics`` URL of every process of a launch, by name (gateway, encoder0.., prefill, decode), from the
    launcher's ``metrics: name=URL ...`` line (JSON log lines)."""
    for line in log_path.read_text().splitlines():
        if line.startswith("{") and (msg := json.loads(line)["message"]).startswith("metrics: "):
            return dict(item.split("=", 1) for item in msg.removeprefix("metrics: ").split())
    raise AssertionError("no metrics line in the launch log")


@pytest.fixture(scope="session")
def stage_procs(tiny_model_path, tmp_path_factory):
    """Encoder, prefill and decode of the tiny model as processes (tests/cluster.py), 256 KV pages each; shared by
    the fault and fuzz tests, which leave them running (restarting any they kill)."""
    from cluster import StageProcs

    procs = StageProcs(tiny_model_path, tmp_path_factory.mktemp("stages"))
    procs.start()
    yield procs
    procs.stop_all()


@pytest.fixture
def interpreter(monkeypatch, request):
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``) for the kernels of the test module's ``mod``, whose cached
    ``_kernel()`` is rebuilt under it and again after the test."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = request.module.mod._kernel
    kernel.cache_clear()
    yield
    kernel.cache_clear()
