"""Check a decoded wire message before any server acts on it: field types, then the ranges the stages rely on.

:func:`epdserve.wire.messages.decode` only guarantees that the frames name a known dataclass. Anything can send
frames to a ZeroMQ port, and a message with a string where a token list belongs, a port above 65535, or
overlapping image spans would otherwise raise deep inside a scheduler (or worse, inside a batched forward,
failing every request of the batch). :func:`check_message` rejects such a message up front with a
:class:`~epdserve.wire.messages.WireError`, which the receive helpers in :mod:`epdserve.wire.transport` log and drop.

The checks are what the stages assume, not policy: the gateway's own request validation is stricter.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import typing
from functools import cache
from types import SimpleNamespace, UnionType
from typing import Any

from epdserve.wire import messages
from epdserve.wire.codec import FLOAT_DTYPE_NAMES
from epdserve.wire.messages import WireError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A seed must fit torch.Generator.manual_seed, which takes a signed or unsigned 64-bit value.
SEED_MIN, SEED_MAX = INT64_MIN, (1 << 64) - 1
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]{1,253})$")
_TCP_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]{1,253}):(\d{1,5})$")
_HEX = re.compile(r"^[0-9a-fA-F]{15,128}$")
_MAX_RID = 512  # characters; gateway ids are ~41
_MAX_GRAMMAR = messages.MAX_GRAMMAR_CHARS  # the gateway's request bodies are bounded far below this
MAX_CHOICES = 1024  # n: the gateway's --max-n is far below; a bound keeps a forged message from forking without end


class _Tensor:
    """Stands for ``torch.Tensor`` in the messages' annotations, which are resolved without importing torch (a
    process without torch, the gateway, never receives a tensor: issue 43)."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, {**vars(messages), "torch": SimpleNamespace(Tensor=_Tensor)})


def _is_tensor(v: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    return torch is not None and isinstance(v, torch.Tensor)


def _is_float_tensor(t: Any, dim: int) -> bool:
    return t.dim() == dim and str(t.dtype).removeprefix("torch.") in FLOAT_DTYPE_NAMES


def _int_ok(v: Any) -> bool:
    return type(v) is int and SEED_MIN <= v <= SEED_MAX  # type(), not isinstance: bool is an int subclass


@cache
def _checker(tp: Any):
    """A predicate: does a value (as msgpack decoded it) have the annotated type ``tp``? Ints must fit int64
    (seeds: uint64) and floats must be finite. Built once per type: the gateway checks every
    ``TokenOutputBatch`` of every decode step, so walking the annotations per message would cost more than the
    message's own decoding."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is UnionType:
        options = [_checker(a) for a in typing.get_args(tp)]
        return lambda v: any(ok(v) for ok in options)
    if tp is type(None):
        return lambda v: v is None
    if origin is list:
        (item,) = typing.get_args(tp)
        if item is int:  # token ids: one pass for the types, min/max for the range
            return lambda v: isinstance(v, list) and all(type(x) is int for x in v) and (
                not v or (SEED_MIN <= min(v) and max(v) <= SEED_MAX))
        ok_item = _checker(item)
        return lambda v: isinstance(v, list) and all(ok_item(x) for x in v)
    if tp is bool:
        return lambda v: isinstance(v, bool)
    if tp is int:
        return _int_ok
    if tp is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if tp is str:
        return lambda v: isinstance(v, str)
    if tp is _Tensor:
        return _is_tensor
    if dataclasses.is_dataclass(tp):
        return lambda v: isinstance(v, tp) and _fields_conform(v)
    return lambda v: True  # Any and types the wire never carries


@cache
def _field_checkers(cls: type) -> list[tuple[str, Any]]:
    hints = _hints(cls)
    return [(f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls)]


def _fields_conform(msg: Any) -> bool:
    return all(ok(getattr(msg, name)) for name, ok in _field_checkers(type(msg)))


def _ints_fit(values, lo: int = INT64_MIN, hi: int = INT64_MAX) -> bool:
    return all(lo <= v <= hi for v in values)


def _check_sampling(sp: messages.SamplingParams) -> str | None:
    if sp.temperature < 0:
        return f"temperature {sp.temperature} < 0"
    if not 0 < sp.top_p <= 1:
        return f"top_p {sp.top_p} not in (0, 1]"
    if not 1 <= sp.max_new_tokens <= INT64_MAX:
        return f"max_new_tokens {sp.max_new_tokens} < 1"
    if not 1 <= sp.n <= MAX_CHOICES:
        return f"n {sp.n} not in [1, {MAX_CHOICES}]"
    if not _ints_fit([sp.top_k, *sp.stop_token_ids]):
        return "top_k or a stop token id does not fit int64"
    g = sp.grammar
    if g is not None and (g.type not in messages.GRAMMAR_KINDS or len(g.text) > _MAX_GRAMMAR):
        return f"grammar of kind {g.type[:40]!r} and {len(g.text)} characters"
    return None


def _check_rid(rid: str) -> str | None:
    return None if 0 < len(rid) <= _MAX_RID else f"request id of length {len(rid)}"


def _check_endpoint(endpoint: str) -> str | None:
    m = _TCP_ENDPOINT.match(endpoint)
    return None if m and 0 < int(m.group(2)) < 65536 else f"bad endpoint {endpoint[:80]!r}"


def _check_prefill(msg: messages.PrefillRequest) -> str | None:
    if not _ints_fit(msg.input_ids) or not 0 <= msg.bootstrap_room <= INT64_MAX:
        return "input id or bootstrap room out of range"
    end = 0
    for span in msg.images:
        if len(span.grid_thw) != 3 or not _ints_fit(span.grid_thw, 1, 1 << 20):
            return f"bad image grid {span.grid_thw[:4]}"
        if not _HEX.match(span.image_hash):
            return "image hash is not hex"
        if not isinstance(span.video, bool) or not _ints_fit([span.embed_offset], 0, 1 << 40):
            return "bad video flag or embedding offset"
        if not isinstance(span.time_interval, (int, float)) or not 0 < span.time_interval < 1e6:
            return f"bad time interval {span.time_interval!r}"
        if span.offset < end or span.length < 1 or span.offset + span.length > len(msg.input_ids):
            return "image spans overlap, are out of order, or leave the prompt"
        end = span.offset + span.length
    return _check_sampling(msg.sampling)


def _check_decode(msg: messages.DecodeRequest) -> str | None:
    if not 1 <= msg.prompt_len <= INT64_MAX or not 0 <= msg.bootstrap_room <= INT64_MAX:
        return "prompt_len or bootstrap room out of range"
    if not _HOST.match(msg.bootstrap_host) or not 0 < msg.bootstrap_port < 65536:
        return f"bad bootstrap address {msg.bootstrap_host[:80]!r}:{msg.bootstrap_port}"
    return _check_sampling(msg.sampling)


def _check_embeddings(msg: messages.ImageEmbeddings) -> str | None:
    if len(msg.image_hashes) != len(msg.embeddings):
        return "image hashes and embeddings differ in number"
    for e in msg.embeddings:
        if isinstance(e, messages.SharedTensor):
            if len(e.cuda_ipc) != 8 or len(e.shape) != 2 or e.dtype not in FLOAT_DTYPE_NAMES \
                    or not _ints_fit(e.shape, 0):
                return "a shared embedding is not a 2-D float tensor with an 8-field CUDA IPC handle"
        elif not _is_float_tensor(e, 2):
            return "an embedding is not a 2-D float tensor"
    return None


def _check_transfer(msg: messages.KVTransfer) -> str | None:
    if msg.kv is not None and not _is_float_tensor(msg.kv, 5):
        return "KV is not a 5-D float tensor"
    if not 0 <= msg.bootstrap_room <= INT64_MAX or not _ints_fit([msg.first_token_id, msg.cached_tokens,
                                                                  msg.mrope_position_delta]):
        return "a KV transfer field is out of range"
    st = msg.state
    if st is not None and ((st.conv is not None and not _is_float_tensor(st.conv, 3))
                           or (st.recurrent is not None and not _is_float_tensor(st.recurrent, 4))
                           or not _ints_fit([st.slot], -1)):
        return "the linear-attention state is not 3-D / 4-D float tensors or its slot is out of range"
    return None


def _check_register(msg: messages.KVRegister) -> str | None:
    if not 0 <= msg.bootstrap_room <= INT64_MAX:
        return "bootstrap room out of range"
    if not -1 <= msg.state_slot <= INT64_MAX:
        return "state slot out of range"
    return _check_endpoint(msg.kv_endpoint)


_SEMANTIC = {
    messages.PrefillRequest: _check_prefill,
    messages.DecodeRequest: _check_decode,
    messages.ImageEmbeddings: _check_embeddings,
    messages.KVTransfer: _check_transfer,
    messages.KVRegister: _check_register,
}


def check_message(msg: Any) -> Any:
    """Return ``msg`` if its fields have their annotated types and the values the stages rely on.

    Raises:
        WireError: a field of the wrong type (or an int beyond 64 bits, a non-finite float), or a value no stage
            can act on: bad sampling parameters, image spans that overlap or leave the prompt, a malformed image
            hash or grid, a bad endpoint or port, a tensor of the wrong rank or dtype, an empty request id.
    """
    kind = type(msg).__name__
    if not _fields_conform(msg):
        raise WireError(f"{kind} has a field of the wrong type")
    rid = getattr(msg, "rid", None)
    problem = _check_rid(rid) if isinstance(rid, str) else None
    check = _SEMANTIC.get(type(msg))
    if problem is None and check is not None:
        problem = check(msg)
    if problem is not None:
        raise WireError(f"{kind}: {problem}")
    return msg
