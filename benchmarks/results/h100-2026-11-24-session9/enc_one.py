"""Encoder in process: (1) one image at a time, stage times for 448² and 1280x720; (2) the c128 pipeline under
py-spy (--native --idle --threads), to see where the tower thread and the others wait."""
import asyncio, os, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np, torch, zmq.asyncio
import epdserve.encoder.server as srv
from epdserve.encoder.vision import VisionEncoder
from epdserve.encoder.batcher import EncodeBatcher
from epdserve.encoder.server import EmbeddingPusher, EncoderServicer
from epdserve.encoder.cache import EmbeddingCache
from epdserve.bench.encoder import _jpegs, _measure

enc = VisionEncoder(sys.argv[1], "cuda", torch.bfloat16, 32, True)
enc.warm_up()
log = []
def wrap(obj, name, label):
    fn = getattr(obj, name)
    def timed(*a, **k):
        t0 = time.perf_counter(); r = fn(*a, **k); log.append((label, t0, time.perf_counter())); return r
    setattr(obj, name, timed)
wrap(enc, "preprocess", "prep"); wrap(enc, "run_tower", "tower"); wrap(srv, "_decode_one", "decode")
orig_tower_run = enc.tower.run
def tower_run(*a):
    t0 = time.perf_counter(); r = orig_tower_run(*a); torch.cuda.synchronize(); log.append(("graph+sync", t0, time.perf_counter())); return r
enc.tower.run = tower_run

async def main():
    tower = ThreadPoolExecutor(max_workers=1)
    ctx = zmq.asyncio.Context()
    rng = np.random.default_rng(11)
    for w, h in ((448, 448), (1280, 720)):
        b = EncodeBatcher(tower, 2.0, 16384)
        s = EncoderServicer(EmbeddingCache(0), EmbeddingPusher(ctx), b, 1 << 40); s.encoder = enc
        await _measure(s, _jpegs(rng, w, h, 4), 1)
        per = []
        for data in _jpegs(rng, w, h, 12):
            log.clear()
            m = await _measure(s, [data], 1)
            d = {k: 0.0 for k in ("decode", "prep", "tower", "graph+sync")}
            for k, t0, t1 in log: d[k] += (t1 - t0) * 1e3
            d["total"] = m["seconds"] * 1e3
            per.append(d)
        med = {k: float(np.median([p[k] for p in per])) for k in per[0]}
        print(f"{w}x{h} one at a time, median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)
        await s.aclose()
    enc.tower.run = orig_tower_run
    b = EncodeBatcher(tower, 2.0, 16384)
    s = EncoderServicer(EmbeddingCache(0), EmbeddingPusher(ctx), b, 1 << 40); s.encoder = enc
    await _measure(s, _jpegs(rng, 448, 448, 64), 64)
    imgs = _jpegs(rng, 448, 448, 768)
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--native", "--idle", "--threads", "-r", "100",
                            "-f", "raw", "-o", os.environ["OUT"] + "/spy_enc.txt", "--duration", "5"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    await asyncio.sleep(1.0)
    m = await _measure(s, imgs, 128)
    print(f"c128 pipeline: {768 / m['seconds']:.1f} img/s", flush=True)
    print("py-spy:", spy.wait(), spy.stderr.read().decode()[-300:])
    await s.aclose(); tower.shutdown(); ctx.term()

asyncio.run(main())
