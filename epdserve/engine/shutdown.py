"""A bounded stop for prefill and decode servers and their TP ranks: a process asked to stop exits within
:data:`STOP_DEADLINE_S` seconds whatever its teardown meets.

The orderly path (``StageServer.run`` and ``TPRunner.close``): the loop ends, the TP ranks are told to stop, every
rank drops its CUDA graphs and then leaves the process group (:meth:`~epdserve.engine.distributed.TPGroup.close`,
itself bounded), rank 0 waits for the ranks and kills any that linger. NCCL does not destroy a communicator that a
captured CUDA graph still references (pytorch/pytorch#115388: the teardown waits for those graphs forever), which
is why the graphs go first. Should anything still hang, :func:`arm_stop_deadline`'s timer (faulthandler's, a C
thread that needs no interpreter lock) prints every thread's stack and ends the process with exit code 1.
"""

from __future__ import annotations

import faulthandler
import logging

log = logging.getLogger(__name__)

# From SIGINT/SIGTERM (or, on a TP rank, rank 0's TPShutdown) to a forced exit. Below the 10 s that launchers and
# orchestrators give a process before SIGKILL, so a stuck teardown says where it was stuck.
STOP_DEADLINE_S = 9.0


def arm_stop_deadline(what: str, seconds: float = STOP_DEADLINE_S) -> None:
    """Start the forced-exit timer of a process that was asked to stop (``what`` names it in the log): if it is
    still alive ``seconds`` later, every thread's stack goes to stderr and the process exits with code 1. Arming
    again restarts the timer."""
    log.debug("%s stopping: forced exit in %.0f s if the teardown hangs", what, seconds)
    faulthandler.dump_traceback_later(seconds, exit=True)
