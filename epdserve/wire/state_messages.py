"""The hybrid-model (Qwen3.5) part of the prefill -> decode hand-off: a request's linear-attention state, which
travels beside its attention-layer KV inside :class:`~epdserve.wire.messages.KVTransfer` (``state``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from epdserve.wire.messages import KVPoolHandle


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
