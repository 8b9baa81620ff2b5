"""What the two scheduler gRPC protocols smg speaks (SGLang's and TokenSpeed's, both from smg-grpc-proto) share in
turning a ``GenerateRequest`` into the stage requests of one PD leg: the leg itself (:class:`GrpcLeg`), the
sampling parameters, the prompt's token ids, the PD bootstrap fields and the image-run checks, with every check a
request must pass first (:class:`InvalidRequest`: gRPC INVALID_ARGUMENT). Each protocol's own conversion:
:mod:`epdserve.frontend.sglang.requests`, :mod:`epdserve.frontend.tokenspeed.requests`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epdserve.frontend.errors import APIError
from epdserve.frontend.grpc_tensor import InvalidRequest
from epdserve.frontend.prompt import EncodedImage
from epdserve.frontend.structured import checked, generate_grammar
from epdserve.wire.messages import DecodeRequest, GrammarSpec, ImageSpan, PrefillRequest, SamplingParams


@dataclass
class EncodeRoom:
    """Where the embedding of image span ``span`` waits (TokenSpeed EPD): room ``room`` of the encoder bootstrap
    server at ``host``:``port``."""

    span: int
    host: str
    port: int
    room: int


@dataclass
class GrpcLeg:
    """One Generate call's stage requests (both built; the role sends its own) and where its images' embeddings
    come from: ``image_data`` (SGLang: the files, for the front's encoders) or ``rooms`` (TokenSpeed: one encoder
    bootstrap room per image span)."""

    prefill: PrefillRequest
    decode: DecodeRequest
    image_data: list[bytes]
    stream: bool
    rooms: list[EncodeRoom] = field(default_factory=list)


async def sampling_params(sp: Any, prompt_len: int, context_length: int, vocab_size: int,
                          temperature: float | None = None) -> SamplingParams:
    """epdserve's :class:`SamplingParams` for a proto ``SamplingParams`` (SGLang's, or TokenSpeed's, whose
    ``temperature`` is optional: its caller passes ``temperature``, the value to use instead of the field).

    proto3 cannot tell an unset number from 0, so smg always sends every field (temperature 1, top_p 1, top_k -1
    when the client set none); ``top_k`` 0 and ``top_p`` 0 are read as "off" (SGLang rejects them). Stop strings
    are not matched here: smg matches them on its own detokenized text and ends the stream, which aborts the
    request at this worker; a single-token stop arrives in ``stop_token_ids``.

    Raises:
        InvalidRequest: an option the stages do not implement (``n`` > 1, ``min_p``, ``repetition_penalty``), a
            token budget past the context length, a token id outside the vocabulary, or a grammar xgrammar
            rejects.
    """
    if sp.n > 1:
        raise InvalidRequest("n > 1 is not supported: send one request per sample")
    if sp.min_p > 0:
        raise InvalidRequest("min_p is not supported")
    if sp.repetition_penalty not in (0.0, 1.0):
        raise InvalidRequest("repetition_penalty is not supported (frequency_penalty and presence_penalty are)")
    left = context_length - prompt_len
    if left <= 0:
        raise InvalidRequest(f"the prompt has {prompt_len} tokens, but the model's context length is "
                             f"{context_length} tokens")
    max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else left
    if max_new > left:
        raise InvalidRequest(f"the prompt has {prompt_len} tokens and {max_new} new tokens were requested, but the "
                             f"model's context length is {context_length} tokens")
    bias = []
    for key, value in sorted(sp.logit_bias.items()):
        if not key.isdigit() or int(key) >= vocab_size:
            raise InvalidRequest(f"logit_bias names token {key!r}, not an id of the vocabulary ({vocab_size} ids)")
        bias.append([int(key), float(value)])
    if any(t >= vocab_size for t in sp.stop_token_ids):
        raise InvalidRequest(f"a stop token id is outside the vocabulary ({vocab_size} ids)")
    try:
        constraint = sp.WhichOneof("constraint")
        if constraint == "structural_tag":
            grammar = await checked(GrammarSpec("structural_tag", sp.structural_tag), "structural_tag")
        else:
            text = getattr(sp, constraint) if constraint else None
            grammar = await generate_grammar(text if constraint == "json_schema" else None,
                                             text if constraint == "regex" else None,
                                             text if constraint == "ebnf_grammar" else None, None)
    except APIError as e:
        raise InvalidRequest(e.message) from None
    temperature = sp.temperature if temperature is None else temperature
    return SamplingParams(temperature=max(temperature, 0.0), top_p=sp.top_p if sp.top_p > 0 else 1.0,
                          top_k=sp.top_k if sp.top_k > 0 else -1, max_new_tokens=max_new,
                          stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                          frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
                          logit_bias=bias, grammar=grammar)


def check_image_runs(runs: list[tuple[int, int]], input_ids: list[int], image_token_id: int, label: str,
                     holders: str) -> None:
    """Each ``(offset, length)`` of ``runs`` is a run of the image token in ``input_ids``, and no image token is
    outside them (the scheduler protocols' placeholders of SGLang and TokenSpeed alike).

    Raises:
        InvalidRequest: otherwise; the message names the run as ``label`` and its number, and the runs as
            ``holders``.
    """
    for i, (offset, length) in enumerate(runs):
        run = input_ids[offset:offset + length]
        if len(run) != length or any(t != image_token_id for t in run):
            raise InvalidRequest(f"{label} {i}: input_ids[{offset}:{offset + length}] is not a run of the image "
                                 f"token {image_token_id}")
    if sum(t == image_token_id for t in input_ids) != sum(length for _, length in runs):
        raise InvalidRequest(f"input_ids hold image tokens outside the {holders}")


def check_encoded(spans: list[ImageSpan], encoded: list[EncodedImage]) -> None:
    """Raise :class:`InvalidRequest` unless the encoders' results agree with the spans (hash, tokens, grid)."""
    for i, (span, enc) in enumerate(zip(spans, encoded, strict=True)):
        if (enc.image_hash, enc.num_tokens, list(enc.grid_thw)) != (span.image_hash, span.length, span.grid_thw):
            raise InvalidRequest(f"image {i}: the encoder made {enc.num_tokens} tokens of grid {enc.grid_thw}, the "
                                 f"prompt has {span.length} of grid {span.grid_thw}")


def prompt_ids(req: Any, vocab_size: int) -> list[int]:
    """The prompt's token ids of a ``GenerateRequest`` of either scheduler protocol (SGLang's and TokenSpeed's
    name these fields alike).

    Raises:
        InvalidRequest: a ``data_parallel_rank`` above 0, no token ids, or one outside the vocabulary.
    """
    if req.HasField("data_parallel_rank") and req.data_parallel_rank > 0:
        raise InvalidRequest(f"data_parallel_rank {req.data_parallel_rank}: this worker has one rank")
    if not req.HasField("tokenized") or not req.tokenized.input_ids:
        raise InvalidRequest("the request needs tokenized.input_ids (this worker takes no text)")
    ids = list(req.tokenized.input_ids)
    if max(ids) >= vocab_size:
        raise InvalidRequest(f"token id {max(ids)} is outside the vocabulary ({vocab_size} ids)")
    return ids


def pd_bootstrap(req: Any, field: str, role: str) -> Any:
    """The PD bootstrap message ``field`` of ``req`` (SGLang's ``disaggregated_params``, TokenSpeed's
    ``kv_bootstrap_info``: bootstrap_host, bootstrap_port, bootstrap_room).

    Raises:
        InvalidRequest: it is missing, or on a decode worker it lacks the prefill server's host or port.
    """
    if not req.HasField(field):
        raise InvalidRequest(f"this is a {role} worker for PD dual dispatch: the request needs {field} "
                             "(bootstrap_host, bootstrap_port, bootstrap_room)")
    info = getattr(req, field)
    if role == "decode" and not (info.bootstrap_host and info.bootstrap_port):
        raise InvalidRequest(f"{field} lacks the prefill server's bootstrap_host or bootstrap_port "
                             "(smg: --prefill grpc://HOST:PORT BOOTSTRAP_PORT)")
    return info
