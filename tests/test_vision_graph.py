"""The vision tower run from precomputed metadata (CPU: equal to transformers' own call) and from CUDA graphs
(GPU only: equal to the eager call, captured on a shape's second use, bounded in number)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from epdserve.encoder.vision import VisionEncoder
from epdserve.encoder.vision_graph import TowerGraphs, tower_metadata

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Three grids, repeated out of order so that grouping by grid and power-of-two chunking (3 -> 2 + 1) both happen.
SIZES = [(56, 56), (84, 56), (56, 56), (112, 84), (56, 56), (84, 56)]


def _images(sizes=SIZES) -> list[Image.Image]:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def _inputs(enc: VisionEncoder, images):
    kwargs = {"device": enc.device} if enc.device.type == "cuda" else {}
    inputs = enc.image_processor(images=images, return_tensors="pt", **kwargs)
    pixels = inputs["pixel_values"].to(enc.device).type(enc.dtype)
    return pixels, inputs["image_grid_thw"].cpu()


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def cpu_encoder(request, tmp_path_factory) -> VisionEncoder:
    from epdserve.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    return VisionEncoder(path, "cpu", "float32")


@torch.inference_mode()
def test_precomputed_metadata_equals_transformers_call(cpu_encoder):
    # Passing transformers its own helpers' output as kwargs must not change a bit: the graphs rely on it.
    enc = cpu_encoder
    pixels, grid = _inputs(enc, _images())
    ref = enc.model(pixels, grid_thw=grid).pooler_output
    meta = tower_metadata(enc.model, [tuple(r) for r in grid.tolist()], enc.device)
    assert ("window_index" in meta) == (enc.model_type == "qwen2_5_vl")
    assert meta["max_seqlen"] == max(t * h * w for t, h, w in grid.tolist())
    out = enc.model(pixels, grid_thw=torch.zeros_like(grid), **meta).pooler_output  # grid_thw itself unused
    assert torch.equal(out, ref)


@torch.inference_mode()
def test_grouped_run_gives_each_image_its_own_rows(cpu_encoder):
    # With graphs on, TowerGraphs splits the batch by grid and into power-of-two chunks (a shape's first use runs
    # eagerly, so this runs on the CPU); every image's rows equal the tower on that image alone, in order.
    enc = cpu_encoder
    images = _images()
    pixels, grid = _inputs(enc, images)
    rows = [tuple(r) for r in grid.tolist()]
    sizes = [enc.num_tokens(r) for r in rows]
    alone = [enc.model(*_inputs(enc, [img])[:1], grid_thw=_inputs(enc, [img])[1]).pooler_output for img in images]
    for max_graphs in (8, 0):  # 0: the whole batch in one eager call
        tower = TowerGraphs(enc.model, enc.device, max_graphs=max_graphs)
        out = tower.run(pixels, rows)
        assert out.shape == (sum(sizes), enc.hidden_size) and tower.num_graphs == 0
        for got, want in zip(torch.split(out, sizes), alone):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_cuda_graphs_match_eager_and_stay_bounded(tiny_model_path):
    enc = VisionEncoder(tiny_model_path, "cuda", "bfloat16", cuda_graphs=2)
    eager = VisionEncoder(tiny_model_path, "cuda", "bfloat16", cuda_graphs=0)
    images = _images()
    pixels, grid = _inputs(enc, images)
    rows = [tuple(r) for r in grid.tolist()]
    want = eager.tower.run(pixels, rows)
    first = enc.tower.run(pixels, rows)  # first sight of every (grid, n): eager
    assert enc.tower.num_graphs == 0
    second = enc.tower.run(pixels, rows)  # second sight: captured, at most 2 kept
    assert enc.tower.num_graphs == 2
    third = enc.tower.run(pixels, rows)  # replays (and re-captures what the LRU dropped)
    for got in (first, second, third):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    # A replay reads its new input: other pixels give the eager answer for those pixels.
    other = _images([(56, 56)] * 2)
    p2, g2 = _inputs(enc, other)
    r2 = [tuple(r) for r in g2.tolist()]
    enc.tower.run(p2, r2)
    enc.tower.run(p2, r2)
    torch.testing.assert_close(enc.tower.run(p2, r2), eager.tower.run(p2, r2), atol=0, rtol=0)
