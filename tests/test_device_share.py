"""Embeddings handed from the encoder to prefill ranks through GPU memory (CUDA IPC): the message on the wire
(msgpack, never pickle), its validation, and on a GPU the hand-off across processes, every receiver's copy equal
to the sender's tensor and the sender's memory back to its baseline once all receivers took theirs."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from epdserve.wire.codec import WireError
from epdserve.wire.device_share import DeviceSharer, take_embeddings
from epdserve.wire.messages import ImageEmbeddings, SharedTensor, decode, encode
from epdserve.wire.validate import check_message

HASH = "ab" * 32


def _handle(**kw) -> SharedTensor:
    fields = dict(cuda_ipc=[0, b"h" * 64, 4096, 0, b"/torch_1_2", 3, b"e" * 64, True], dtype="bfloat16",
                  shape=[16, 32])
    fields.update(kw)
    return SharedTensor(**fields)


def test_shared_embedding_round_trips_the_wire_and_is_validated():
    msg = ImageEmbeddings(rid="r1", image_hashes=[HASH, HASH], embeddings=[_handle(), torch.ones(2, 3)])
    got = check_message(decode([bytes(f) for f in encode(msg)]))
    assert isinstance(got.embeddings[0], SharedTensor) and got.embeddings[0].cuda_ipc == _handle().cuda_ipc
    assert torch.equal(got.embeddings[1], torch.ones(2, 3))
    for bad in (_handle(cuda_ipc=[0] * 7), _handle(shape=[2, 3, 4]), _handle(dtype="int64"), _handle(shape=[-1, 3])):
        msg = ImageEmbeddings(rid="r1", image_hashes=[HASH], embeddings=[bad])
        with pytest.raises(WireError):
            check_message(decode([bytes(f) for f in encode(msg)]))


def test_a_message_of_bytes_passes_through_untouched():
    msg = ImageEmbeddings(rid="r1", image_hashes=[HASH], embeddings=[torch.ones(2, 3)])
    assert take_embeddings(msg, torch.device("cpu")) is msg


def test_a_handle_that_cannot_be_mapped_drops_the_message_with_an_error(caplog):
    msg = ImageEmbeddings(rid="r9", image_hashes=[HASH], embeddings=[_handle(dtype="int8")])
    assert take_embeddings(msg, torch.device("cpu")) is None
    assert "rid=r9" in caplog.text and "--kv-transfer zmq" in caplog.text


def _receiver(frames, device: int, out) -> None:
    """Child (one prefill rank): take the shared embeddings, send back their bytes as float32."""
    msg = take_embeddings(check_message(decode(frames)), torch.device("cuda", device))
    torch.cuda.synchronize()
    out.send([e.float().cpu().numpy().tobytes() for e in msg.embeddings])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_receivers_take_their_copies_and_the_sender_gets_its_memory_back():
    dev = torch.device("cuda", 0)
    torch.cuda.ipc_collect()
    baseline = torch.cuda.memory_allocated(dev)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(1760, 512, generator=g).to(torch.bfloat16).pin_memory(),  # a cached host embedding
               torch.randn(64, 512, generator=g).to(torch.bfloat16)]  # a pageable one
    sharer = DeviceSharer(dev)
    per_receiver = sharer.share(sources, 2)
    assert torch.cuda.memory_allocated(dev) > baseline
    ctx = mp.get_context("spawn")
    for shared in per_receiver:
        frames = [bytes(f) for f in encode(ImageEmbeddings(rid="r1", image_hashes=[HASH, HASH], embeddings=shared))]
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(frames, 0, child))
        proc.start()
        got = parent.recv()
        proc.join(60)
        assert proc.exitcode == 0
        for src, raw in zip(sources, got):
            assert raw == src.float().numpy().tobytes()
    del per_receiver
    torch.cuda.ipc_collect()  # both receivers released their counters: the limbo empties
    assert torch.cuda.memory_allocated(dev) == baseline
    print(f"CUDA IPC: 2 receivers each read {len(sources)} shared embeddings bit for bit; "
          "the sender's memory is back to its baseline")
