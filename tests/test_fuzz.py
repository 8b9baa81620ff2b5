"""Property-based fuzzing of every way in, with the real stage processes behind (tiny model, CPU).

- >= 500 generated bad requests to the gateway's chat endpoint (mutated valid requests, random JSON, bytes that
  are not JSON, broken and hostile images): every answer is 200 or a documented error (400, 404, 413, 429, 503,
  504) in OpenAI's error shape, never another 5xx.
- Garbage to every ZeroMQ port (prefill requests, embeddings, bootstrap; decode requests, KV): random frames,
  every message kind with random field values, and type-correct messages with hostile values. No stage dies.
- Malformed, oversized and hostile protobuf to the encoder: a gRPC status, never a crash, nothing left in flight.

After each, the servers are alive and a greedy request still gives the tokens it gave before, which are also
transformers' ``generate()`` tokens.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import time

import msgpack
import pytest
import torch
import zmq
from cluster import body, noise_png, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epdserve.wire import messages

DOCUMENTED = {200, 400, 404, 413, 429, 503, 504}
GOOD_TEXT = "Tell me about the sea."
GOOD_TOKENS = 12


@pytest.fixture(scope="module")
def client(stage_procs, tiny_model_path):
    """An in-process gateway (ASGI test client) on the real stages; completions default to 4 tokens."""
    from fastapi.testclient import TestClient

    from epdserve.gateway.app import create_app

    config = stage_procs.gateway_config(stage_timeout_s=10.0, max_tokens_default=4, max_image_bytes=1 << 20)
    with TestClient(create_app(config, startup_timeout_s=120)) as c:
        assert wait_for(lambda: c.get("/health").status_code == 200, 120)
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """transformers' greedy ids for GOOD_TEXT (EOS ignored), via the end-to-end tests' helper."""
    import torch
    from test_e2e import _hf_reference
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    _, ids, _ = _hf_reference((processor, model), [("user", [GOOD_TEXT])], new_tokens=GOOD_TOKENS)
    return ids


def _assert_still_good(client, model, reference) -> None:
    r = client.post("/v1/chat/completions", json=body(model, GOOD_TEXT, max_tokens=GOOD_TOKENS))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference


# ---------------------------------------------------------------------------------------------- HTTP requests

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12)


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _bomb_png(w: int, h: int) -> bytes:
    """A PNG header claiming ``w`` x ``h`` pixels with almost no data (a decompression bomb)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def _gif_animated() -> bytes:
    from PIL import Image

    frames = [Image.new("RGB", (16, 16), (i * 40, 0, 0)) for i in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    return buf.getvalue()


_image_bytes = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda b, n: b[:n], st.just(_png(40, 30)), st.integers(0, 200)),  # truncated PNG
    st.builds(_png, st.integers(1, 3), st.integers(1, 3)),  # tiny (valid)
    st.builds(_png, st.just(1), st.integers(201, 400)),  # aspect ratio the processor refuses
    st.builds(_bomb_png, st.integers(10_000, 60_000), st.integers(10_000, 60_000)),
    st.just(_gif_animated()),
    st.builds(lambda b: b"\x89PNG\r\n\x1a\n" + b, st.binary(max_size=100)),  # PNG magic, garbage after
)
_image_url = st.one_of(
    st.builds(lambda b: "data:image/png;base64," + base64.b64encode(b).decode(), _image_bytes),
    st.text(max_size=60),
    st.sampled_from(["data:image/png;base64,!!!", "data:,", "data:image/png;base64", "data:text/plain;base64,AA==",
                     "http://127.0.0.1:1/x.png", "file:///etc/passwd", "ftp://x/y", "data:image/png;base64," +
                     "A" * ((1 << 20) // 3 * 4 + 8)]),  # the last is past --max-image-bytes (1 MiB here)
)
_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.one_of(
        _image_url, st.fixed_dictionaries({"url": _image_url}), _json)}),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(st.text(max_size=80), _json)}),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "video_url", "", "TEXT"]), "x": _json}),
    _json,
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "", "x"]),
                           "content": st.one_of(st.text(max_size=80), st.lists(_part, max_size=3), _json)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": st.lists(st.fixed_dictionaries({
        "id": st.text(max_size=6), "function": st.fixed_dictionaries({"name": st.text(max_size=8), "arguments": (
            st.text(max_size=20) | st.just('{"a": 1}') | _json)})}) | _json, max_size=2)}),
    _json,
)
_bad_values = {
    "model": st.one_of(st.text(max_size=20), _json),
    "messages": st.one_of(st.lists(_message, max_size=3), _json),
    "temperature": st.one_of(st.floats(), st.integers(-5, 5), st.just(1e-300), _json),
    "top_p": st.one_of(st.floats(), st.integers(-2, 2), _json),
    "top_k": st.one_of(st.integers(-(2**70), 2**70), _json),
    "max_completion_tokens": st.one_of(st.integers(-(2**70), 0), st.integers(5000, 2**70), st.integers(1, 4), _json),
    "max_tokens": st.one_of(st.integers(-(2**70), 0), st.integers(5000, 2**70), _json),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5), _json),
    "stop_token_ids": st.one_of(st.lists(st.integers(-(2**70), 2**70), max_size=4), _json),
    "seed": st.one_of(st.integers(-(2**70), 2**70), _json),
    "n": st.one_of(st.integers(-3, 4), _json),
    "stream": st.one_of(st.booleans(), _json),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": _json}), _json),
    "ignore_eos": _json,
    "return_token_ids": _json,
    "logprobs": _json,
    "presence_penalty": _json,
    # tool calling: tool lists whose schemas may be anything (xgrammar must refuse, never crash), choices naming
    # tools that may not exist, and history messages carrying calls
    "tools": st.one_of(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "x"]), "function": (
        st.fixed_dictionaries({"name": st.text(max_size=8), "parameters": st.one_of(
            _json, st.just({"type": "object", "properties": {"a": {"type": "integer"}}}))}) | _json)}),
        max_size=2), _json),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "x"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=8)})}), _json),
}


@st.composite
def _bad_request(draw, model: str):
    """(path, content bytes, content type): mostly a valid request with fields mutated, sometimes random JSON or
    bytes."""
    kind = draw(st.sampled_from(["mutate"] * 6 + ["json", "bytes", "image"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200)), draw(st.sampled_from(["application/json", "text/plain", ""]))
    if kind == "json":
        return json.dumps(draw(_json)).encode(), "application/json"
    req = {"model": model, "messages": [{"role": "user", "content": "Hello?"}], "max_completion_tokens": 2}
    if kind == "image":
        req["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": draw(_image_url)}},
                                         {"type": "text", "text": "What is it?"}]
    for field in draw(st.lists(st.sampled_from(sorted(_bad_values)), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()) and field in ("model", "messages"):
            req.pop(field)
        else:
            req[field] = draw(_bad_values[field])
    return json.dumps(req, allow_nan=True).encode(), "application/json"


def test_fuzz_http_requests(client, tiny_model_path, reference):
    seen: dict[int, int] = {}

    @settings(max_examples=520, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_bad_request(tiny_model_path))
    def one(request):
        content, ctype = request
        r = client.post("/v1/chat/completions", content=content,
                        headers={"content-type": ctype} if ctype else {})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in DOCUMENTED, (content[:500], r.status_code, r.text[:500])
        if r.status_code != 200:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:300]
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.json()["object"] == "chat.completion"

    one()
    print("HTTP fuzz statuses:", dict(sorted(seen.items())))
    assert sum(seen.values()) >= 500 and seen.get(400, 0) > 250
    assert client.get("/health").status_code == 200
    _assert_still_good(client, tiny_model_path, reference)


# -------------------------------------------------------------------------------------------------- ZeroMQ

# msgpack carries ints of at most 64 bits.
_mp_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=40),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12)
_field = st.one_of(_mp_json, st.binary(max_size=20),
                   st.fixed_dictionaries({"__tensor__": st.integers(-2, 3), "dtype": st.sampled_from(
                       ["float32", "int64", "complex", ""]), "shape": st.lists(st.integers(-2, 9), max_size=5)}))


@st.composite
def _garbage(draw):
    """Frames for a ZMQ port: random bytes, random msgpack, a message kind with random field values, or a
    type-correct message with hostile values."""
    kind = draw(st.sampled_from(["bytes", "msgpack", "fields", "hostile", "deep"]))
    extra = draw(st.lists(st.binary(max_size=64), max_size=2))
    if kind == "bytes":
        return [draw(st.binary(max_size=200))] + extra
    if kind == "msgpack":
        return [msgpack.packb(draw(_mp_json))] + extra
    if kind == "deep":
        return [b"\x91" * draw(st.integers(100, 100_000)) + b"\xc0"]
    if kind == "fields":
        name = draw(st.sampled_from(sorted(messages.KINDS)))
        cls = messages.KINDS[name]
        fields = {f.name: draw(_field) for f in dataclasses.fields(cls) if draw(st.integers(0, 4))}
        return [msgpack.packb({"kind": name, **fields})] + extra
    return messages.encode(draw(_hostile()))


def _hostile():
    sampling = st.builds(messages.SamplingParams, temperature=st.floats(-1, 1e308) | st.just(1e-300),
                         top_p=st.floats(-1, 2), top_k=st.integers(-(2**63), 2**63 - 1),
                         max_new_tokens=st.integers(-5, 2**40), seed=st.none() | st.integers(-(2**63), 2**64 - 1))
    ids = st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 300), min_size=0, max_size=50)
    span = st.builds(messages.ImageSpan, offset=st.integers(-3, 60), length=st.integers(-3, 60),
                     image_hash=st.text(max_size=70) | st.just("ab" * 32),
                     grid_thw=st.lists(st.integers(-2, 10), max_size=4))
    room = st.integers(0, 2**63 - 1)
    tensor = st.builds(lambda shape, dt: torch.zeros(shape, dtype=dt), st.lists(st.integers(0, 3), min_size=1,
                       max_size=5), st.sampled_from([torch.float32, torch.int64]))
    return st.one_of(
        st.builds(messages.PrefillRequest, rid=st.text(max_size=8), input_ids=ids, images=st.lists(span, max_size=2),
                  sampling=sampling, bootstrap_room=room),
        st.builds(messages.DecodeRequest, rid=st.text(max_size=8), prompt_len=st.integers(-2, 2**40),
                  sampling=sampling, bootstrap_host=st.sampled_from(["-", ".", "127.0.0.1", "[zz]", "", "x" * 300]),
                  bootstrap_port=st.integers(-1, 70000), bootstrap_room=room),
        st.builds(messages.KVRegister, rid=st.text(max_size=8), bootstrap_room=room,
                  kv_endpoint=st.sampled_from(["tcp://-:1", "tcp://127.0.0.1:99999", "ipc:///tmp/x", "garbage", ""])),
        st.builds(messages.KVTransfer, rid=st.text(max_size=8), bootstrap_room=room,
                  first_token_id=st.integers(-(2**63), 2**63 - 1), kv=st.none() | tensor),
        st.builds(messages.ImageEmbeddings, rid=st.text(max_size=8), image_hashes=st.lists(st.text(max_size=64),
                  max_size=2), embeddings=st.lists(tensor, max_size=2)),
        st.builds(messages.AbortRequest, rid=st.text(max_size=8)),
        st.builds(messages.TokenOutput, rid=st.text(max_size=8), token_ids=st.lists(st.integers(0, 10))),
        st.just(messages.LoadRequest()), st.just(messages.ServerInfoRequest()),
    )


def test_fuzz_zmq_ports(stage_procs, client, tiny_model_path, reference):
    ctx = zmq.Context()
    p = stage_procs.ports
    targets = {"prefill": (zmq.DEALER, p["prefill"]), "embed": (zmq.PUSH, p["embed"]),
               "bootstrap": (zmq.PUSH, p["bootstrap"]), "decode": (zmq.DEALER, p["decode"]),
               "kv": (zmq.PUSH, p["kv"])}
    socks = {}
    for name, (kind, port) in targets.items():
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks[name] = sock
    sent = {name: 0 for name in socks}
    try:
        @settings(max_examples=300, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.sampled_from(sorted(socks)), _garbage())
        def one(name, frames):
            socks[name].send_multipart(frames)
            sent[name] += 1

        one()
        # Each port gets everything once more, in order, so none is left out by the draw.
        for name in socks:
            for frames in ([b""], [b"\xff" * 10], [msgpack.packb({"kind": "PrefillRequest"})],
                           [b"\x91" * 150_000 + b"\xc0"]):
                socks[name].send_multipart(frames)
        time.sleep(2.0)  # let the servers chew through it
        for name in ("encoder", "prefill", "decode"):
            assert stage_procs.alive(name), f"{name} died:\n{stage_procs.log_path(name).read_text()[-3000:]}"
        assert min(sent.values()) > 20
        assert wait_for(lambda: client.get("/health").status_code == 200, 15)
        _assert_still_good(client, tiny_model_path, reference)
    finally:
        ctx.destroy(linger=0)


# ------------------------------------------------------------------------------------------------ encoder

def test_fuzz_encoder_protobuf(stage_procs, client, tiny_model_path, reference):
    import grpc

    from epdserve.proto import encoder_pb2 as pb2

    channel = grpc.insecure_channel(stage_procs.encoder_addr, options=[
        ("grpc.max_send_message_length", 64 << 20)])
    raw = channel.unary_unary("/epdserve.v1.Encoder/Encode")  # bytes in, bytes out: no serializer
    # The encoder's documented statuses (a target not accepting is UNAVAILABLE), and the client's own deadline.
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
               grpc.StatusCode.DEADLINE_EXCEEDED}
    codes: dict[str, int] = {}

    def call(payload: bytes, timeout_s: float = 10.0) -> None:
        try:
            raw(payload, timeout=timeout_s)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            assert e.code() in allowed, (e.code(), e.details())
            codes[e.code().name] = codes.get(e.code().name, 0) + 1

    hostile = [
        pb2.EncodeRequest(),  # no images
        pb2.EncodeRequest(request_id="x", images=[pb2.Image(data=b"")]),
        pb2.EncodeRequest(request_id="x", images=[pb2.Image(data=_bomb_png(50_000, 50_000))]),
        pb2.EncodeRequest(request_id="x", images=[pb2.Image(data=_png(1, 300))]),
        pb2.EncodeRequest(request_id="x", images=[pb2.Image(data=b"\x89PNG" + b"\0" * 50)] * 300),
        pb2.EncodeRequest(images=[pb2.Image(data=_png(8, 8))], targets=["tcp://127.0.0.1:1"]),  # targets, no id
        pb2.EncodeRequest(request_id="x", images=[pb2.Image(data=_png(8, 8))], targets=["tcp://-:1", "garbage"]),
    ]
    for req in hostile:
        call(req.SerializeToString())
    # A target nobody reads: the client gives up first; the encoder must not keep the call.
    call(pb2.EncodeRequest(request_id="y", images=[pb2.Image(data=_png(9, 9))],
                           targets=["tcp://127.0.0.1:1"]).SerializeToString(), timeout_s=1.0)
    call(b"\x0a" + b"\xff" * 12)  # a length that runs past the end
    call(b"\x12\x05\x0a\x03abc" * 1000)  # 1000 images with 3-byte "files"
    call(b"\x12" + b"\xff\xff\xff\xff\x0f")  # a varint length of 4 GiB

    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=400))
    def one(payload):
        call(payload)

    one()
    # Larger than the encoder's --max-message-mb (16 here): refused before it is read.
    call(b"\x12" + b"\xff" * 5 + b"\0" * (17 << 20))
    channel.close()
    print("encoder fuzz statuses:", codes)
    assert stage_procs.alive("encoder")
    assert codes.get("RESOURCE_EXHAUSTED", 0) >= 1 and codes.get("INVALID_ARGUMENT", 0) >= 5
    d = details_of(client)
    (enc,) = d["stages"]["encoders"]
    assert enc["up"] and wait_for(lambda: not details_of(client)["stages"]["encoders"][0]["load"]["num_requests"],
                                  15)
    # A real image still encodes, and the text reference still holds.
    r = client.post("/v1/chat/completions", json=body(tiny_model_path, "And this?", image=noise_png(77)))
    assert r.status_code == 200, r.text
    _assert_still_good(client, tiny_model_path, reference)


def details_of(client) -> dict:
    return client.get("/health", params={"details": 1, "fresh": 1}).json()
