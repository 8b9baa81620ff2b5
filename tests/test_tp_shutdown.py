"""TP servers stop in bounded time (epdserve/engine/shutdown.py): a TP=2 prefill and a TP=2 decode server (gloo on
the CPU) exit 0 within 10 s of SIGTERM and SIGINT with no rank left behind; the process group's teardown gives up
after its timeout; and the forced-exit timer ends a process whose teardown hangs, with every thread's stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from epdserve.engine.distributed import TPGroup
from epdserve.wire.ports import free_ports

STOP_WITHIN_S = 10.0


def _followers_of(pid: int) -> list[int]:
    """Live TP rank processes (``epdserve.engine.tp_follower``) whose parent is ``pid``."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            argv = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and b"epdserve.engine.tp_follower" in argv:
            out.append(int(p))
    return out


def test_tp2_servers_exit_within_10s_of_sigterm_and_sigint(tiny_model_path, tmp_path):
    ports = free_ports(5)
    common = ["--model-path", tiny_model_path, "--device", "cpu", "--tp", "2", "--port", "0", "--metrics-port", "0"]
    cmds = {
        "prefill": ["prefill", *common, "--zmq-port", str(ports[0]), "--embed-port", str(ports[1]),
                    "--bootstrap-port", str(ports[2])],
        "decode": ["decode", *common, "--zmq-port", str(ports[3]), "--kv-port", str(ports[4])],
    }
    logs = {name: tmp_path / f"{name}.log" for name in cmds}
    procs = {name: subprocess.Popen([sys.executable, "-m", "epdserve", "--log-level", "DEBUG", *cmd],
                                    stdout=open(logs[name], "w"), stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
             for name, cmd in cmds.items()}
    try:
        deadline = time.monotonic() + 180
        for name, proc in procs.items():
            while f"{name} ready on" not in logs[name].read_text():
                assert proc.poll() is None and time.monotonic() < deadline, logs[name].read_text()[-3000:]
                time.sleep(0.2)
        ranks = {name: _followers_of(proc.pid) for name, proc in procs.items()}
        assert all(len(r) == 1 for r in ranks.values()), ranks
        sent = time.monotonic()
        procs["prefill"].send_signal(signal.SIGTERM)
        procs["decode"].send_signal(signal.SIGINT)
        codes = {name: proc.wait(timeout=30) for name, proc in procs.items()}
        took = time.monotonic() - sent
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    tails = {name: "\n".join(log.read_text().splitlines()[-8:]) for name, log in logs.items()}
    assert codes == {"prefill": 0, "decode": 0}, tails
    assert took < STOP_WITHIN_S, (took, tails)
    for name, (rank,) in ranks.items():  # every TP rank is gone too, and went in order (told, not killed)
        assert not Path(f"/proc/{rank}").exists() or "Z" in Path(f"/proc/{rank}/stat").read_text().split()[2]
        assert "TP ranks 1..1 stopped" in logs[name].read_text() and "killed" not in tails[name], tails[name]


def test_leaving_a_process_group_gives_up_after_its_timeout(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: time.sleep(30))  # a peer that never tears down
    t0 = time.monotonic()
    assert TPGroup(0, 2, torch.device("cpu")).close(timeout_s=0.3) is False
    assert time.monotonic() - t0 < 2.0
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    assert TPGroup(0, 2, torch.device("cpu")).close(timeout_s=0.3) is True
    assert TPGroup.single().close() is True


def test_release_graphs_drops_them():
    import weakref

    from epdserve.engine.model_runner import ModelRunner

    class Graphs:
        pass

    runner = ModelRunner.__new__(ModelRunner)  # only the fields release_graphs uses
    runner.device, runner.graphs, runner.prefill_graphs = torch.device("cpu"), Graphs(), Graphs()
    refs = [weakref.ref(runner.graphs), weakref.ref(runner.prefill_graphs)]
    runner.release_graphs()
    assert runner.graphs is None and runner.prefill_graphs is None and all(r() is None for r in refs)


def test_stop_deadline_ends_a_hung_teardown():
    """A process that armed the deadline and then hangs exits 1 soon after it, printing every thread's stack."""
    code = textwrap.dedent("""
        import time
        from epdserve.engine.shutdown import arm_stop_deadline
        arm_stop_deadline("test server", seconds=0.5)
        time.sleep(30)  # a teardown that never returns
    """)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and time.monotonic() - t0 < 10, done
    assert "Thread" in done.stderr and 'File "<string>", line 5' in done.stderr, done.stderr
