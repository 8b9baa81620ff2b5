"""Resolve the ``device``/``dtype`` strings of the server configs."""

from __future__ import annotations

import functools
import os

import torch

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> ``cuda`` when available, else ``cpu``; anything else is passed to ``torch.device``.

    Raises:
        ValueError: a CUDA device is asked for and none is available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> bfloat16 on CUDA, float32 on CPU.

    Raises:
        ValueError: unknown dtype name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _NAMED:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_NAMED)} or 'auto'")
    return _NAMED[name]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device`` without blocking the host: on CUDA through pinned memory and an
    asynchronous copy (a plain ``.to("cuda")`` of pageable memory waits for the whole stream, which would stall a
    step that is meant to overlap the GPU's work). Torch's pinned allocator keeps the block until the copy ran."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def limit_cpu_threads(device: torch.device) -> None:
    """On CUDA, run torch's CPU ops on one thread, unless ``OMP_NUM_THREADS`` is set (then that rules).

    A GPU server's CPU work is small tensors and Python; torch's default pool of one thread per core only makes
    the encoder, prefill and decode processes of one machine crowd each other's cores. On an H100 with all stages
    on one machine, the prefill host's work for one 334-token forward took 10-30 ms in the server against 1.1 ms
    in a process alone (docs/performance.md, seventh session). vLLM makes the same choice for its GPU workers.
    On the CPU the pool is the forward's parallelism and stays as it is.
    """
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def supports_pdl(device: torch.device) -> bool:
    """Whether this project's Triton kernels launch on ``device`` with programmatic dependent launch (PDL).

    Under PDL (CUDA 12, compute capability 9.0 and later) a kernel may start while the one before it on the stream
    is still finishing: its launch and whatever it does before ``griddepcontrol.wait`` (the kernels here load only
    weights there) overlap the previous kernel's tail, and the wait then holds every other memory access until
    that kernel has completed and its writes are visible. The kernels then let the next one start
    (``griddepcontrol.launch_dependents``). A decode step of a small model is a chain of ~10 short kernels per
    layer, where these fixed costs are a large share (docs/performance.md, "2026-11-29, tenth session"). The split-KV
    attention, its merge and gate_up + SiLU launch this way; the RoPE kernels do not (measured: "eleventh session").
    flashinfer decides the same way for its norms (``flashinfer.utils.device_support_pdl``), which this matches.

    Returns:
        True for an NVIDIA device of compute capability >= 9.0; False otherwise (the CPU, where Triton's interpreter
        has no PDL, and ROCm, whose devices also report as ``cuda``).
    """
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability_major(device.index) >= 9


@functools.cache
def _capability_major(index: int | None) -> int:
    # Once per device: the kernels ask at every launch, several per layer in an eager forward.
    return torch.cuda.get_device_capability(index)[0]
