"""The pieces of smg's ``--epd-disaggregation`` path that need no model or smg: bootstrap rooms (claim before or
after the Encode, give-up, expiry), the bootstrap port's wire messages and their checks, the claim round trip from
the prefill front's client through the encoder's bootstrap port to a prefill rank's socket, and the checks of
TokenSpeed multimodal items against a Qwen2-VL-family processor."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from epdserve.encoder import rooms as rooms_mod
from epdserve.encoder.cache import EmbeddingCache
from epdserve.encoder.metrics import EncoderMetrics
from epdserve.encoder.outbox import EmbeddingOutbox
from epdserve.encoder.pusher import EmbeddingPusher
from epdserve.encoder.rooms import RoomServer, RoomStore
from epdserve.frontend.errors import StageError
from epdserve.frontend.grpc_tensor import InvalidRequest
from epdserve.frontend.scheduler_requests import EncodeRoom
from epdserve.frontend.tokenspeed.items import ProcessorLimits, image_item, item_pixels, tensor_from_proto
from epdserve.frontend.tokenspeed.room_client import RoomClient
from epdserve.wire import messages, room_messages
from epdserve.wire.codec import WireError
from epdserve.wire.room_messages import EmbedClaim, EmbedClaimReply
from epdserve.wire.ports import free_port

pb = pytest.importorskip("smg_grpc_proto").tokenspeed_scheduler_pb2


def _done(value) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def test_room_store_claims_before_and_after_the_encode_and_gives_up():
    async def run():
        store = RoomStore(timeout_s=60)
        store.add(1, "aa", _done("x"))
        assert (await store.take(1, 1.0)).image_hash == "aa" and len(store) == 0  # after the Encode
        early = asyncio.ensure_future(store.take(2, 5.0))  # before it: waits
        await asyncio.sleep(0)
        store.add(2, "bb", _done("y"))
        assert (await early).result.result() == "y" and len(store) == 0
        with pytest.raises(TimeoutError):
            await store.take(3, 0.01)
        store.give_up(4)  # given up before its Encode: the Encode holds nothing
        store.add(4, "cc", _done("z"))
        assert 4 not in store
        waiting = asyncio.ensure_future(store.take(5, 5.0))
        await asyncio.sleep(0)
        store.give_up(5)  # a claim still waiting ends
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(run())


def test_unclaimed_rooms_expire(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(rooms_mod.time, "monotonic", lambda: now[0])

    async def run():
        store = RoomStore(timeout_s=10)
        store.add(1, "aa", _done(None))
        now[0] += 5
        store.add(2, "bb", _done(None))
        assert store.expire() == [] and len(store) == 2
        now[0] += 6  # room 1 is 11 s old, room 2 6 s
        assert store.expire() == [1] and 2 in store and 1 not in store

    asyncio.run(run())


def test_room_messages_round_trip_and_refuse_bad_fields():
    claim = EmbedClaim(7, "r1", "ab" * 32, ["tcp://127.0.0.1:1"], "host", 5.0)
    assert room_messages.decode(room_messages.encode(claim)) == claim
    reply = EmbedClaimReply(7, 0, "", 16, [1, 8, 8])
    assert room_messages.decode(room_messages.encode(reply)) == reply
    for bad in (EmbedClaim(-1, "r", "h"), EmbedClaim(1, "r", "h", ["http://x"]), EmbedClaim(1, "r", "h", wait_s=0),
                EmbedClaimReply(1, grid_thw=[1, 2]), EmbedClaimReply(1, status=1000)):
        with pytest.raises(WireError):
            room_messages.decode(room_messages.encode(bad))
    with pytest.raises(WireError):  # another wire's message is not one of these
        room_messages.decode(messages.encode(messages.AbortRequest("r")))


def test_claim_pushes_the_embedding_to_the_targets_and_reports_it():
    """A prefill front's claim reaches the bootstrap port, the room's embedding goes to the target (a prefill rank's
    PULL socket) as ImageEmbeddings(rid, [hash]), and the reply carries its token count and grid; a claim of a
    room that never comes fails with 504, and a room holding another image with 400."""
    async def run():
        ctx = zmq.asyncio.Context()
        rank = ctx.socket(zmq.PULL)
        rank_port = rank.bind_to_random_port("tcp://127.0.0.1")
        store = RoomStore(timeout_s=60)
        cache = EmbeddingCache(1 << 20)
        pusher = EmbeddingPusher(ctx)
        outbox = EmbeddingOutbox(pusher, cache, EncoderMetrics(), set())
        server = RoomServer(store, outbox, torch.device("cpu"), lambda g: g[0] * g[1] * g[2] // 4)
        port = free_port()
        server.bind("127.0.0.1", port)
        serving = asyncio.create_task(server.run())
        client = RoomClient()
        emb = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        try:
            store.add(11, "ab" * 32, _done((emb, [1, 4, 4])))
            target = f"tcp://127.0.0.1:{rank_port}"
            got = await client.claim("rid-1", EncodeRoom(0, "127.0.0.1", port, 11), "ab" * 32, [target], "", 5.0)
            assert (got.num_tokens, got.grid_thw) == (4, [1, 4, 4]) and len(store) == 0
            pushed = messages.decode(await rank.recv_multipart())
            assert pushed.rid == "rid-1" and pushed.image_hashes == ["ab" * 32]
            assert torch.equal(pushed.embeddings[0], emb)
            with pytest.raises(StageError) as e:
                await client.claim("rid-2", EncodeRoom(0, "127.0.0.1", port, 12), "cd", [target], "", 0.2)
            assert e.value.status == 504
            store.add(13, "ef", _done((emb, [1, 4, 4])))
            with pytest.raises(StageError) as e:
                await client.claim("rid-3", EncodeRoom(0, "127.0.0.1", port, 13), "cd", [target], "", 2.0)
            assert e.value.status == 400 and "holds image" in e.value.message
        finally:
            client.close()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            server.close()
            pusher.close()
            rank.close(linger=0)
            ctx.term()

    asyncio.run(run())


LIMITS = ProcessorLimits(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=4096, max_pixels=524288,
                         image_token_id=99)


def _tensor(arr: np.ndarray, dtype: str) -> pb.TensorData:
    return pb.TensorData(shape=list(arr.shape), dtype=dtype, inline=arr.tobytes())


def _item(grid=(1, 4, 6), length=None, patches=None, modality=1, token=99) -> pb.MultimodalItem:
    n = grid[0] * grid[1] * grid[2]
    pixels = np.zeros((n if patches is None else patches, LIMITS.patch_dim), np.float32)
    return pb.MultimodalItem(
        modality=modality, content_hash=b"\x01" * 32, encoder_input=_tensor(pixels, "float32"),
        model_specific_tensors={"image_grid_thw": _tensor(np.array([grid], np.int64), "int64")},
        placeholders=[pb.PlaceholderRange(offset=3, length=n // 4 if length is None else length)],
        placeholder_token_id=token)


def test_items_are_checked_against_the_processor():
    item = _item()
    checked = image_item(item, 0, LIMITS)
    assert (checked.image_hash, checked.grid_thw, checked.offset, checked.length) == ("01" * 32, [1, 4, 6], 3, 6)
    assert list(item_pixels(item, checked, LIMITS).shape) == [24, LIMITS.patch_dim]
    for bad, words in ((_item(length=7), "placeholder tokens"), (_item(grid=(1, 3, 6)), "multiples of 2"),
                       (_item(grid=(1, 2, 2)), "pixels"), (_item(modality=2), "only images"),
                       (_item(token=5), "image token")):
        with pytest.raises(InvalidRequest, match=words):
            image_item(bad, 0, LIMITS)
    bad = _item(patches=20)
    with pytest.raises(InvalidRequest, match="needs"):
        item_pixels(bad, image_item(bad, 0, LIMITS), LIMITS)


def test_tensors_inline_only_and_in_the_sent_dtype():
    bf16 = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    t = pb.TensorData(shape=[1, 2], dtype="bfloat16", inline=bf16.view(torch.int16).numpy().tobytes())
    assert torch.equal(tensor_from_proto(t, "x"), bf16)
    shm = pb.TensorData(shape=[1], dtype="float32")
    shm.shm.name = "seg"
    with pytest.raises(InvalidRequest, match="inline"):
        tensor_from_proto(shm, "x")
    with pytest.raises(InvalidRequest, match="values for shape"):
        tensor_from_proto(pb.TensorData(shape=[3], dtype="float32", inline=b"\0" * 8), "x")
