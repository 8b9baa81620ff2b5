"""TP rank 0 of a prefill or decode server: starts ranks 1..N-1 as child processes and mirrors every model call.

How a TP server runs (as SGLang's and mini-sglang's schedulers with ``--tp``, but with one scheduler): rank 0 is
the server process. It owns the sockets to the outside world, the scheduler (page ids, radix cache, batching)
and sampling. Each forward it schedules, and each KV read or write, is sent first to the other ranks on a
ZeroMQ ROUTER socket on 127.0.0.1 (one DEALER per rank; messages in :mod:`epdserve.wire.messages`, never pickle), and
then run by rank 0's own :class:`~epdserve.engine.model_runner.ModelRunner`; the other ranks
(:mod:`epdserve.engine.tp_follower`) run the same call, so the collectives inside pair up. Token ids and KV tensors move
between ranks by ``torch.distributed`` collectives on the device (NCCL / gloo), not over ZeroMQ.

Sampling happens on rank 0 only: logits are all-gathered to every rank, rank 0 samples, and the next step's
token ids reach the other ranks by broadcast. Outputs are therefore those of one process, whatever the TP size.

A rank that dies takes the server down: a watchdog thread polls the child processes; on a death it sets
:attr:`TPRunner.failed` (the server loop then fails its requests and exits non-zero) and, should rank 0 be stuck
in a collective with the dead rank (NCCL waits; gloo raises), ends the process after a grace period. The ranks
watch their parent the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time

import torch
import zmq

from epdserve.wire import transport
from epdserve.engine.distributed import TPGroup, rank_device
from epdserve.engine.forward_batch import ForwardBatch
from epdserve.wire.messages import encode
from epdserve.wire.tp_messages import (
    TPCopyState, TPEmbedReceipt, TPEngineCancel, TPEngineWrite, TPEngineWriteDone, TPForward, TPHello, TPReadKV,
    TPReadState, TPReleaseEmbeddings, TPShutdown, TPWriteKV, TPWriteState,
)
from epdserve.engine.model_runner import ModelRunner, build_runner
from epdserve.models.config import ModelConfig
from epdserve.models.parallel import head_shard, split_evenly

log = logging.getLogger(__name__)

# How long rank 0 waits for the other ranks to load, warm up and say hello.
_START_TIMEOUT_S = 900.0
# After a rank died: time the server loop gets to fail its requests and exit before the watchdog ends it.
_FAIL_GRACE_S = 5.0
_WATCH_INTERVAL_S = 0.2


def config_argv(cfg) -> list[str]:
    """The ``--flag value`` list that :func:`epdserve.config.add_config_args` parses back into ``cfg``."""
    argv = []
    for f in dataclasses.fields(cfg):
        flag, value = "--" + f.name.replace("_", "-"), getattr(cfg, f.name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


class TPRunner:
    """Rank 0's model runner of a TP server: the :class:`~epdserve.engine.model_runner.ModelRunner` interface the
    schedulers use (``forward``, ``read_kv``, ``write_kv``, ``config``, ``num_pages``, ``page_size``, ``device``,
    ``dtype``; hybrid models: ``state_pool`` (rank 0's, whose slot ids every rank shares), ``read_state``,
    ``write_state``, ``copy_state``), each call run on every rank.

    Also: :attr:`ctrl` (poll it for :meth:`receipts`), :meth:`release_embeddings` (prefill), :attr:`failed`
    (set when a rank is lost), :meth:`close`; with a transfer engine, :attr:`kv_regions` (ranks 1..N-1's pools)
    and :meth:`engine_write` / :meth:`engine_cancel` / :meth:`write_reports` (prefill). Build it with
    :func:`start_tp_runner`.
    """

    def __init__(self, local: ModelRunner, ctx: zmq.Context, ctrl: zmq.Socket, procs: dict[int, subprocess.Popen]):
        self.local = local
        self.config, self.num_pages, self.page_size = local.config, local.num_pages, local.page_size
        self.device, self.dtype, self.tp, self.heads = local.device, local.dtype, local.tp, local.heads
        self.state_pool, self.kv_pool = local.state_pool, local.kv_pool  # rank 0's own shards
        self.prefill_graphs = local.prefill_graphs  # every rank captures the same sizes
        self.startup_s = local.startup_s  # rank 0's; every rank loads, captures and warms up alike
        self._ctx, self.ctrl, self._procs = ctx, ctrl, procs
        self._receipts: list[TPEmbedReceipt] = []
        self._write_reports: list[TPEngineWriteDone] = []
        self.embed_endpoints: list[str] = []  # ranks 1..N-1's embedding endpoints (prefill), set at start
        self.kv_regions: list = []  # ranks 1..N-1's transfer engine regions (KVEngineRegion), set at start
        self.failed: str | None = None
        self._closing = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    # ---- the ModelRunner interface -------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`ModelRunner.forward` on every rank; returns rank 0's logits ``[B, vocab]`` (all of the vocabulary).

        Raises:
            ValueError: image rows without ``batch.mm_sources`` (the other ranks could not find them).
            RuntimeError: a rank is lost (a collective fails), or what :meth:`ModelRunner.forward` raises.
        """
        if batch.mm_embeds is not None and not batch.mm_sources:
            raise ValueError("a TP forward with image embeddings needs mm_sources")
        mm_mask = None if batch.mm_mask is None else batch.mm_mask.to(torch.uint8)
        self._send(TPForward(
            is_decode=batch.is_decode, num_tokens=int(batch.input_ids.shape[0]), positions=batch.positions,
            out_slots=batch.out_slots, q_lens=list(batch.q_lens), kv_lens=list(batch.kv_lens),
            page_table=[list(p) for p in batch.page_table], mm_mask=mm_mask,
            mm_sources=[list(s) for s in batch.mm_sources or []], state_slots=batch.state_slots,
            state_snapshots=None if batch.state_snapshots is None else [list(c) for c in batch.state_snapshots]))
        return self.local.forward(batch)

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """:meth:`ModelRunner.read_kv` gathered from every rank's KV heads: ``[layers, 2, n, kv_heads, head_dim]``
        on the CPU, all of the model's KV heads."""
        self._send(TPReadKV(slots=slots))
        return self.local.read_kv(slots)

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """:meth:`ModelRunner.write_kv` on every rank; each keeps its own KV heads of ``kv`` (all heads).

        Raises:
            ValueError: ``kv`` is not ``[layers, 2, len(slots), kv_heads, head_dim]`` (checked before any rank
                is told, so the ranks stay in step).
        """
        cfg = self.config
        want = (cfg.num_kv_layers, 2, int(slots.numel()), cfg.num_kv_heads, cfg.head_dim)
        if tuple(kv.shape) != want:
            raise ValueError(f"kv shape {tuple(kv.shape)} != expected {want}")
        self._send(TPWriteKV(slots=slots, shape=list(want)))
        self.local.write_kv(slots, kv)

    def read_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`ModelRunner.read_state` gathered from every rank's DeltaNet heads (whole state, on the CPU)."""
        self._send(TPReadState(slot=slot))
        return self.local.read_state(slot)

    def write_state(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """:meth:`ModelRunner.write_state` on every rank; each keeps its own heads.

        Raises:
            ValueError: wrong shapes (checked before any rank is told, so the ranks stay in step).
        """
        from epdserve.engine.state_io import state_shapes

        want = state_shapes(self.config)
        if (tuple(conv.shape), tuple(recurrent.shape)) != want:
            raise ValueError(f"state shapes {tuple(conv.shape)}, {tuple(recurrent.shape)} != expected {want}")
        self._send(TPWriteState(slot=slot))
        self.local.write_state(slot, conv, recurrent)

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """:meth:`ModelRunner.copy_state` on every rank."""
        self._send(TPCopyState(src=src_slot, dst=dst_slot))
        self.local.copy_state(src_slot, dst_slot)

    def state_handles(self) -> None:
        """None: a TP server's state pool is split over its ranks, like its KV pool (see :meth:`kv_handle`)."""
        return None

    def kv_handle(self) -> None:
        """None: a TP server's KV pool is split over its ranks, so it is never shared with another process (its
        KV hand-off goes through host memory, every KV head in the message)."""
        return None

    # ---- embeddings (prefill) ------------------------------------------------------------------------------
    def receipts(self) -> list[TPEmbedReceipt]:
        """The embedding receipts the other ranks sent since the last call (never blocks)."""
        self._drain()
        out, self._receipts = self._receipts, []
        return out

    def _drain(self) -> None:
        while (got := transport.recv_routed(self.ctrl)) is not None:
            _, msg = got
            if isinstance(msg, TPEmbedReceipt):
                self._receipts.append(msg)
            elif isinstance(msg, TPEngineWriteDone):
                self._write_reports.append(msg)

    # ---- transfer engine writes (prefill) ------------------------------------------------------------------
    def engine_write(self, msg: TPEngineWrite) -> None:
        """Tell the other ranks to write their KV heads of a request (after the forwards sent before)."""
        self._send(msg)

    def engine_cancel(self, room: int) -> None:
        """Tell the other ranks to give up their writes of ``room``."""
        self._send(TPEngineCancel(room=room))

    def write_reports(self) -> list[TPEngineWriteDone]:
        """The other ranks' reports of writes that ended, since the last call (never blocks)."""
        self._drain()
        out, self._write_reports = self._write_reports, []
        return out

    def release_embeddings(self, rids: list[str]) -> None:
        """Tell the other ranks to drop their copies of ``rids``' embeddings (after the forwards sent before)."""
        if rids:
            self._send(TPReleaseEmbeddings(rids=list(rids)))

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Tell the other ranks to exit, drop this rank's CUDA graphs and leave the process group alongside them
        (bounded: :meth:`TPGroup.close`), and wait for them, killing any that have not exited ``timeout_s`` seconds
        after they were told (:mod:`epdserve.engine.shutdown`)."""
        if self._closing.is_set():
            return
        self._closing.set()
        deadline = time.monotonic() + timeout_s
        if self.failed is None:
            try:
                self._send(TPShutdown())
            except zmq.ZMQError:
                pass
            # Every rank leaves the group at about the same time: the ranks leave it on TPShutdown, and an NCCL
            # group's teardown may wait for its peers, so rank 0 must not first wait for them to exit. The graphs
            # go first: a communicator that a captured graph references is never destroyed.
            self.prefill_graphs = None
            self.local.release_graphs()
            self.tp.close(timeout_s=max(0.5, deadline - time.monotonic() - 1.0))
        for rank, proc in self._procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("TP rank %d did not exit within %.0f s of being told; killed", rank, timeout_s)
                proc.kill()
                proc.wait()
        log.debug("TP ranks 1..%d stopped %.1f s after being told", len(self._procs),
                  time.monotonic() - deadline + timeout_s)
        self._ctx.destroy(linger=0)

    def _send(self, msg) -> None:
        frames = encode(msg)
        for rank in self._procs:
            self.ctrl.send_multipart([_identity(rank), *frames], copy=False)

    def _watch(self) -> None:
        while not self._closing.wait(_WATCH_INTERVAL_S):
            dead = {r: p.returncode for r, p in self._procs.items() if p.poll() is not None}
            if not dead:
                continue
            self.failed = "TP rank " + ", ".join(f"{r} exited (code {c})" for r, c in dead.items())
            log.error("%s: the server stops", self.failed)
            for proc in self._procs.values():
                if proc.poll() is None:
                    proc.kill()
            if not self._closing.wait(_FAIL_GRACE_S):  # the main thread is stuck (in a collective): end it here
                log.error("rank 0 did not stop within %.0f s of losing a TP rank; exiting", _FAIL_GRACE_S)
                os._exit(1)
            return


def _identity(rank: int) -> bytes:
    return f"rank{rank}".encode()


def start_tp_runner(cfg, model_path: str, cuda_graph_max_bs: int = 0) -> TPRunner:
    """Become TP rank 0 of a ``cfg.tp``-rank prefill or decode server (``cfg`` a
    :class:`~epdserve.config.PrefillConfig` or :class:`~epdserve.config.DecodeConfig`): start ranks
    1..tp-1 (``python -m epdserve.engine.tp_follower``), join the process group, load and warm up this rank's model
    alongside them, and wait until every rank said hello.

    Raises:
        ValueError: a bad device / ``base_gpu_id``, or heads that do not split over ``cfg.tp`` ranks.
        RuntimeError: a rank exited or did not say hello within the start timeout.
    """
    from epdserve.config import PrefillConfig
    from epdserve.wire.ports import free_port

    role = "prefill" if isinstance(cfg, PrefillConfig) else "decode"
    device = rank_device(cfg.device, cfg.base_gpu_id, 0)
    model = ModelConfig.load(model_path)
    for rank in range(cfg.tp):  # a model that does not split fails here, before any process starts
        group = TPGroup(rank, cfg.tp, device)
        head_shard(model.num_heads, model.num_kv_heads, group)
        split_evenly(model.intermediate_size, group, "intermediate size")
        if model.is_hybrid:
            from epdserve.models.qwen3_5_deltanet import deltanet_heads

            deltanet_heads(model, group)
    ctx = zmq.Context()
    ctrl = ctx.socket(zmq.ROUTER)
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl.setsockopt(zmq.SNDHWM, 0)
    ctrl.setsockopt(zmq.RCVHWM, 0)
    ctrl_port = ctrl.bind_to_random_port("tcp://127.0.0.1")
    dist_port = free_port()
    level = logging.getLevelName(logging.getLogger("epdserve").getEffectiveLevel())
    procs: dict[int, subprocess.Popen] = {}
    try:
        for rank in range(1, cfg.tp):
            cmd = [sys.executable, "-m", "epdserve.engine.tp_follower", "--log-level", level, role,
                   "--tp-rank", str(rank), "--dist-port", str(dist_port), "--ctrl-endpoint", f"tcp://127.0.0.1:{ctrl_port}",
                   "--graph-bs", str(cuda_graph_max_bs), *config_argv(dataclasses.replace(cfg, model_path=model_path))]
            # Own session: a Ctrl-C at the terminal reaches rank 0 only, which then stops the ranks in order.
            procs[rank] = subprocess.Popen(cmd, start_new_session=True)
        runner = _start_rank0(cfg, model_path, cuda_graph_max_bs, device, dist_port, procs)
        hellos = _wait_hellos(ctrl, procs)
    except BaseException:
        for proc in procs.values():
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
        raise
    log.info("%s TP ranks 0..%d ready (rank 0 on %s)", role, cfg.tp - 1, device)
    tp_runner = TPRunner(runner, ctx, ctrl, procs)
    tp_runner.embed_endpoints = [hellos[r].embed_endpoint for r in sorted(hellos)]
    tp_runner.kv_regions = [hellos[r].kv_region for r in sorted(hellos) if hellos[r].kv_region is not None]
    return tp_runner


def _start_rank0(cfg, model_path, cuda_graph_max_bs, device, dist_port, procs) -> ModelRunner:
    # A rank that dies while rank 0 waits in the rendezvous or a collective would leave it waiting for the
    # collective timeout: watch the children meanwhile and end this process if one dies.
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_WATCH_INTERVAL_S):
            dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
            if dead:
                log.error("TP rank(s) %s exited while starting; exiting", dead)
                for proc in procs.values():
                    if proc.poll() is None:
                        proc.kill()
                os._exit(1)

    threading.Thread(target=watch, name="tp-start-watchdog", daemon=True).start()
    try:
        tp = TPGroup.init(0, cfg.tp, port=dist_port, device=device,
                           custom_all_reduce=not cfg.disable_custom_all_reduce)
        return build_runner(cfg, model_path, tp, cuda_graph_max_bs)
    finally:
        done.set()


def _wait_hellos(ctrl: zmq.Socket, procs: dict[int, subprocess.Popen]) -> dict[int, TPHello]:
    """Wait for every rank's ``TPHello``; returns them by rank."""
    waiting, deadline = set(procs), time.monotonic() + _START_TIMEOUT_S
    hellos: dict[int, TPHello] = {}
    while waiting:
        dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"TP rank(s) exited while starting: {dead}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"TP rank(s) {sorted(waiting)} did not start within {_START_TIMEOUT_S:.0f} s")
        if ctrl.poll(100):
            got = transport.recv_routed(ctrl)
            if got is not None and isinstance(got[1], TPHello):
                waiting.discard(got[1].rank)
                hellos[got[1].rank] = got[1]
    return hellos
