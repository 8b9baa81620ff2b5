"""A TP group's all-reduce for small CUDA messages: PyTorch's one-shot kernel over symmetric memory.

A decode step of a TP server all-reduces two small activations per layer (``[batch, hidden]``: 7 KB for one
request of a 7B model), and at that size an all-reduce is all latency. NCCL's ring/tree protocols pay several
steps of it; a one-shot all-reduce has every rank read every peer's buffer over NVLink in one kernel
(``torch.ops.symm_mem.one_shot_all_reduce_copy_out``: copy the local input into this rank's symmetric buffer,
barrier over the signal pads, sum the peers' buffers in rank order, barrier again). This is what vLLM's and
SGLang's custom all-reduce do for decode-sized messages (``vllm/distributed/device_communicators``,
``sglang/srt/distributed/device_communicators``); the kernel here is PyTorch's own, so there is nothing to build.
It needs no NVLink multicast (unlike ``multimem_all_reduce_``), is captured in CUDA graphs like any kernel, and for
two ranks gives the same bits as NCCL (one bf16 rounding of ``a + b``).

Larger messages (prefill) stay on NCCL, whose bandwidth-optimal algorithms win there.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Messages up to this size take the one-shot kernel (each rank reads (size - 1) x this over NVLink); above it NCCL.
# Two H200s, in CUDA graphs: one-shot 6.6 / 14.8 / 36 us against NCCL 14-19 / 28 / 62 us at 7 KB / 0.9 MB / 3.7 MB.
DEFAULT_MAX_BYTES = 4 << 20


class SymmMemAllReduce:
    """One-shot sum all-reduce of small CUDA tensors over a symmetric buffer shared by every rank of the default
    process group. Build it with :meth:`create` (a collective: every rank at the same point).

    Args:
        buffer: this rank's symmetric buffer, ``[max_bytes]`` uint8 (from ``symm_mem.empty``, rendezvoused).
        group_name: the process group's name (the kernels look the buffer's peers up by it).
    """

    def __init__(self, buffer: torch.Tensor, group_name: str):
        self.buffer = buffer
        self.group_name = group_name
        self.max_bytes = buffer.numel()

    @classmethod
    def create(cls, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> SymmMemAllReduce | None:
        """Allocate and rendezvous the symmetric buffer on ``device`` for the initialised default group.

        Every rank decides the same way from the same facts (the op exists, the GPUs reach each other by P2P), so
        either all ranks take part in the rendezvous or none does.

        Returns:
            None where the one-shot path is not available (not CUDA, no process group, no such op in this torch,
            a GPU pair without P2P): the group then all-reduces through NCCL only.

        Raises:
            RuntimeError: the symmetric allocation or its rendezvous fails (``torch.distributed``); the server does
                not start rather than have its ranks disagree on the path.
        """
        if device.type != "cuda" or not dist.is_initialized():
            return None
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
            log.info("TP all-reduce: NCCL only (this torch has no symm_mem.one_shot_all_reduce_copy_out)")
            return None
        world = dist.get_world_size()
        here = device.index if device.index is not None else torch.cuda.current_device()
        # The ranks are cuda:(base .. base + world - 1) of one host (epdserve.engine.distributed.rank_device).
        base = here - dist.get_rank()
        peers = [base + r for r in range(world) if base + r != here]
        if any(p < 0 or p >= torch.cuda.device_count() or not torch.cuda.can_device_access_peer(here, p)
               for p in peers):
            log.info("TP all-reduce: NCCL only (cuda:%d has no P2P access to every peer)", here)
            return None
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group_name)
        if dist.get_rank() == 0:
            log.info("TP all-reduce: one-shot over symmetric memory up to %d bytes, NCCL above", max_bytes)
        return cls(buffer, group_name)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` takes the one-shot path: CUDA, contiguous, a dtype the kernel has (bf16 or fp32), its
        address and length 16-byte aligned (the kernel's vector width, which must match the buffer's), at most
        ``max_bytes``. The same answer on every rank for the same shapes."""
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32)
                and 0 < nbytes <= self.max_bytes and nbytes % 16 == 0 and x.data_ptr() % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (any shape, :meth:`fits`) over the ranks in place; returns ``x``."""
        flat = x.view(-1)
        symm = self.buffer[:flat.numel() * flat.element_size()].view(flat.dtype)
        # In place is safe: each thread copies its own elements into the buffer before it overwrites them.
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.group_name, flat)
        return x
