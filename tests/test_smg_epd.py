"""smg's own EPD mode in front of epdserve (issue 29): ``smg launch --epd-disaggregation --encode grpc://ENCODER
BOOTSTRAP_PORT`` (two epdserve encoders with ``--bootstrap-port``) ``--prefill grpc://... --decode grpc://...``
(``--grpc-protocol tokenspeed``) ``--encode-policy consistent_hashing``, started by tests/smg_cluster.py (``epd``).

smg applies the chat template, tokenizes and preprocesses each image itself, sends its pixels to the encoder its
consistent hashing picks (``TokenSpeedEncoder/Encode`` with a bootstrap room) and the prompt to prefill and decode
(TokenSpeed's ``Generate``); the prefill front claims each room on the encoder's bootstrap port and the encoder
pushes the embedding to the prefill's TP ranks.

Checks: the parity prompts (text, one photo, two photos, two turns) through the official openai client equal
transformers' generate() (greedy, token for token), streaming and not; a repeated image is looked up on the same
encoder and hits its cache there; afterwards the encoders hold no room and prefill and decode are at rest. Over
gRPC without smg: a bad item is INVALID_ARGUMENT, and a room nobody claims is dropped after ``--room-timeout-s``.
The model is the tiny Qwen3-VL (smg 1.13 cannot send Qwen2/2.5-VL images to gRPC workers; tests/test_smg_grpc.py).
Skipped when smg is not installed.
"""

from __future__ import annotations

import secrets
import time

import grpc
import pytest

from conftest import hf_reference_model
from epdserve.proto import encoder_pb2, encoder_pb2_grpc
from smg_cluster import smg_executable, start_cluster, wait_at_rest
from test_e2e import _openai_messages
from test_smg_grpc import CASES, _turns, assert_openai_parity

pytestmark = pytest.mark.skipif(smg_executable() is None, reason="smg is not installed")
_proto = pytest.importorskip("smg_grpc_proto")

NEW_TOKENS = 16
TIMEOUT_S = 20.0  # the stages' --request-timeout-s (how long a prefill waits for a room's encode)
ROOM_TIMEOUT_S = 15.0  # the encoders' --room-timeout-s


@pytest.fixture(scope="module")
def cluster(tiny_qwen3_vl_path, tmp_path_factory):
    c = start_cluster(tiny_qwen3_vl_path, tmp_path_factory.mktemp("smg-epd"), encoders=2, prefills=1, decodes=1,
                      policy=None, request_timeout_s=TIMEOUT_S, epd=True,
                      encoder_args=("--room-timeout-s", str(ROOM_TIMEOUT_S)))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def hf3(tiny_qwen3_vl_path):
    return hf_reference_model(tiny_qwen3_vl_path, "Qwen3VLForConditionalGeneration")


def _encoders(cluster) -> list[str]:
    return [s.grpc for name, s in cluster.servers.items() if name.startswith("encoder")]


def _encoder_stats(cluster) -> dict[str, encoder_pb2.GetServerInfoResponse]:
    """Each encoder's GetServerInfo (cache entries, hits, misses), by its gRPC address."""
    out = {}
    for addr in _encoders(cluster):
        with grpc.insecure_channel(addr) as ch:
            out[addr] = encoder_pb2_grpc.EncoderStub(ch).GetServerInfo(encoder_pb2.GetServerInfoRequest(), timeout=30)
    return out


def _rooms(addr: str) -> int:
    """Bootstrap rooms an encoder holds (its TokenSpeed ``GetLoads``: rooms count as waiting)."""
    pb, pb_grpc = _proto.tokenspeed_scheduler_pb2, _proto.tokenspeed_scheduler_pb2_grpc
    with grpc.insecure_channel(addr) as ch:
        return pb_grpc.TokenSpeedSchedulerStub(ch).GetLoads(pb.GetLoadsRequest(), timeout=30).loads[0].num_waiting_reqs


def _wait(cond, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {within_s} s")
        time.sleep(0.2)


@pytest.mark.parametrize("case", list(CASES))
def test_openai_client_through_smg_epd_matches_transformers(cluster, hf3, tiny_qwen3_vl_path, photo_paths, case):
    openai = pytest.importorskip("openai")
    assert_openai_parity(openai, cluster.url, tiny_qwen3_vl_path, hf3, _turns(case, photo_paths))


def test_repeated_images_hit_the_same_encoders_cache(cluster, tiny_qwen3_vl_path, photo_paths):
    """smg's consistent hashing sends an image to the same encoder every time, so the first request's images are
    each looked up once on one encoder (a miss is encoded and cached there), and asking again is all cache hits on
    exactly those encoders: each encoder hits as often as it was asked before, and encodes nothing new."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="EMPTY", max_retries=0)
    photos = list(photo_paths.values())[:4]

    def ask(text: str) -> dict[str, encoder_pb2.GetServerInfoResponse]:
        messages = _openai_messages([("user", [*photos, text])])
        client.chat.completions.create(model=tiny_qwen3_vl_path, messages=messages, temperature=0,
                                       max_completion_tokens=2)
        return _encoder_stats(cluster)

    before = _encoder_stats(cluster)
    first = ask("What is in these pictures?")
    looked_up = {a: first[a].cache_hits + first[a].cache_misses - before[a].cache_hits - before[a].cache_misses
                 for a in first}
    assert sum(looked_up.values()) == len(photos), looked_up
    for a in first:
        assert first[a].cache_entries - before[a].cache_entries == first[a].cache_misses - before[a].cache_misses
    second = ask("And now, in one word?")  # another prompt, the same images
    for a in first:
        assert second[a].cache_hits - first[a].cache_hits == looked_up[a], (a, looked_up)
        assert second[a].cache_misses == first[a].cache_misses, a
        assert second[a].cache_entries == first[a].cache_entries, a


def test_every_stage_back_at_baseline(cluster):
    """After the requests above: no encoder holds a room, prefill and decode hold no request, room or KV page."""
    for addr in _encoders(cluster):
        _wait(lambda: _rooms(addr) == 0, 30, f"encoder {addr} still holds rooms")
    wait_at_rest(cluster, ["prefill0", "decode0"], 30)


def _item(hf3, photo, length_delta: int = 0):
    """A TokenSpeed ``MultimodalItem`` of ``photo`` as smg sends an encoder one: this processor's patches and
    grid, a placeholder run of the grid's token count (plus ``length_delta``), a random content hash."""
    import numpy as np

    processor, model = hf3
    pb = _proto.tokenspeed_scheduler_pb2
    from PIL import Image

    out = processor.image_processor(images=[Image.open(photo).convert("RGB")], return_tensors="pt")
    pixels, grid = out["pixel_values"].float().numpy(), out["image_grid_thw"].numpy().astype(np.int64)
    tokens = int(grid.prod()) // 4
    return pb.MultimodalItem(
        modality=1, content_hash=secrets.token_bytes(32),
        encoder_input=pb.TensorData(shape=list(pixels.shape), dtype="float32", inline=pixels.tobytes()),
        model_specific_tensors={"image_grid_thw": pb.TensorData(shape=[1, 3], dtype="int64", inline=grid.tobytes())},
        placeholders=[pb.PlaceholderRange(offset=0, length=tokens + length_delta)],
        placeholder_token_id=model.config.image_token_id)


def _encode(addr: str, item, room: int):
    enc_pb, enc_grpc = _proto.tokenspeed_encoder_pb2, _proto.tokenspeed_encoder_pb2_grpc
    mm = _proto.tokenspeed_scheduler_pb2.MultimodalInputs(items=[item])
    request = enc_pb.EncodeRequest(request_id=f"test-{room}", mm_inputs=mm,
                                   items=[enc_pb.EncodeItemAssignment(bootstrap_room=room)])
    with grpc.insecure_channel(addr) as ch:
        return enc_grpc.TokenSpeedEncoderStub(ch).Encode(request, timeout=60)


def test_bad_items_are_invalid_argument(cluster, hf3, photo_paths):
    addr = _encoders(cluster)[0]
    with pytest.raises(grpc.RpcError) as e:
        _encode(addr, _item(hf3, photo_paths["chelsea"], length_delta=1), secrets.randbits(62))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "placeholder tokens" in e.value.details()
    item = _item(hf3, photo_paths["chelsea"])
    item.encoder_input.shape[0] -= 4  # patches that do not fill the grid
    with pytest.raises(grpc.RpcError) as e:
        _encode(addr, item, secrets.randbits(62))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "values for shape" in e.value.details()
    assert _rooms(addr) == 0


def test_unclaimed_room_expires(cluster, hf3, photo_paths):
    """A room no prefill ever claims (smg gave the request up) is dropped after --room-timeout-s."""
    addr = _encoders(cluster)[1]
    assert _encode(addr, _item(hf3, photo_paths["rocket"]), secrets.randbits(62)).accepted
    assert _rooms(addr) == 1
    _wait(lambda: _rooms(addr) == 0, ROOM_TIMEOUT_S + 10, "the unclaimed room was not dropped")


def test_abort_while_waiting_for_a_room_frees_everything(cluster, hf3, photo_paths):
    """A prefill leg whose image's encode never comes waits for its room; ``Abort`` ends it at once with
    ``finish_reason`` "abort", the prefill gives the room up at the encoder (whose late Encode then holds nothing)
    and nothing stays at prefill."""
    import threading

    pb, pb_grpc = _proto.tokenspeed_scheduler_pb2, _proto.tokenspeed_scheduler_pb2_grpc
    tok = hf3[0].tokenizer
    item = _item(hf3, photo_paths["coffee"])
    n = item.placeholders[0].length
    head = tok("Look:").input_ids
    ids = head + [hf3[1].config.image_token_id] * n + tok(" what is it?").input_ids
    item.placeholders[0].offset = len(head)
    bare = pb.MultimodalItem()
    bare.CopyFrom(item)
    bare.ClearField("encoder_input")  # smg sends the prefill no pixels
    enc, room, rid = _encoders(cluster)[0], secrets.randbits(62), f"test-{secrets.token_hex(6)}"
    boot = cluster.servers[enc_name(cluster, enc)].bootstrap_port
    request = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=False,
        sampling_params=pb.SamplingParams(temperature=0, max_new_tokens=4), mm_inputs=pb.MultimodalInputs(items=[bare]),
        encode_bootstrap_info=pb.EncodeBootstrapInfo(items=[pb.EncodeItemBootstrapInfo(
            item_index=0, bootstrap_host="127.0.0.1", bootstrap_port=boot, bootstrap_room=room)]),
        kv_bootstrap_info=pb.KvBootstrapInfo(bootstrap_host="127.0.0.1",
                                             bootstrap_port=cluster.servers["prefill0"].bootstrap_port,
                                             bootstrap_room=secrets.randbits(62)))
    out = {}
    with grpc.insecure_channel(cluster.servers["prefill0"].grpc) as ch:
        stub = pb_grpc.TokenSpeedSchedulerStub(ch)
        runner = threading.Thread(target=lambda: out.update(r=list(stub.Generate(request, timeout=60))))
        runner.start()
        _wait(lambda: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).active_requests == 1, 10,
              "the Generate did not start")
        started = time.monotonic()
        assert stub.Abort(pb.AbortRequest(request_id=rid, reason="test"), timeout=10).success
        runner.join(timeout=30)
        assert time.monotonic() - started < TIMEOUT_S / 2  # not the room wait's timeout
    assert [r.complete.finish_reason for r in out["r"] if r.HasField("complete")] == ["abort"]
    assert _encode(enc, item, room).accepted  # the Encode comes late: the room was given up, nothing is held
    _wait(lambda: _rooms(enc) == 0, 10, "the given-up room is held")
    wait_at_rest(cluster, ["prefill0"], 30)


def enc_name(cluster, addr: str) -> str:
    return next(name for name, s in cluster.servers.items() if s.grpc == addr and name.startswith("encoder"))


def test_info_rpcs_answer_what_smg_reads(cluster, tiny_qwen3_vl_path):
    """TokenSpeed's discovery RPCs on every role: healthy, the model and the pixel dtype smg sends (the tower's:
    float32 on the CPU), the role (``disaggregation_mode``) and, on the encoder, its bootstrap port; the tokenizer
    files as a ZIP."""
    import io
    import zipfile

    pb, pb_grpc = _proto.tokenspeed_scheduler_pb2, _proto.tokenspeed_scheduler_pb2_grpc
    common = _proto.generated.common_pb2
    for name, role in (("encoder0", "encode"), ("prefill0", "prefill"), ("decode0", "decode")):
        with grpc.insecure_channel(cluster.servers[name].grpc) as ch:
            stub = pb_grpc.TokenSpeedSchedulerStub(ch)
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).healthy, name
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.model_path == tiny_qwen3_vl_path and info.multimodal_encoder_dtype == "float32", name
            assert list(info.supported_modalities) == [1] and info.supports_multimodal
            args = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args
            assert args["disaggregation_mode"] == role, name
            if role != "decode":
                assert int(args["disaggregation_bootstrap_port"]) == cluster.servers[name].bootstrap_port
            data = b"".join(c.data for c in stub.GetTokenizer(common.GetTokenizerRequest(), timeout=10))
            assert "tokenizer.json" in zipfile.ZipFile(io.BytesIO(data)).namelist(), name
