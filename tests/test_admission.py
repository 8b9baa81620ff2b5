"""Overload and bad input without real stages (fast): admission control, wire-message checks, prefill waiting
for pages.

- :class:`Admission`: FIFO slots, a bounded queue, 429 beyond it, 503 after the queue timeout, no slot lost when
  a waiter is cancelled.
- The gateway on fake stages: past ``--max-inflight-requests`` + ``--max-queued-requests`` a request gets 429 with
  ``Retry-After``, a queued one 503 after ``--queue-timeout-s``; slots come back when clients hang up.
- :func:`epdserve.wire.validate.check_message` rejects what would crash a stage and passes what the gateway sends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest
import torch
from test_gateway import FakeEncoder, FakeStage, hang_script, running_gateway

from epdserve.config import GatewayConfig
from epdserve.frontend.admission import Admission, Overloaded
from epdserve.gateway.stages import GatewayStages as StageClient
from epdserve.wire.messages import (DecodeRequest, ImageEmbeddings, ImageSpan, KVRegister, KVTransfer, PrefillRequest,
                               SamplingParams, WireError, decode, encode)
from epdserve.wire.validate import check_message


def test_admission_queue_and_limits():
    async def run():
        adm = Admission(max_inflight=2, max_queued=2, queue_timeout_s=0.3)
        await adm.acquire()
        await adm.acquire()
        order = []

        async def wait(i):
            await adm.acquire()
            order.append(i)

        waiters = [asyncio.create_task(wait(i)) for i in range(2)]
        await asyncio.sleep(0.01)
        assert (adm.inflight, adm.queued) == (2, 2)
        with pytest.raises(Overloaded) as e:
            await adm.acquire()
        assert e.value.status == 429 and e.value.retry_after_s >= 1
        adm.release()  # the oldest waiter takes the slot over
        await asyncio.sleep(0.01)
        assert order == [0] and (adm.inflight, adm.queued) == (2, 1)
        waiters[1].cancel()  # a client that gives up while queued leaves no trace
        await asyncio.gather(waiters[1], return_exceptions=True)
        assert adm.queued == 0
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as e:
            await adm.acquire()
        assert e.value.status == 503 and 0.25 < time.monotonic() - t0 < 2
        for _ in range(2):
            adm.release()
        assert (adm.inflight, adm.queued) == (0, 0)

    asyncio.run(run())


def test_gateway_overload_answers_429_and_503_with_retry_after(tiny_model_path, processor):
    prefill, decode_ = FakeStage("prefill"), FakeStage("decode")
    decode_.script = hang_script  # every request runs until its client leaves
    config = GatewayConfig(model_path=tiny_model_path, prefill_addr=prefill.addr, decode_addr=decode_.addr,
                           max_inflight_requests=2, max_queued_requests=1, queue_timeout_s=1.0)
    body = {"model": tiny_model_path, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    try:
        with running_gateway(config, StageClient(config, encoder=FakeEncoder(processor))) as base:
            url = f"{base}/v1/chat/completions"
            with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
                with c1.stream("POST", url, json=body) as s1, c2.stream("POST", url, json=body) as s2:
                    assert s1.status_code == s2.status_code == 200
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        queued = pool.submit(httpx.post, url, json=body, timeout=30)
                        time.sleep(0.3)
                        r = httpx.post(url, json=body, timeout=30)
                        assert r.status_code == 429 and r.headers["retry-after"] == "1"
                        assert r.json()["error"]["type"] == "rate_limit_error"
                        r = queued.result()
                    assert r.status_code == 503 and r.headers["retry-after"] and "busy" in r.json()["error"]["message"]
            # Both streams hung up: their slots are free again.
            assert _settles(base)
            with httpx.stream("POST", url, json=body, timeout=30) as s:
                assert s.status_code == 200
    finally:
        prefill.stop()
        decode_.stop()


def _settles(base: str) -> bool:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/health", params={"details": 1}).json()["gateway"]["inflight"] == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_path)


def _roundtrip(msg):
    return check_message(decode(encode(msg)))


def test_check_message_passes_good_and_rejects_hostile():
    sp = SamplingParams(temperature=0.0, max_new_tokens=4, seed=2**64 - 1)
    h = "ab" * 32
    good = [
        PrefillRequest("r", [1, 2, 5, 5, 5, 5, 3], [ImageSpan(2, 4, h, [1, 4, 4])], sp, 2**63 - 1),
        DecodeRequest("r", 7, sp, "127.0.0.1", 8998, 5),
        KVRegister("r", 5, "tcp://127.0.0.1:30201"),
        KVTransfer("r", 5, 3, 0, 0, torch.zeros(2, 2, 7, 1, 4, dtype=torch.bfloat16)),
        ImageEmbeddings("r", [h], [torch.zeros(4, 8)]),
    ]
    for msg in good:
        out = _roundtrip(msg)
        assert type(out) is type(msg) and out.rid == msg.rid
    bad = [
        PrefillRequest("r", "abc", [], sp, 1),  # wrong type
        PrefillRequest("r", [1, 2, 3], [ImageSpan(1, 2, h, [1, 4, 4]), ImageSpan(2, 1, h, [1, 2, 2])], sp, 1),
        PrefillRequest("r", [1, 2, 3], [ImageSpan(0, 2, "not hex!", [1, 4, 4])], sp, 1),
        PrefillRequest("r", [1, 2, 3], [ImageSpan(0, 2, h, [1, 4])], sp, 1),
        PrefillRequest("r", [1], [], SamplingParams(top_p=0.0), 1),
        PrefillRequest("", [1], [], sp, 1),
        DecodeRequest("r", 0, sp, "127.0.0.1", 8998, 5),
        DecodeRequest("r", 7, sp, "127.0.0.1", 70000, 5),
        DecodeRequest("r", 7, sp, "bad host!", 1, 5),
        DecodeRequest("r", 7, SamplingParams(max_new_tokens=0), "127.0.0.1", 1, 5),
        KVRegister("r", 5, "ipc:///tmp/x"),
        KVRegister("r", -1, "tcp://127.0.0.1:1"),
        KVTransfer("r", 5, kv=torch.zeros(3, dtype=torch.int64)),
        ImageEmbeddings("r", [h, h], [torch.zeros(4, 8)]),
        ImageEmbeddings("r", [h], [torch.zeros(4, 8, dtype=torch.int64)]),
    ]
    for msg in bad:
        with pytest.raises(WireError):
            _roundtrip(msg)
    # An int past 64 bits cannot even be encoded; a float that is not finite is refused.
    with pytest.raises(WireError):
        check_message(SamplingParams(temperature=float("inf")))


def test_prefill_waits_for_lent_pages_instead_of_failing(tiny_model_path):
    """Shared KV path: while a decode server still copies a prefilled request's pages, a request that does not fit
    the rest of the prefill pool waits (nothing runs at prefill, yet the pages come back) and runs after the ack;
    only a prompt larger than the whole pool fails."""
    from epdserve.wire.messages import KVAck
    from epdserve.engine.model_runner import ModelRunner
    from epdserve.prefill.scheduler import PrefillScheduler

    runner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=10,
                         page_size=4, attention_backend="sdpa", share_kv=True)
    sched = PrefillScheduler(runner, context_length=4096, max_prefill_tokens=8192, timeout_s=60.0)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)

    def submit(rid: str, room: int, n: int) -> None:
        sched.add_request(PrefillRequest(rid, [7 + i % 50 for i in range(n)], [], sp, room))
        sched.register(KVRegister(rid, room, "tcp://127.0.0.1:1", host_id=sched.host_id, accept_shared=True))

    submit("a", 1, 30)  # 8 of the 10 pages, lent to decode once prefilled
    (_, ta), = sched.step()
    assert ta.error is None and ta.kv is None and len(ta.kv_pages) == 8
    submit("b", 2, 30)  # 8 more pages: only 2 are free
    for _ in range(3):
        assert sched.step() == []
    assert sched.load().num_waiting_reqs == 1  # waiting, not failed
    sched.ack(KVAck("a", 1))
    (_, tb), = sched.step()
    assert tb.rid == "b" and tb.error is None
    sched.ack(KVAck("b", 2))
    submit("c", 3, 41)  # 11 pages: more than the pool
    (_, tc), = sched.step()
    assert tc.rid == "c" and "more KV pages than the pool has" in tc.error
