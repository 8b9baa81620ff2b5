"""Encoder pipeline at c128: wall ms per preprocess call and per tower call vs the run's wall time (is the tower
busy?), for several --max-batch-patches."""
import asyncio, time, sys
from concurrent.futures import ThreadPoolExecutor
import numpy as np, torch, zmq.asyncio
from epdserve.encoder.vision import VisionEncoder
from epdserve.encoder.batcher import EncodeBatcher
from epdserve.encoder.server import EmbeddingPusher, EncoderServicer
from epdserve.encoder.cache import EmbeddingCache
from epdserve.bench.encoder import _jpegs, _measure, _tower_ms

enc = VisionEncoder(sys.argv[1], "cuda", torch.bfloat16, 32, True)
enc.warm_up()
log = []
for name in ("preprocess", "run_tower"):
    fn = getattr(enc, name)
    def timed(x, fn=fn, name=name):
        t0 = time.perf_counter(); r = fn(x); log.append((name, t0, time.perf_counter()))
        return r
    setattr(enc, name, timed)

async def main():
    tower = ThreadPoolExecutor(max_workers=1)
    ctx = zmq.asyncio.Context()
    rng = np.random.default_rng(7)
    for mbp in (16384, 32768, 65536):
        for conc in (64, 128):
            b = EncodeBatcher(tower, 2.0, mbp)
            s = EncoderServicer(EmbeddingCache(0), EmbeddingPusher(ctx), b, 1 << 40)
            s.encoder = enc
            for _ in range(2):
                await _measure(s, _jpegs(rng, 448, 448, 64), 64)
            imgs = _jpegs(rng, 448, 448, 512)
            log.clear(); c0 = b.calls
            m = await _measure(s, imgs, conc)
            calls = b.calls - c0
            prep = [e - t for n, t, e in log if n == "preprocess"]
            tw = [e - t for n, t, e in log if n == "run_tower"]
            print(f"mbp {mbp} c{conc}: {512 / m['seconds']:.1f} img/s, {calls} calls ({512 / calls:.1f} img/call); "
                  f"prep {1e3 * np.mean(prep):.1f} ms/call (sum {sum(prep):.2f} s), tower {1e3 * np.mean(tw):.1f} "
                  f"ms/call (sum {sum(tw):.2f} s) of {m['seconds']:.2f} s", flush=True)
            await s.aclose()
    for n in (16, 32, 64):
        print(f"tower alone {n} images: {_tower_ms(enc, 448, 448, n):.1f} ms", flush=True)
    tower.shutdown(); ctx.term()

asyncio.run(main())
