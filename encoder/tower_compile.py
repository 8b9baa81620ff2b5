"""``torch.compile`` of the vision tower, done beside serving instead of before it.

Why: compiling the tower's blocks and merger (dynamo's tracing, AOTAutograd, Inductor's code or its cache) took
6-8 s of the encoder's start-up on an H200 machine even with every cache warm, and importing Inductor 1-4 s more:
the longest part of a warm ``epdserve launch`` (docs/performance.md, "2026-11-28, eighth session"). The encoder now
reports ready with the eager tower and compiles on another thread meanwhile, as prefill does with flashinfer's FA3
module.

How the compiled code reaches the serving tower without compiling twice or in the tower's way: the compile thread
runs a *shadow* of the tower (:func:`shadow`: its own module objects over the same parameters and buffers) through
``torch.compile`` on the warm-up images. dynamo keeps compiled code on the code object (one for every block, one
for the merger) behind guards on types, shapes and values, not on module identity (one compile already serves all
32 blocks), so once the shadow is warm, the real blocks get their compile wrappers on the tower thread and their
first call finds the code ready (the GPU test checks that no compile follows). Until then the tower thread runs
the eager tower: dynamo's frame hook is per thread, so the compile thread's tracing never catches its calls.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
import time
from concurrent.futures import Executor
from typing import Protocol

import torch
from PIL import Image

log = logging.getLogger("epdserve.encoder")


class Compilable(Protocol):
    """What :func:`compile_beside_serving` calls: :class:`~epdserve.encoder.vision.VisionEncoder`'s two halves."""

    def compile_tower(self) -> float: ...

    def finish_compile(self, compiled: bool) -> None: ...


# Image sizes of the warm-up calls: one image, then batches, so dynamo meets the dynamic patch and image counts.
WARM_UP_BATCHES = ([(448, 448)], [(448, 448), (336, 224)], [(336, 224)] * 3)


def can_compile() -> bool:
    """Whether Triton, which Inductor's GPU kernels are written in, is installed (logs a warning if not)."""
    from torch.utils._triton import has_triton

    if has_triton():
        return True
    log.warning("triton is not installed: the vision tower runs without torch.compile")
    return False


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> None:
    """Put ``torch.compile(dynamic=True)`` wrappers on ``model``'s blocks, merger and DeepStack mergers (lazy: a
    wrapper compiles on its first call, or finds code compiled for a :func:`shadow`).

    Per module, not the whole forward: transformers' forward also does host-side grid arithmetic that would only
    break the graph; every block shares one code object, so one compile serves all. ``backend`` other than
    Inductor is for tests on the CPU (``"eager"``: dynamo's tracing and guards without code generation)."""
    for module in (*model.blocks, model.merger, *getattr(model, "deepstack_merger_list", ())):
        module.compile(dynamic=True, backend=backend)


def shadow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s tree of modules sharing its parameters, buffers and settings (no tensor is copied):
    compile wrappers set on the shadow leave the original's calls alone."""
    clone = copy.copy(module)  # Module.__setstate__: a new __dict__ holding the same values
    clone.__dict__["_modules"] = {name: None if child is None else shadow(child)
                                  for name, child in module._modules.items()}
    return clone


@torch.inference_mode()  # dynamo guards on the grad mode: the serving calls run in inference mode too
def warm_shadow(model: torch.nn.Module, image_processor, device: torch.device, dtype: torch.dtype,
                with_metadata: bool, backend: str = "inductor") -> float:
    """Compile a :func:`shadow` of the vision tower ``model`` and run it on :data:`WARM_UP_BATCHES` (solid-colour
    images through ``image_processor`` on the host), on the calling thread. Returns the seconds it took.

    ``with_metadata``: call the tower as :class:`~epdserve.encoder.vision_graph.TowerGraphs` does (the grid's
    metadata precomputed and passed as kwargs), which the serving tower does when it keeps CUDA graphs; else the
    plain ``model(pixels, grid_thw=...)`` call. The two pass the blocks differently typed arguments, so the warm-up
    must make the serving calls'.

    Raises:
        RuntimeError: compiling failed (Inductor and Triton raise many types; the message names the way out).
    """
    from epdserve.encoder.vision_graph import TowerGraphs

    t0 = time.monotonic()
    try:
        twin = shadow(model)
        compile_blocks(twin, backend)
        runner = TowerGraphs(twin, device, 0) if with_metadata else None  # 0 graphs: the metadata call alone
        for sizes in WARM_UP_BATCHES:
            images = [Image.new("RGB", size, (i * 40 % 256, 90, 160)) for i, size in enumerate(sizes)]
            inputs = image_processor(images=images, return_tensors="pt")
            pixels, grids = inputs["pixel_values"].to(device, dtype), inputs["image_grid_thw"]
            if runner is not None:
                runner.run(pixels, [tuple(g) for g in grids.tolist()])
            else:
                twin(pixels, grid_thw=grids.to(device))
    except Exception as e:
        raise RuntimeError(f"torch.compile of the vision tower failed ({type(e).__name__}: {e}); start the "
                           "encoder with --no-compile (epdserve launch --no-encoder-compile)") from e
    return time.monotonic() - t0


# CPython's GIL switch interval while the compile runs. The compile thread (dynamo's tracing, Inductor's lowering) holds
# the GIL for whole intervals, and every torch op and socket call of the serving threads gives it up and must take it
# back: at the default 5 ms each of those waits up to an interval (the convoy effect), hundreds of them a request.
# On the 2-core CPU machine (tiny model) one image's tower call took 31-40 ms alone, 848-1214 ms (median) beside
# dynamo tracing the tower at 5 ms, 446 at 1 ms, 157-165 at 0.2 ms and 81-89 at 0.05 ms; a tracing pass ~10 % longer
# at 0.2 ms (docs/performance.md, eighteenth session). On an H200 the TTFT of one request during the compile was
# 189-1766 ms against 39-112 after it (seventeenth session).
COMPILE_SWITCH_INTERVAL_S = 0.0002


def compile_beside_serving(encoder: Compilable, tower: Executor) -> threading.Thread:
    """Start ``encoder.compile_tower()`` on a new daemon thread (a shutdown does not wait for a compile), then
    hand ``encoder.finish_compile`` to ``tower``, the executor of the tower's calls, so that it runs between two
    of them. A failed compile is logged, and the eager tower keeps serving. While it compiles the process's GIL
    switch interval is :data:`COMPILE_SWITCH_INTERVAL_S` (restored after). Returns the started thread."""
    def run() -> None:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)
        try:
            seconds, compiled = encoder.compile_tower(), True
        except RuntimeError as e:
            log.error("%s; the eager tower keeps serving", e)
            compiled = False
        finally:
            sys.setswitchinterval(interval)
        try:
            tower.submit(encoder.finish_compile, compiled).result()
        except RuntimeError:  # the executor is shut down: the server is stopping
            return
        if compiled:
            log.info("vision tower compiled in %.1f s beside serving; the compiled tower serves from now on", seconds)

    thread = threading.Thread(target=run, name="epdserve-compile", daemon=True)
    thread.start()
    return thread
