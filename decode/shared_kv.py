"""Admission's copy of a request's prompt KV out of a prefill server's pool on this machine (the shared hand-off
path, :mod:`epdserve.kvcache.kv_share`): the prefill server lends its pages until the decode server acknowledges
the copy (a ``KVAck`` once the copy has run on the device) or until its lend deadline."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from epdserve.kvcache.kv_share import PeerPools
from epdserve.kvcache.page_pool import page_slots
from epdserve.wire.messages import KVTransfer

log = logging.getLogger("epdserve.decode.scheduler")

# A shared KV copy is only queued this long before the prefill server's lend deadline, so that it runs on the
# device (behind at most a few queued steps) before the pages can be handed to another request.
LEND_MARGIN_S = 5.0


def copy_shared_kv(runner, peer_pools: PeerPools, forks: list, transfer: KVTransfer, idx: torch.Tensor,
                   slots: torch.Tensor, load_states: Callable[[], None]) -> tuple[str | None, torch.cuda.Event | None]:
    """Copy prompt tokens ``idx`` of the KV in the prefill pool that ``transfer.pool`` maps into ``slots`` (the
    forks' pages, :func:`~epdserve.decode.forks.fork_copy_plan`), then ``load_states()`` (hybrid models' states),
    both queued on the device.

    Returns:
        ``(error, done)``: an error message for the request when the lend is about to expire or the pool cannot be
        mapped (None when the copy was queued), and on CUDA the event recorded after the copy, which the
        ``KVAck`` that frees the prefill server's pages must wait for (None: acknowledge at once).
    """
    seq = forks[0]
    # The prefill pool's page size (shape[3]) may differ from this pool's.
    src = torch.tensor(page_slots(transfer.kv_pages, transfer.pool.shape[3], 0, seq.msg.prompt_len),
                       dtype=torch.int64)[idx]
    if transfer.lend_until and time.time() > transfer.lend_until - LEND_MARGIN_S:
        return ("KV hand-off expired: the prefill server releases lent pages after its --request-timeout-s, and "
                "this request waited too long for decode pages to copy them into"), None
    try:
        runner.copy_kv_from(peer_pools.get(transfer.pool), src, slots)
        load_states()  # before the ack's event
    except (RuntimeError, ValueError) as e:
        log.error("rid=%s cannot copy KV from the prefill pool (%s); start decode with --kv-transfer zmq if "
                  "the stages cannot share memory", seq.msg.rid, e)
        return f"KV hand-off failed: {e}", None
    if runner.device.type != "cuda":
        return None, None
    event = torch.cuda.Event()
    event.record()
    return None, event
