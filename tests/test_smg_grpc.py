"""epdserve's prefill and decode servers as smg's ``grpc://`` workers (SGLang's scheduler gRPC protocol on
``--grpc-port``): one encoder, one prefill and two decode servers, smg in PD mode in front of their gRPC ports
(tests/smg_cluster.py, ``grpc_workers``).

The model is the tiny Qwen3-VL: smg 1.13 cannot send Qwen2/2.5-VL images to a SGLang gRPC worker (its
``QwenVLVisionSpec`` matches any "qwen"+"vl" model id and expands an ``<image>`` token that Qwen2/2.5-VL tokenizers
lack: "image placeholder token '<image>' is missing from the tokenizer vocabulary"), while its Qwen3-VL spec expands
``<|image_pad|>`` as the model does.

Checks: through smg with the openai client, greedy answers equal transformers' generate() (text, one photo, two
photos, two turns; streaming and not); a shared-prefix benchmark (images included) fails no request; killing a
decode worker fails only requests already streaming, and every stage returns to baseline. Without smg, over gRPC:
Generate on both legs gives transformers' tokens (text and a photo), Abort and a cancelled stream free everything,
bad image metadata is INVALID_ARGUMENT, and the info RPCs answer what smg reads. Skipped without smg or
``smg-grpc-proto``.
"""

from __future__ import annotations

import json
import secrets
import threading

import pytest

from conftest import hf_reference_model
from smg_cluster import bench_killing, smg_executable, start_cluster
from smg_cluster import wait_at_rest as _wait_baseline
from test_e2e import _hf_generate, _hf_reference, _openai_messages

pytestmark = pytest.mark.skipif(smg_executable() is None, reason="smg is not installed")
_proto = pytest.importorskip("smg_grpc_proto")  # its generated modules load as attributes
pb, pb_grpc = _proto.sglang_scheduler_pb2, _proto.sglang_scheduler_pb2_grpc

NEW_TOKENS = 16
TIMEOUT_S = 15.0  # the stages' --request-timeout-s: long enough for image prefills on a busy CPU
# smg renders a message's images before its text (MediaPartOrder::MediaFirst, crates/multimodal/src/registry/
# traits.rs, as vLLM's interleave_mm_strings=false), so the parity prompts put images first, where both agree.
CASES = {
    "text": [("user", ["Tell me a story about a rocket and a cat."])],
    "one_photo": [("user", ["chelsea", "Describe this image."])],
    "two_photos": [("user", ["astronaut", "coffee", "What differs between these two pictures?"])],
    "two_turns": [("user", ["rocket", "What is this?"]), ("assistant", ["A rocket launch."]),
                  ("user", ["Where is it going?"])],
}


def _turns(case, photo_paths):
    return [(role, [photo_paths[p] if p in photo_paths else p for p in parts]) for role, parts in CASES[case]]


@pytest.fixture(scope="module")
def cluster(tiny_qwen3_vl_path, tmp_path_factory):
    c = start_cluster(tiny_qwen3_vl_path, tmp_path_factory.mktemp("smg-grpc"), encoders=1, prefills=1, decodes=2,
                      policy=None, request_timeout_s=TIMEOUT_S, smg_args=("--decode-policy", "round_robin"),
                      grpc_workers=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def hf3(tiny_qwen3_vl_path):
    return hf_reference_model(tiny_qwen3_vl_path, "Qwen3VLForConditionalGeneration")


def smg_text(tokenizer, ids: list[int]) -> str:
    """The text smg shows for ``ids``: like SGLang's and vLLM's detokenizers it holds back text that ends in U+FFFD
    (an incomplete UTF-8 sequence that later tokens may complete) and drops what is still held at the end, so the
    answer is the decoding of the longest prefix of ``ids`` whose text does not end in U+FFFD."""
    for k in range(len(ids), -1, -1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            return text
    return ""


def assert_openai_parity(openai, url: str, model: str, hf3, turns) -> None:
    """The openai client through smg at ``url``, greedy, streamed and not: text and token counts equal
    transformers' generate() on the same checkpoint (``hf3``) for the conversation ``turns``."""
    ref_prompt, ref_ids, _ = _hf_reference(hf3, turns, NEW_TOKENS)
    expected = smg_text(hf3[0].tokenizer, ref_ids)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
    kw = dict(model=model, messages=_openai_messages(turns), temperature=0,
              max_completion_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kw)
    assert resp.choices[0].message.content == expected
    assert resp.usage.completion_tokens == NEW_TOKENS and resp.usage.prompt_tokens == len(ref_prompt)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS and chunks[-1].usage.prompt_tokens == len(ref_prompt)


@pytest.mark.parametrize("case", list(CASES))
def test_openai_client_through_smg_grpc_matches_transformers(cluster, hf3, tiny_qwen3_vl_path, photo_paths, case):
    openai = pytest.importorskip("openai")
    assert_openai_parity(openai, cluster.url, tiny_qwen3_vl_path, hf3, _turns(case, photo_paths))


def _stub(cluster, name: str):
    import grpc

    return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(cluster.servers[name].grpc))


def _request(cluster, rid: str, ids: list[int], *, room: int, stream: bool, max_new: int = NEW_TOKENS, mm=None):
    boot = pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=cluster.servers["prefill0"].bootstrap_port,
                                  bootstrap_room=room)
    sp = pb.SamplingParams(temperature=0, top_p=1, top_k=-1, max_new_tokens=max_new, ignore_eos=True)
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=sp,
                              disaggregated_params=boot, stream=stream, mm_inputs=mm)


def _dual(cluster, ids: list[int], mm=None) -> tuple[list, list]:
    """Dispatch one request to prefill0 (not streamed) and decode0 (streamed) at once, as smg does."""
    rid, room = f"test-{secrets.token_hex(6)}", secrets.randbits(31)
    out = {}

    def run(name, stream):
        out[name] = list(_stub(cluster, name).Generate(_request(cluster, rid, ids, room=room, stream=stream, mm=mm),
                                                       timeout=120))

    threads = [threading.Thread(target=run, args=a) for a in (("prefill0", False), ("decode0", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out["prefill0"], out["decode0"]


def _mm(hf3, turns, ref_prompt: list[int], grid_delta: int = 0, length_delta: int = 0):
    """``mm_inputs`` as smg sends them for ``turns``' images: the files, the processor's grid, the pad runs."""
    inputs, _ = _hf_generate(hf3, turns, 1)
    pad = hf3[1].config.image_token_id
    runs, i = [], 0
    while i < len(ref_prompt):
        if ref_prompt[i] == pad:
            j = i
            while j < len(ref_prompt) and ref_prompt[j] == pad:
                j += 1
            runs.append(pb.PlaceholderRange(offset=i, length=j - i + length_delta))
            i = j
        i += 1
    grid = inputs["image_grid_thw"].clone()
    grid[0, 1] += grid_delta
    files = [p.read_bytes() for _, parts in turns for p in parts if not isinstance(p, str)]
    return pb.MultimodalInputs(image_data=files, mm_placeholders=runs, model_specific_tensors={
        "image_grid_thw": pb.TensorData(data=grid.numpy().astype("<i8").tobytes(), shape=list(grid.shape),
                                        dtype="int64")})


@pytest.mark.parametrize("case", ["text", "one_photo"])
def test_generate_on_both_legs_over_grpc_matches_transformers(cluster, hf3, photo_paths, case):
    turns = _turns(case, photo_paths)
    ref_prompt, ref_ids, _ = _hf_reference(hf3, turns, NEW_TOKENS)
    mm = _mm(hf3, turns, ref_prompt) if case != "text" else None
    pre, dec = _dual(cluster, ref_prompt, mm)
    # The prefill leg may send empty heartbeats (smg's prefill silence bound) before its one answer.
    assert all(r == pb.GenerateResponse(request_id=r.request_id) for r in pre[:-1])
    pre = pre[-1:]
    assert [r.WhichOneof("response") for r in pre] == ["complete"]
    assert list(pre[0].complete.output_ids) == ref_ids[:1] and pre[0].complete.prompt_tokens == len(ref_prompt)
    chunks = [r.chunk for r in dec if r.HasField("chunk")]
    assert sum((list(c.token_ids) for c in chunks), []) == ref_ids
    assert dec[-1].complete.finish_reason == "length" and list(dec[-1].complete.output_ids) == ref_ids
    assert dec[-1].complete.completion_tokens == NEW_TOKENS


def test_bad_requests_are_invalid_argument(cluster, hf3, photo_paths):
    import grpc

    turns = _turns("one_photo", photo_paths)
    ref_prompt, _, _ = _hf_reference(hf3, turns, 1)
    pre = _stub(cluster, "prefill0")
    cases = {
        "grid": _request(cluster, "bad-1", ref_prompt, room=1, stream=False, mm=_mm(hf3, turns, ref_prompt, 2)),
        "placeholder tokens": _request(cluster, "bad-2", ref_prompt, room=2, stream=False,
                                       mm=_mm(hf3, turns, ref_prompt, 0, -1)),
        "disaggregated_params": pb.GenerateRequest(request_id="bad-3", tokenized=pb.TokenizedInput(input_ids=[1])),
        "vocabulary": _request(cluster, "bad-4", [10**8], room=4, stream=False),
    }
    for what, req in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            list(pre.Generate(req, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details(), what
    with pytest.raises(grpc.RpcError) as e:
        pre.Embed(pb.EmbedRequest(request_id="e"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    _wait_baseline(cluster, ["prefill0", "decode0"], TIMEOUT_S + 5)


def test_info_rpcs_answer_what_smg_reads(cluster, tiny_qwen3_vl_path):
    from google.protobuf.json_format import MessageToDict

    for name, role in (("prefill0", "prefill"), ("decode0", "decode")):
        stub = _stub(cluster, name)
        health = stub.HealthCheck(pb.HealthCheckRequest(), timeout=10)
        assert health.healthy, health.message
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.tokenizer_path == info.model_path == info.served_model_name == tiny_qwen3_vl_path
        assert info.supports_vision and info.is_generation and info.max_context_length > 0 and info.eos_token_ids
        args = MessageToDict(stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args)
        assert args["disaggregation_mode"] == role and args["context_length"] == info.max_context_length
        loads = stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
        assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens > 0
    args = MessageToDict(_stub(cluster, "prefill0").GetServerInfo(pb.GetServerInfoRequest(), timeout=10).server_args)
    assert args["disaggregation_bootstrap_port"] == cluster.servers["prefill0"].bootstrap_port
    # GetTokenizer: the model directory's tokenizer files, zipped, in chunks; the last carries the SHA-256.
    import hashlib
    import io
    import zipfile
    from pathlib import Path

    from smg_grpc_proto.generated import common_pb2

    chunks = list(_stub(cluster, "decode0").GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert zf.read("tokenizer.json") == (Path(tiny_qwen3_vl_path) / "tokenizer.json").read_bytes()
        names = set(zf.namelist())
    assert {"tokenizer_config.json", "config.json", "chat_template.jinja"} <= names
    assert names & {"preprocessor_config.json", "processor_config.json"}


def test_abort_and_cancel_free_kv_and_rooms(cluster, hf3, photo_paths):
    ref_prompt, _, _ = _hf_reference(hf3, _turns("text", photo_paths), 1)
    dec, pre = _stub(cluster, "decode0"), _stub(cluster, "prefill0")
    for how in ("abort", "cancel"):
        rid, room = f"long-{how}", secrets.randbits(31)
        pre_out = list(pre.Generate(_request(cluster, rid, ref_prompt, room=room, stream=False, max_new=2000),
                                    timeout=60))
        assert pre_out[-1].complete.output_ids
        call = dec.Generate(_request(cluster, rid, ref_prompt, room=room, stream=True, max_new=2000), timeout=120)
        first = next(call)
        assert first.chunk.token_ids
        if how == "abort":
            assert dec.Abort(pb.AbortRequest(request_id=rid), timeout=10).success
            rest = list(call)
            assert rest[-1].complete.finish_reason == "abort"
        else:
            call.cancel()
        _wait_baseline(cluster, ["prefill0", "decode0"], TIMEOUT_S + 5)
    assert not dec.Abort(pb.AbortRequest(request_id="long-abort"), timeout=10).success  # gone


def _bench(cluster, model: str, out_path, num: int, seed: int, concurrency: int = 6) -> dict:
    from epdserve.bench.cli import main as bench

    code = bench(["--base-url", cluster.url, "--model", model, "--dataset", "shared-prefix", "--num-prompts",
                  str(num), "--output-len", "6", "--max-concurrency", str(concurrency), "--seed", str(seed),
                  "--warmup", "0", "--output-json", str(out_path), "--disable-tqdm"])
    assert code in (0, 1)
    return json.loads(out_path.read_text())


def test_concurrent_requests_with_images_through_smg_grpc(cluster, tiny_qwen3_vl_path, tmp_path):
    doc = _bench(cluster, tiny_qwen3_vl_path, tmp_path / "bench.json", 24, seed=1, concurrency=6)
    assert doc["summary"]["failed_requests"] == 0, [r["error"] for r in doc["requests"] if not r["success"]]
    assert all(r["completion_tokens"] == 6 for r in doc["requests"])
    _wait_baseline(cluster, ["prefill0", "decode0", "decode1"], TIMEOUT_S + 5)


def test_killing_a_decode_worker_mid_run(cluster, tiny_qwen3_vl_path, tmp_path):
    requests, failed = bench_killing(cluster, "decode1", lambda: _bench(
        cluster, tiny_qwen3_vl_path, tmp_path / "kill.json", 20, seed=2))
    assert len(failed) < len(requests) // 2
    # Only streams that had begun may break (smg answered 200 and sent tokens before decode1 died), and requests
    # smg itself routed to decode1 between its death and smg's next health check: smg 1.13's gRPC PD router does
    # not retry a worker it cannot connect to and answers 503 (nothing reached our servers; the client may retry).
    never_started = [r for r in failed if r["http_status"] == 503 and "tcp connect error" in (r["error"] or "")]
    begun = [r for r in failed if r["http_status"] == 200 and r["num_events"] > 0]
    assert len(begun) + len(never_started) == len(failed), [r["error"] for r in failed]
    _wait_baseline(cluster, ["prefill0", "decode0"], TIMEOUT_S + 10)
