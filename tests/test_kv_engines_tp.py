"""Different TP sizes on the two sides of a transfer engine hand-off (``--kv-transfer nixl|mooncake``): one write
per (prefill rank, decode rank) pair, each moving the KV heads both hold (epdserve/kvcache/engine_copies.py).

- Head-sliced writes through each engine, in one process: two TP-2 prefill pool shards into one TP-1 decode pool
  (2 -> 1) and one TP-1 pool into two TP-2 shards (1 -> 2) fill exactly the named pages' heads, the last page only
  as far as the prompt goes; a KV head replicated over ranks is written once.
- Prefill rank 0 of a TP server (the other rank a stand-in) sends the transfer only once every rank's part has
  landed, fails the request (pages back) when any rank's part failed, and tells every rank to give the write up
  on an abort.
- ``epdserve launch`` with prefill TP 2 -> decode TP 1 (NIXL) and TP 1 -> TP 2 (Mooncake): greedy output equals
  transformers' generate() (text and a photo, streamed and not, and n = 3 greedy choices); every request's KV
  crossed by the engines, as many bytes as the prompts' whole KV (decode's ``kv_engine_bytes_total``), none
  through host memory; pages, rooms and registrations are back at baseline afterwards.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import httpx
import pytest
import torch

from cluster import at_baseline, details, stream, wait_for
from conftest import hf_reference_model, launch_metrics_urls, launched
from test_e2e import NEW_TOKENS, _chat, _hf_reference, _openai_messages, _resolve
from test_kv_engine_schedulers import _at_rest, _StandIn
from test_kv_engines import ENGINES, needs
from test_schedulers import PAGE, _run, runner  # noqa: F401  (fixtures)

from epdserve.kvcache.engine import make_engine
from epdserve.kvcache.engine_copies import writer_heads
from epdserve.kvcache.rank_writes import RankWrites
from epdserve.prefill.scheduler import PrefillScheduler
from epdserve.wire.messages import (KVAck, KVRegister, PrefillRequest, SamplingParams, TPEngineCancel, TPEngineWrite,
                                    TPEngineWriteDone)

L, PAGES, PS, D = 2, 300, 4, 3  # layers, pages per pool, page size, head dim; two KV heads in the model


def _write_all(writes: list[RankWrites], regions, src_pages, dst_pages, n_tokens, targets=()) -> None:
    """Start ``writes`` and poll them to their end, the ``targets`` engines (written into) progressing meanwhile
    as a decode loop turn lets them."""
    for w in writes:
        assert w.start(7, src_pages, n_tokens, regions, dst_pages) is None
    ended = []

    def turn() -> bool:
        for t in targets:
            t.progress()
        ended.extend(r for w in writes for r in w.poll())
        return len(ended) == len(writes)

    assert wait_for(turn, 10, 0.001)
    assert all(err == "" for *_, err in ended) and not any(w.busy for w in writes), ended


@pytest.mark.parametrize("name", ENGINES)
def test_head_sliced_writes_fill_each_ranks_heads(name):
    full = torch.randn(L, 2, PAGES, PS, 2, D)  # the model's two KV heads
    # 1102 tokens (L x 2 x 1102 head slices: more than one Mooncake batch), the last page only half; pages in any
    # order on both sides.
    n = 1102
    src_pages, dst_pages = (torch.randperm(PAGES, generator=torch.Generator().manual_seed(seed))[:-(-n // PS)].tolist()
                            for seed in (0, 1))
    want_full = torch.zeros_like(full)
    for i, (sp, dp) in enumerate(zip(src_pages, dst_pages)):
        rows = min(PS, n - i * PS)
        want_full[:, :, dp, :rows] = full[:, :, sp, :rows]
    engines = [make_engine(name, "127.0.0.1") for _ in range(3)]
    try:
        # 2 -> 1: prefill ranks 0 and 1 (one KV head each) write into decode rank 0's pool (both heads).
        shards = [full[..., h:h + 1, :].contiguous() for h in range(2)]
        dst = torch.zeros_like(full)
        for e, buf, h in zip(engines, shards, range(2)):
            e.register(buf, head_start=h)
        engines[2].register(dst)
        writes = [RankWrites(engines[r], shards[r], r, writer_heads(4, 2, 2, r), 2) for r in range(2)]
        _write_all(writes, [engines[2].describe()], src_pages, dst_pages, n, engines[2:])
        assert torch.equal(dst, want_full)
    finally:
        for e in engines:
            e.close()
    engines = [make_engine(name, "127.0.0.1") for _ in range(3)]
    try:
        # 1 -> 2: prefill rank 0 (both heads) writes decode rank 0 head 0 and decode rank 1 head 1.
        dsts = [torch.zeros(L, 2, PAGES, PS, 1, D) for _ in range(2)]
        engines[0].register(full)
        for e, buf, h in zip(engines[1:], dsts, range(2)):
            e.register(buf, head_start=h)
        writes = [RankWrites(engines[0], full, 0, writer_heads(4, 2, 1, 0), 2)]
        _write_all(writes, [e.describe() for e in engines[1:]], src_pages, dst_pages, n, engines[1:])
        for h in range(2):
            assert torch.equal(dsts[h], want_full[..., h:h + 1, :]), h
    finally:
        for e in engines:
            e.close()


def test_replicated_kv_head_is_written_once():
    # 4 query heads, 1 KV head over 2 ranks: both hold it, rank 0 writes it.
    assert [writer_heads(4, 1, 2, r) for r in range(2)] == [(0, 1), (0, 0)]
    # 8 query heads, 2 KV heads over 4 ranks: heads 0, 0, 1, 1 held; ranks 0 and 2 write.
    assert [writer_heads(8, 2, 4, r) for r in range(4)] == [(0, 1), (0, 0), (1, 1), (1, 0)]
    assert [writer_heads(4, 2, 2, r) for r in range(2)] == [(0, 1), (1, 1)]


class _Rank0Of2:
    """Rank 0 of a pretend TP-2 prefill server: the real (TP 1) runner computes, so rank 0's pool holds both KV
    heads but, as rank 0 of two, writes only head 0; rank 1's messages are recorded and its reports scripted."""

    def __init__(self, runner):  # noqa: F811
        self._runner, self.sent, self.reports = runner, [], []
        self.local = SimpleNamespace(tp=SimpleNamespace(size=2, rank=0), kv_pool=runner.kv_pool, heads=runner.heads,
                                     config=runner.config, state_pool=None)

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def engine_write(self, msg):
        self.sent.append(msg)

    def engine_cancel(self, room):
        self.sent.append(TPEngineCancel(room=room))

    def write_reports(self):
        out, self.reports = self.reports, []
        return out


@pytest.mark.parametrize("rank1", ["done", "fail", "abort"])
def test_transfer_waits_for_every_rank(runner, rank1):  # noqa: F811
    tp, eng = _Rank0Of2(runner), _StandIn("done")
    eng.register(runner.kv_pool.buffer)
    sched = PrefillScheduler(tp, context_length=4096, max_prefill_tokens=8192, timeout_s=60.0, engine=eng)
    ids = list(range(100, 123))
    sched.register(KVRegister(rid="r", bootstrap_room=1, kv_endpoint="tcp://d", regions=[eng.describe()],
                              kv_pages=list(range(-(-len(ids) // PAGE)))))
    sched.add_request(PrefillRequest(rid="r", input_ids=ids, images=[], bootstrap_room=1,
                                     sampling=SamplingParams(temperature=0, max_new_tokens=4)))
    assert _run(sched, 5) == []  # rank 0's part landed, rank 1's not yet
    [msg] = tp.sent
    assert isinstance(msg, TPEngineWrite) and msg.room == 1 and msg.n_tokens == len(ids) and len(msg.regions) == 1
    per_token = runner.kv_pool.num_layers * 2 * runner.kv_pool.head_dim * 4  # one KV head, float32
    assert sum(c[2] for c in eng.writes[0]) == len(ids) * per_token  # head 0 of every token, no more
    assert sched.load().rooms == 1 and sched.has_work()
    if rank1 == "abort":
        sched.abort("r")
        assert tp.sent[-1] == TPEngineCancel(room=1) and eng.cancelled == []  # rank 0's part had landed
        tp.reports.append(TPEngineWriteDone(rank=1, room=1, nbytes=0, error="cancelled"))
        assert _run(sched, 1) == []  # a late report of a given-up write is dropped
    else:
        tp.reports.append(TPEngineWriteDone(rank=1, room=1, nbytes=len(ids) * per_token,
                                            error="peer gone" if rank1 == "fail" else ""))
        [(_, t)] = _run(sched, 1)
        if rank1 == "done":
            assert t.engine_written and t.error is None and t.engine_bytes == 2 * len(ids) * per_token
            assert sched.load().rooms == 1  # lent until the ack
            sched.ack(KVAck(rid="r", bootstrap_room=1))
        else:
            assert not t.engine_written and "TP rank 1: peer gone" in t.error
    assert _at_rest(sched.load()), sched.load()


def _per_token_bytes(model_path: str) -> int:
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    return text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * \
        (text["hidden_size"] // text["num_attention_heads"]) * 4  # float32 on the CPU


def _counter(url: str, name: str) -> float:
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in {url}")


LAYOUTS = [pytest.param("nixl", "2", "1", id="nixl-tp2-to-tp1", marks=needs("nixl")),
           pytest.param("mooncake", "1", "2", id="mooncake-tp1-to-tp2", marks=needs("mooncake"))]


@pytest.fixture(scope="module")
def refs(tiny_model_path, photo_paths):
    hf = hf_reference_model(tiny_model_path)
    return {case: _hf_reference(hf, _resolve(case, photo_paths)) for case in ("text", "one_photo")}


@pytest.mark.parametrize("name,prefill_tp,decode_tp", LAYOUTS)
def test_greedy_parity_across_tp_sizes(name, prefill_tp, decode_tp, refs, tiny_model_path, photo_paths,
                                       tmp_path_factory):
    with launched(tiny_model_path, tmp_path_factory.mktemp(f"launch-{name}-tp"), "--kv-transfer", name,
                  "--prefill-tp", prefill_tp, "--decode-tp", decode_tp) as (url, log_path):
        decode_metrics = launch_metrics_urls(log_path)["decode"]
        prompt_tokens = 0
        for case, (ref_prompt, ref_ids, ref_text) in refs.items():
            messages = _openai_messages(_resolve(case, photo_paths))
            resp = _chat(url, tiny_model_path, messages)
            assert resp["prompt_token_ids"] == ref_prompt, case
            assert resp["choices"][0]["token_ids"] == ref_ids, case
            assert resp["choices"][0]["message"]["content"] == ref_text, case
            prompt_tokens += len(ref_prompt)
        streamed = stream(url, {"model": tiny_model_path, "messages": messages, "temperature": 0,
                                "max_completion_tokens": NEW_TOKENS, "ignore_eos": True, "return_token_ids": True})
        assert streamed.done and streamed.error is None and streamed.token_ids == ref_ids
        # n = 3: the engines write fork 0's pages, decode copies the partial last page to the other forks.
        forks = _chat(url, tiny_model_path, messages, n=3)["choices"]
        assert [c["token_ids"] for c in sorted(forks, key=lambda c: c["index"])] == [ref_ids] * 3
        prompt_tokens += 2 * len(ref_prompt)
        # Every rank pair's write landed: the prompts' whole KV (all heads, once each) crossed by the engines.
        assert _counter(decode_metrics, "epdserve:kv_engine_bytes_total") == prompt_tokens * \
            _per_token_bytes(tiny_model_path)
        check_engine_launch(url, log_path, 4)
        assert f"KV hand-off {name}" in log_path.read_text()


def check_engine_launch(url: str, log_path, handoffs: int) -> None:
    """A launch through a transfer engine, its requests done: every stage back at baseline, and each of the
    ``handoffs`` hand-offs written by the engine, none sent through host memory, none failed."""
    problems = []

    def rested():
        problems[:] = at_baseline(details(url))
        return not problems

    assert wait_for(rested, 20, 0.3), problems
    log = log_path.read_text()
    assert log.count("KV received (written by the engine") == handoffs
    assert "through host memory" not in log and "KV write to the decode server failed" not in log
