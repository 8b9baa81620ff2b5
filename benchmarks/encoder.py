"""``python -m epdserve.bench.encoder``: throughput of the encoder stage alone (no gateway, prefill or decode).

    python -m epdserve.bench.encoder --model-path DIR --image-sizes 448x448 1280x720 --batch 1 32 \\
        --num-images 256 [--device cuda] [--output-json out.json]

For each image size and each ``--batch`` level B, ``--num-images`` requests of one image each are sent by B
concurrent clients straight to the encoder's gRPC servicer (``EncoderServicer.Encode`` in this process, with the
server's own batcher; no gRPC transport, embeddings returned in the response as without ``targets``). Every
image is distinct random noise (seeded), JPEG-encoded, and the embedding cache is off, so each request hashes,
decodes, preprocesses and runs the tower: B=1 is one request at a time, B=32 shows cross-request batching.
Each row also times the vision tower alone (``tower ms``: one call on min(B, 16) preprocessed images), which
separates the tower from the host work around it (JPEG decoding, hashing, the image processor).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zmq.asyncio
from PIL import Image

from epdserve.device import resolve_device, resolve_dtype
from epdserve.encoder.batcher import EncodeBatcher
from epdserve.encoder.cache import EmbeddingCache
from epdserve.encoder.pusher import EmbeddingPusher
from epdserve.encoder.server import EncoderServicer
from epdserve.encoder.vision import VisionEncoder
from epdserve.models.paths import resolve_model_path
from epdserve.proto import encoder_pb2

from .report import print_rows, text_table
from .synth import parse_size, random_image


class _Context:
    async def abort(self, code, message):
        raise RuntimeError(f"encode failed: {code.name}: {message}")


def _jpegs(rng: np.random.Generator, width: int, height: int, n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        random_image(rng, width, height).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


async def _measure(servicer: EncoderServicer, images: list[bytes], concurrency: int) -> dict:
    """Encode ``images`` (one per request) with ``concurrency`` clients; wall time and per-request latencies."""
    todo = iter(enumerate(images))
    latencies: list[float] = []

    async def client() -> None:
        for i, data in todo:  # the clients share one iterator: each image is sent once
            request = encoder_pb2.EncodeRequest(request_id=f"b{i}", images=[encoder_pb2.Image(data=data)])
            t0 = time.perf_counter()
            await servicer.Encode(request, _Context())
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"seconds": time.perf_counter() - t0, "latencies": latencies}


def _tower_ms(encoder: VisionEncoder, width: int, height: int, n: int, reps: int = 10) -> float:
    """Milliseconds per call of the vision tower alone on ``n`` processed ``width``x``height`` images (the image
    processor's output made once, outside the timing), synchronized with the device."""
    images = [random_image(np.random.default_rng(i), width, height) for i in range(n)]
    kwargs = {"device": encoder.device} if encoder.device.type == "cuda" else {}
    inputs = encoder.image_processor(images=images, return_tensors="pt", **kwargs)
    pixels = inputs["pixel_values"].to(encoder.device).type(encoder.dtype)
    grid = inputs["image_grid_thw"]
    rows = [tuple(r) for r in grid.tolist()]

    def call():
        with torch.inference_mode():
            if encoder.tower is not None:
                return encoder.tower.run(pixels, rows)
            return encoder.model(pixels, grid_thw=grid.to(encoder.device)).pooler_output

    for _ in range(3):  # the second call captures the graph when graphs are on
        call()
    sync = torch.cuda.synchronize if encoder.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    sync()
    return (time.perf_counter() - t0) / reps * 1000


async def run(args: argparse.Namespace) -> list[dict]:
    """One result row per (torch.compile setting, CUDA-graph setting, JPEG decoder, image size, batch level); see
    the module docstring."""
    rows = []
    for compiled in args.compile:
        for graphs in args.cuda_graphs:
            for gpu_jpeg in args.gpu_jpeg_decode:
                rows += await _run_one(args, graphs, bool(compiled), bool(gpu_jpeg))
    return rows


async def _run_one(args: argparse.Namespace, graphs: int, compiled: bool, gpu_jpeg: bool) -> list[dict]:
    device = resolve_device(args.device)
    encoder = VisionEncoder(resolve_model_path(args.model_path), device, resolve_dtype(args.dtype, device), graphs,
                            compiled, gpu_jpeg)
    t0 = time.perf_counter()
    encoder.warm_up()
    if encoder.compile_pending:  # the server compiles beside serving; the figures here are the compiled tower's
        encoder.compile_tower()
        encoder.finish_compile(True)
    warm_up_s = time.perf_counter() - t0
    tower = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-vision")
    zmq_ctx = zmq.asyncio.Context()
    rng = np.random.default_rng(args.seed)
    rows = []
    try:
        for size in args.image_sizes:
            width, height = parse_size(size)
            patches = encoder.num_patches(Image.new("RGB", (width, height)))
            for batch in args.batch:
                batcher = EncodeBatcher(tower, args.batch_wait_ms, args.max_batch_patches)
                servicer = EncoderServicer(EmbeddingCache(0), EmbeddingPusher(zmq_ctx), batcher, 1 << 40)
                servicer.encoder = encoder
                for _ in range(2):  # twice: a tower shape is graphed on its second use
                    await _measure(servicer, _jpegs(rng, width, height, args.warmup), min(batch, args.warmup))
                calls0 = batcher.calls
                m = await _measure(servicer, _jpegs(rng, width, height, args.num_images), batch)
                calls = batcher.calls - calls0
                lat_ms = np.array(m["latencies"]) * 1000
                rows.append({"image_size": size, "batch": batch, "num_images": args.num_images,
                             "images_per_s": args.num_images / m["seconds"], "seconds": m["seconds"],
                             "mean_latency_ms": float(lat_ms.mean()),
                             "p99_latency_ms": float(np.percentile(lat_ms, 99)),
                             "tower_calls": calls, "mean_images_per_call": args.num_images / calls,
                             "patches_per_image": patches, "tokens_per_image": patches // encoder.merge_size**2,
                             "cuda_graphs": graphs, "compile": encoder.compiled,
                             "gpu_jpeg_decode": encoder.gpu_jpeg_decode, "warm_up_s": warm_up_s,
                             "tower_ms": await asyncio.get_running_loop().run_in_executor(
                                 tower, _tower_ms, encoder, width, height, min(batch, 16))})
                await servicer.aclose()
    finally:
        tower.shutdown()
        zmq_ctx.term()
    return rows


def _table(rows: list[dict]) -> str:
    return text_table([
        ("compile", 7, lambda r: "on" if r["compile"] else "off"),
        ("graphs", 6, lambda r: str(r["cuda_graphs"])),
        ("jpeg", 4, lambda r: "gpu" if r.get("gpu_jpeg_decode") else "cpu"),
        ("image", 10, lambda r: r["image_size"]),
        ("batch", 5, lambda r: str(r["batch"])),
        ("images/s", 9, lambda r: f"{r['images_per_s']:.1f}"),
        ("mean ms", 8, lambda r: f"{r['mean_latency_ms']:.1f}"),
        ("p99 ms", 8, lambda r: f"{r['p99_latency_ms']:.1f}"),
        ("calls", 6, lambda r: str(r["tower_calls"])),
        ("img/call", 8, lambda r: f"{r['mean_images_per_call']:.2f}"),
        ("tokens", 6, lambda r: str(r["tokens_per_image"])),
        ("tower ms", 15, lambda r: f"{r['tower_ms']:>7.1f} ({min(r['batch'], 16):>2} img)"),
    ], rows)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run every (size, batch) configuration, print a table; exit status 0 (2 for bad flags)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default="", help="local checkpoint directory (default: the tiny model)")
    p.add_argument("--image-sizes", nargs="+", default=["448x448"], help="WIDTHxHEIGHT per configuration")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32], help="concurrent single-image requests")
    p.add_argument("--num-images", type=int, default=256, help="measured images per configuration")
    p.add_argument("--warmup", type=int, default=8, help="unmeasured images before each configuration")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    p.add_argument("--batch-wait-ms", type=float, default=2.0, help="the encoder's --batch-wait-ms")
    p.add_argument("--max-batch-patches", type=int, default=65536, help="the encoder's --max-batch-patches")
    p.add_argument("--seed", type=int, default=0, help="seed of the random images")
    p.add_argument("--cuda-graphs", nargs="+", type=int, default=[0],
                   help="the encoder's --cuda-graphs; several values run side by side (e.g. 0 32)")
    p.add_argument("--compile", nargs="+", type=int, choices=(0, 1), default=[1],
                   help="the encoder's --compile (1) or --no-compile (0); 0 1 runs both side by side")
    p.add_argument("--gpu-jpeg-decode", nargs="+", type=int, choices=(0, 1), default=[1],
                   help="the encoder's --gpu-jpeg-decode (1, CUDA only) or --no-gpu-jpeg-decode (0, PIL); 0 1 runs "
                        "both side by side")
    p.add_argument("--output-json", help="also write the config and the rows here")
    args = p.parse_args(argv)
    for size in args.image_sizes:
        try:
            parse_size(size)
        except ValueError as e:
            p.error(str(e))
    if min(args.batch) < 1 or args.num_images < 1 or args.warmup < 1:
        p.error("--batch, --num-images and --warmup must be >= 1")
    rows = asyncio.run(run(args))
    print_rows(_table(rows), rows, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
