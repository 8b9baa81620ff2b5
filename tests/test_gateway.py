"""Gateway tests on CPU with fake stages: a fake encoder object and fake prefill/decode ZMQ ROUTER servers.

The prompt tests use the real tiny processor: the gateway's token ids must equal the Hugging Face processor's.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hashlib
import io
import json
import math
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import zmq

from epdserve.config import GatewayConfig
from epdserve.gateway.app import create_app, server_config
from epdserve.frontend.media import MediaError, MediaPolicy, decode_data_url, load_image
from epdserve.frontend.openai.chat import to_hf_messages
from epdserve.frontend.openai.protocol import ChatMessage
from epdserve.frontend.prompt import EncodedImage, PromptBuilder, PromptError
from epdserve.frontend.errors import StageError
from epdserve.gateway.stages import GatewayStages as StageClient
from epdserve.wire.messages import (
    AbortRequest, DecodeRequest, Load, LoadRequest, PrefillRequest, ServerInfo, ServerInfoRequest, TokenOutput,
    TokenOutputBatch, decode, encode,
)
from epdserve.models.checkpoint_parts import build_tokenizer
from epdserve.wire.ports import free_port

CONTEXT = 4096
EMBED_ENDPOINTS = ["tcp://127.0.0.1:39101", "tcp://127.0.0.1:39102"]
# The fake decode sends token ids only, as the real one does; the gateway detokenizes them with the tiny
# checkpoint's tokenizer (the same one, built offline).
TOKENIZER = build_tokenizer()


def _ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


REPLY = ["The", " cat", "!"]
REPLY_IDS = [i for piece in REPLY for i in _ids(piece)]
assert len(REPLY_IDS) == len(REPLY), "each piece of the fake reply must be one token"
STOP_TEXT = "The cup is blue. The table"


# ---------------------------------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def processor(tiny_model_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def builder(processor) -> PromptBuilder:
    return PromptBuilder(processor)


def _encoded(processor, image) -> EncodedImage:
    """What the encoder reports for ``image``: grid from the real image processor, tokens = grid / merge**2."""
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    merge = processor.image_processor.merge_size
    return EncodedImage(hashlib.sha256(image.tobytes()).hexdigest(), math.prod(grid) // merge**2, grid)


def _data_url(path: Path) -> str:
    mime = "image/png" if path.suffix == ".png" else "image/jpeg"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


class FakeEncoder:
    """Stands in for the gRPC encoder: decodes the image and reports the real processor's grid."""

    def __init__(self, processor):
        self.processor = processor
        self.calls: list[tuple[str, int, list[str]]] = []
        self.hold = threading.Event()  # cleared: answers wait until it is set again
        self.hold.set()
        self.extra_tokens = 0  # reported on top of the true count: an encoder serving another checkpoint

    async def encode(self, rid, images, targets):
        self.calls.append((rid, len(images), list(targets)))
        await asyncio.to_thread(self.hold.wait, 10)
        out = await asyncio.to_thread(self._encode, images)
        return [EncodedImage(e.image_hash, e.num_tokens + self.extra_tokens, e.grid_thw) for e in out]

    def _encode(self, images):
        from PIL import Image

        out = []
        for i, data in enumerate(images):
            try:
                img = Image.open(io.BytesIO(data))
                img.load()
            except Exception as e:
                raise StageError(f"image {i} cannot be decoded: {e}", 400) from None
            enc = _encoded(self.processor, img)
            out.append(EncodedImage(hashlib.sha256(data).hexdigest(), enc.num_tokens, enc.grid_thw))
        return out

    async def close(self):
        pass


def default_script(req: DecodeRequest) -> list[TokenOutputBatch]:
    """Three tokens ("The", " cat", "!"), cut at ``max_new_tokens``; one batch per token."""
    ids = REPLY_IDS[: req.sampling.max_new_tokens]
    n = len(ids)
    finish = "length" if req.sampling.max_new_tokens <= 3 else "stop"
    return [TokenOutputBatch([TokenOutput(req.rid, [tid], finish if i == n - 1 else None,
                                          prompt_tokens=req.prompt_len, completion_tokens=i + 1,
                                          cached_tokens=2)])
            for i, tid in enumerate(ids)]


def hang_script(req: DecodeRequest) -> list[TokenOutputBatch]:
    """One token, then nothing: the request runs until someone aborts it."""
    return [TokenOutputBatch([TokenOutput(req.rid, REPLY_IDS[:1])])]


def error_script(req: DecodeRequest) -> list[TokenOutputBatch]:
    return [TokenOutputBatch([TokenOutput(req.rid, REPLY_IDS[:1])]),
            TokenOutputBatch([TokenOutput(req.rid, [], "error", error="KV transfer failed")])]


def stop_script(req: DecodeRequest) -> list[TokenOutputBatch]:
    """The ids of ``STOP_TEXT``, three per output, and no finish: only an abort ends the request."""
    ids = _ids(STOP_TEXT)
    return [TokenOutputBatch([TokenOutput(req.rid, ids[i:i + 3], prompt_tokens=req.prompt_len,
                                          completion_tokens=min(i + 3, len(ids)), cached_tokens=2)])
            for i in range(0, len(ids), 3)]


class FakeStage:
    """A prefill or decode server: a ZMQ ROUTER in a thread that records every message it gets.

    It answers ``ServerInfoRequest``; the decode one answers ``DecodeRequest`` with ``self.script(req)``.
    """

    def __init__(self, role: str, context_length: int = CONTEXT, port: int | None = None, delay_s: float = 0.0):
        self.role = role
        self.context_length = context_length
        self.port = port or free_port()
        self.addr = f"tcp://127.0.0.1:{self.port}"
        self.script = default_script
        # What a fake prefill advertises (tests of several prefill servers give each its own).
        self.embed_endpoints, self.bootstrap_port = EMBED_ENDPOINTS, 38998
        self.received: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._delay_s = delay_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def messages(self, kind: type) -> list:
        with self._lock:
            return [m for m in self.received if isinstance(m, kind)]

    def reset(self) -> None:
        with self._lock:
            self.received.clear()
        self.script = default_script

    def _run(self) -> None:
        time.sleep(self._delay_s)  # a server that is still loading
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.addr)
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                ident, *frames = sock.recv_multipart()
                msg = decode(frames)
                with self._lock:
                    self.received.append(msg)
                if isinstance(msg, ServerInfoRequest):
                    info = ServerInfo(role=self.role, model_path="", context_length=self.context_length,
                                      page_size=16, num_pages=256)
                    if self.role == "prefill":
                        info.embed_endpoints = self.embed_endpoints
                        info.bootstrap_host, info.bootstrap_port = "127.0.0.1", self.bootstrap_port
                    sock.send_multipart([ident, *encode(info)])
                elif isinstance(msg, LoadRequest):
                    # The gateway's heartbeat: a stage silent for stage_timeout_s (10 s) is taken as down, so a
                    # fake that ignored it would flap down and up in a long test module (503s).
                    sock.send_multipart([ident, *encode(Load(role=self.role, num_running_reqs=0, num_waiting_reqs=0,
                                                             kv_pages_used=0, kv_pages_total=256))])
                elif isinstance(msg, DecodeRequest) and self.role == "decode":
                    for batch in self.script(msg):
                        sock.send_multipart([ident, *encode(batch)])
        finally:
            ctx.destroy(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _wait_for(pred, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


@contextmanager
def running_gateway(config: GatewayConfig, stages: StageClient):
    """Serve ``create_app(config, stages)`` with uvicorn on a free port in a thread; yield its base URL."""
    import uvicorn

    app = create_app(config, stages, startup_timeout_s=30)
    # The settings `epdserve gateway` serves with, on a free local port.
    server = uvicorn.Server(server_config(app, "127.0.0.1", free_port()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.config.port}"
    try:
        assert _wait_for(lambda: _healthy(base), 60), "gateway did not become healthy"
        yield base
    finally:
        server.should_exit = True
        thread.join(10)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------------------------------------------- prompt

@pytest.mark.parametrize("names", [[], ["chelsea"], ["chelsea", "coffee"]], ids=["0img", "1img", "2img"])
def test_prompt_ids_match_hf_processor(names, processor, builder, photo_paths):
    from PIL import Image

    images = [Image.open(photo_paths[n]) for n in names]
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}} for _ in names]
    content.append({"type": "text", "text": "Describe this image."})
    messages = [ChatMessage.model_validate({"role": "user", "content": content})]
    hf, urls, _ = to_hf_messages(messages)
    assert len(urls) == len(names)
    prompt = builder.build(hf, [_encoded(processor, im) for im in images])

    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=images or None)["input_ids"][0]
    assert prompt.input_ids == list(expected)
    assert len(prompt.images) == len(names)
    for span, im in zip(prompt.images, images):
        assert span.length == _encoded(processor, im).num_tokens
        assert set(prompt.input_ids[span.offset:span.offset + span.length]) == {builder.image_token_id}
        assert prompt.input_ids[span.offset - 1] != builder.image_token_id


def test_prompt_multi_turn_matches_hf_processor(processor, builder, photo_paths):
    from PIL import Image

    images = [Image.open(photo_paths["astronaut"]), Image.open(photo_paths["rocket"])]
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "First:"},
                                     {"type": "image_url", "image_url": {"url": "data:,"}}]},
        {"role": "assistant", "content": "An astronaut."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                     {"type": "text", "text": "And this one?"}]},
    ]]
    hf, _, _ = to_hf_messages(messages)
    prompt = builder.build(hf, [_encoded(processor, im) for im in images])
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    assert prompt.input_ids == list(processor(text=[text], images=images)["input_ids"][0])
    assert [s.offset for s in prompt.images] == sorted(s.offset for s in prompt.images)


def test_to_hf_messages():
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "data:x"}]},
        {"role": "assistant", "content": None},
    ]]
    hf, urls, _ = to_hf_messages(messages)
    assert hf == [{"role": "system", "content": "sys"},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
                  {"role": "assistant", "content": ""}]
    assert urls == ["data:x"]


def test_prompt_image_count_mismatch(builder):
    hf = [{"role": "user", "content": [{"type": "text", "text": "spoof <|image_pad|>"}]}]
    with pytest.raises(PromptError):
        builder.build(hf, [])
    with pytest.raises(PromptError):
        builder.build([{"role": "user", "content": "hi"}], [EncodedImage("h", 4, [1, 4, 4])])


# ---------------------------------------------------------------------------------------------------- media

def test_data_urls():
    assert decode_data_url("data:image/png;base64," + base64.b64encode(b"abc").decode(), 100) == b"abc"
    wrapped = base64.encodebytes(bytes(range(256))).decode()  # MIME style: 76 columns, newline-terminated lines
    assert "\n" in wrapped
    assert decode_data_url("data:image/png;base64," + wrapped.replace("\n", "\r\n\t "), 1000) == bytes(range(256))
    for bad in ["data:image/png;base64,@@@", "data:text/plain;base64,YWJj", "data:image/png,abc", "data:image/png"]:
        with pytest.raises(MediaError) as e:
            decode_data_url(bad, 100)
        assert e.value.status == 400
    with pytest.raises(MediaError) as e:
        decode_data_url("data:image/png;base64," + base64.b64encode(b"x" * 101).decode(), 100)
    assert e.value.status == 413


def test_remote_and_local_policy(tmp_path, photo_paths):
    policy = MediaPolicy(max_bytes=10**8)
    with pytest.raises(MediaError, match="remote"):
        asyncio.run(load_image("https://example.com/cat.png", policy))
    with pytest.raises(MediaError, match="disabled"):
        asyncio.run(load_image(photo_paths["chelsea"].as_uri(), policy))
    (tmp_path / "a.png").write_bytes(b"img")
    local = MediaPolicy(max_bytes=10**8, local_root=str(tmp_path))
    assert asyncio.run(load_image((tmp_path / "a.png").as_uri(), local)) == b"img"
    with pytest.raises(MediaError, match="outside"):
        asyncio.run(load_image(photo_paths["chelsea"].as_uri(), local))
    with pytest.raises(MediaError, match="outside"):
        asyncio.run(load_image((tmp_path / ".." / "x.png").as_uri(), local))
    with pytest.raises(MediaError) as e:
        asyncio.run(load_image((tmp_path / "a.png").as_uri(), MediaPolicy(max_bytes=2, local_root=str(tmp_path))))
    assert e.value.status == 413


# ---------------------------------------------------------------------------------------------------- app

@pytest.fixture(scope="module")
def stage_servers():
    prefill, decode_ = FakeStage("prefill"), FakeStage("decode")
    yield prefill, decode_
    prefill.stop()
    decode_.stop()


@pytest.fixture(scope="module")
def gateway(tiny_model_path, processor, stage_servers):
    """(base_url, prefill, decode, encoder) of a gateway on fake stages, shared by the module's tests."""
    prefill, decode_ = stage_servers
    config = GatewayConfig(model_path=tiny_model_path, prefill_addr=prefill.addr, decode_addr=decode_.addr)
    encoder = FakeEncoder(processor)
    with running_gateway(config, StageClient(config, encoder=encoder)) as base:
        yield base, prefill, decode_, encoder


@pytest.fixture
def gw(gateway):
    base, prefill, decode_, encoder = gateway
    # The fake decode answers before the gateway's PrefillRequest lands, so the previous test's messages can
    # still be arriving: wait until the fakes have been quiet for a moment, then start from empty.
    seen = -1
    while seen != (seen := len(prefill.received) + len(decode_.received)):
        time.sleep(0.1)
    prefill.reset()
    decode_.reset()
    encoder.calls.clear()
    encoder.hold.set()
    encoder.extra_tokens = 0
    return gateway


def _chat(base, model, content="Say hi.", **kw):
    body = {"model": model, "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)


def _photo_content(path: Path, text="What is in the picture?"):
    return [{"type": "image_url", "image_url": {"url": _data_url(path)}}, {"type": "text", "text": text}]


def _error(resp) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_health_and_models(gw, tiny_model_path):
    base = gw[0]
    assert httpx.get(f"{base}/health").status_code == 200
    models = httpx.get(f"{base}/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == tiny_model_path
    assert models["data"][0]["owned_by"] == "epdserve"


def test_non_stream_with_image(gw, tiny_model_path, processor, photo_paths):
    from PIL import Image

    base, prefill, decode_, encoder = gw
    resp = _chat(base, tiny_model_path, _photo_content(photo_paths["chelsea"]), max_completion_tokens=8,
                 temperature=0, top_k=5, top_p=0.9, stop="END", seed=7, ignore_eos=True, return_token_ids=True)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == tiny_model_path
    choice = out["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "The cat!"}
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == REPLY_IDS

    # What the stages received: decode first, then prefill, same room; ids equal the HF processor's. The fake
    # decode answers without waiting for prefill, so the answer can come before the fake prefill's thread has
    # recorded its request.
    assert _wait_for(lambda: prefill.messages(PrefillRequest))
    (pre,), (dec,) = prefill.messages(PrefillRequest), decode_.messages(DecodeRequest)
    assert pre.rid == dec.rid == out["id"]
    assert encoder.calls == [(out["id"], 1, EMBED_ENDPOINTS)]
    hf = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    text = processor.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    expected = list(processor(text=[text], images=[Image.open(photo_paths["chelsea"])])["input_ids"][0])
    assert pre.input_ids == expected == out["prompt_token_ids"]
    (span,) = pre.images
    assert span.image_hash == hashlib.sha256(photo_paths["chelsea"].read_bytes()).hexdigest()
    assert dec.prompt_len == len(expected) and dec.bootstrap_room == pre.bootstrap_room
    assert 0 <= pre.bootstrap_room < 2**63
    assert (dec.bootstrap_host, dec.bootstrap_port) == ("127.0.0.1", 38998)
    s = pre.sampling
    assert (s.temperature, s.top_k, s.top_p, s.stop, s.seed, s.ignore_eos, s.max_new_tokens) == \
        (0.0, 5, 0.9, ["END"], 7, True, 8)
    assert dec.sampling == s
    assert out["usage"] == {"prompt_tokens": len(expected), "completion_tokens": 3,
                            "total_tokens": len(expected) + 3, "prompt_tokens_details": {"cached_tokens": 2}}


def test_non_stream_text_defaults(gw, tiny_model_path):
    base, prefill, decode_, encoder = gw
    resp = _chat(base, tiny_model_path, "Hi", max_tokens=2)  # legacy max_tokens
    assert resp.status_code == 200
    out = resp.json()
    assert out["choices"][0]["message"]["content"] == "The cat"
    assert out["choices"][0]["finish_reason"] == "length"
    assert "token_ids" not in out["choices"][0] and "prompt_token_ids" not in out
    assert encoder.calls == []
    (dec,) = decode_.messages(DecodeRequest)
    assert dec.sampling.temperature == 1.0 and dec.sampling.top_k == -1 and dec.sampling.max_new_tokens == 2
    # No max tokens given: the rest of the context.
    _chat(base, tiny_model_path, "Hi")
    assert decode_.messages(DecodeRequest)[-1].sampling.max_new_tokens == CONTEXT - dec.prompt_len


def _sse(resp) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_stream_shape(gw, tiny_model_path, photo_paths):
    base = gw[0]
    body = {"model": tiny_model_path, "messages": [{"role": "user", "content": _photo_content(photo_paths["coffee"])}],
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "max_completion_tokens": 10}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks[0]["prompt_token_ids"]) > 100
    # The fake decode sends its three tokens at once, so they may come as fewer chunks (queued outputs merge).
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert "".join(contents) == "".join(REPLY) and all(contents)
    ids = [c["choices"][0]["token_ids"] for c in chunks[1:-2]]
    assert sum(ids, []) == REPLY_IDS
    assert [TOKENIZER.decode(i) for i in ids] == contents
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] == len(chunks[0]["prompt_token_ids"])


def test_queued_outputs_merge_up_to_a_finish_or_an_error():
    from epdserve.frontend.scheduler_client import OutputRoute

    async def scenario():
        route = OutputRoute()
        for i, finish in ((1, None), (2, None), (3, "length"), (4, None)):
            route.put(TokenOutput("r", [i], finish, completion_tokens=i))
        first = await route.take(1.0)
        assert (first.token_ids, first.finish_reason, first.completion_tokens) == ([1, 2, 3], "length", 3)
        assert (await route.take(1.0)).token_ids == [4]  # nothing merges past a finish
        route.put(TokenOutput("r", [5]))
        route.put(StageError("decode went down", 503))
        assert (await route.take(1.0)).token_ids == [5]  # the outputs before an error still go out
        with pytest.raises(StageError):
            await route.take(1.0)
        with pytest.raises(TimeoutError):
            await route.take(0.05)
        later = asyncio.get_running_loop().call_later(0.05, route.put, TokenOutput("r", [6]))
        assert (await route.take(5.0)).token_ids == [6]  # a waiting take wakes on a put
        later.cancel()

    asyncio.run(scenario())


def test_stream_without_usage(gw, tiny_model_path):
    with httpx.stream("POST", f"{gw[0]}/v1/chat/completions", timeout=30,
                      json={"model": tiny_model_path, "messages": [{"role": "user", "content": "x"}],
                            "stream": True}) as resp:
        events = _sse(resp)
    assert events[-1] == "[DONE]"
    assert all("usage" not in c and "token_ids" not in c["choices"][0] for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


# How long client pools keep an idle connection for reuse: httpx's default (also the openai SDK's) and aiohttp's
# (TCPConnector's keepalive_timeout; SGLang's bench_serving, epdserve bench).
CLIENT_POOL_IDLE_S = {"httpx": httpx.Limits().keepalive_expiry, "aiohttp": 15.0}


def test_keep_alive_outlasts_client_pools():
    """The gateway closes an idle connection well after any common client pool stops reusing it: a pool starts its
    clock later than the server (once it has closed the response), so equal timeouts race."""
    keep_alive = server_config(None, "127.0.0.1", 0).timeout_keep_alive
    for client, idle_s in CLIENT_POOL_IDLE_S.items():
        assert keep_alive >= 2 * idle_s, f"{client} pools reuse connections idle for up to {idle_s} s"


def test_idle_connection_is_still_served_when_a_client_pool_reuses_it(gw):
    """The benchmark's ReadErrors: a loaded httpx pool handed out a connection idle for nearly its own 5 s expiry
    (counted from its close of the last response, late) and wrote the request just as uvicorn's 5 s keep-alive timer
    closed it; the request was never read (no response, connection reset). Reusing a connection idle for httpx's
    expiry plus half a second of client lag must get an answer."""
    url = httpx.URL(gw[0])
    request = f"GET /health HTTP/1.1\r\nHost: {url.host}\r\n\r\n".encode()
    with socket.create_connection((url.host, url.port), timeout=5) as sock:
        sock.sendall(request)
        assert _read_head(sock).startswith(b"HTTP/1.1 200")
        time.sleep(CLIENT_POOL_IDLE_S["httpx"] + 0.5)
        try:
            sock.sendall(request)
            head = _read_head(sock)
        except ConnectionError as e:
            head = repr(e).encode()
        assert head.startswith(b"HTTP/1.1 200"), f"the gateway closed the idle connection: {head!r}"


def _read_head(sock: socket.socket) -> bytes:
    """A response's status line and headers (``/health`` answers 200 with no body); b"" if the server closed."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_request_errors(gw, tiny_model_path):
    base = gw[0]
    url = f"{base}/v1/chat/completions"
    r = _chat(base, "gpt-4o")
    assert r.status_code == 404 and _error(r)["code"] == "model_not_found"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in _error(r)["message"]
    r = httpx.post(url, json={"model": tiny_model_path})
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    r = _chat(base, tiny_model_path, [{"type": "input_audio", "input_audio": {}}])
    assert r.status_code == 400
    r = _chat(base, tiny_model_path, n=17)  # over the default --max-n
    assert r.status_code == 400 and "--max-n" in _error(r)["message"]
    r = _chat(base, tiny_model_path, temperature=-1)
    assert r.status_code == 400
    for bad_url, why in [("data:image/png;base64,!!!", "base64"), ("data:image/png;base64", "malformed"),
                         ("http://example.com/a.png", "remote"), ("file:///etc/passwd", "disabled")]:
        r = _chat(base, tiny_model_path, [{"type": "image_url", "image_url": {"url": bad_url}}])
        assert r.status_code == 400 and why in _error(r)["message"], (bad_url, r.text)
    # Valid base64, but not an image: the gateway finds no image header in it (400 with PIL's reason).
    r = _chat(base, tiny_model_path, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert r.status_code == 400 and "cannot decode image" in _error(r)["message"]
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and _error(r)
    # ... and the server still serves.
    assert _chat(base, tiny_model_path).status_code == 200


def test_context_length(gw, tiny_model_path, photo_paths):
    base, prefill, decode_, encoder = gw
    r = _chat(base, tiny_model_path, "hello " * 5000)
    assert r.status_code == 400
    msg = _error(r)["message"]
    assert str(CONTEXT) in msg and "prompt has" in msg
    r = _chat(base, tiny_model_path, _photo_content(photo_paths["chelsea"]), max_completion_tokens=CONTEXT)
    assert r.status_code == 400 and str(CONTEXT) in _error(r)["message"]
    # The image was already encoded: prefill is told to drop its embeddings.
    rid = encoder.calls[-1][0]
    assert _wait_for(lambda: any(m.rid == rid for m in prefill.messages(AbortRequest)))
    assert prefill.messages(PrefillRequest) == []


def test_image_request_reaches_prefill_before_the_encoder_answers(gw, tiny_model_path, photo_paths):
    """The gateway knows an image's hash, token count and grid from its bytes and header, so prefill and decode
    get the request while the encoder still works; the answer waits for the encoder's agreement."""
    base, prefill, decode_, encoder = gw
    encoder.hold.clear()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_chat, base, tiny_model_path, _photo_content(photo_paths["chelsea"]))
        assert _wait_for(lambda: prefill.messages(PrefillRequest))
        (req,) = prefill.messages(PrefillRequest)
        assert [m.rid for m in decode_.messages(DecodeRequest)] == [req.rid]
        time.sleep(0.2)
        assert not answer.done()  # held by the encoder
        encoder.hold.set()
        r = answer.result(30)
    assert r.status_code == 200, r.text
    data = photo_paths["chelsea"].read_bytes()
    (span,) = req.images
    assert span.image_hash == hashlib.sha256(data).hexdigest()
    from PIL import Image

    expected = _encoded(encoder.processor, Image.open(photo_paths["chelsea"]).convert("RGB"))
    assert (span.length, span.grid_thw) == (expected.num_tokens, expected.grid_thw)


def _chat_after_dispatch(base, model, prefill, encoder, content):
    """``_chat``, with the encoder's answer held until prefill has one more request: otherwise the encoder can
    fail before the gateway sends anything ahead, and there is nothing to drop."""
    sent = len(prefill.messages(PrefillRequest))
    encoder.hold.clear()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_chat, base, model, content)
        assert _wait_for(lambda: len(prefill.messages(PrefillRequest)) > sent)
        encoder.hold.set()
        return answer.result(30)


def test_encoder_failure_after_dispatch_aborts_the_request(gw, tiny_model_path, photo_paths):
    """An image whose header reads but whose pixels do not (truncated) passes the gateway and fails at the
    encoder: 400 with the encoder's message, and prefill and decode drop the request sent ahead."""
    base, prefill, decode_, encoder = gw
    data = photo_paths["chelsea"].read_bytes()
    data = data[:len(data) // 2]
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    # Held until prefill has the request: otherwise the encoder can fail first, and nothing is sent ahead.
    r = _chat_after_dispatch(base, tiny_model_path, prefill, encoder,
                             [{"type": "image_url", "image_url": {"url": url}}])
    assert r.status_code == 400 and "cannot be decoded" in _error(r)["message"]
    (req,) = prefill.messages(PrefillRequest)
    for stage in (prefill, decode_):
        assert _wait_for(lambda: req.rid in [m.rid for m in stage.messages(AbortRequest)]), stage.role
    # An encoder that counts the image's tokens differently than the gateway: 500, and the request is dropped.
    encoder.extra_tokens = 4
    r = _chat_after_dispatch(base, tiny_model_path, prefill, encoder, _photo_content(photo_paths["chelsea"]))
    assert r.status_code == 500 and "the gateway expected" in _error(r)["message"]
    rid = prefill.messages(PrefillRequest)[-1].rid
    assert rid != req.rid
    for stage in (prefill, decode_):
        assert _wait_for(lambda: rid in [m.rid for m in stage.messages(AbortRequest)]), stage.role
    encoder.extra_tokens = 0
    assert _chat(base, tiny_model_path, _photo_content(photo_paths["chelsea"])).status_code == 200


def test_stage_error(gw, tiny_model_path):
    base, prefill, decode_, _ = gw
    decode_.script = error_script
    r = _chat(base, tiny_model_path)
    assert r.status_code == 500 and "KV transfer failed" in _error(r)["message"]
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30,
                      json={"model": tiny_model_path, "messages": [{"role": "user", "content": "x"}],
                            "stream": True}) as resp:
        events = _sse(resp)
    assert events[-1] == "[DONE]"
    assert "KV transfer failed" in events[-2]["error"]["message"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_abort_on_client_disconnect(gw, tiny_model_path, stream):
    base, prefill, decode_, _ = gw
    decode_.script = hang_script
    body = {"model": tiny_model_path, "messages": [{"role": "user", "content": "x"}], "stream": stream}
    if stream:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as resp:
            for line in resp.iter_lines():  # hang up mid-stream, after the first token
                if '"content":"The"' in line:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=1.0)
    (dec,) = decode_.messages(DecodeRequest)
    for stage in (prefill, decode_):
        assert _wait_for(lambda: dec.rid in [m.rid for m in stage.messages(AbortRequest)]), stage.role


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_stop_string_ends_response_and_aborts_decode(gw, tiny_model_path, stream):
    """The gateway matches stop strings: the text ends before the stop string, finish_reason is "stop", usage
    counts the tokens up to the one that completed it, and prefill and decode get an AbortRequest (the fake decode
    never finishes the request on its own)."""
    base, prefill, decode_, _ = gw
    decode_.script = stop_script
    ids = _ids(STOP_TEXT)
    n = next(k for k in range(1, len(ids) + 1) if "blue" in TOKENIZER.decode(ids[:k]))
    assert n % 3 != 0  # the stop string completes inside a TokenOutput: the ids after it in that output are dropped
    body = {"model": tiny_model_path, "messages": [{"role": "user", "content": "x"}], "stop": ["blue"],
            "return_token_ids": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as resp:
            events = _sse(resp)
        assert events[-1] == "[DONE]"
        chunks = events[1:-1]
        finish = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
        assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "stop"
        content = chunks[:chunks.index(finish[0])]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in content)
        token_ids = [t for c in content for t in c["choices"][0]["token_ids"]]
        usage = chunks[-1]["usage"]
    else:
        out = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()
        assert out["choices"][0]["finish_reason"] == "stop"
        text, token_ids, usage = out["choices"][0]["message"]["content"], out["choices"][0]["token_ids"], out["usage"]
    assert text == "The cup is "
    assert token_ids == ids[:n] and usage["completion_tokens"] == n
    (dec,) = decode_.messages(DecodeRequest)
    for stage in (prefill, decode_):
        assert _wait_for(lambda: dec.rid in [m.rid for m in stage.messages(AbortRequest)]), stage.role


def test_a_choice_ending_at_a_stop_string_stops_its_own_fork(gw, tiny_model_path):
    """n = 2: choice 1's text hits the stop string, choice 0's never does and runs to its length. Choice 1 ends at
    once with "stop", decode gets an AbortRequest for its fork alone (index 1) while choice 0 still runs, and prefill
    gets none; choice 0 then finishes with the whole text."""
    base, prefill, decode_, _ = gw
    stop_ids, plain_ids = _ids(STOP_TEXT), _ids("The cup is red. The table")

    def script(req):
        outs = []
        for i in range(0, max(len(stop_ids), len(plain_ids)), 3):
            for index, ids in ((1, stop_ids), (0, plain_ids)):
                if i < len(ids):
                    end = min(i + 3, len(ids))
                    outs.append(TokenOutputBatch([TokenOutput(
                        req.rid, ids[i:end], "length" if index == 0 and end == len(ids) else None,
                        prompt_tokens=req.prompt_len, completion_tokens=end, index=index,
                        last=index == 0 and end == len(ids))]))
        return outs

    decode_.script = script
    body = {"model": tiny_model_path, "messages": [{"role": "user", "content": "x"}], "stop": ["blue"], "n": 2,
            "max_completion_tokens": len(plain_ids)}
    out = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()
    by = {c["index"]: c for c in out["choices"]}
    assert by[1]["finish_reason"] == "stop" and by[1]["message"]["content"] == "The cup is "
    assert by[0]["finish_reason"] == "length" and by[0]["message"]["content"] == "The cup is red. The table"
    (dec,) = decode_.messages(DecodeRequest)
    assert _wait_for(lambda: [(m.rid, m.index) for m in decode_.messages(AbortRequest)] == [(dec.rid, 1)])
    time.sleep(0.2)  # nothing else comes: the request finished, so no whole-request abort either
    assert [(m.rid, m.index) for m in decode_.messages(AbortRequest)] == [(dec.rid, 1)]
    assert not prefill.messages(AbortRequest)


def test_concurrent_requests(gw, tiny_model_path):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: _chat(gw[0], tiny_model_path, f"q{i}"), range(8)))
    assert all(r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The cat!"
               for r in results)
    assert len({r.json()["id"] for r in results}) == 8


def test_openai_client(gw, tiny_model_path, photo_paths):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{gw[0]}/v1", api_key="EMPTY")
    assert [m.id for m in client.models.list()] == [tiny_model_path]
    messages = [{"role": "user", "content": _photo_content(photo_paths["chelsea"])}]
    out = client.chat.completions.create(model=tiny_model_path, messages=messages, max_completion_tokens=16)
    assert out.choices[0].message.content == "The cat!" and out.usage.total_tokens > 3
    stream = client.chat.completions.create(model=tiny_model_path, messages=messages, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The cat!"
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=messages)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=tiny_model_path, messages=messages, max_completion_tokens=10**6)


def test_api_key_name_and_image_limit(tiny_model_path, processor, stage_servers, photo_paths):
    prefill, decode_ = stage_servers
    config = GatewayConfig(model_path=tiny_model_path, prefill_addr=prefill.addr, decode_addr=decode_.addr,
                           api_key="sekret", served_model_name="tiny", max_image_bytes=1000)
    with running_gateway(config, StageClient(config, encoder=FakeEncoder(processor))) as base:
        url = f"{base}/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.get(f"{base}/health").status_code == 200  # health needs no key
        r = httpx.post(url, json=body)
        assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{base}/v1/models").status_code == 401
        auth = {"Authorization": "Bearer sekret"}
        assert httpx.post(url, json=body, headers=auth).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        r = httpx.post(url, headers=auth, json={**body, "model": tiny_model_path})
        assert r.status_code == 404
        big = {**body, "messages": [{"role": "user", "content": _photo_content(photo_paths["chelsea"])}]}
        r = httpx.post(url, json=big, headers=auth)
        assert r.status_code == 413 and "1000" in _error(r)["message"]


def test_health_503_until_stages_answer(tiny_model_path, processor):
    # The stages come up 1.5 s after the gateway: /health is 503 until they answer, chat is 503 meanwhile.
    prefill, decode_ = FakeStage("prefill", delay_s=1.5), FakeStage("decode", delay_s=1.5)
    config = GatewayConfig(model_path=tiny_model_path, prefill_addr=prefill.addr, decode_addr=decode_.addr)
    app = create_app(config, StageClient(config, encoder=FakeEncoder(processor)), startup_timeout_s=30)
    from fastapi.testclient import TestClient

    try:
        with TestClient(app) as client:
            assert client.get("/health").status_code == 503
            r = client.post("/v1/chat/completions",
                            json={"model": tiny_model_path, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503
            assert _wait_for(lambda: client.get("/health").status_code == 200, 30)
            r = client.post("/v1/chat/completions",
                            json={"model": tiny_model_path, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The cat!"
    finally:
        prefill.stop()
        decode_.stop()


def test_wrong_role_fails_startup():
    prefill, decode_ = FakeStage("decode"), FakeStage("decode")  # two decode servers: a misconfiguration
    config = GatewayConfig(prefill_addr=prefill.addr, decode_addr=decode_.addr)

    async def run():
        stages = StageClient(config, encoder=FakeEncoder(None))
        try:
            with pytest.raises(StageError, match="expected 'prefill'"):
                await stages.start(timeout_s=10)
        finally:
            await stages.close()

    try:
        asyncio.run(run())
    finally:
        prefill.stop()
        decode_.stop()


# ---------------------------------------------------------------------------------------------------- gRPC

def test_grpc_encoder_client():
    """The real gRPC client against a scripted server: results parse, INVALID_ARGUMENT -> 400, down -> 503."""
    import grpc

    from epdserve.frontend.encoder_client import GrpcEncoderClient
    from epdserve.proto import encoder_pb2 as pb2, encoder_pb2_grpc as pb2_grpc

    seen = []

    class Servicer(pb2_grpc.EncoderServicer):
        def Encode(self, request, context):
            seen.append((request.request_id, [i.data for i in request.images], list(request.targets)))
            if any(i.data == b"bad" for i in request.images):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "image 0 cannot be decoded")
            return pb2.EncodeResponse(request_id=request.request_id, images=[
                pb2.ImageResult(image_hash=hashlib.sha256(i.data).hexdigest(), num_tokens=4, grid_thw=[1, 4, 4])
                for i in request.images])

    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    pb2_grpc.add_EncoderServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def run():
        client = GrpcEncoderClient(f"127.0.0.1:{port}")
        try:
            await client.wait_ready(10)
            out = await client.encode("r1", [b"a", b"b"], EMBED_ENDPOINTS)
            assert out == [EncodedImage(hashlib.sha256(d).hexdigest(), 4, [1, 4, 4]) for d in (b"a", b"b")]
            with pytest.raises(StageError) as e:
                await client.encode("r2", [b"bad"], [])
            assert e.value.status == 400 and "cannot be decoded" in e.value.message
            server.stop(None).wait()
            with pytest.raises(StageError) as e:
                await client.encode("r3", [b"a"], [])
            assert e.value.status == 503
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(None)
    assert seen[0] == ("r1", [b"a", b"b"], EMBED_ENDPOINTS)


def test_max_new_tokens_budget(builder):
    from types import SimpleNamespace

    from epdserve.frontend.chat import ChatService
    from epdserve.frontend.errors import APIError
    from epdserve.frontend.openai.protocol import ChatCompletionRequest

    def budget(default, **kw):
        svc = ChatService(SimpleNamespace(context_length=100), builder, "m", MediaPolicy(max_bytes=1), default)
        try:
            req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)
            return svc._max_new_tokens(req.requested_max_tokens(), 60, "messages", "max_completion_tokens")
        finally:
            svc.close()

    assert budget(0) == 40  # the rest of the context
    assert budget(16) == 16 and budget(64) == 40  # the server default, clipped to the context
    assert budget(0, max_tokens=10, max_completion_tokens=30) == 30  # the current name wins
    assert budget(0, max_completion_tokens=40) == 40
    with pytest.raises(APIError, match="41 completion tokens"):
        budget(0, max_completion_tokens=41)
