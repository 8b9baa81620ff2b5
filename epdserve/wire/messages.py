"""Every message that crosses a ZeroMQ socket between stages, and the codec built for all of them.

Data flows one way, stage by stage::

    gateway --PrefillRequest--> prefill            encoder --ImageEmbeddings--> prefill (every TP rank)
    gateway --DecodeRequest---> decode --KVRegister--> prefill bootstrap
    prefill --KVTransfer------> decode --TokenOutput--> gateway

The wire format is :mod:`epdserve.wire.codec`'s (msgpack header + raw tensor frames, never pickle); the messages
inside one TP server are in :mod:`epdserve.wire.tp_messages`. Only the classes listed in ``_CODEC`` decode.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the gateway imports these without torch (issue 43)
    import torch

from epdserve.wire.codec import Codec, WireError, tensor_bytes, tensor_from_bytes  # noqa: F401  (the wire's names)
from epdserve.wire.engine_region import KVEngineRegion, StateEngineRegion
from epdserve.wire.tp_messages import (
    TPCopyState, TPEmbedReceipt, TPEngineCancel, TPEngineWrite, TPEngineWriteDone, TPForward, TPHello, TPReadKV,
    TPReadState, TPReleaseEmbeddings, TPShutdown, TPWriteKV, TPWriteState,
)


# The constraint kinds a GrammarSpec may name (the future ``tool_choice: required`` grammar becomes one more kind).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's text; the stages refuse longer ones (wire/validate.py)


@dataclass
class GrammarSpec:
    """A request's output constraint, as data: prefill and decode each compile it with xgrammar against their
    tokenizer (:mod:`epdserve.engine.grammar`), so it travels as text, never as a compiled object.

    ``type`` is one of ``GRAMMAR_KINDS`` (the field is not named ``kind``: the codec tags nested messages with
    that key): ``json_schema`` (``text`` a JSON Schema document), ``json_object`` (any JSON object; ``text``
    empty), ``regex`` (xgrammar's regex dialect), ``ebnf`` (xgrammar's EBNF, whose start
    rule is ``root``) or ``structural_tag`` (xgrammar's structural-tag JSON; the tool calls of
    ``tool_choice`` required or named). The gateway has already checked that xgrammar parses it.
    """

    type: str
    text: str = ""


@dataclass
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy; ``top_k <= 0`` and ``top_p == 1`` disable them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int = -1  # -1: none; 0: each sampled token's log-probability; k > 0: also the k most likely tokens
    frequency_penalty: float = 0.0  # OpenAI's: subtracted from a token's logit once per time it was output
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from the logit of every token output so far
    # OpenAI's: [token id, bias] pairs, the bias added to that token's logit (pairs: every map on the wire is a message)
    logit_bias: list[list] = field(default_factory=list)
    grammar: GrammarSpec | None = None  # structured outputs: every sampled token keeps the output in the grammar
    n: int = 1  # choices: one prefill, ``n`` decode forks sharing the prompt's KV (choice i seeds with seed + i)


@dataclass
class TokenLogprob:
    """One sampled token's log-probability under the model's distribution (log-softmax of the raw logits, before
    temperature, top-k and top-p, as vLLM's default ``raw_logprobs``), and the most likely tokens at that step as
    ``[token id, log-probability]`` pairs, most likely first (as many as ``SamplingParams.logprobs``)."""

    logprob: float
    top: list[list] = field(default_factory=list)


@dataclass
class ImageSpan:
    """Where one image's tokens, or one run of a video's tokens, sit in a prompt.

    ``offset``/``length`` index into ``input_ids`` (tokens); ``grid_thw`` is the processor's patch grid before
    spatial merging of the tokens of this span (M-RoPE takes it); ``image_hash`` is the embedding cache key: the
    hex SHA-256 of the image bytes, or a video's :func:`epdserve.hashing.video_key`.

    Video (``video`` True: the tokens are the model's video token id): Qwen2/2.5-VL put a video in one span of grid
    ``[t, h, w]``; Qwen3-VL writes each temporal patch as its own run between timestamp text, one span each of
    grid ``[1, h, w]``, all with the video's key, and ``embed_offset`` the first row of the video's embedding that
    the span takes. ``time_interval`` is the M-RoPE temporal step per grid ``t`` (Qwen2.5-VL:
    ``second_per_grid_t * tokens_per_second``; 1 otherwise, see :func:`epdserve.models.mrope.mrope_positions`).
    """

    offset: int
    length: int
    image_hash: str
    grid_thw: list[int]
    video: bool = False
    embed_offset: int = 0
    time_interval: float = 1.0


@dataclass
class PrefillRequest:
    """gateway -> prefill: a tokenized prompt. Image token positions hold the model's image token id."""

    rid: str
    input_ids: list[int]
    images: list[ImageSpan]
    sampling: SamplingParams
    bootstrap_room: int
    reply: bool = False  # answer the sender with a TokenOutput once prefill is done (the HTTP front asks)
    input_digest: str = ""  # input_ids_digest(input_ids); copied into the KVTransfer for decode to compare


@dataclass
class DecodeRequest:
    """gateway -> decode: decode ``rid`` once its KV arrives from the prefill server at the bootstrap address."""

    rid: str
    prompt_len: int
    sampling: SamplingParams
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int
    input_digest: str = ""  # when set, a KVTransfer with another non-empty digest fails the request

    @property
    def bootstrap_endpoint(self) -> str:
        """The prefill bootstrap's ZeroMQ endpoint, ``tcp://host:port``."""
        return f"tcp://{self.bootstrap_host}:{self.bootstrap_port}"


@dataclass
class AbortRequest:
    """gateway -> prefill/decode: drop ``rid`` and free its KV pages. With ``index`` (n > 1, decode only): drop
    only that choice's fork, which ended at a stop string at the front, and let the other choices run on."""

    rid: str
    index: int | None = None


@dataclass
class ServerInfoRequest:
    """Any client -> prefill/decode: ask for a ``ServerInfo`` reply on the same socket."""


@dataclass
class ServerInfo:
    """prefill/decode -> client. ``embed_endpoints`` has one ZMQ endpoint per TP rank (prefill only);
    ``embed_host_id`` (prefill on CUDA, ``--kv-transfer`` not ``zmq``) names its machine
    (:func:`epdserve.kvcache.kv_share.host_id`): an encoder on the same one hands it embeddings through GPU
    memory."""

    role: str
    model_path: str
    context_length: int
    page_size: int
    num_pages: int
    embed_endpoints: list[str] = field(default_factory=list)
    bootstrap_host: str = ""
    bootstrap_port: int = 0
    embed_host_id: str = ""


@dataclass
class LoadRequest:
    """Any client -> prefill/decode: ask for a ``Load`` reply on the same socket."""


@dataclass
class Load:
    """prefill/decode -> client: what the server holds right now (accounting for health details, metrics and
    SGLang-style ``/loads``).

    Counts are requests or KV pages. ``kv_pages_used`` includes ``kv_pages_cached`` (prefill: pages held only by
    the radix cache, evictable; 0 on decode). ``rooms`` counts bootstrap rooms with state (prefill: decode
    registrations and finished KV waiting for one; decode: requests waiting for their KV). ``embeddings``
    counts requests whose image embeddings the prefill server holds. ``state_slots_used`` / ``state_slots_total``:
    hybrid models' linear-attention state slots (one per request holding a state; 0 / 0 for other models);
    ``state_slots_cached``: prefill's prefix-cache state snapshots (evictable, not in ``state_slots_used``).
    """

    role: str
    num_running_reqs: int
    num_waiting_reqs: int
    kv_pages_used: int
    kv_pages_total: int
    kv_pages_cached: int = 0
    rooms: int = 0
    embeddings: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    state_slots_cached: int = 0


@dataclass
class SharedTensor:
    """A CUDA tensor left in the sender's GPU memory for ONE receiver on the same machine (no data, a handle).

    ``cuda_ipc`` is the 8 values of torch's ``UntypedStorage._share_cuda_()`` (device index, cudaIpcMemHandle
    bytes, storage size and offset in bytes, ref-counter handle and offset, event handle, event-sync flag) of a
    storage that holds exactly the tensor, contiguous from byte 0; ``dtype`` is its dtype name, ``shape`` its
    shape. The receiver takes it exactly once (:func:`epdserve.wire.device_share.take`), which hands the memory
    back to the sender.
    """

    cuda_ipc: list
    dtype: str
    shape: list[int]


@dataclass
class ImageEmbeddings:
    """encoder -> prefill (every TP rank): vision tower output for the images and videos of ``rid``.

    ``embeddings[i]`` is ``[num_tokens_i, embed_width]`` in the tower's dtype for item ``image_hashes[i]``:
    its bytes (a ``torch.Tensor``), or, when the encoder and this rank share a machine and a GPU driver, a
    :class:`SharedTensor` in the encoder's GPU memory that the receiving rank copies out on arrival.
    """

    rid: str
    image_hashes: list[str]
    embeddings: list[torch.Tensor | SharedTensor]


@dataclass
class KVRegister:
    """decode -> prefill bootstrap: send the KV of ``bootstrap_room`` to ``kv_endpoint`` (SGLang's rendezvous).

    ``host_id`` names the decode server's machine; with ``accept_shared`` the decode server can map a prefill KV
    pool on that machine (see :class:`KVPoolHandle`) and copy pages from it itself. With ``regions`` and
    ``kv_pages`` (transfer engine path) the prefill server writes the prompt's KV straight into those pages of
    the decode pools (one region per decode TP rank, in rank order; token ``i`` into page
    ``kv_pages[i // page_size]`` of every rank's pool, each rank getting its own KV heads), then sends a
    tensor-less ``KVTransfer`` with ``engine_written`` set once every write landed. A hybrid model's (Qwen3.5)
    registration also names ``state_slot``, the decode state slot reserved for the request (the same on every
    rank), into which the prefill server writes the request's final prompt state through each region's ``state``.
    """

    rid: str
    bootstrap_room: int
    kv_endpoint: str
    host_id: str = ""
    accept_shared: bool = False
    # Transfer engine path: the decode pools (one per decode TP rank) the prefill server writes into ...
    regions: list[KVEngineRegion] = field(default_factory=list)
    kv_pages: list[int] = field(default_factory=list)  # ... and this request's pages there (prompt + output)
    state_slot: int = -1  # ... and, for a hybrid model, its state slot there (-1: none)


@dataclass
class KVPoolHandle:
    """How another process on the same machine maps a prefill server's whole KV pool (no data, only a handle).

    ``shape`` is the pool buffer's ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` and ``dtype``
    its dtype name. CUDA pools give ``cuda_ipc``: the 8 values of torch's ``UntypedStorage._share_cuda_()``
    (device index, cudaIpcMemHandle bytes, storage size and offset in bytes, ref-counter handle and offset, event
    handle, event-sync flag). CPU pools give ``shm_path``, a file under /dev/shm holding the buffer.
    """

    host_id: str
    shape: list[int]
    dtype: str
    cuda_ipc: list = field(default_factory=list)
    shm_path: str = ""


@dataclass
class KVAck:
    """decode -> prefill bootstrap: the KV of ``bootstrap_room`` was copied out of the prefill pool (shared
    path) or arrived in the decode pool (transfer engine path), so the prefill server may reuse those pages."""

    rid: str
    bootstrap_room: int


@dataclass
class StateHandoff:
    """prefill -> decode (``KVTransfer.state``): the Gated DeltaNet state a hybrid model's request reached at the
    end of its prompt; decode loads it into a state slot of its own before its first step.

    Host path (``--kv-transfer zmq``): ``conv`` ``[layers, conv_dim, kernel]`` in the model dtype and
    ``recurrent`` ``[layers, value_heads, key_dim, value_dim]`` float32, every DeltaNet head in checkpoint order
    (:mod:`epdserve.engine.state_io`; ``layers`` counts the DeltaNet layers only).

    Shared path (``--kv-transfer shared``, same machine): no tensors; ``conv_pool`` and ``recurrent_pool`` map the
    prefill server's state buffers (``[layers, slots + 1, ...]``) and ``slot`` is the request's slot in them. The
    prefill server holds the slot with the KV pages, until the decode server's ``KVAck`` or the transfer's
    ``lend_until``.
    """

    conv: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None
    conv_pool: KVPoolHandle | None = None
    recurrent_pool: KVPoolHandle | None = None
    slot: int = -1


@dataclass
class KVTransfer:
    """prefill -> decode: a request's prompt KV and its first sampled token.

    ``kv`` is ``[num_layers, 2, prompt_len, num_kv_heads, head_dim]`` in the model dtype (K at index 0, V at 1),
    gathered token-major from the prefill server's KV pages. ``mrope_position_delta`` is the M-RoPE offset that
    decode positions add to the token index. On failure ``error`` is set and ``kv`` is None. ``sent_at`` is the
    sender's wall clock (``time.time()``) when it was sent, for decode's hand-off latency metric (0 = unknown).

    Shared path (same machine): ``kv`` is None and the KV stays in the prefill pool that ``pool`` maps, in pages
    ``kv_pages`` of ``pool.shape[3]`` tokens each (token ``i`` at page ``kv_pages[i // page_size]``); the decode
    server copies it out and answers with :class:`KVAck`. The prefill server holds the pages until the ack or
    until ``lend_until`` (wall clock, ``time.time()``; the two servers share a machine, hence a clock), after
    which the decode server must not copy them: they may hold another request's KV.
    """

    rid: str
    bootstrap_room: int
    first_token_id: int = -1
    cached_tokens: int = 0
    mrope_position_delta: int = 0
    kv: torch.Tensor | None = None
    pool: KVPoolHandle | None = None
    kv_pages: list[int] = field(default_factory=list)
    error: str | None = None
    sent_at: float = 0.0
    input_digest: str = ""  # the PrefillRequest's digest of the ids this KV was computed from
    lend_until: float = 0.0
    first_logprob: TokenLogprob | None = None  # when the request asked for logprobs
    state: StateHandoff | None = None  # hybrid models (Qwen3.5): the DeltaNet state, on either path
    engine_written: bool = False  # transfer engine path: the KV is already in the decode pages it registered
    engine_bytes: int = 0  # ... this many bytes of KV, written in engine_seconds (prefill's submit to completion)
    engine_state_bytes: int = 0  # ... and, for a hybrid model, this many bytes of its state, in the same writes
    engine_seconds: float = 0.0
    # n > 1: every choice's first token (choice 0's is also ``first_token_id``) and, when asked, their logprobs
    first_token_ids: list[int] = field(default_factory=list)
    first_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class TokenOutput:
    """decode -> gateway: new token ids of one request since the last output (the gateway detokenizes them and
    matches stop strings; decode stops only on EOS, ``stop_token_ids``, ``max_new_tokens``, the context length
    and, for a constrained request, its grammar's end).

    ``finish_reason`` is None while running, then ``"stop"``, ``"length"`` or ``"error"``. ``completion_tokens``
    counts all output tokens so far, these included. ``logprobs`` has one entry per id of ``token_ids`` when the
    request asked for them (``SamplingParams.logprobs >= 0``), else none.

    ``n > 1`` (choices): ``index`` names the choice (a decode fork); ``finish_reason`` and ``completion_tokens``
    are that choice's, and ``last`` is False on a choice's finish while other choices of the request still run,
    so a request is over at the first output with a ``finish_reason`` and ``last`` (an error always ends it).
    """

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    index: int = 0
    last: bool = True

    @property
    def ends_request(self) -> bool:
        """Whether no output of the request follows this one."""
        return self.finish_reason is not None and (self.last or self.finish_reason == "error")


@dataclass
class TokenOutputBatch:
    """decode -> gateway: every ``TokenOutput`` of one decode step for one gateway, in one message."""

    outputs: list[TokenOutput]


def input_ids_digest(input_ids: list[int]) -> str:
    """A short fingerprint of a prompt's token ids (hex BLAKE2b-64 of their little-endian int64 bytes).

    Prefill and decode servers that tokenize the same HTTP request on their own (behind a PD router) each send
    it, so a tokenization mismatch fails the request instead of decoding from a KV cache of another prompt.
    """
    return hashlib.blake2b(struct.pack(f"<{len(input_ids)}q", *input_ids), digest_size=8).hexdigest()
_CODEC = Codec((
    GrammarSpec, SamplingParams, TokenLogprob, ImageSpan, PrefillRequest, DecodeRequest, AbortRequest,
    ServerInfoRequest, ServerInfo, LoadRequest, Load,
    SharedTensor, ImageEmbeddings, KVEngineRegion, StateEngineRegion, KVRegister, KVPoolHandle, KVAck, KVTransfer,
    TokenOutput, TokenOutputBatch,
    StateHandoff, TPHello, TPForward, TPReadKV, TPWriteKV, TPReleaseEmbeddings, TPShutdown, TPEmbedReceipt,
    TPReadState, TPWriteState, TPCopyState, TPEngineWrite, TPEngineCancel, TPEngineWriteDone,
))
KINDS = _CODEC.kinds  # every kind the stages exchange, by class name
encode = _CODEC.encode  # see Codec.encode: a registered dataclass -> [header, *tensor frames]
decode = _CODEC.decode  # see Codec.decode: frames -> the dataclass (WireError when they are not one)
