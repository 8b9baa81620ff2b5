"""The vision tower compiled beside serving (encoder/tower_compile.py), on the CPU with dynamo's ``eager`` backend:
its tracing and guards without Inductor's code generation. What must hold for the encoder to report ready before
compiling: a shadow shares the tower's tensors and leaves the tower's own calls eager, and the real tower, once its
wrappers are on, runs the code compiled for its shadow without compiling again (plain and metadata calls). On the
CPU the tower attends window by window, and dynamo specializes on the number of windows, so these calls use the
warm-up's own images; the GPU test in test_vision_graph.py (packed attention) runs the whole path."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters

from epdserve.encoder.tower_compile import (COMPILE_SWITCH_INTERVAL_S, WARM_UP_BATCHES, compile_beside_serving,
                                            compile_blocks, shadow, warm_shadow)
from epdserve.encoder.vision import VisionEncoder
from epdserve.encoder.vision_graph import TowerGraphs


@pytest.fixture
def encoder(tiny_model_path) -> VisionEncoder:
    torch._dynamo.reset()  # no compiled code left from another test
    counters.clear()
    yield VisionEncoder(tiny_model_path, "cpu", "float32")
    torch._dynamo.reset()


def test_a_shadow_shares_every_tensor_and_keeps_its_wrappers_to_itself(encoder):
    model = encoder.model
    twin = shadow(model)
    assert twin is not model and twin.blocks is not model.blocks and twin.blocks[0] is not model.blocks[0]
    assert twin.merger is not model.merger
    assert [id(p) for p in twin.parameters()] == [id(p) for p in model.parameters()]
    assert [id(b) for b in twin.buffers()] == [id(b) for b in model.buffers()]
    compile_blocks(twin, backend="eager")
    assert twin.blocks[0]._compiled_call_impl is not None and twin.merger._compiled_call_impl is not None
    assert model.blocks[0]._compiled_call_impl is None and model.merger._compiled_call_impl is None


@pytest.mark.parametrize("with_metadata", [False, True])
def test_the_tower_runs_its_shadows_compiled_code_without_compiling(encoder, with_metadata):
    warm_shadow(encoder.model, encoder.image_processor, encoder.device, encoder.dtype, with_metadata,
                backend="eager")
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 2, "the warm-up compiled nothing (a block and the merger at least)"
    batches = [[Image.new("RGB", size, (i * 40 % 256, 90, 160)) for i, size in enumerate(sizes)]
               for sizes in WARM_UP_BATCHES]
    eager = [torch.cat([emb for emb, _ in encoder.encode(images)]) for images in batches]
    compile_blocks(encoder.model, backend="eager")
    runner = TowerGraphs(encoder.model, encoder.device, 0)
    for images, want in zip(reversed(batches), reversed(eager)):
        with torch.inference_mode():
            inputs = encoder.image_processor(images=images, return_tensors="pt")
            pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"]
            out = (runner.run(pixels, [tuple(g) for g in grids.tolist()]) if with_metadata
                   else encoder.model(pixels, grid_thw=grids).pooler_output)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == compiled, "the real tower compiled again"
    print(f"shadow warm-up compiled {compiled} graphs; the real tower ran its {len(batches)} batches on them "
          f"({'metadata' if with_metadata else 'plain'} calls) without another compile")


class _FakeEncoder:
    """A Compilable whose compile records the GIL switch interval it ran under (or fails)."""

    def __init__(self, fail: bool):
        self.fail, self.seen, self.finished = fail, None, None

    def compile_tower(self) -> float:
        self.seen = sys.getswitchinterval()
        if self.fail:
            raise RuntimeError("torch.compile of the vision tower failed (test)")
        return 0.0

    def finish_compile(self, compiled: bool) -> None:
        self.finished = compiled


@pytest.mark.parametrize("fail", [False, True])
def test_the_compile_runs_at_a_short_switch_interval_and_restores_it(fail):
    """Beside serving, the compile thread would hold the GIL for whole default intervals (5 ms) against every
    serving thread's reacquisition; the short interval applies only while it compiles, failed or not."""
    before = sys.getswitchinterval()
    fake = _FakeEncoder(fail)
    with ThreadPoolExecutor(1) as tower:
        compile_beside_serving(fake, tower).join(10)
    assert fake.seen == pytest.approx(COMPILE_SWITCH_INTERVAL_S) and COMPILE_SWITCH_INTERVAL_S < before
    assert sys.getswitchinterval() == pytest.approx(before)
    assert fake.finished is (not fail)
