"""Prefill and decode schedulers driven directly (no sockets): arrival orders, chunked prefill, radix sharing,
aborts and failures freeing KV pages, timeouts."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoProcessor

from epdserve.decode.scheduler import DecodeScheduler
from epdserve.encoder.vision import VisionEncoder
from epdserve.wire.messages import (DecodeRequest, ImageEmbeddings, ImageSpan, KVRegister, Load, PrefillRequest,
                               SamplingParams, decode, encode)
from epdserve.engine.model_runner import ModelRunner
from epdserve.prefill.scheduler import PrefillScheduler

PAGE = 4


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=256,
                       page_size=PAGE)


@pytest.fixture(scope="module")
def photo_request(tiny_model_path, photo_paths):
    """(PrefillRequest without room, ImageEmbeddings) for one photo, built the way the gateway builds them."""
    from PIL import Image

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    image = Image.open(photo_paths["chelsea"])
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image])
    ids = list(inputs["input_ids"][0])
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    offset, length = ids.index(pad), ids.count(pad)
    emb, grid = VisionEncoder(tiny_model_path, torch.device("cpu"), torch.float32).encode([image])[0]
    span = ImageSpan(offset=offset, length=length, image_hash="ab" * 32, grid_thw=list(grid))
    return ids, span, emb


class _Clock:
    """``time`` for a scheduler under test with ``monotonic`` moved on by hand (:meth:`advance`): its deadlines
    fire when the test says so, never because a loaded machine ran a step slowly. Everything else is real time."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


def _fake_clock(monkeypatch, module) -> _Clock:
    """Give ``module`` (a scheduler's module) a :class:`_Clock` as its ``time``."""
    clock = _Clock()
    monkeypatch.setattr(module, "time", clock)
    return clock


def _prefill(runner, **kw):
    return PrefillScheduler(runner, context_length=4096, max_prefill_tokens=kw.get("max_prefill_tokens", 8192),
                            timeout_s=kw.get("timeout_s", 60.0), chunked_prefill_size=kw.get("chunk", 0))


def _req(photo_request, rid, room, **sampling):
    ids, span, _ = photo_request
    return PrefillRequest(rid=rid, input_ids=ids, images=[span], sampling=SamplingParams(temperature=0, **sampling),
                          bootstrap_room=room)


def _embeds(photo_request, rid):
    _, span, emb = photo_request
    return ImageEmbeddings(rid=rid, image_hashes=[span.image_hash], embeddings=[emb])


def _run(sched, steps=50):
    out = []
    for _ in range(steps):
        out += sched.step()
    return out


def _pages_accounted(sched) -> bool:
    load = sched.load()
    assert load.kv_pages_used == sched.pool.num_pages - sched.pool.num_free
    return sched.pool.num_free + sched.radix.num_pages == sched.pool.num_pages and \
        load.kv_pages_used == load.kv_pages_cached


def test_embeddings_and_registration_in_any_order(runner, photo_request):
    results = []
    for order in (["req", "emb", "reg"], ["emb", "reg", "req"], ["reg", "req", "emb"]):
        sched, sent = _prefill(runner), []
        for what in order:
            if what == "req":
                sched.add_request(_req(photo_request, "r", 7))
            elif what == "emb":
                sched.add_embeddings(_embeds(photo_request, "r"))
            else:
                sched.register(KVRegister(rid="r", bootstrap_room=7, kv_endpoint="tcp://decode"))
            sent += sched.step()
        (endpoint, transfer), = sent + _run(sched)  # sent exactly once
        assert endpoint == "tcp://decode" and transfer.error is None
        results.append(transfer)
        assert _pages_accounted(sched)
        sched.radix.check_integrity()
    assert len({t.first_token_id for t in results}) == 1
    assert all(torch.equal(t.kv, results[0].kv) for t in results)


def _transfer_when_done(sched, req, emb):
    sched.add_request(req)
    sched.add_embeddings(emb)
    sched.register(KVRegister(rid=req.rid, bootstrap_room=req.bootstrap_room, kv_endpoint="tcp://d"))
    (_, transfer), = _run(sched)
    return transfer


def test_chunked_prefill_equals_one_shot(runner, photo_request):
    one = _transfer_when_done(_prefill(runner), _req(photo_request, "a", 1), _embeds(photo_request, "a"))
    sched = _prefill(runner, max_prefill_tokens=37)  # splits inside the image span, not on a page boundary
    chunked = _transfer_when_done(sched, _req(photo_request, "b", 2), _embeds(photo_request, "b"))
    assert chunked.first_token_id == one.first_token_id
    torch.testing.assert_close(chunked.kv, one.kv, rtol=1e-5, atol=1e-5)
    assert _pages_accounted(sched)


def test_chunked_prefill_size_lets_a_short_prompt_pass_a_long_one(runner, photo_request):
    one = _transfer_when_done(_prefill(runner), _req(photo_request, "a", 1), _embeds(photo_request, "a"))
    sched = _prefill(runner, chunk=16)
    sched.add_request(_req(photo_request, "long", 1))
    sched.add_embeddings(_embeds(photo_request, "long"))
    sched.register(KVRegister(rid="long", bootstrap_room=1, kv_endpoint="tcp://d"))
    sched.step()  # the long prompt's first chunk
    short = PrefillRequest(rid="short", input_ids=photo_request[0][:10], images=[],
                           sampling=SamplingParams(temperature=0), bootstrap_room=2)
    sched.add_request(short)
    sched.register(KVRegister(rid="short", bootstrap_room=2, kv_endpoint="tcp://d"))
    order = [t.rid for _ in range(40) for _, t in sched.step()]
    assert order == ["short", "long"]  # the short prompt rode along the long one's second chunk
    assert len(photo_request[0]) > 3 * 16
    long = _transfer_when_done(_prefill(runner, chunk=16), _req(photo_request, "b", 3), _embeds(photo_request, "b"))
    assert long.first_token_id == one.first_token_id
    torch.testing.assert_close(long.kv, one.kv, rtol=1e-5, atol=1e-5)
    assert _pages_accounted(sched)


def test_radix_cache_shares_image_kv_and_separates_other_images(runner, photo_request):
    sched = _prefill(runner)
    first = _transfer_when_done(sched, _req(photo_request, "a", 1), _embeds(photo_request, "a"))
    again = _transfer_when_done(sched, _req(photo_request, "b", 2), _embeds(photo_request, "b"))
    ids, span, emb = photo_request
    assert first.cached_tokens == 0
    assert again.cached_tokens == ((len(ids) - 1) // PAGE) * PAGE  # everything but the last (partial) page
    assert again.first_token_id == first.first_token_id
    torch.testing.assert_close(again.kv, first.kv, rtol=1e-5, atol=1e-5)
    # Same token ids, different image hash: only the text before the image may be shared.
    other = ImageSpan(span.offset, span.length, "cd" * 32, span.grid_thw)
    req = PrefillRequest(rid="c", input_ids=ids, images=[other], sampling=SamplingParams(temperature=0),
                         bootstrap_room=3)
    emb_c = ImageEmbeddings(rid="c", image_hashes=[other.image_hash], embeddings=[emb.flip(0)])
    third = _transfer_when_done(sched, req, emb_c)
    assert third.cached_tokens <= span.offset
    assert not torch.equal(third.kv, first.kv)
    assert _pages_accounted(sched)
    sched.radix.check_integrity()


def test_abort_mid_chunked_prefill_frees_pages(runner, photo_request):
    sched = _prefill(runner, max_prefill_tokens=16)
    sched.add_request(_req(photo_request, "a", 1))
    sched.add_embeddings(_embeds(photo_request, "a"))
    sched.step()
    assert sched.running and sched.pool.num_free < sched.pool.num_pages
    sched.abort("a")
    assert not sched.running and not sched.embeds
    assert sched.pool.num_free == sched.pool.num_pages  # nothing was cached: the prompt never finished
    sched.radix.check_integrity()


def test_failures_become_error_transfers(runner, photo_request):
    sched = _prefill(runner, timeout_s=0.05)
    ids, span, emb = photo_request
    sched.register(KVRegister(rid="x", bootstrap_room=1, kv_endpoint="tcp://d"))
    sched.add_request(_req(photo_request, "x", 1))  # its embeddings never come
    time.sleep(0.1)
    (_, transfer), = sched.step()
    assert "timed out" in transfer.error
    bad = ImageEmbeddings(rid="y", image_hashes=[span.image_hash], embeddings=[emb[:-1]])
    sched = _prefill(runner)
    transfer = _transfer_when_done(sched, _req(photo_request, "y", 2), bad)
    assert "shape" in transfer.error
    too_long = PrefillRequest(rid="z", input_ids=[1] * 5000, images=[], sampling=SamplingParams(),
                              bootstrap_room=3)
    sched.add_request(too_long)
    sched.register(KVRegister(rid="z", bootstrap_room=3, kv_endpoint="tcp://d"))
    (_, transfer), = sched.step()
    assert "context length" in transfer.error
    assert _pages_accounted(sched)


def _decode_sched(runner, **kw):
    return DecodeScheduler(runner, context_length=4096, max_running_requests=kw.get("max_running", 8),
                           timeout_s=kw.get("timeout_s", 60.0), kv_endpoint="tcp://me",
                           accept_shared=kw.get("accept_shared", False))


def _decode_tokens(dec, room, max_steps=20):
    outs = []
    for _ in range(max_steps):
        outs += [o for _, o in dec.step()]
        if any(o.finish_reason for o in outs):
            break
    return [t for o in outs for t in o.token_ids], outs[-1]


def test_shared_kv_hand_off_holds_pages_until_decode_acks(tiny_model_path, runner, photo_request):
    """The shared path (CPU: the prefill pool in /dev/shm): decode copies the pages itself, the prefill server
    keeps them until the KVAck, and the tokens equal the host path's."""
    n = len(photo_request[0])
    shared = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=64,
                         page_size=PAGE, attention_backend="sdpa", share_kv=True)
    prefill = _prefill(shared)
    assert prefill.pool_handle is not None and prefill.pool_handle.shm_path.startswith("/dev/shm/")
    sampling = SamplingParams(temperature=0, max_new_tokens=5)

    def decode_request(room):
        return DecodeRequest(rid=f"r{room}", prompt_len=n, sampling=sampling, bootstrap_host="h", bootstrap_port=1,
                             bootstrap_room=room)

    def hand_off(room):
        """Decode registers request ``room``, prefill computes it: (decode's bootstrap endpoint, the
        registration, prefill's one (KV endpoint, KVTransfer))."""
        endpoint, reg = dec.add_request(decode_request(room), peer=b"g")
        prefill.add_request(_req(photo_request, f"r{room}", room))
        prefill.add_embeddings(_embeds(photo_request, f"r{room}"))
        prefill.register(reg)
        (sent,) = _run(prefill)
        return endpoint, reg, sent

    def ack_frees_the_pages():
        (_, ack), = dec.take_acks()
        prefill.ack(ack)
        assert prefill.load().rooms == 0 and _pages_accounted(prefill)

    # Reference: the host path (a decode server that does not map pools gets the KV in the message).
    dec = _decode_sched(runner)
    _, reg, (_, host_t) = hand_off(1)
    assert not reg.accept_shared
    assert host_t.kv is not None and host_t.pool is None
    dec.add_transfer(host_t)
    want, _ = _decode_tokens(dec, 1)

    dec = _decode_sched(runner, accept_shared=True)
    endpoint, reg, (kv_endpoint, t) = hand_off(2)
    assert reg.accept_shared and reg.host_id
    assert kv_endpoint == "tcp://me" and t.kv is None and len(t.kv_pages) == -(-n // PAGE)
    held = prefill.load()
    assert held.rooms == 1 and held.kv_pages_used > held.kv_pages_cached  # lent pages: not yet reusable
    dec.add_transfer(decode(encode(t)))  # through the wire codec, as between processes
    got, last = _decode_tokens(dec, 2)
    assert got == want and last.cached_tokens == t.cached_tokens
    (ack_endpoint, ack), = dec.take_acks()
    assert ack_endpoint == endpoint == "tcp://h:1" and ack.bootstrap_room == 2
    prefill.ack(ack)
    assert prefill.load().rooms == 0 and _pages_accounted(prefill)
    prefill.radix.check_integrity()

    # A pool that cannot be mapped fails that request with an error and still frees the prefill pages.
    _, _, (_, t) = hand_off(3)
    t.pool.shm_path = "/dev/shm/epdserve-kv-gone"
    dec.add_transfer(t)
    _, last = _decode_tokens(dec, 3)
    assert last.finish_reason == "error" and "KV hand-off failed" in last.error
    ack_frees_the_pages()

    # Pages lent past the prefill server's deadline may already hold other KV: decode fails the request instead
    # of copying them, and acks.
    _, _, (_, t) = hand_off(4)
    assert t.lend_until > time.time() + 30  # the scheduler's timeout
    t.lend_until = time.time() + 1.0  # inside the safety margin
    copies = []
    dec.runner.copy_kv_from = lambda *a: copies.append(a)
    try:
        dec.add_transfer(t)
        _, last = _decode_tokens(dec, 4)
    finally:
        del dec.runner.copy_kv_from
    assert last.finish_reason == "error" and "expired" in last.error and not copies
    ack_frees_the_pages()
    assert dec.load().kv_pages_used == 0

    # A shared transfer decode rejects (another prompt's digest): the request fails and the pages are acked.
    _, _, (_, t) = hand_off(6)
    t.input_digest = "0" * 16
    dec.pending[6].msg.input_digest = "1" * 16
    dec.add_transfer(t)
    _, last = _decode_tokens(dec, 6)
    assert last.finish_reason == "error" and "tokenization mismatch" in last.error
    ack_frees_the_pages()

    # Aborted on decode before its copy (waiting for pages): the ack lets the prefill server free them now.
    _, _, (_, t) = hand_off(5)
    dec.add_transfer(t)
    dec.abort("r5")
    ack_frees_the_pages()


def test_decode_batches_frees_pages_and_reports_errors(runner, photo_request):
    prefill = _prefill(runner)
    transfers = [_transfer_when_done(prefill, _req(photo_request, f"r{i}", i), _embeds(photo_request, f"r{i}"))
                 for i in range(3)]
    dec = _decode_sched(runner)
    prompt_len = len(photo_request[0])
    for i, t in enumerate(transfers):
        msg = DecodeRequest(rid=f"r{i}", prompt_len=prompt_len, sampling=SamplingParams(
            temperature=0, max_new_tokens=6 if i else 50, ignore_eos=True), bootstrap_host="h", bootstrap_port=1,
            bootstrap_room=i)
        endpoint, reg = dec.add_request(msg, peer=b"g")
        assert endpoint == "tcp://h:1" and reg.kv_endpoint == "tcp://me" and reg.bootstrap_room == i
        dec.add_transfer(t)
    outs = [o for _, o in dec.step()]
    assert len(dec.running) == 3  # continuous batching: all three in one decode batch
    for _ in range(5):
        outs += [o for _, o in dec.step()]
    finished = {o.rid: o for o in outs if o.finish_reason}
    assert set(finished) == {"r1", "r2"} and all(o.finish_reason == "length" for o in finished.values())
    assert finished["r1"].completion_tokens == 6
    tokens = {rid: [t for o in outs if o.rid == rid for t in o.token_ids] for rid in ("r0", "r1", "r2")}
    assert tokens["r1"] == tokens["r2"] == tokens["r0"][:6]  # same prompt, greedy: batching does not mix them
    assert dec.load().num_running_reqs == 1 and dec.load().kv_pages_used > 0
    dec.abort("r0")
    assert not dec.running and dec.pool.num_free == dec.pool.num_pages
    assert dec.load() == Load(role="decode", num_running_reqs=0, num_waiting_reqs=0, kv_pages_used=0,
                              kv_pages_total=dec.pool.num_pages)
    # An error from prefill ends the request with finish_reason "error"; a transfer for an unknown room is dropped.
    dec.add_request(DecodeRequest(rid="e", prompt_len=3, sampling=SamplingParams(), bootstrap_host="h",
                                  bootstrap_port=1, bootstrap_room=99), peer=b"g")
    from epdserve.wire.messages import KVTransfer

    dec.add_transfer(KVTransfer(rid="e", bootstrap_room=99, error="boom"))
    dec.add_transfer(KVTransfer(rid="?", bootstrap_room=12345, error="late"))
    (peer, out), = dec.step()
    assert (peer, out.rid, out.finish_reason, out.error) == (b"g", "e", "error", "boom")


def test_decode_times_out_without_kv(runner):
    dec = _decode_sched(runner, timeout_s=0.05)
    dec.add_request(DecodeRequest(rid="t", prompt_len=3, sampling=SamplingParams(), bootstrap_host="h",
                                  bootstrap_port=1, bootstrap_room=5), peer=b"g")
    time.sleep(0.1)
    (_, out), = dec.step()
    assert out.finish_reason == "error" and "timed out" in out.error


def test_decode_sends_ids_only_and_a_gateway_abort_frees_pages(runner, photo_request):
    """Stop strings are the gateway's: decode ignores them, ends on stop_token_ids, and frees a request's pages when
    the gateway aborts it (what it does when its detokenizer matches a stop string)."""
    from dataclasses import replace

    prefill = _prefill(runner)
    transfer = _transfer_when_done(prefill, _req(photo_request, "p", 0), _embeds(photo_request, "p"))
    dec = _decode_sched(runner)
    prompt_len = len(photo_request[0])

    def start(rid, room, **sampling):
        dec.add_request(DecodeRequest(rid=rid, prompt_len=prompt_len, sampling=SamplingParams(
            temperature=0, ignore_eos=True, **sampling), bootstrap_host="h", bootstrap_port=1, bootstrap_room=room),
            peer=b"g")
        dec.add_transfer(replace(transfer, rid=rid, bootstrap_room=room))

    every_char = [chr(c) for c in range(32, 127)] + ["\ufffd"]
    start("s", 1, max_new_tokens=8, stop=every_char)
    outs = [o for _, o in _run(dec, 10)]
    assert [o.finish_reason for o in outs] == [None] * 7 + ["length"] and outs[-1].completion_tokens == 8
    assert all(len(o.token_ids) == 1 and not hasattr(o, "text") for o in outs)
    ids = [o.token_ids[0] for o in outs]

    start("t", 2, max_new_tokens=8, stop_token_ids=[ids[3]])
    outs = [o for _, o in _run(dec, 10)]
    assert [t for o in outs for t in o.token_ids] == ids[:ids.index(ids[3]) + 1]
    assert outs[-1].finish_reason == "stop"

    start("a", 3, max_new_tokens=50)
    start("b", 4, max_new_tokens=6)
    dec.step()
    dec.step()
    (a,) = [s for s in dec.running if s.msg.rid == "a"]
    free = dec.pool.num_free
    dec.abort("a")
    assert dec.pool.num_free == free + len(a.pages) and [s.msg.rid for s in dec.running] == ["b"]
    outs = [o for _, o in _run(dec, 10)]
    assert {o.rid for o in outs} == {"b"} and outs[-1].finish_reason == "length"
    assert not dec.running and dec.pool.num_free == dec.pool.num_pages


def test_logprobs_ride_the_host_path_for_the_requests_that_ask(runner, photo_request):
    # r0 asks for its tokens' logprobs and the top 3, r1 for none; they prefill and decode in one batch. Greedy, so
    # each token is its step's most likely one: the first top entry names it, with the same log-probability.
    prefill = _prefill(runner)
    asks = {"r0": 3, "r1": -1}
    transfers = [_transfer_when_done(prefill, _req(photo_request, rid, i, logprobs=k), _embeds(photo_request, rid))
                 for i, (rid, k) in enumerate(asks.items())]
    first = transfers[0].first_logprob
    assert transfers[0].kv is not None and transfers[1].first_logprob is None
    assert [t for t, _ in first.top][0] == transfers[0].first_token_id and len(first.top) == 3
    assert first.logprob == first.top[0][1] < 0 and first.top[0][1] >= first.top[1][1] >= first.top[2][1]
    dec = _decode_sched(runner)
    for i, ((rid, k), t) in enumerate(zip(asks.items(), transfers)):
        dec.add_request(DecodeRequest(rid=rid, prompt_len=len(photo_request[0]), sampling=SamplingParams(
            temperature=0, max_new_tokens=5, ignore_eos=True, logprobs=k), bootstrap_host="h", bootstrap_port=1,
            bootstrap_room=i), peer=b"g")
        dec.add_transfer(t)
    outs = [o for _ in range(10) for _, o in dec.step()]
    got = {rid: [(tok, lp) for o in outs if o.rid == rid for tok, lp in zip(o.token_ids, o.logprobs)]
           for rid in asks}
    assert len(got["r0"]) == 5 and got["r1"] == []
    assert all(not o.logprobs for o in outs if o.rid == "r1")
    for tok, lp in got["r0"]:
        assert lp.top[0][0] == tok and lp.logprob == lp.top[0][1] and len(lp.top) == 3


def test_prefill_records_expire_in_one_sweep_and_free_everything(runner, photo_request, monkeypatch):
    """Every kind of record the prefill scheduler keeps (embeddings without a request, a registration without a
    request, KV nobody registered for, an aborted id's marker) goes at its deadline, and nothing stays held."""
    import epdserve.prefill.scheduler as prefill_scheduler

    monkeypatch.setattr(prefill_scheduler, "_LATE_S", 0.05)
    clock = _fake_clock(monkeypatch, prefill_scheduler)
    sched = _prefill(runner, timeout_s=0.3)
    sched.add_embeddings(_embeds(photo_request, "orphan"))  # its request never comes
    sched.register(KVRegister(rid="nobody", bootstrap_room=9, kv_endpoint="tcp://d"))  # nor does this one's
    sched.add_request(_req(photo_request, "k", 5))
    sched.add_embeddings(_embeds(photo_request, "k"))
    assert _run(sched, 3) == []  # prefilled, but no decode server registered for room 5
    sched.abort("gone")
    sched.add_embeddings(_embeds(photo_request, "gone"))  # late: kept _LATE_S only
    load = sched.load()
    assert (load.rooms, load.embeddings, load.num_waiting_reqs, load.num_running_reqs) == (2, 2, 0, 0)
    clock.advance(0.1)
    sched.step()
    assert "gone" not in sched.embeds and "orphan" in sched.embeds  # the late ones went first
    clock.advance(0.3)
    assert sched.step() == []
    load = sched.load()
    assert (load.rooms, load.embeddings) == (0, 0) and not sched.reqs and _pages_accounted(sched)
    sched.radix.check_integrity()


def test_prefill_request_under_a_reused_id_keeps_its_early_embeddings(runner, photo_request):
    """An aborted id reused at once: the new request's embeddings, even if they came first, are used."""
    sched = _prefill(runner)
    sched.add_request(_req(photo_request, "r", 1))
    sched.abort("r")
    sched.add_embeddings(_embeds(photo_request, "r"))  # the new request's, before the new request
    transfer = _transfer_when_done(sched, _req(photo_request, "r", 2), _embeds(photo_request, "r"))
    assert transfer.error is None and transfer.bootstrap_room == 2
    assert not sched.reqs and _pages_accounted(sched)
