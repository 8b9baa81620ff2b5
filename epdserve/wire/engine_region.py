"""The wire dataclasses both the stages' messages (:mod:`epdserve.wire.messages`: ``KVRegister``) and the TP
ranks' (:mod:`epdserve.wire.tp_messages`: ``TPHello``, ``TPEngineWrite``) carry: where a transfer engine reaches
a KV pool, and a hybrid model's state pool beside it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StateEngineRegion:
    """How a transfer engine reaches one TP rank's linear-attention state pool (a hybrid model's
    :class:`~epdserve.kvcache.state_pool.StatePool`, Qwen3.5); no data.

    ``conv_base`` is the address of the pool's ``conv_buffer`` ``conv_shape`` ``[layers, slots + 1, conv_dim,
    kernel]`` of dtype name ``conv_dtype``, its channels this rank's q | k | v parts; ``recurrent_base`` that of
    ``recurrent_buffer`` ``recurrent_shape`` ``[layers, slots + 1, value_heads, key_dim, value_dim]`` of dtype name
    ``recurrent_dtype``. The rank holds the model's DeltaNet key heads from ``key_start`` on and its value heads
    from ``value_start`` on (how many follows from the shapes: :mod:`epdserve.kvcache.state_copies`).
    """

    conv_base: int
    conv_shape: list[int]
    conv_dtype: str
    recurrent_base: int
    recurrent_shape: list[int]
    recurrent_dtype: str
    key_start: int = 0
    value_start: int = 0


@dataclass
class KVEngineRegion:
    """How a transfer engine (``--kv-transfer nixl|mooncake``) reaches a decode server's KV pool; no data.

    ``engine`` is the engine's name; ``agent`` the peer's name for it (NIXL: the agent name; Mooncake: the
    ``host:rpc_port`` session of its P2P handshake); ``metadata`` what the engine needs to connect (NIXL: the
    agent's metadata blob; Mooncake: nothing). ``base`` is the pool buffer's address in the decode process, of
    ``shape`` ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` and dtype name ``dtype``, on
    ``gpu`` (CUDA device index; -1: host memory). A TP server has one pool, engine and region per rank, each
    holding ``num_kv_heads`` (``shape[4]``) of the model's KV heads from ``head_start`` on. A hybrid model's
    (Qwen3.5) region also names the rank's state pool, registered with the same engine (``state``).
    """

    engine: str
    agent: str
    base: int
    shape: list[int]
    dtype: str
    gpu: int = -1
    metadata: bytes = b""
    head_start: int = 0
    state: StateEngineRegion | None = None
