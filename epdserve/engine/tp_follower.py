"""TP ranks 1..N-1 of a prefill or decode server: run the calls rank 0 sends, on this rank's shard of the model.

Started by rank 0 (:func:`epdserve.engine.tp_runner.start_tp_runner`), never by hand::

    python -m epdserve.engine.tp_follower [--log-level L] {prefill,decode} --tp-rank R --dist-port P \\
        --ctrl-endpoint tcp://127.0.0.1:C [--graph-bs N] <the server's own flags>

A rank joins the process group, builds and warms up its :class:`~epdserve.engine.model_runner.ModelRunner` in step with
rank 0, then serves two sockets:
- a DEALER to rank 0's control ROUTER: ``TPForward`` / ``TPReadKV`` / ``TPWriteKV`` / ``TPReadState`` /
  ``TPWriteState`` / ``TPCopyState`` / ``TPReleaseEmbeddings`` / ``TPShutdown`` in, run in order; ``TPHello``
  and ``TPEmbedReceipt`` out.
- on a prefill server, a PULL on a port it binds itself (reported to rank 0 in ``TPHello``): the encoder's
  ``ImageEmbeddings`` for this rank. The rank keeps its own copy until rank 0 releases it and reports each
  arrival to rank 0, which schedules a request only once every rank holds its embeddings.

With ``--kv-transfer nixl|mooncake`` the rank runs its own transfer engine with its KV pool shard registered (its
region goes to rank 0 in ``TPHello``; a hybrid model's state pool shard too): a decode rank's pages and state
slots are written into by the prefill ranks; a prefill rank writes its KV and DeltaNet heads on ``TPEngineWrite``
(:class:`~epdserve.kvcache.rank_writes.RankWrites`), gives them up on ``TPEngineCancel`` and reports each
request's end with ``TPEngineWriteDone``.

It exits 0 on ``TPShutdown`` (within :data:`~epdserve.engine.shutdown.STOP_DEADLINE_S`, else 1 with every thread's
stack), 1 when a call fails or its parent (rank 0) is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

import torch
import zmq

from epdserve.wire import transport
from epdserve.config import DecodeConfig, PrefillConfig, add_config_args, config_from_args
from epdserve.engine.distributed import TPGroup, rank_device
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.engine.server import register_kv_engine, start_kv_engine
from epdserve.engine.shutdown import arm_stop_deadline
from epdserve.kvcache.rank_writes import RankWrites
from epdserve.wire.device_share import take_embeddings
from epdserve.wire.messages import ImageEmbeddings
from epdserve.wire.tp_messages import (
    TPCopyState, TPEmbedReceipt, TPEngineCancel, TPEngineWrite, TPEngineWriteDone, TPForward, TPHello, TPReadKV,
    TPReadState, TPReleaseEmbeddings, TPShutdown, TPWriteKV, TPWriteState,
)
from epdserve.engine.model_runner import ModelRunner, build_runner

log = logging.getLogger("epdserve.tp")

_PARENT_POLL_S = 0.5


def _watch_parent() -> None:
    """End this process when rank 0 (its parent) is gone, even while it waits inside a collective."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            threading.Event().wait(_PARENT_POLL_S)
            if os.getppid() != parent:
                log.error("TP rank: rank 0 (pid %d) is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


class Follower:
    """One TP rank > 0: its runner, its copy of image embeddings, and the handling of rank 0's calls.

    Args:
        runner: this rank's model runner (``runner.tp.rank > 0``).
        report: sends a message to rank 0 (the control DEALER).
        writes: this prefill rank's transfer engine writes (``--kv-transfer nixl|mooncake``), or None.
    """

    def __init__(self, runner: ModelRunner, report, writes: RankWrites | None = None):
        self.runner, self.rank, self._report, self.writes = runner, runner.tp.rank, report, writes
        self.embeds: dict[str, dict[str, torch.Tensor]] = {}  # rid -> image hash -> [n, embed_width]
        self._inflight: torch.cuda.Event | None = None  # the previous forward's end on the device

    def add_embeddings(self, msg: ImageEmbeddings) -> None:
        """Keep this rank's copy of ``msg``'s embeddings and tell rank 0 it has them."""
        by_hash = self.embeds.setdefault(msg.rid, {})
        for h, emb in zip(msg.image_hashes, msg.embeddings):
            by_hash[h] = emb
            log.debug("rid=%s TP rank %d received the embedding of image %s", msg.rid, self.rank, h[:12])
        self._report(TPEmbedReceipt(rank=self.rank, rid=msg.rid, image_hashes=list(msg.image_hashes)))

    def handle(self, msg) -> bool:
        """Run one call from rank 0. Returns False on ``TPShutdown``.

        Raises:
            KeyError: a forward names embeddings this rank does not hold (rank 0 broke its promise).
            RuntimeError: a collective failed (another rank is gone).
        """
        runner, dev = self.runner, self.runner.device
        if isinstance(msg, TPForward):
            mm_embeds = mm_mask = None
            if msg.mm_sources:
                mm_embeds = torch.cat([self.embeds[rid][h][s:e] for rid, h, s, e in msg.mm_sources])
                mm_mask = msg.mm_mask.to(torch.bool)
            runner.forward(ForwardBatch(
                is_decode=msg.is_decode, input_ids=torch.zeros(msg.num_tokens, dtype=torch.int64, device=dev),
                positions=msg.positions, out_slots=msg.out_slots, q_lens=msg.q_lens, kv_lens=msg.kv_lens,
                page_table=msg.page_table, mm_embeds=mm_embeds, mm_mask=mm_mask, state_slots=msg.state_slots,
                state_snapshots=msg.state_snapshots))
            if dev.type == "cuda":
                # At most one forward queued ahead of the device, as on rank 0 (its overlap scheduler): a host far
                # ahead would re-plan attention into host buffers that earlier, unexecuted copies still read.
                done = torch.cuda.Event()
                done.record()
                if self._inflight is not None:
                    self._inflight.synchronize()
                self._inflight = done
        elif isinstance(msg, TPReadKV):
            runner.read_kv(msg.slots)
        elif isinstance(msg, TPWriteKV):
            runner.write_kv(msg.slots, torch.empty(msg.shape, dtype=runner.dtype, device=dev))
        elif isinstance(msg, TPReadState):
            runner.read_state(msg.slot)
        elif isinstance(msg, TPWriteState):
            from epdserve.engine.state_io import state_shapes

            conv, rec = state_shapes(runner.config)
            pool = runner.state_pool
            runner.write_state(msg.slot, torch.empty(conv, dtype=pool.dtype, device=dev),
                               torch.empty(rec, dtype=pool.recurrent_dtype, device=dev))
        elif isinstance(msg, TPCopyState):
            runner.copy_state(msg.src, msg.dst)
        elif isinstance(msg, TPEngineWrite):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the forwards that computed the KV have run before the engine reads it
            if err := self.writes.start(msg.room, msg.src_pages, msg.n_tokens, msg.regions, msg.dst_pages,
                                        msg.src_slot, msg.dst_slot):
                self._report(TPEngineWriteDone(rank=self.rank, room=msg.room, nbytes=0, error=err))
        elif isinstance(msg, TPEngineCancel):
            self.writes.cancel(msg.room)
        elif isinstance(msg, TPReleaseEmbeddings):
            for rid in msg.rids:
                self.embeds.pop(rid, None)
        elif isinstance(msg, TPShutdown):
            return False
        return True

    def poll_writes(self) -> None:
        """Report every request whose engine writes have all ended since the last call."""
        for room, nbytes, state_bytes, error in self.writes.poll() if self.writes is not None else ():
            self._report(TPEngineWriteDone(rank=self.rank, room=room, nbytes=nbytes, error=error,
                                           state_bytes=state_bytes))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m epdserve.engine.tp_follower", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="role", required=True)
    for role, cls in (("prefill", PrefillConfig), ("decode", DecodeConfig)):
        p = sub.add_parser(role)
        p.add_argument("--tp-rank", type=int, required=True)
        p.add_argument("--dist-port", type=int, required=True)
        p.add_argument("--ctrl-endpoint", required=True)
        p.add_argument("--graph-bs", type=int, default=0, help="decode CUDA graphs up to this batch (rank 0's)")
        add_config_args(p, cls)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one TP rank until rank 0 says stop. Returns the exit code."""
    from epdserve.entry.cli import setup_logging

    args = _parser().parse_args(argv)
    setup_logging(args.log_level)
    cfg = config_from_args(PrefillConfig if args.role == "prefill" else DecodeConfig, args)
    rank = args.tp_rank
    _watch_parent()
    engine = start_kv_engine(cfg)  # this rank's own, for its pool shard
    tp = TPGroup.init(rank, cfg.tp, port=args.dist_port, device=rank_device(cfg.device, cfg.base_gpu_id, rank),
                      custom_all_reduce=not cfg.disable_custom_all_reduce)
    runner = build_runner(cfg, cfg.model_path, tp, args.graph_bs)
    register_kv_engine(engine, runner)
    writes = RankWrites.for_runner(engine, runner) if engine is not None and args.role == "prefill" else None
    ctx = zmq.Context()
    try:
        ctrl = ctx.socket(zmq.DEALER)
        ctrl.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
        ctrl.setsockopt(zmq.LINGER, 0)
        ctrl.setsockopt(zmq.SNDHWM, 0)
        ctrl.setsockopt(zmq.RCVHWM, 0)
        ctrl.connect(args.ctrl_endpoint)
        poller = zmq.Poller()
        poller.register(ctrl, zmq.POLLIN)
        embeds = None
        if args.role == "prefill":
            embeds = transport.bind(ctx, zmq.PULL, cfg.host, 0)  # any free port: reported to rank 0 below
            poller.register(embeds, zmq.POLLIN)
        follower = Follower(runner, lambda m: transport.send(ctrl, m), writes)
        endpoint = embeds.getsockopt_string(zmq.LAST_ENDPOINT) if embeds is not None else ""
        transport.send(ctrl, TPHello(rank=rank, embed_endpoint=endpoint,
                                     kv_region=engine.describe() if engine is not None else None))
        log.debug("%s TP rank %d serving on %s", args.role, rank, runner.device)
        while True:
            # Writes in flight: poll them often. A pool written into: its engine progresses on these turns (over TCP
            # a write lands only as it does), and this rank does not know when one comes: every millisecond.
            poller.poll(1 if (writes is not None and writes.busy) or (engine is not None and writes is None) else 1000)
            follower.poll_writes()
            if engine is not None and writes is None:
                engine.progress()
            while embeds is not None and (msg := transport.recv(embeds)) is not None:
                if isinstance(msg, ImageEmbeddings) and (msg := take_embeddings(msg, runner.device)) is not None:
                    follower.add_embeddings(msg)
            while (msg := transport.recv(ctrl)) is not None:
                if not follower.handle(msg):
                    arm_stop_deadline(f"{args.role} TP rank {rank}")
                    # Leave the group before exiting (torch warns about, and may wait on, a live one); the graphs
                    # first, since NCCL does not destroy a communicator a captured graph still references.
                    runner.release_graphs()
                    tp.close()
                    return 0
    except Exception:
        log.exception("%s TP rank %d failed", args.role, rank)
        return 1
    finally:
        ctx.destroy(linger=0)
        if engine is not None:
            engine.close()


if __name__ == "__main__":
    sys.exit(main())
