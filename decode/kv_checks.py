"""The checks a decode server runs on a prefill server's ``KVTransfer`` before it loads the KV (bad input from a
socket becomes the request's error, never a crash or a wrong answer)."""

from __future__ import annotations

from epdserve.kvcache.state_slots import StateSlots
from epdserve.wire.messages import DecodeRequest, KVTransfer


def check_kv(cfg, states: StateSlots, req: DecodeRequest, reserved: bool, msg: KVTransfer) -> str | None:
    """Why the KV hand-off ``msg`` for decode request ``req`` cannot be loaded (None: it can): another prompt's
    tokens (input digest), first tokens out of ``cfg``'s vocabulary or not one per choice, an engine write into
    pages this server did not reserve (``reserved``: it did) or not of one whole state for a hybrid model, a state
    hand-off ``states`` cannot take, or KV (a
    mapped prefill pool's, or in the message) of another shape than ``cfg``'s layers, heads and head size."""
    if req.input_digest and msg.input_digest and req.input_digest != msg.input_digest:
        return (f"tokenization mismatch: the prefill server computed the KV of other token ids than this decode "
                f"server's (input digest {msg.input_digest} != {req.input_digest}); do both serve the same "
                f"model and processor?")
    firsts = msg.first_token_ids or [msg.first_token_id]
    if len(firsts) != req.sampling.n or not all(0 <= t < cfg.vocab_size for t in firsts):
        return f"first tokens {firsts[:4]} out of the vocabulary or not one per choice (n={req.sampling.n})"
    if msg.engine_written:
        if not reserved:
            return "KV written by a transfer engine into pages this server did not reserve"
        return states.check_engine_written(msg.engine_state_bytes)
    state_err = states.check_handoff(msg.state, shared=msg.pool is not None)
    if state_err:
        return state_err
    if msg.pool is not None:
        shape = msg.pool.shape
        want = [cfg.num_kv_layers, 2, cfg.num_kv_heads, cfg.head_dim]
        if len(shape) != 6 or [*shape[:2], *shape[4:]] != want or shape[3] <= 0:
            return f"prefill KV pool has shape {shape}, expected [{cfg.num_kv_layers}, 2, pages, page size, " \
                   f"{cfg.num_kv_heads}, {cfg.head_dim}]"
        if len(msg.kv_pages) != -(-req.prompt_len // shape[3]) or \
                any(not 0 <= p < shape[2] for p in msg.kv_pages):
            return f"KV transfer names {len(msg.kv_pages)} pages for a {req.prompt_len}-token prompt"
        return None
    want = (cfg.num_kv_layers, 2, req.prompt_len, cfg.num_kv_heads, cfg.head_dim)
    if msg.kv is None or tuple(msg.kv.shape) != want:
        got = None if msg.kv is None else tuple(msg.kv.shape)
        return f"KV transfer has shape {got}, expected {want}"
    return None

