"""nvJPEG vs PIL on photos and noise: pixel and luma differences, embedding cosine (3B-preset tower, bf16)."""
import glob, io, sys
import numpy as np, torch
from PIL import Image
from epdserve.encoder.vision import VisionEncoder, decode_image
from epdserve.bench.synth import random_image
enc = VisionEncoder(sys.argv[1], "cuda", torch.bfloat16, 0, False, True)
files = sorted(glob.glob(".gpu/photos/*.jpg"))
datas = [(f.split("/")[-1], open(f, "rb").read()) for f in files]
for w, h in ((448, 448), (1280, 720)):
    buf = io.BytesIO(); random_image(np.random.default_rng(0), w, h).save(buf, format="JPEG", quality=90)
    datas.append((f"noise {w}x{h} (bench)", buf.getvalue()))
Y = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
for name, data in datas:
    gpu = enc.decode(data, 1 << 30); pil = decode_image(data, 1 << 30)
    g = gpu.cpu().float(); p = torch.from_numpy(np.asarray(pil)).permute(2, 0, 1).float()
    d = (g - p).abs(); dy = ((g * Y).sum(0) - (p * Y).sum(0)).abs()
    [(eg, _)], [(ep, _)] = enc.encode([gpu]), enc.encode([pil])
    cos = torch.nn.functional.cosine_similarity(eg.float().flatten(), ep.float().flatten(), dim=0).item()
    print(f"{name:28s} {pil.size[0]}x{pil.size[1]}: RGB mean {d.mean():.2f} max {d.max():.0f}; luma mean {dy.mean():.2f}; "
          f"embedding cosine {cos:.5f}, max abs diff {(eg.float() - ep.float()).abs().max():.3f}", flush=True)
