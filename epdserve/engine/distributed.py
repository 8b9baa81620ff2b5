"""The tensor-parallel (TP) group of one prefill or decode server: its rank, its size and the collectives the
model and the model runner use.

One process per TP rank, one ``torch.distributed`` process group over all of them: NCCL on CUDA, gloo on the CPU
(rendezvous over TCP on 127.0.0.1, so a server's ranks sit on one host). NCCL collectives issued by
``torch.distributed`` on the current stream can be captured in CUDA graphs (as nano-vllm and mini-sglang's
default ``TorchDistributedImpl`` do), so the decode graphs hold their all-reduces.

A size-1 group (:meth:`TPGroup.single`) makes every collective a no-op and creates no process group: TP=1 runs
exactly the single-process code.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from epdserve.engine.symm_all_reduce import SymmMemAllReduce

log = logging.getLogger(__name__)

# A collective that waits this long for a peer fails instead of hanging (a dead rank is normally noticed far
# sooner: see epdserve.engine.tp_runner's watchdog).
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its server's TP group.

    Attributes:
        rank: 0 .. size-1; rank 0 is the server process (sockets, scheduler, sampling).
        size: number of ranks.
        device: the device this rank computes on (collectives move tensors there).
        one_shot: the one-shot all-reduce for small CUDA messages (decode steps), or None (NCCL / gloo only).
    """

    rank: int
    size: int
    device: torch.device
    one_shot: SymmMemAllReduce | None = field(default=None, compare=False, repr=False)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> TPGroup:
        """The group of a TP=1 server: no process group, every collective a no-op."""
        return cls(0, 1, torch.device(device))

    @classmethod
    def init(cls, rank: int, size: int, *, port: int, device: torch.device,
             custom_all_reduce: bool = True) -> TPGroup:
        """Join the ``size``-rank group whose rank 0 listens on ``127.0.0.1:port`` (blocks until all joined).

        NCCL when ``device`` is CUDA (its communicator is created at once, bound to ``device``), else gloo.
        This initialises ``torch.distributed``'s default group of this process: one TP group per process.
        On CUDA with ``custom_all_reduce`` (every rank must pass the same), small all-reduces take the one-shot
        kernel over symmetric memory (:mod:`epdserve.engine.symm_all_reduce`) where the GPUs allow it.

        Raises:
            RuntimeError: the rendezvous fails or times out (``torch.distributed``).
        """
        device = torch.device(device)
        if size == 1:
            return cls.single(device)
        kw = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            kw["device_id"] = device
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT, **kw)
        log.debug("TP rank %d of %d joined on %s", rank, size, device)
        one_shot = SymmMemAllReduce.create(device) if custom_all_reduce else None
        return cls(rank, size, device, one_shot)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place; returns ``x``. Small CUDA messages take the one-shot kernel when the
        group has one, the rest NCCL (gloo on the CPU)."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                self.one_shot(x)
            else:
                dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, rank order; a new tensor."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one flat NCCL call (also inside a CUDA graph), then ranks moved to ``dim``
            flat = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(flat, x)
            parts = flat.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``x`` on every rank with rank ``src``'s ``x`` (same shape and dtype everywhere); returns it."""
        if self.size > 1:
            dist.broadcast(x, src)
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. KV pages every rank has room for)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self, timeout_s: float = 3.0) -> bool:
        """Leave the process group (no-op for TP=1). Collectives fail afterwards.

        Bounded: the teardown runs in a daemon thread and this returns after at most ``timeout_s`` seconds. Every
        rank must call it at about the same time (an NCCL group's teardown flushes its collectives with the
        peers), and a rank's CUDA graphs must be gone first (:meth:`ModelRunner.release_graphs`).

        Returns:
            False when the teardown had not finished in time (the process should exit without waiting for it;
            its forced-exit timer, :mod:`epdserve.engine.shutdown`, ends it otherwise), else True.
        """
        if self.size == 1 or not dist.is_initialized():
            return True
        done = threading.Event()

        def destroy() -> None:
            try:
                dist.destroy_process_group()
            except Exception as e:  # a peer already gone: nothing left to tear down with it
                log.warning("TP rank %d: leaving the process group failed: %s", self.rank, e)
            finally:
                done.set()

        threading.Thread(target=destroy, name="tp-group-close", daemon=True).start()
        if done.wait(timeout_s):
            return True
        log.error("TP rank %d: leaving the process group did not finish within %.0f s", self.rank, timeout_s)
        return False


def rank_device(device: str, base_gpu_id: int, rank: int) -> torch.device:
    """The device of TP rank ``rank`` of a server configured with ``--device device --base-gpu-id base_gpu_id``:
    ``cuda:(base + rank)`` on CUDA, where base is ``base_gpu_id`` or the N of ``--device cuda:N``; the CPU
    otherwise.

    Raises:
        ValueError: CUDA asked for and not available, or both ``cuda:N`` and a nonzero ``base_gpu_id`` given.
    """
    from epdserve.device import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is not None and base_gpu_id:
        raise ValueError(f"--device {device} and --base-gpu-id {base_gpu_id} both place the GPU; give one")
    return torch.device("cuda", (dev.index or 0) + base_gpu_id + rank)
