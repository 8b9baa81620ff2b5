"""Starting and stopping a prefill/decode server's HTTP front (``epdserve.frontend.pd``) as a child process, and
the child's side of that tie (:func:`die_with_parent`).

Kept apart from the front itself so the scheduler process imports no web framework.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys

logger = logging.getLogger("epdserve.front")


class FrontProcess:
    """A running front child process; :meth:`stop` ends it (SIGTERM, then SIGKILL after ``grace_s`` seconds)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn_front(module: str, config) -> FrontProcess | None:
    """Start a server's HTTP front, ``python -m module`` (the ``http_front`` module of the server's package), with
    ``config`` (the server's ``PrefillConfig`` or ``DecodeConfig``) as a child process; None when ``config.port`` and
    ``config.grpc_port`` are 0.

    The child gets the config as JSON with the model path resolved (the default tiny model is built here, once,
    not by two processes at the same time), logs at this process's epdserve level to the same stderr, and dies
    with this process.

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
    """
    if not config.port and not config.grpc_port:
        return None
    from epdserve.models.paths import resolve_model_path

    config = dataclasses.replace(config, model_path=resolve_model_path(config.model_path))
    level = logging.getLevelName(logging.getLogger("epdserve").getEffectiveLevel())
    cmd = [sys.executable, "-m", module, json.dumps(dataclasses.asdict(config)), "--parent-pid", str(os.getpid()),
           "--log-level", level]
    return FrontProcess(subprocess.Popen(cmd))


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux), and exit now if it already has.

    A front whose scheduler is gone would accept requests it can never finish; dead, its port refuses them and
    the router retries elsewhere at once.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        logger.warning("cannot tie the front's life to its server's (no prctl)")
    if os.getppid() != parent_pid:
        os._exit(1)
