"""TokenSpeed's scheduler ``GenerateRequest`` (smg-grpc-proto's ``tokenspeed.grpc.scheduler``) turned into the stage
requests of one PD leg: what smg sends a ``grpc://`` prefill or decode worker in ``--epd-disaggregation`` (and
TokenSpeed PD) mode, with every check a request must pass first.

Like SGLang's request it carries token ids, never text, and the same sampling fields (checked by
:func:`~epdserve.frontend.scheduler_requests.sampling_params`; TokenSpeed's optional ``temperature`` defaults to 1).
Differences: the prefill↔decode rendezvous is ``kv_bootstrap_info`` (the prefill's bootstrap host, port and room,
SGLang's ``disaggregated_params``), and an image arrives as a ``MultimodalItem`` without pixels whose embedding
an encoder of smg's choosing computes; ``encode_bootstrap_info`` names, per item, that encoder's bootstrap host,
port and room, from which the prefill front pulls it (:mod:`epdserve.frontend.tokenspeed.room_client`). The
image's span is checked against this checkpoint's processor (:mod:`epdserve.frontend.tokenspeed.items`) and hashed
by smg's content hash, so a repeated image shares radix-cache pages as with epdserve's own gateway.
"""

from __future__ import annotations

from typing import Any

from epdserve.frontend.grpc_tensor import InvalidRequest
from epdserve.frontend.scheduler_requests import (
    EncodeRoom, GrpcLeg, check_image_runs, pd_bootstrap, prompt_ids, sampling_params,
)
from epdserve.frontend.tokenspeed.items import ProcessorLimits, image_item
from epdserve.wire.messages import DecodeRequest, ImageSpan, PrefillRequest, input_ids_digest


def _rooms(req: Any, num_items: int) -> list[EncodeRoom]:
    """One encoder room per item from ``encode_bootstrap_info``.

    Raises:
        InvalidRequest: an item without a room (or two), an index out of range, or no bootstrap address.
    """
    if num_items and not req.HasField("encode_bootstrap_info"):
        raise InvalidRequest("the request has images but no encode_bootstrap_info: this prefill worker takes "
                             "embeddings from smg's encode workers (smg --epd-disaggregation)")
    rooms: dict[int, EncodeRoom] = {}
    for info in req.encode_bootstrap_info.items:
        if info.item_index >= num_items or info.item_index in rooms:
            raise InvalidRequest(f"encode_bootstrap_info names item {info.item_index} twice or out of range "
                                 f"({num_items} items)")
        if not info.bootstrap_host or info.bootstrap_port <= 0:
            raise InvalidRequest(f"encode_bootstrap_info of item {info.item_index} lacks the encoder's bootstrap "
                                 "host or port (smg: --encode grpc://HOST:PORT BOOTSTRAP_PORT)")
        rooms[info.item_index] = EncodeRoom(info.item_index, info.bootstrap_host, info.bootstrap_port,
                                            info.bootstrap_room)
    if len(rooms) != num_items:
        raise InvalidRequest(f"encode_bootstrap_info has rooms for {len(rooms)} of {num_items} items")
    return [rooms[i] for i in range(num_items)]


async def build_leg(req: Any, rid: str, role: str, *, context_length: int, vocab_size: int,
                    limits: ProcessorLimits) -> GrpcLeg:
    """Both stage requests (request id ``rid``) of a TokenSpeed ``GenerateRequest`` for a ``role`` ("prefill" or
    "decode") worker: the room of ``kv_bootstrap_info`` on both legs (the decode leg also names the prefill's
    bootstrap address), and on the prefill leg the image spans and their encoder rooms. smg sends the decode leg
    the items' metadata without rooms; decode only needs the prompt's length.

    Raises:
        InvalidRequest: no token ids, no ``kv_bootstrap_info``, a token id outside the vocabulary, bad items or
            rooms (:func:`~epdserve.frontend.tokenspeed.items.image_item`, :func:`_rooms`), or as
            :func:`~epdserve.frontend.scheduler_requests.sampling_params`.
    """
    ids = prompt_ids(req, vocab_size)
    kv = pd_bootstrap(req, "kv_bootstrap_info", role)
    sp = req.sampling_params
    sampling = await sampling_params(sp, len(ids), context_length, vocab_size,
                                     temperature=sp.temperature if sp.HasField("temperature") else 1.0)
    if req.return_logprob:
        sampling.logprobs = max(req.top_logprobs_num, 0)
    spans, rooms = [], []
    if role == "prefill" and req.HasField("mm_inputs") and req.mm_inputs.items:
        items = [image_item(it, i, limits) for i, it in enumerate(req.mm_inputs.items)]
        check_image_runs([(it.offset, it.length) for it in items], ids, limits.image_token_id, "item",
                         "items' placeholders")
        spans = [ImageSpan(offset=it.offset, length=it.length, image_hash=it.image_hash, grid_thw=it.grid_thw)
                 for it in items]
        rooms = _rooms(req, len(items))
    elif role == "prefill" and req.HasField("encode_bootstrap_info") and req.encode_bootstrap_info.items:
        raise InvalidRequest("encode_bootstrap_info names items, but mm_inputs has none")
    digest = input_ids_digest(ids)
    prefill = PrefillRequest(rid=rid, input_ids=ids, images=spans, sampling=sampling,
                             bootstrap_room=kv.bootstrap_room, reply=True, input_digest=digest)
    decode = DecodeRequest(rid=rid, prompt_len=len(ids), sampling=sampling, bootstrap_host=kv.bootstrap_host,
                           bootstrap_port=kv.bootstrap_port, bootstrap_room=kv.bootstrap_room, input_digest=digest)
    return GrpcLeg(prefill, decode, [], req.stream, rooms)
