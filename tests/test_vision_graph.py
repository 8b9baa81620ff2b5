"""The vision tower run from precomputed metadata (CPU: equal to transformers' own call) and from CUDA graphs
(GPU only: a lone image's grid captured on its second use, equal to the eager call, bounded in number)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from torch._dynamo.utils import counters

from epdserve.encoder.tower_compile import WARM_UP_BATCHES
from epdserve.encoder.vision import VisionEncoder
from epdserve.encoder.vision_graph import TowerGraphs, tower_metadata

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Three grids, repeated out of order: a batch mixes them, and alone they are more grids than the LRU below keeps.
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
def test_batch_run_gives_each_image_its_own_rows(cpu_encoder):
    # With graphs on or off, a batch of several images is one eager call from the precomputed metadata (graphs
    # are for lone images only); every image's rows equal the tower on that image alone, in order.
    enc = cpu_encoder
    images = _images()
    pixels, grid = _inputs(enc, images)
    rows = [tuple(r) for r in grid.tolist()]
    sizes = [enc.num_tokens(r) for r in rows]
    alone = [enc.model(*_inputs(enc, [img])[:1], grid_thw=_inputs(enc, [img])[1]).pooler_output for img in images]
    for max_graphs in (8, 0):
        tower = TowerGraphs(enc.model, enc.device, max_graphs=max_graphs)
        for _ in range(2):  # a batch's second sight captures nothing either
            out = tower.run(pixels, rows)
            assert out.shape == (sum(sizes), enc.hidden_size) and tower.num_graphs == 0
            for got, want in zip(torch.split(out, sizes), alone):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_cuda_graphs_match_eager_and_stay_bounded(tiny_model_path):
    enc = VisionEncoder(tiny_model_path, "cuda", "bfloat16", cuda_graphs=2)
    assert VisionEncoder(tiny_model_path, "cuda", "bfloat16", cuda_graphs=0).tower is None  # the plain call
    images = _images()
    by_grid = {}
    for img in images:  # one image per grid (three grids among six images): a grid's second sight captures
        p, g = _inputs(enc, [img])
        by_grid.setdefault(tuple(g[0].tolist()), (p, g))
    lone = list(by_grid.values())
    assert len(lone) == 3
    plain = [enc.model(p, grid_thw=g.to(enc.device)).pooler_output for p, g in lone]
    runs = []
    for sight in range(3):  # first sight of a grid: eager; second: captured (at most 2 kept); then replays
        runs.append([enc.tower.run(p, [tuple(r) for r in g.tolist()]) for p, g in lone])
        if sight == 0:
            assert enc.tower.num_graphs == 0
    assert enc.tower.num_graphs == 2
    for got in runs[1:]:  # replays run the eager call's kernels on the same shapes
        for a, b in zip(got, runs[0]):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(runs[0], plain):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    # A replay reads its new input: other pixels of a graphed grid give the plain call's answer for them.
    p2, g2 = _inputs(enc, [Image.fromarray(255 - np.asarray(_images([(56, 56)])[0]))])  # seed 7 made image 0 too
    want2 = enc.model(p2, grid_thw=g2.to(enc.device)).pooler_output
    assert not torch.allclose(want2.float(), runs[0][0].float(), atol=0.1)  # really another image
    for _ in range(3):
        torch.testing.assert_close(enc.tower.run(p2, [tuple(g2[0].tolist())]).float(), want2.float(), atol=2e-2,
                                   rtol=2e-2)
    # A batch is one eager call and leaves the graphs alone.
    pixels, grid = _inputs(enc, images)
    batch = enc.tower.run(pixels, [tuple(r) for r in grid.tolist()])
    torch.testing.assert_close(batch.float(), enc.model(pixels, grid_thw=grid.to(enc.device)).pooler_output.float(),
                               atol=2e-2, rtol=2e-2)
    print(f"tower graphs: {len(lone)} grids, 2 graphs kept; replays equal the first eager run bit for bit, and the "
          "plain call within 2e-2 (new pixels of a graphed grid too; a batch runs eagerly)")


@pytest.mark.gpu
@needs_cuda
@torch.inference_mode()
def test_compiled_tower_matches_eager_and_composes_with_graphs(tiny_model_path):
    # torch.compile fuses the float32 norm/rotary arithmetic: the same math in another order, so
    # equal to the eager tower up to bf16 rounding, alone and captured in CUDA graphs; the CPU never compiles.
    eager = VisionEncoder(tiny_model_path, "cuda", "bfloat16")
    assert not eager.compiled and not VisionEncoder(tiny_model_path, "cpu", "float32", compile=True).compiled
    images = _images()
    want = [emb.float() for emb, _ in eager.encode(images)]
    worst = 1.0
    recompiles = []
    for graphs in (0, 4):
        enc = VisionEncoder(tiny_model_path, "cuda", "bfloat16", cuda_graphs=graphs, compile=True)
        # Until the compile is finished the tower serves eagerly, without graphs (they would capture eager code).
        assert enc.compile_pending and not enc.compiled and enc.tower is None
        for (emb, _), ref in zip(enc.encode(images), want):
            assert torch.equal(emb.float(), ref)
        enc.compile_tower()  # the shadow's compile: on the test's thread here, on its own thread in the server
        compiled = counters["stats"]["unique_graphs"]
        enc.finish_compile(True)
        assert enc.compiled and not enc.compile_pending and (enc.tower is not None) == (graphs > 0)
        warm_up_images = [Image.new("RGB", size, (i * 40 % 256, 90, 160)) for i, size in enumerate(WARM_UP_BATCHES[1])]
        enc.encode(warm_up_images)
        enc.encode(warm_up_images[:1])
        assert counters["stats"]["unique_graphs"] == compiled, "the tower compiled again what its shadow compiled"
        for sight in range(3):  # the batch, then each image alone: eager, capture, replay
            got = enc.encode(images) if sight == 0 else [enc.encode([img])[0] for img in images]
            for (emb, _), ref in zip(got, want):
                cos = torch.nn.functional.cosine_similarity(emb.float().flatten(), ref.flatten(), dim=0)
                assert cos > 0.999, f"compiled tower drifted from eager (cosine {cos:.5f}, graphs={graphs})"
                worst = min(worst, float(cos))
        recompiles.append(counters["stats"]["unique_graphs"] - compiled)
    print(f"compiled tower, without and with graphs: lowest cosine to the eager tower {worst:.5f} (bound 0.999); "
          f"no compile on the warm-up's sizes after the shadow's; graphs compiled for other sizes: {recompiles}")
