"""Starting and stopping a prefill/decode server's HTTP front (``epdserve.gateway.pd_front``) as a child process.

Kept apart from the front itself so the scheduler process imports no web framework.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys


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


def spawn_front(role: str, config) -> FrontProcess | None:
    """Start the HTTP front of a ``role`` server ("prefill" or "decode") with ``config`` (its ``PrefillConfig``
    or ``DecodeConfig``) as a child process; None when ``config.port`` is 0.

    The child gets the config as JSON with the model path resolved (the default tiny model is built here, once,
    not by two processes at the same time), logs at this process's epdserve level to the same stderr, and dies
    with this process.

    Raises:
        FileNotFoundError: ``config.model_path`` is not a local checkpoint.
    """
    if not config.port:
        return None
    from epdserve.models.paths import resolve_model_path

    config = dataclasses.replace(config, model_path=resolve_model_path(config.model_path))
    level = logging.getLevelName(logging.getLogger("epdserve").getEffectiveLevel())
    cmd = [sys.executable, "-m", "epdserve.gateway.pd_front", role, json.dumps(dataclasses.asdict(config)),
           "--parent-pid", str(os.getpid()), "--log-level", level]
    return FrontProcess(subprocess.Popen(cmd))
