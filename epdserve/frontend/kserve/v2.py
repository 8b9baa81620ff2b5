"""The Open Inference Protocol (v2, KServe's and Triton's) for a chat model, the way Triton's vLLM backend maps an
LLM onto tensors; shared by the HTTP routes (:mod:`epdserve.frontend.kserve.http`) and the gRPC service
(``epdserve.gateway.kserve_grpc``).

Inputs (one request, no batch dimension beyond 1):

- ``text_input`` (BYTES, one element, UTF-8): the prompt. Chat-formatted with the checkpoint's template as one user
  turn (the images and videos first, then the text) unless the request parameter ``apply_chat_template`` is false;
  then tokenized as is (as SGLang's ``/generate`` does), which takes no image.
- ``image`` / ``video`` (BYTES, one or more elements): encoded files (PNG, JPEG, ...; MP4, ...), raw or base64
  (JSON has no raw bytes).
- ``stream`` (BOOL): one response per text delta (gRPC ``ModelStreamInfer``, HTTP ``generate_stream``).
- ``sampling_parameters`` (BYTES, one JSON object) with vLLM's names: ``temperature``, ``top_p``, ``top_k``,
  ``max_tokens`` (default 16, as vLLM), ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
  ``frequency_penalty``, ``presence_penalty``. The same names are also taken from the request's ``parameters``
  (Triton's ``/generate`` sends them so); the tensor wins.
- ``exclude_input_in_output`` (BOOL, default false as in Triton's backend: ``text_output`` then starts with
  ``text_input`` as sent, the first response of a stream only).
- ``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens`` (BOOL): add Triton's
  outputs ``finish_reason`` (BYTES: "length", "stop", or "None" before the last response of a stream),
  ``num_input_tokens`` and ``num_output_tokens`` (UINT32; streamed: the tokens of that response).

Output: ``text_output`` (BYTES, one element), and the others above when asked for (or named in ``outputs``). Any
other input, a wrong datatype or shape, or a bad ``sampling_parameters`` is an :class:`APIError` 400 (gRPC
INVALID_ARGUMENT); another model name 404.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import epdserve
from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.errors import APIError
from epdserve.frontend.httputil import describe_validation_error
from epdserve.frontend.request import ChatRequest, Int64, MaxTokens, Penalty, PromptRequest, Seed, TokenId, stop_list
from epdserve.wire.messages import SamplingParams

INPUTS = {"text_input": "BYTES", "image": "BYTES", "video": "BYTES", "stream": "BOOL",
          "sampling_parameters": "BYTES", "exclude_input_in_output": "BOOL", "return_finish_reason": "BOOL",
          "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL"}
OUTPUTS = {"text_output": "BYTES", "finish_reason": "BYTES", "num_input_tokens": "UINT32",
           "num_output_tokens": "UINT32"}
DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, so a Triton client gets what it got there
EXTENSIONS = ["binary_tensor_data", "parameters", "generate"]
_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")


class Sampling(BaseModel):
    """``sampling_parameters`` with vLLM's ``SamplingParams`` names (Triton's vLLM backend passes them to it), and
    the ranges epdserve's OpenAI route takes; unset: that route's defaults."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int64 | None = None
    max_tokens: MaxTokens | None = DEFAULT_MAX_TOKENS
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None

    def params(self) -> SamplingParams:
        """The stages' sampling (``max_new_tokens`` is the front's to set)."""
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=-1 if self.top_k is None else self.top_k, stop=stop_list(self.stop),
                              stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                              seed=self.seed, frequency_penalty=self.frequency_penalty or 0.0,
                              presence_penalty=self.presence_penalty or 0.0)


SAMPLING = tuple(Sampling.model_fields)


@dataclass
class Tensor:
    """One input tensor as a transport decoded it: ``values`` flattened (``bytes`` for BYTES, ``bool`` for BOOL;
    None for a datatype no input of this model has)."""

    name: str
    datatype: str
    shape: list[int]
    values: list | None


@dataclass
class V2Request:
    """One v2 inference request, validated (:func:`parse_v2`)."""

    model: str
    id: str
    text: str
    images: list[bytes] = field(default_factory=list)
    videos: list[bytes] = field(default_factory=list)
    stream: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    apply_chat_template: bool = True
    exclude_input: bool = False
    outputs: list[str] = field(default_factory=lambda: ["text_output"])


@dataclass
class V2Output:
    """One response's worth of a request's answer: its text (a delta when streamed) and counts."""

    text: str
    finish_reason: str | None
    input_tokens: int
    output_tokens: int
    final: bool


def check_model(name: str, version: str, served: str) -> None:
    """Raise APIError 404 unless ``name`` is the served model and ``version`` is empty or "1"."""
    if name != served:
        raise APIError(404, f"unknown model {name!r}; this server serves {served!r}", code="model_not_found")
    if version not in ("", "1"):
        raise APIError(404, f"unknown version {version!r} of model {name!r}; it has version '1'")


def _flag(t: Tensor) -> bool:
    if len(t.values) != 1:
        raise APIError(400, f"input {t.name!r} must hold one element, not {len(t.values)}", param=t.name)
    return bool(t.values[0])


def _one_string(t: Tensor) -> str:
    if len(t.values) != 1:
        raise APIError(400, f"input {t.name!r} must hold one element (one prompt per request), not "
                            f"{len(t.values)}", param=t.name)
    try:
        return t.values[0].decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"input {t.name!r} is not UTF-8 text: {e}", param=t.name) from None


def media_bytes(value: bytes) -> bytes:
    """An ``image``/``video`` element's file bytes: the element itself, or its base64 decoding when it does not
    start like an image file and is valid base64 (a JSON client's only way to send bytes)."""
    if value.startswith(_IMAGE_MAGIC) or value[4:8] == b"ftyp":  # ftyp: an MP4/MOV box at offset 4
        return value
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return value  # not base64 either: the media checks say what is wrong with it


def _sampling_json(t: Tensor) -> dict[str, Any]:
    text = _one_string(t)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"sampling_parameters is not valid JSON: {e}", param="sampling_parameters") from None
    if not isinstance(value, dict):
        raise APIError(400, "sampling_parameters must be a JSON object", param="sampling_parameters")
    unknown = sorted(set(value) - set(SAMPLING))
    if unknown:
        raise APIError(400, f"sampling_parameters: {', '.join(map(repr, unknown))} not supported (supported: "
                            f"{', '.join(SAMPLING)})", param="sampling_parameters")
    return value


def _checked(tensors: list[Tensor]) -> dict[str, Tensor]:
    """``tensors`` by name, each a known input of the right datatype whose element count matches its shape."""
    by_name: dict[str, Tensor] = {}
    for t in tensors:
        if t.name in by_name:
            raise APIError(400, f"input {t.name!r} is given twice", param=t.name)
        if t.name not in INPUTS:
            raise APIError(400, f"unknown input {t.name!r}; the inputs are {', '.join(INPUTS)}", param=t.name)
        if t.datatype != INPUTS[t.name]:
            raise APIError(400, f"input {t.name!r} must be {INPUTS[t.name]}, not {t.datatype or 'untyped'}",
                           param=t.name)
        if any(d < 0 for d in t.shape) or t.values is None or len(t.values) != math.prod(t.shape):
            n = "no" if t.values is None else len(t.values)
            raise APIError(400, f"input {t.name!r} has shape {list(t.shape)} but {n} elements", param=t.name)
        by_name[t.name] = t
    if "text_input" not in by_name:
        raise APIError(400, "the input 'text_input' (BYTES, the prompt) is missing", param="text_input")
    return by_name


def parse_v2(model: str, rid: str, tensors: list[Tensor], parameters: dict[str, Any],
             outputs: list[str] | None, stream: bool = False) -> V2Request:
    """Validate one request's input tensors, request ``parameters`` and requested ``outputs`` (None: the default
    ones) into a :class:`V2Request`; ``stream``: its default when neither the ``stream`` input nor parameter says.

    Raises:
        APIError: 400 naming the first problem (missing ``text_input``, an unknown input or output, a wrong
            datatype or shape, unparsable ``sampling_parameters``).
    """
    by_name = _checked(tensors)
    flags = {n: _flag(t) for n, t in by_name.items() if INPUTS[n] == "BOOL"}
    sampling = {k: v for k, v in parameters.items() if k in SAMPLING}
    if "sampling_parameters" in by_name:
        sampling |= _sampling_json(by_name["sampling_parameters"])
    for name in ("apply_chat_template", "stream"):
        if not isinstance(parameters.get(name, False), bool):
            raise APIError(400, f"the parameter {name!r} must be a boolean", param=name)
    template = parameters.get("apply_chat_template", True)
    names = [n for n in OUTPUTS if n == "text_output" or flags.get(f"return_{n}")] if outputs is None else outputs
    for name in names:
        if name not in OUTPUTS:
            raise APIError(400, f"unknown output {name!r}; the outputs are {', '.join(OUTPUTS)}", param=name)
    req = V2Request(model, rid, _one_string(by_name["text_input"]),
                    [media_bytes(v) for v in by_name["image"].values] if "image" in by_name else [],
                    [media_bytes(v) for v in by_name["video"].values] if "video" in by_name else [],
                    flags.get("stream", bool(parameters.get("stream", stream))), sampling, template,
                    flags.get("exclude_input_in_output", False), names)
    if not req.apply_chat_template and (req.images or req.videos):
        raise APIError(400, "images and videos need the chat template (apply_chat_template=false takes text only)",
                       param="apply_chat_template")
    return req


def _data_url(kind: str, data: bytes) -> str:
    # Through the chat request's own media path, so the size limits and decode checks are the OpenAI route's; the
    # subtype is not read (the decoders sniff the file).
    return f"data:{kind}/unknown;base64,{base64.b64encode(data).decode()}"


def as_request(req: V2Request) -> ChatRequest | PromptRequest:
    """The chat request (one user turn: the images and videos, then the text) or, without the template, the
    prompt that ``req`` asks for, in the core's terms.

    Raises:
        APIError: 400 for a sampling value out of range or of the wrong type.
    """
    try:
        sampling = Sampling.model_validate(req.sampling)
    except ValidationError as e:
        message = describe_validation_error(e).removeprefix("invalid request: ")
        raise APIError(400, f"invalid sampling_parameters: {message}", param="sampling_parameters") from None
    if not req.apply_chat_template:
        return PromptRequest(sampling.params(), text=req.text, max_tokens=sampling.max_tokens)
    content = [{"type": "image"} for _ in req.images] + [{"type": "video"} for _ in req.videos]
    content.append({"type": "text", "text": req.text})
    return ChatRequest([{"role": "user", "content": content}], sampling.params(),
                       [_data_url("image", b) for b in req.images], [_data_url("video", b) for b in req.videos],
                       sampling.max_tokens)


async def prepare(chat: ChatService, rid: str, req: V2Request, deadline: float | None) -> PreparedChat:
    """Prepare ``req`` on ``chat`` (as :meth:`ChatService.prepare` or :meth:`ChatService.prepare_ids`)."""
    request = as_request(req)
    if isinstance(request, PromptRequest):
        return await chat.prepare_ids(rid, request, deadline)
    return await chat.prepare(rid, request, deadline)


async def v2_stream(chat: ChatService, prepared: PreparedChat, req: V2Request) -> AsyncIterator[V2Output]:
    """``prepared``'s answer as one :class:`V2Output` per text delta, the last one ``final``. Closing it early
    aborts the request (through its lifetime).

    Raises:
        APIError: as :meth:`ChatService.outputs`.
    """
    prefix = "" if req.exclude_input else req.text
    n_out = pending = 0  # output ids in all, and since the last response (an id may complete no character yet)
    async with aclosing(chat.outputs(prepared)) as outputs:
        async for delta, out in outputs:
            n_out += len(out.token_ids)
            pending += len(out.token_ids)
            final = out.finish_reason is not None
            if delta or final:
                usage = chat.usage(prepared, out, n_out)
                yield V2Output(prefix + delta, out.finish_reason, usage.prompt_tokens, pending, final)
                prefix, pending = "", 0


async def v2_collect(chat: ChatService, prepared: PreparedChat, req: V2Request) -> V2Output:
    """Run ``prepared`` to the end: its whole answer as one final :class:`V2Output`. Raises as
    :meth:`ChatService.outputs`."""
    text, ids, _, final = await chat.collect(prepared)
    usage = chat.usage(prepared, final, len(ids))
    prefix = "" if req.exclude_input else req.text
    return V2Output(prefix + text, final.finish_reason, usage.prompt_tokens, usage.completion_tokens, True)


def output_values(req: V2Request, out: V2Output) -> list[tuple[str, str, list]]:
    """``(name, datatype, values)`` of every output ``req`` asked for (one element each): BYTES as ``bytes``,
    UINT32 as ``int``."""
    values = {"text_output": out.text.encode(), "finish_reason": str(out.finish_reason).encode(),
              "num_input_tokens": out.input_tokens, "num_output_tokens": out.output_tokens}
    return [(name, OUTPUTS[name], [values[name]]) for name in req.outputs]


def raw_values(datatype: str, raw: bytes) -> list | None:
    """The elements of a tensor sent as raw bytes (gRPC ``raw_input_contents``, HTTP binary data): BYTES as
    4-byte little-endian lengths each followed by that many bytes, BOOL one byte each; None for other datatypes.

    Raises:
        APIError: 400 for BYTES whose lengths run past the data.
    """
    if datatype == "BOOL":
        return [b != 0 for b in raw]
    if datatype != "BYTES":
        return None
    values, at = [], 0
    while at < len(raw):
        if at + 4 > len(raw) or at + 4 + (n := int.from_bytes(raw[at:at + 4], "little")) > len(raw):
            raise APIError(400, "malformed BYTES tensor data: an element's length runs past the data")
        values.append(bytes(raw[at + 4:at + 4 + n]))
        at += 4 + n
    return values


def raw_bytes(datatype: str, values: list) -> bytes:
    """``values`` of an output as raw bytes (the inverse of :func:`raw_values`; UINT32 little-endian)."""
    if datatype == "BYTES":
        return b"".join(len(v).to_bytes(4, "little") + v for v in values)
    return b"".join(int(v).to_bytes(4, "little") for v in values)


def server_metadata() -> dict[str, Any]:
    """The v2 server metadata: name, version, extensions."""
    return {"name": "epdserve", "version": epdserve.__version__, "extensions": EXTENSIONS}


def model_metadata(name: str) -> dict[str, Any]:
    """The v2 model metadata of the served model ``name``: its one version, platform and tensors (-1: any size)."""
    shapes = {"image": [-1], "video": [-1], "text_output": [-1], "finish_reason": [-1], "num_input_tokens": [-1],
              "num_output_tokens": [-1]}
    return {"name": name, "versions": ["1"], "platform": "epdserve",
            "inputs": [{"name": n, "datatype": d, "shape": shapes.get(n, [1])} for n, d in INPUTS.items()],
            "outputs": [{"name": n, "datatype": d, "shape": shapes.get(n, [1])} for n, d in OUTPUTS.items()]}
