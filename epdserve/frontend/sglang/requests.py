"""SGLang's scheduler gRPC ``GenerateRequest`` (smg-grpc-proto's ``sglang.grpc.scheduler``) turned into the stage
requests of one PD leg, with every check a request must pass first (the checks both scheduler protocols share:
:mod:`epdserve.frontend.scheduler_requests`).

smg (and SGLang's own gRPC clients) send token ids, never text: the gateway has applied the chat template and
tokenized. For an image it sends, in ``mm_inputs``, the raw file bytes (``image_data``), its own preprocessing
(``pixel_values`` and the ``image_grid_thw`` model tensor) and where each image's ``<|image_pad|>`` run sits in
``input_ids`` (``mm_placeholders``). epdserve's encoders take the file bytes, so the pixels are not used; the grid
and the placeholder lengths are checked against this checkpoint's own processor (:func:`image_slots`), so a gateway
whose preprocessing differs (another resize rule, other min/max pixels) is refused with INVALID_ARGUMENT instead of
feeding the language model embeddings that do not fit its prompt.
"""

from __future__ import annotations

from typing import Any

from epdserve.frontend.grpc_tensor import InvalidRequest, decode_tensor
from epdserve.frontend.image_slots import image_slots
from epdserve.frontend.scheduler_requests import (
    GrpcLeg, check_image_runs, pd_bootstrap, prompt_ids, sampling_params,
)
from epdserve.wire.messages import DecodeRequest, ImageSpan, PrefillRequest, input_ids_digest


def image_spans(mm: Any, input_ids: list[int], image_token_id: int, image_processor: Any) -> tuple[list[bytes],
                                                                                                 list[ImageSpan]]:
    """The raw images of ``mm`` (a proto ``MultimodalInputs``) and their spans in ``input_ids``, checked against
    this checkpoint's processor: one placeholder per image, each a run of the image token exactly as long as the
    processor's token count for that image, every image token inside one, and (when sent) the gateway's
    ``image_grid_thw`` rows equal to the processor's grids. The spans' hashes are the SHA-256 of the bytes, the
    encoder's cache key.

    Raises:
        InvalidRequest: any mismatch, video or audio inputs, or pixels without the raw image bytes.
    """
    if mm.video_data or mm.audio_data or mm.video_urls or mm.audio_urls:
        raise InvalidRequest("only images are supported in mm_inputs (no video or audio)")
    if mm.image_urls:
        raise InvalidRequest("image_urls are not fetched by this worker: send the image bytes in image_data")
    images = list(mm.image_data)
    if not images:
        if mm.HasField("pixel_values"):
            raise InvalidRequest("pixel_values without image_data: epdserve's encoders take the image files")
        return [], []
    if mm.HasField("im_token_id") and mm.im_token_id != image_token_id:
        raise InvalidRequest(f"im_token_id {mm.im_token_id} is not this model's image token {image_token_id}")
    holders = list(mm.mm_placeholders)
    if len(holders) != len(images):
        raise InvalidRequest(f"{len(holders)} mm_placeholders for {len(images)} images")
    try:
        slots = [image_slots(image_processor, data) for data in images]
    except Exception as e:  # StageError(400) for bad bytes; anything else is the same to the client
        raise InvalidRequest(str(e)) from None
    grids = None
    if "image_grid_thw" in mm.model_specific_tensors:
        t = mm.model_specific_tensors["image_grid_thw"]
        grids = decode_tensor(t.data, t.shape, t.dtype, "image_grid_thw").reshape(-1, 3).tolist()
        if len(grids) != len(images):
            raise InvalidRequest(f"image_grid_thw has {len(grids)} rows for {len(images)} images")
    spans = []
    for i, (holder, slot) in enumerate(zip(holders, slots)):
        if grids is not None and grids[i] != slot.grid_thw:
            raise InvalidRequest(f"image {i}: the gateway's image_grid_thw {grids[i]} differs from this model's "
                                 f"processor's {slot.grid_thw} (check the processor config smg reads)")
        if holder.length != slot.num_tokens:
            raise InvalidRequest(f"image {i}: {holder.length} placeholder tokens, but this model's processor "
                                 f"makes {slot.num_tokens} tokens of it")
        spans.append(ImageSpan(offset=holder.offset, length=holder.length, image_hash=slot.image_hash,
                               grid_thw=list(slot.grid_thw)))
    check_image_runs([(s.offset, s.length) for s in spans], input_ids, image_token_id, "image", "mm_placeholders")
    return images, spans


async def build_leg(req: Any, rid: str, role: str, *, context_length: int, vocab_size: int, image_token_id: int,
                    image_processor: Any) -> GrpcLeg:
    """Both stage requests (request id ``rid``) of a proto ``GenerateRequest`` for a ``role`` ("prefill" or
    "decode") worker, with the bootstrap fields of ``disaggregated_params`` (the same room on both legs; the decode
    leg also names the prefill server's bootstrap address) and the prompt's digest. Images are checked on the
    prefill leg only: smg sends the decode leg no pixels, and decode only needs the prompt's length.

    Raises:
        InvalidRequest: no token ids, no room, a token id outside the vocabulary, or as :func:`sampling_params`
            and :func:`image_spans`.
    """
    ids = prompt_ids(req, vocab_size)
    dp = pd_bootstrap(req, "disaggregated_params", role)
    if req.input_embeds:
        raise InvalidRequest("input_embeds are not supported")
    if req.lora_id:
        raise InvalidRequest("LoRA adapters are not supported")
    sampling = await sampling_params(req.sampling_params, len(ids), context_length, vocab_size)
    if req.return_logprob:
        sampling.logprobs = max(req.top_logprobs_num, 0)
    images, spans = [], []
    if role == "prefill" and req.HasField("mm_inputs"):
        images, spans = image_spans(req.mm_inputs, ids, image_token_id, image_processor)
    digest = input_ids_digest(ids)
    prefill = PrefillRequest(rid=rid, input_ids=ids, images=spans, sampling=sampling,
                             bootstrap_room=dp.bootstrap_room, reply=True, input_digest=digest)
    decode = DecodeRequest(rid=rid, prompt_len=len(ids), sampling=sampling, bootstrap_host=dp.bootstrap_host,
                           bootstrap_port=dp.bootstrap_port, bootstrap_room=dp.bootstrap_room, input_digest=digest)
    return GrpcLeg(prefill, decode, images, req.stream)
