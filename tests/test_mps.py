"""``epdserve launch``'s CUDA MPS (epdserve/entry/mps.py), on the CPU: which stage processes share a GPU, the
private daemon's start and stop (a stand-in ``nvidia-cuda-mps-control`` that records how it was called), the
fallbacks (no binary, a refusing daemon, tensor parallelism on a shared GPU, a daemon already running), and the
environment the launcher gives each stage process."""

from __future__ import annotations

import io
import json
import logging
import os
import stat
from pathlib import Path

import pytest

from epdserve.config import LaunchConfig, add_config_args, config_from_args
from epdserve.entry import launch as launch_mod
from epdserve.entry import mps

# Records each call (arguments, MPS pipe directory, stdin) as a JSON line; `-d` checks that the pipe directory it
# was given exists and fails with a message when FAKE_MPS_FAIL is set, as a daemon refused by the driver would.
FAKE_CONTROL = """#!{python}
import json, os, sys
args = sys.argv[1:]
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
stdin = "" if args == ["-d"] else sys.stdin.read()
with open({log!r}, "a") as f:
    f.write(json.dumps(dict(args=args, pipe=pipe, log=os.environ.get("CUDA_MPS_LOG_DIRECTORY", ""), stdin=stdin)) + "\\n")
if args == ["-d"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    assert os.path.isdir(pipe), pipe
"""


@pytest.fixture
def control(tmp_path, monkeypatch) -> tuple[str, Path]:
    """A stand-in control binary on PATH and the file it records its calls in."""
    import sys

    record = tmp_path / "calls.jsonl"
    exe = tmp_path / "bin" / mps.CONTROL
    exe.parent.mkdir()
    exe.write_text(FAKE_CONTROL.format(python=sys.executable, log=str(record)))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", tmp_path / "no-system-daemon")
    return mps.CONTROL, record


def _calls(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def _gpus(encoder: int, prefill: tuple[int, int], decode: tuple[int, int], num_encoders: int = 1) -> dict:
    """The launch plan's GPUs of one prefill and one decode server, each ``(first GPU, TP ranks)``."""
    from epdserve.entry.launch_plan import plan_launch

    cfg = LaunchConfig(num_encoders=num_encoders, encoder_gpus=[encoder], prefill_gpus=[prefill[0]],
                       prefill_tp=[prefill[1]], decode_gpus=[decode[0]], decode_tp=[decode[1]])
    return plan_launch(cfg, "/models/m", on_gpus=True).gpus


def test_stage_gpus_and_the_shared_ones():
    one_gpu = _gpus(0, (0, 1), (0, 1), num_encoders=2)
    assert one_gpu == {"encoder0": [0], "encoder1": [0], "prefill": [0], "decode": [0]}
    assert mps.shared(one_gpu) == {0}
    apart = _gpus(0, (1, 2), (3, 1))
    assert apart["prefill"] == [1, 2] and mps.shared(apart) == set()
    assert mps.shared(_gpus(2, (0, 1), (2, 1))) == {2}  # encoder and decode on GPU 2


def test_daemon_started_for_the_stages_on_a_shared_gpu_and_quit_after(control, caplog):
    caplog.set_level(logging.INFO, "epdserve.entry.launch")
    gpus = _gpus(1, (0, 1), (1, 1))  # encoder and decode share GPU 1; prefill alone on GPU 0
    daemon, env = mps.start_for(gpus, True, control[0])
    assert daemon is not None and sorted(env) == ["decode", "encoder0"]
    pipe = env["decode"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert env["encoder0"] == env["decode"] and Path(pipe).is_dir() and Path(pipe).parent == daemon.directory
    assert "CUDA MPS on for GPU 1 (decode, encoder0 share it" in caplog.text
    daemon.stop()
    calls = _calls(control[1])
    assert [c["args"] for c in calls] == [["-d"], []]
    assert calls[0]["pipe"] == calls[1]["pipe"] == pipe and calls[1]["stdin"] == "quit\n"
    assert calls[0]["log"] == env["decode"]["CUDA_MPS_LOG_DIRECTORY"]
    assert not daemon.directory.exists()


def test_nothing_started_when_no_gpu_is_shared_or_mps_is_off(control):
    assert mps.start_for(_gpus(0, (1, 1), (2, 1)), True, control[0]) == (None, {})
    assert mps.start_for(_gpus(0, (0, 1), (0, 1)), False, control[0]) == (None, {})
    assert _calls(control[1]) == []


@pytest.mark.parametrize("case", ["refused", "missing", "tensor-parallel", "running"])
def test_time_slicing_with_one_line_why_when_mps_cannot_be_used(case, control, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, "epdserve.entry.launch")
    gpus = _gpus(0, (0, 1), (0, 1))
    name = control[0]
    if case == "refused":
        monkeypatch.setenv("FAKE_MPS_FAIL", "1")
        why = "CUDA MPS off (nvidia-cuda-mps-control -d exited 1: An instance of this daemon is already running)"
    elif case == "missing":
        name = "no-such-mps-control"
        why = "CUDA MPS off (no-such-mps-control is not on PATH)"
    elif case == "tensor-parallel":
        gpus = _gpus(0, (0, 2), (0, 1))
        why = "CUDA MPS off: prefill spans several GPUs"
    else:
        (tmp_path / "no-system-daemon").mkdir()
        (tmp_path / "no-system-daemon" / "control").touch()
        why = f"join the MPS daemon at {tmp_path / 'no-system-daemon'}"
    assert mps.start_for(gpus, True, name) == (None, {})
    assert why in caplog.text
    assert [c["args"] for c in _calls(control[1])] == ([["-d"]] if case == "refused" else [])
    if case == "refused":  # its directories are gone
        assert not Path(json.loads(control[1].read_text().splitlines()[0])["pipe"]).parent.exists()


def test_launch_gives_the_pipe_to_the_stages_on_the_shared_gpu_and_stops_the_daemon(control, monkeypatch,
                                                                                     tiny_model_path):
    """The launcher's side, with stand-in processes that exit at once (so launch returns 1 and cleans up)."""
    seen: dict[str, dict | None] = {}
    popen = launch_mod.subprocess.Popen

    class Exited:
        returncode = 1

        def __new__(cls, cmd, *args, **kw):
            return super().__new__(cls) if "-m" in cmd else popen(cmd, *args, **kw)  # the control binary runs

        def __init__(self, cmd, env=None, **_):
            name = cmd[cmd.index("-m") + 2 + 4]  # [python, -m, epdserve, --log-level, L, --log-format, F, name]
            seen[name.replace("encoder", "encoder0")] = env  # one encoder
            self.stderr = io.BytesIO(b"")

        def poll(self):
            return 1

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(launch_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(launch_mod.subprocess, "Popen", Exited)
    cfg = LaunchConfig(model_path=tiny_model_path, device="cuda", encoder_gpus=[1], prefill_gpus=[0],
                       decode_gpus=[1])
    assert launch_mod.launch(cfg, ready_timeout_s=5) == 1
    assert sorted(seen) == ["decode", "encoder0", "gateway", "prefill"]
    assert seen["prefill"] is None and seen["gateway"] is None  # alone on GPU 0; no GPU
    pipe = seen["decode"]["CUDA_MPS_PIPE_DIRECTORY"]
    assert seen["encoder0"]["CUDA_MPS_PIPE_DIRECTORY"] == pipe and seen["decode"]["PATH"] == os.environ["PATH"]
    calls = _calls(control[1])
    assert [c["args"] for c in calls] == [["-d"], []] and calls[1]["stdin"] == "quit\n"
    assert not Path(pipe).exists()


def test_mps_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_config_args(parser, LaunchConfig)
    assert config_from_args(LaunchConfig, parser.parse_args([])).mps is True
    assert config_from_args(LaunchConfig, parser.parse_args(["--no-mps"])).mps is False
