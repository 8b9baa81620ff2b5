"""CUDA MPS for ``epdserve launch``: stages that share a GPU run their kernels side by side instead of in turns.

Without MPS, processes on one GPU get it in time slices: while prefill's long forward holds its slice, decode's
short step waits, and the other way round. Under MPS (NVIDIA's Multi-Process Service: one server process owns the
GPU and runs every client's kernels in one context) the stages' kernels share the SMs. Measured on an H100 with the
``qwen3.5-9b`` preset at 32 concurrent requests (docs/performance.md, "Qwen3.5: the stages under CUDA MPS"):
14.6 req/s against 12.6, TPOT median 11.2 ms against 13.7.

The launcher starts a control daemon of its own (``nvidia-cuda-mps-control -d``) with a private pipe and log
directory, gives the pipe directory to the stage processes on a shared GPU (``CUDA_MPS_PIPE_DIRECTORY``) and
stops the daemon (``quit``) after the stages. It starts none where an MPS daemon already serves this environment
(``CUDA_MPS_PIPE_DIRECTORY`` set, or the system one's pipe at its default place): the stages join that one.
Where MPS cannot start (no control binary, the daemon refuses), or a stage on a shared GPU spans several GPUs
(tensor parallelism: NCCL under MPS is not tested here), the stages share the GPU by time-slicing, as with
``--no-mps``, and one log line says why.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("epdserve.entry.launch")

CONTROL = "nvidia-cuda-mps-control"
# Where a system-wide MPS daemon keeps its pipes when CUDA_MPS_PIPE_DIRECTORY is not set (NVIDIA's MPS guide).
DEFAULT_PIPE_DIR = Path("/tmp/nvidia-mps")


def shared(gpus: dict[str, list[int]]) -> set[int]:
    """The GPUs that more than one stage process uses."""
    count = collections.Counter(g for used in gpus.values() for g in used)
    return {g for g, n in count.items() if n > 1}


@dataclass
class MpsDaemon:
    """An MPS control daemon private to one launch.

    Attributes:
        directory: holds its ``pipe`` and ``log`` directories; removed by :meth:`stop`.
        env: the variables a client process needs to use it (``CUDA_MPS_PIPE_DIRECTORY``,
            ``CUDA_MPS_LOG_DIRECTORY``).
    """

    directory: Path
    env: dict[str, str]
    control: str = CONTROL

    @classmethod
    def start(cls, control: str = CONTROL) -> MpsDaemon:
        """Start ``control -d`` with fresh pipe and log directories.

        Raises:
            OSError: the control binary is not on PATH, or the daemon did not start (its output in the message).
        """
        path = shutil.which(control)
        if path is None:
            raise FileNotFoundError(f"{control} is not on PATH")
        directory = Path(tempfile.mkdtemp(prefix="epdserve-mps-"))
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(directory / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(directory / "log")}
        for d in env.values():
            os.makedirs(d)
        try:
            # -d forks the daemon and returns; the MPS server itself starts at the first client's CUDA call.
            done = subprocess.run([path, "-d"], env=os.environ | env, capture_output=True, text=True, timeout=30,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(directory, ignore_errors=True)
            raise OSError(f"{control} -d: {e}") from e
        if done.returncode != 0:
            shutil.rmtree(directory, ignore_errors=True)
            raise OSError(f"{control} -d exited {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}")
        return cls(directory, env, path)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Ask the daemon to quit (it stops its server once the clients are gone) and remove its directories."""
        try:
            subprocess.run([self.control], input="quit\n", env=os.environ | self.env, capture_output=True,
                           text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("CUDA MPS daemon did not quit (%s); its pipes are in %s", e, self.directory)
            return
        shutil.rmtree(self.directory, ignore_errors=True)


def running_elsewhere() -> str | None:
    """The pipe directory of an MPS daemon that already serves this environment, or None."""
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        return os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    return str(DEFAULT_PIPE_DIR) if (DEFAULT_PIPE_DIR / "control").exists() else None


def start_for(gpus: dict[str, list[int]], enabled: bool, control: str = CONTROL
              ) -> tuple[MpsDaemon | None, dict[str, dict[str, str]]]:
    """Start MPS for the stage processes that share a GPU (see the module docstring for when it does not).

    Args:
        gpus: every stage process's GPUs by name (``LaunchPlan.gpus``).
        enabled: ``--mps``; with False nothing is started or logged.
        control: the control binary (a test passes its own).

    Returns:
        ``(daemon or None, extra environment by process name)``: the daemon to :meth:`MpsDaemon.stop` after the
        stages, and the variables to add to each process on a shared GPU (empty where MPS is not used).
    """
    common = shared(gpus)
    on_shared = {name for name, used in gpus.items() if set(used) & common}
    if not enabled or not on_shared:
        return None, {}
    where = _names(common)
    spanning = sorted(name for name in on_shared if len(gpus[name]) > 1)
    if spanning:
        log.info("CUDA MPS off: %s spans several GPUs (tensor parallelism) and shares one with another stage; "
                 "the stages time-slice GPU %s", ", ".join(spanning), where)
        return None, {}
    if (pipe := running_elsewhere()) is not None:
        log.info("CUDA MPS: stages on GPU %s join the MPS daemon at %s", where, pipe)
        return None, {}
    try:
        daemon = MpsDaemon.start(control)
    except OSError as e:
        log.warning("CUDA MPS off (%s): the stages on GPU %s time-slice it; --no-mps silences this", e, where)
        return None, {}
    log.info("CUDA MPS on for GPU %s (%s share it; --no-mps: time-slicing)", where, ", ".join(sorted(on_shared)))
    return daemon, {name: daemon.env for name in on_shared}


def _names(gpus: set[int]) -> str:
    return ",".join(str(g) for g in sorted(gpus))
