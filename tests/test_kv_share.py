"""Mapping another process's KV pool (the shared prefill -> decode hand-off): CPU /dev/shm here, CUDA IPC on a GPU.

The handle crosses the process boundary the way the servers send it: msgpack frames of our own codec, never pickle.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from epdserve.kvcache.kv_pool import KVPool
from epdserve.kvcache.kv_share import PeerPools, export_pool, new_shm_path, open_pool, shares_kv
from epdserve.wire.messages import decode, encode

SHAPE = dict(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)


def _owner(device: str, frames_out, done) -> None:
    """Child: allocate a pool, fill it with a known pattern, send its handle, keep it alive until told."""
    shm = new_shm_path() if device == "cpu" else ""
    pool = KVPool(**SHAPE, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=torch.device(device),
                  shm_path=shm)
    pool.buffer.copy_(torch.arange(pool.buffer.numel(), dtype=torch.float32).view(pool.buffer.shape))
    if device == "cuda":
        torch.cuda.synchronize()
    frames_out.send([bytes(f) for f in encode(export_pool(pool.buffer, shm))])
    done.wait(60)


def _map_from_child(device: str) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    done = ctx.Event()
    proc = ctx.Process(target=_owner, args=(device, child, done))
    proc.start()
    try:
        handle = decode(parent.recv())
        peer = PeerPools().get(handle)  # [L, 2, P * ps, H, D]
        L, P, ps, H, D = (SHAPE[k] for k in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"))
        assert tuple(peer.shape) == (L, 2, P * ps, H, D)
        want = torch.arange(peer.numel(), dtype=torch.float32).view(peer.shape).to(peer.dtype)
        assert torch.equal(peer.cpu(), want)
        # What the decode server does: gather some slots of the peer pool into its own pool.
        mine = KVPool(**SHAPE, dtype=peer.dtype, device=torch.device(device))
        src, dst = torch.tensor([5, 6, 7, 30]), torch.tensor([0, 1, 2, 3])
        mine.write_all(dst.to(device), peer[:, :, src.to(peer.device)].to(device))
        assert torch.equal(mine.read(dst).cpu(), want[:, :, src])
    finally:
        done.set()
        proc.join(30)
    if device == "cpu":
        assert not os.path.exists(handle.shm_path)  # the owner removed its file on exit


def test_cpu_pool_maps_across_processes():
    _map_from_child("cpu")


def test_modes_and_bad_handles():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert shares_kv("shared", cpu) and shares_kv("shared", cuda)
    assert not shares_kv("zmq", cpu) and not shares_kv("zmq", cuda)
    assert shares_kv("auto", cuda) and not shares_kv("auto", cpu)  # no /dev/shm pool unless asked for
    with pytest.raises(ValueError):
        shares_kv("rdma", cpu)
    pool = KVPool(**SHAPE, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError):
        export_pool(pool.buffer)  # not in shared memory
    handle = export_pool(pool.buffer, "/dev/shm/epdserve-kv-missing")
    with pytest.raises(RuntimeError):
        open_pool(handle)  # a peer that is gone: an error, not a fresh file of zeros
    assert not os.path.exists("/dev/shm/epdserve-kv-missing")
    handle.shm_path = "/etc/passwd"
    with pytest.raises(ValueError):
        open_pool(handle)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_maps_across_processes():
    _map_from_child("cuda")
    print("CUDA IPC: a child's bf16 KV pool mapped here reads back its pattern, and slots gathered from it equal it")
