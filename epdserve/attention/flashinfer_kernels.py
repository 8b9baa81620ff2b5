"""flashinfer's JIT kernel modules for one model runner, built before its first forward, all at once.

Why (issue 43): flashinfer 0.6 compiles a kernel module with nvcc the first time a wrapper's ``plan`` or a fused op
asks for it (``JitSpec.build_and_load``), so a fresh machine built the model's modules one after another inside
the CUDA-graph captures: 108 of the 146 s before the 3B preset's ready line on an H100. Here the modules a runner
will load are named up front and built all at once, each by its own ninja run (``JitSpec.build``, the run its
first use repeats and then finds up to date), on threads while the weights load. flashinfer's per-module file
lock makes servers starting together build each module once (the second waits, then finds it built).

FA3, flashinfer's Hopper prefill kernel, is the exception. Its source files take ~65 s each to compile against
~5-11 s for the FA2 ones (nvcc 13.0, sm_90a, measured on a CPU machine; each file compiles on one core, so no
amount of parallelism brings a fresh start under that). Where it is not built yet, the runner starts on the FA2
prefill kernel (what SGLang's FlashInfer backend uses for paged prefill) and builds FA3 on a background thread
at low CPU priority; eager prefills switch to it once it is loaded (FA3 halves prefill attention time at 1.3k
tokens on an H100, docs/performance.md), the prefill CUDA graphs captured on FA2 keep FA2 until the next start,
which finds FA3 built and uses it everywhere, as every start on a warm machine does.

Only the module names and arguments are epdserve's; they mirror what the wrappers' ``plan`` and the fused ops ask
for (``flashinfer/prefill.py``, ``decode.py``, ``norm.py`` and ``activation.py`` of flashinfer 0.6).
A flashinfer whose JIT API differs keeps its own lazy builds (one warning).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelModule:
    """One flashinfer JIT module a model's forwards load.

    ``kind``: ``"prefill"`` (paged prefill, also flashinfer's tensor-core decode on the FA2 backend),
    ``"decode"`` (the CUDA-core decode kernel), ``"norm"`` or ``"activation"`` (SiLU-and-mul);
    ``backend``: ``"fa2"`` or ``"fa3"`` for prefill; ``head_dim`` and ``dtype`` (16-bit) for the attention modules.
    """

    kind: str
    backend: str = ""
    head_dim: int = 0
    dtype: torch.dtype | None = None


def describe(mod: KernelModule) -> str:
    """``"prefill fa2 (head_dim 128, bfloat16)"``, ``"norm"``: a module for the logs."""
    if mod.dtype is None:
        return mod.kind
    name = " ".join(filter(None, (mod.kind, mod.backend)))
    return f"{name} (head_dim {mod.head_dim}, {str(mod.dtype).removeprefix('torch.')})"


def tensor_core_decode(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Whether decode runs flashinfer's tensor-core kernel (the FA2 prefill module with one query row per request):
    from 4 query heads per KV head up, SGLang's threshold (``should_use_tensor_core``); else the CUDA-core decode
    kernel."""
    return num_qo_heads // num_kv_heads >= 4


def kernel_modules(head_dim: int, num_qo_heads: int, num_kv_heads: int, dtype: torch.dtype,
                   fa3: bool) -> list[KernelModule]:
    """The flashinfer modules a runner of these attention shapes (this rank's heads) loads: the FA2 prefill module
    always (prefill before FA3 is built, and tensor-core decode), FA3's where ``fa3`` (the GPU has it), the
    CUDA-core decode module below 4 query heads per KV head, and the fused norm and SiLU-and-mul ops (RoPE is
    :mod:`epdserve.models.rope_inplace`'s Triton kernel: flashinfer's takes ~27 s to compile)."""
    mods = [KernelModule("prefill", "fa2", head_dim, dtype)]
    if fa3:
        mods.append(KernelModule("prefill", "fa3", head_dim, dtype))
    if not tensor_core_decode(num_qo_heads, num_kv_heads):
        mods.append(KernelModule("decode", "", head_dim, dtype))
    return mods + [KernelModule("norm"), KernelModule("activation")]


def foreground_and_background(mods: list[KernelModule], built: set[KernelModule]) -> tuple[list, list]:
    """Split ``mods`` into the ones to build before the first forward and the ones to build while serving: an FA3
    prefill module that is not in ``built`` goes to the background, everything else to the foreground."""
    late = [m for m in mods if m.backend == "fa3" and m not in built]
    return [m for m in mods if m not in late], late


def prefill_module_args(mod: KernelModule) -> tuple:
    """The arguments after the backend that the prefill wrappers' ``plan`` passes to flashinfer's prefill module
    getters for ``mod``: q, KV and output dtype, int32 page indices, head sizes, no position encoding in the
    kernel, no sliding window, no logits soft cap, no fp16 QK reduction."""
    d = mod.dtype
    return d, d, d, torch.int32, mod.head_dim, mod.head_dim, 0, False, False, False


def jit_spec(mod: KernelModule):
    """flashinfer's ``JitSpec`` of ``mod``, made with the arguments its wrappers pass."""
    if mod.kind == "prefill":
        from flashinfer.jit.attention.modules import gen_batch_prefill_module

        return gen_batch_prefill_module(mod.backend, *prefill_module_args(mod))
    if mod.kind == "decode":
        from flashinfer.jit.attention.modules import gen_batch_decode_module

        d = mod.dtype
        return gen_batch_decode_module(d, d, d, torch.int32, mod.head_dim, mod.head_dim, 0, False, False)
    if mod.kind == "norm":
        from flashinfer.jit.norm import gen_norm_module

        return gen_norm_module()
    if mod.kind == "activation":
        from flashinfer.jit.activation import gen_act_and_mul_module

        return gen_act_and_mul_module("silu")
    raise ValueError(f"unknown flashinfer module kind {mod.kind!r}")


class KernelBuild:
    """The flashinfer modules of one model runner, built while its weights load (:meth:`start`, :meth:`wait`) and,
    for a FA3 prefill module not built yet, while it serves (:meth:`start_background`, :attr:`fa3_ready`).

    Args:
        head_dim: attention head size (64, 128 or 256).
        num_qo_heads, num_kv_heads: this rank's query and KV heads.
        dtype: the KV and activations' dtype (bfloat16 or float16).
        device: the CUDA device (FA3 only where flashinfer says the GPU has it: sm90a).
    """

    def __init__(self, head_dim: int, num_qo_heads: int, num_kv_heads: int, dtype: torch.dtype,
                 device: torch.device):
        from flashinfer.utils import determine_attention_backend

        fa3 = determine_attention_backend(device, 0, False, False, dtype, dtype) == "fa3"
        self.modules = kernel_modules(head_dim, num_qo_heads, num_kv_heads, dtype, fa3)
        self.specs = {m: jit_spec(m) for m in self.modules}
        built = {m for m, spec in self.specs.items() if spec.is_compiled}
        self.foreground, self.background = foreground_and_background(self.modules, built)
        #: the eager and graph prefill wrappers' backend at start: FA3 where it is built, else FA2
        self.prefill_backend = "fa3" if fa3 and not self.background else "fa2"
        #: set once a background-built FA3 module is loaded (None: nothing builds in the background)
        self.fa3_ready: threading.Event | None = threading.Event() if self.background else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Start building the foreground modules on a thread (nvcc runs in ninja's processes)."""
        self._thread = threading.Thread(target=self._build_foreground, name="flashinfer-build", daemon=True)
        self._thread.start()

    def _build_foreground(self) -> None:
        t0 = time.monotonic()
        try:
            missing = [m for m in self.foreground if not self.specs[m].is_compiled]
            if missing:
                log.info("flashinfer: building %d kernel modules (%s)", len(missing), ", ".join(map(describe, missing)))
            # Each module with its own ninja run (what its first use runs again, and finds up to date: a module
            # built by one ninja run over several, flashinfer's build_jit_specs, has its objects logged elsewhere,
            # so first use would compile it all over again), all at once; already built ones are only checked.
            # Modules of flashinfer's prebuilt package (flashinfer-jit-cache) load from there: build() would
            # compile them anyway.
            todo = [self.specs[m] for m in self.foreground if not getattr(self.specs[m], "is_aot", False)]
            with ThreadPoolExecutor(max(1, len(todo)), thread_name_prefix="flashinfer-build") as pool:
                for done in [pool.submit(spec.build, False) for spec in todo]:
                    done.result()
            if missing:
                log.info("flashinfer: built %d kernel modules in %.1f s", len(missing), time.monotonic() - t0)
        except BaseException as e:  # re-raised by wait() on the runner's thread
            self._error = e

    def wait(self) -> float:
        """Wait for the foreground build. Returns the seconds waited here.

        Raises:
            RuntimeError: the build failed (flashinfer's ninja output in the message), as the first forward's
                build would have.
        """
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"flashinfer kernel build failed: {self._error}") from self._error
        return time.monotonic() - t0

    def start_background(self) -> None:
        """Start building the background modules, if any. Call it after the CUDA graphs are captured: loading a
        module from another thread during a capture is not something to risk."""
        if self.background:
            threading.Thread(target=self._build_background, name="flashinfer-fa3", daemon=True).start()

    def _build_background(self) -> None:
        from flashinfer.prefill import get_batch_prefill_module

        # nvcc and ninja inherit this thread's nice value: the serving threads of every stage keep their cores.
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + 10, 19))
        t0 = time.monotonic()
        try:
            for m in self.background:
                log.info("flashinfer: building the FA3 prefill module in the background (prefill runs FA2 until "
                         "then)")
                self.specs[m].build(verbose=False)
                # Loaded here, so the serving thread's first FA3 plan finds it in the getter's cache.
                get_batch_prefill_module("fa3", *prefill_module_args(m))
        except Exception as e:  # serving goes on with FA2
            log.warning("flashinfer: the FA3 prefill module did not build (%s); prefill stays on FA2", e)
            return
        log.info("flashinfer: FA3 prefill module ready after %.1f s; eager prefills use it from now on",
                 time.monotonic() - t0)
        self.fa3_ready.set()


def start_kernel_build(head_dim: int, num_qo_heads: int, num_kv_heads: int, dtype: torch.dtype,
                       device: torch.device) -> KernelBuild | None:
    """A started :class:`KernelBuild`, or None where this flashinfer's JIT API is not the one named here (its
    lazy per-module builds then run as before; one warning)."""
    try:
        build = KernelBuild(head_dim, num_qo_heads, num_kv_heads, dtype, device)
    except (ImportError, AttributeError, TypeError) as e:
        log.warning("flashinfer kernel prebuild not available with this flashinfer (%s): modules build on first "
                    "use", e)
        return None
    build.start()
    return build
