"""The CUDA probe answers as torch would, and the launcher gets to its stages' commands without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from epdserve import cuda_probe


def test_torchs_cuda_build_is_read_without_importing_it():
    assert cuda_probe.torch_cuda_version() == torch.version.cuda


def test_this_machine_agrees_with_torch():
    assert cuda_probe.cuda_available() == torch.cuda.is_available()


@pytest.mark.parametrize("driver,built,torch_says,expected,torch_asked", [
    ((0, 0), "13.0", True, False, False),       # no device (or no driver)
    ((2, 13000), "13.0", False, True, False),   # a device, and a CUDA build the driver runs
    ((2, 13020), "12.8", False, True, False),
    ((2, 12080), "13.0", False, False, True),   # a driver older than torch's CUDA: torch decides
    ((2, 13000), None, False, False, True),     # a CPU build of torch: torch decides
    (None, "13.0", True, True, True),           # the driver failed otherwise: torch decides
])
def test_when_torch_is_asked(monkeypatch, driver, built, torch_says, expected, torch_asked):
    asked = []
    monkeypatch.setattr(cuda_probe, "driver_device_count", lambda: driver)
    monkeypatch.setattr(cuda_probe, "torch_cuda_version", lambda: built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or torch_says)
    assert cuda_probe.cuda_available() is expected
    assert bool(asked) == torch_asked


def test_the_launchers_path_to_its_commands_imports_no_torch(tiny_model_path):
    code = f"""
import sys, types
sys.modules["flashinfer"] = types.ModuleType("flashinfer")  # installed, as on a GPU machine
from epdserve.config import LaunchConfig
from epdserve.entry import cli, launch
from epdserve.entry.extras import check_extras
from epdserve.entry.launch_plan import plan_launch
from epdserve.models.paths import resolve_model_path
for device in ("auto", "cuda"):
    cfg = LaunchConfig(model_path={tiny_model_path!r}, device=device)
    check_extras(cfg)
    cfg = cli._local_model(cfg)
    plan = plan_launch(cfg, resolve_model_path(cfg.model_path, cfg.revision), launch._on_gpus(cfg))
    assert len(plan.commands) == 4, plan.commands
print(sorted(m for m in ("torch", "zmq", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_the_gateway_and_the_wire_work_without_torch():
    """The gateway imports its app, encodes and checks a tensor-free message without torch (it imports torch later,
    with the checkpoint's processor, in parallel with the stages' start); a message with a tensor field fails the
    check rather than passing as some other type."""
    code = """
import sys
import epdserve.gateway.app
from epdserve.wire import messages
from epdserve.wire.validate import check_message
msg = messages.TokenOutputBatch([messages.TokenOutput("r1", [1, 2], "stop", 3, 2)])
assert check_message(messages.decode(messages.encode(msg))) == msg
try:
    check_message(messages.decode(messages.encode(messages.ImageEmbeddings("r1", ["ab" * 16], ["no tensor"]))))
except messages.WireError:
    pass
else:
    raise AssertionError("a string passed as an embedding")
print(sorted(m for m in ("torch", "transformers", "xgrammar") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("no_bytecode,expected", [(True, True), (False, False)])
def test_the_launcher_notices_torch_without_bytecode(tmp_path, no_bytecode, expected):
    """Where bytecode may not be written and none is found (an empty pycache prefix here), the launcher names
    torch's directory for its warning; where it may be written, nothing is said."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if no_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    code = "from epdserve.entry.launch import torch_without_bytecode as t; print(t())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    found = out.stdout.strip()
    assert (found != "None") == expected, found
    if expected:
        assert found == os.path.dirname(torch.__file__)
