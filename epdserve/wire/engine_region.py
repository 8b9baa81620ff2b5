"""The one wire dataclass both the stages' messages (:mod:`epdserve.wire.messages`: ``KVRegister``) and the TP
ranks' (:mod:`epdserve.wire.tp_messages`: ``TPHello``, ``TPEngineWrite``) carry: where a transfer engine reaches
a KV pool."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVEngineRegion:
    """How a transfer engine (``--kv-transfer nixl|mooncake``) reaches a decode server's KV pool; no data.

    ``engine`` is the engine's name; ``agent`` the peer's name for it (NIXL: the agent name; Mooncake: the
    ``host:rpc_port`` session of its P2P handshake); ``metadata`` what the engine needs to connect (NIXL: the
    agent's metadata blob; Mooncake: nothing). ``base`` is the pool buffer's address in the decode process, of
    ``shape`` ``[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` and dtype name ``dtype``, on
    ``gpu`` (CUDA device index; -1: host memory). A TP server has one pool, engine and region per rank, each
    holding ``num_kv_heads`` (``shape[4]``) of the model's KV heads from ``head_start`` on.
    """

    engine: str
    agent: str
    base: int
    shape: list[int]
    dtype: str
    gpu: int = -1
    metadata: bytes = b""
    head_start: int = 0
