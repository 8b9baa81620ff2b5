"""The Open Inference Protocol v2 (KServe, Triton) on the gateway, spoken by Triton's own client.

``tritonclient.grpc`` and ``tritonclient.http`` (PyPI ``tritonclient``) run in a virtual environment of their own,
made once from the package registry and kept in the system's temp folder (about 30 s the first time): the gRPC
half pins protobuf below 7 and the server's environment has 7. Where it cannot be installed, the tests that need it
skip. The client script is tests/kserve_client.py.

The stages are real processes (``stage_procs``); the gateway runs in-process with ``--kserve-grpc-port``. Greedy
text through both v2 transports (whole and streamed) and Triton's ``generate``/``generate_stream`` must equal the
OpenAI route's and transformers' ``generate()`` (test_e2e.py's cases and reference).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from cluster import at_baseline, details, serve_gateway, wait_for
from conftest import hf_reference_model
from test_e2e import NEW_TOKENS, _hf_reference, _resolve

from epdserve.wire.ports import free_port

TRITONCLIENT = "tritonclient[grpc,http]>=2.60,<3"
CLIENT = Path(__file__).with_name("kserve_client.py")
MODEL = "epd-tiny"


@pytest.fixture(scope="session")
def triton_python() -> str:
    """The Python of a virtual environment with tritonclient, made once per machine (cached in the temp folder,
    keyed by the requirement and this Python's version)."""
    key = hashlib.sha256(f"{TRITONCLIENT} {sys.version_info[:2]}".encode()).hexdigest()[:12]
    venv = Path(tempfile.gettempdir()) / f"epdserve-tritonclient-{key}"
    if (venv / "ready").exists():
        return str(venv / "bin" / "python")
    build = Path(tempfile.mkdtemp(prefix=f"{venv.name}-", dir=venv.parent))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(build)], check=True, capture_output=True,
                       timeout=120)
        pip = subprocess.run([str(build / "bin" / "python"), "-m", "pip", "install", "-q", TRITONCLIENT],
                             capture_output=True, text=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as e:
        shutil.rmtree(build, ignore_errors=True)
        pytest.skip(f"cannot make a virtual environment for tritonclient: {e}")
    if pip.returncode != 0:
        shutil.rmtree(build, ignore_errors=True)
        pytest.skip(f"cannot install {TRITONCLIENT} from the package registry: {pip.stderr[-500:]}")
    (build / "ready").touch()
    try:
        os.rename(build, venv)  # atomic: a concurrent run sees a whole environment or none
    except OSError:  # another run got there first
        shutil.rmtree(build, ignore_errors=True)
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return hf_reference_model(tiny_model_path)


@pytest.fixture(scope="module")
def v2(stage_procs):
    """A gateway with the v2 gRPC service; yields (HTTP base URL, gRPC address, app)."""
    grpc_port = free_port()
    config = stage_procs.gateway_config(served_model_name=MODEL, kserve_grpc_port=grpc_port)
    with serve_gateway(config) as (base, app):
        yield base, f"127.0.0.1:{grpc_port}", app


def _client(python: str, v2, jobs: list[dict]) -> list[dict]:
    base, grpc_addr, _ = v2
    r = subprocess.run([python, str(CLIENT), "jobs", grpc_addr, base.removeprefix("http://"), MODEL],
                       input=json.dumps(jobs), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _bytes(name: str, *values) -> dict:
    return {"name": name, "datatype": "BYTES", "shape": [len(values)], "data": list(values)}


def _bool(name: str, value: bool) -> dict:
    return {"name": name, "datatype": "BOOL", "shape": [1], "data": [value]}


def _inputs(text: str, images=(), *, stream: bool | None = None, exclude: bool = True, **sampling) -> list[dict]:
    tensors = [_bytes("text_input", text)]
    if images:
        tensors.append(_bytes("image", *({"path": str(p)} for p in images)))
    if stream is not None:
        tensors.append(_bool("stream", stream))
    params = {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True} | sampling
    tensors.append(_bytes("sampling_parameters", json.dumps(params)))
    if exclude:
        tensors.append(_bool("exclude_input_in_output", True))
    return tensors


def _case(name: str, photo_paths) -> tuple[list, str, list[Path]]:
    """A one-turn case of test_e2e.py as (turns, its text, its images): the v2 prompt puts images first."""
    turns = _resolve(name, photo_paths)
    ((role, parts),) = turns
    images = [p for p in parts if isinstance(p, Path)]
    assert role == "user" and parts[:len(images)] == images, "the v2 prompt is images first, then the text"
    return turns, " ".join(p for p in parts if isinstance(p, str)), images


def _sse(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("case", ["text", "one_photo"])
def test_greedy_text_equals_openai_and_transformers(triton_python, v2, hf, photo_paths, case):
    base, _, _ = v2
    turns, text, images = _case(case, photo_paths)
    ref_prompt, _, ref_text = _hf_reference(hf, turns)
    content = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in images] + [
        {"type": "text", "text": text}]
    openai = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0,
        "max_completion_tokens": NEW_TOKENS, "ignore_eos": True}).json()
    assert openai["choices"][0]["message"]["content"] == ref_text
    flags = [_bool(f"return_{n}", True) for n in ("finish_reason", "num_input_tokens", "num_output_tokens")]
    grpc_whole, http_whole, streamed = _client(triton_python, v2, [
        {"proto": "grpc", "op": "infer", "inputs": _inputs(text, images) + flags, "id": f"v2-{case}"},
        {"proto": "http", "op": "infer", "inputs": _inputs(text, images)},
        {"proto": "grpc", "op": "stream", "requests": [{"inputs": _inputs(text, images, stream=True) + flags}]}])
    assert grpc_whole["ok"] and grpc_whole["id"] == f"v2-{case}", grpc_whole
    assert grpc_whole["outputs"] == {"text_output": [ref_text], "finish_reason": ["length"],
                                     "num_input_tokens": [len(ref_prompt)], "num_output_tokens": [NEW_TOKENS]}
    assert http_whole["ok"] and http_whole["outputs"] == {"text_output": [ref_text]}, http_whole
    events = streamed["events"]
    assert len(events) > 1 and [e["final"] for e in events] == [False] * (len(events) - 1) + [True], events
    assert "".join(e["outputs"]["text_output"][0] for e in events) == ref_text
    assert sum(e["outputs"]["num_output_tokens"][0] for e in events) == NEW_TOKENS
    assert [e["outputs"]["finish_reason"][0] for e in events][-1] == "length"
    # Triton's generate extension, whole and streamed (images as base64 strings: JSON has no bytes).
    body = {"text_input": text, "image": [_b64(p) for p in images], "exclude_input_in_output": True,
            "parameters": {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}}
    generated = httpx.post(f"{base}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert generated.status_code == 200 and generated.json()["text_output"] == ref_text, generated.text
    stream = httpx.post(f"{base}/v2/models/{MODEL}/generate_stream", json=body, timeout=120)
    deltas = _sse(stream)
    assert len(deltas) > 1 and "".join(d["text_output"] for d in deltas) == ref_text, stream.text


def test_video_equals_transformers(triton_python, v2, hf, tiny_model_path, tmp_path):
    """A ``video`` tensor (an MP4's bytes over gRPC, base64 in ``generate``'s JSON) is the OpenAI route's
    ``video_url`` part: the same greedy text as transformers (test_video_e2e.py's clip and reference)."""
    from test_video import make_clip
    from test_video_e2e import CLIP, video_messages, video_reference

    clip = make_clip(**CLIP)
    messages = video_messages("video", clip)
    _, _, ref_text = video_reference(tiny_model_path, hf, messages, clip, None)
    question = messages[0]["content"][-1]["text"]
    (tmp_path / "clip.mp4").write_bytes(clip)
    tensors = _inputs(question) + [_bytes("video", {"path": str(tmp_path / "clip.mp4")})]
    (whole,) = _client(triton_python, v2, [{"proto": "grpc", "op": "infer", "inputs": tensors}])
    assert whole["ok"] and whole["outputs"]["text_output"] == [ref_text], whole
    body = {"text_input": question, "video": base64.b64encode(clip).decode(), "exclude_input_in_output": True,
            "sampling_parameters": {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True}}
    r = httpx.post(f"{v2[0]}/v2/models/{MODEL}/generate", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["text_output"] == ref_text, r.text


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _data_url(path: Path) -> str:
    return f"data:image/{'jpeg' if path.suffix == '.jpg' else 'png'};base64,{_b64(path)}"


BAD = {
    "missing_text_input": ([_bool("stream", False)], "text_input"),
    "wrong_datatype": ([{"name": "text_input", "datatype": "INT32", "shape": [1], "data": [7]}], "BYTES"),
    "two_prompts": ([_bytes("text_input", "one", "two")], "one element"),
    "bad_sampling_json": ([_bytes("text_input", "hi"), _bytes("sampling_parameters", "{temperature: 0")],
                          "sampling_parameters"),
    "unknown_sampling_key": ([_bytes("text_input", "hi"), _bytes("sampling_parameters", '{"n": 2}')], "'n'"),
    "undecodable_image": ([_bytes("text_input", "hi"), _bytes("image", "this is no image at all")],
                          "cannot decode image"),
}


def test_bad_inputs_get_invalid_argument_and_the_server_keeps_serving(triton_python, v2):
    _, _, app = v2
    metrics = app.state.server.metrics
    before = metrics.value("epdserve:errors_total", kind="http_400")
    jobs = [{"proto": proto, "op": "infer", "inputs": inputs} for proto in ("grpc", "http") for inputs, _ in
            BAD.values()]
    good = _inputs("Say something.", exclude=False, max_tokens=4)
    jobs += [{"proto": "grpc", "op": "infer", "inputs": good}, {"proto": "http", "op": "infer", "inputs": good},
             # On a stream a bad request is an error response; the stream and the next request go on.
             {"proto": "grpc", "op": "stream", "requests": [{"inputs": BAD["bad_sampling_json"][0]},
                                                            {"inputs": _inputs("Hello", stream=True,
                                                                               exclude=False)}]}]
    results = _client(triton_python, v2, jobs)
    for (proto, (name, (_, words))), got in zip([(p, b) for p in ("grpc", "http") for b in BAD.items()], results):
        assert not got["ok"], (proto, name, got)
        assert got["status"] == ("StatusCode.INVALID_ARGUMENT" if proto == "grpc" else "400"), (proto, name, got)
        assert words in got["error"], (proto, name, got)
    for got in results[-3:-1]:
        assert got["ok"] and got["outputs"]["text_output"][0].startswith("Say something."), got
        assert len(got["outputs"]["text_output"][0]) > len("Say something."), got
    events = results[-1]["events"]
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and "sampling_parameters" in errors[0], events
    answers = [e for e in events if "error" not in e]
    assert answers[-1]["final"] and "".join(e["outputs"]["text_output"][0] for e in answers), events
    # exclude_input_in_output false: the prompt leads the first response only.
    texts = [e["outputs"]["text_output"][0] for e in answers]
    assert texts[0].startswith("Hello") and not any(t.startswith("Hello") for t in texts[1:]), texts
    assert metrics.value("epdserve:errors_total", kind="http_400") - before == 2 * len(BAD) + 1


def test_http_routes_health_metadata_and_errors(triton_python, v2):
    base, _, _ = v2
    assert httpx.get(f"{base}/v2/health/live").status_code == 200
    assert httpx.get(f"{base}/v2/health/ready").status_code == 200
    assert httpx.get(f"{base}/v2/models/{MODEL}/ready").status_code == 200
    assert httpx.get(f"{base}/v2/models/{MODEL}/versions/1/ready").status_code == 200
    assert httpx.get(f"{base}/v2/models/other/ready").status_code == 404
    meta = httpx.get(f"{base}/v2/models/{MODEL}").json()
    assert meta["name"] == MODEL and {"text_input", "image", "sampling_parameters"} <= {i["name"] for i in
                                                                                         meta["inputs"]}
    r = httpx.post(f"{base}/v2/models/other/generate", json={"text_input": "hi"})
    assert r.status_code == 404 and "other" in r.json()["error"]
    r = httpx.post(f"{base}/v2/models/{MODEL}/generate", json={"parameters": {"max_tokens": 2}})
    assert r.status_code == 400 and "text_input" in r.json()["error"]
    r = httpx.post(f"{base}/v2/models/{MODEL}/generate", json={"text_input": "hi", "stream": True})
    assert r.status_code == 400 and "generate_stream" in r.json()["error"]
    # Without the chat template the text is tokenized as is; the request id comes from X-Request-Id.
    r = httpx.post(f"{base}/v2/models/{MODEL}/generate", headers={"X-Request-Id": "v2-raw-1"}, json={
        "text_input": "Once upon a time", "parameters": {"apply_chat_template": False, "max_tokens": 3,
                                                         "temperature": 0}})
    assert r.status_code == 200 and r.json()["text_output"].startswith("Once upon a time"), r.text
    assert r.headers["x-request-id"] == "v2-raw-1"
    metadata, = _client(triton_python, v2, [{"proto": "grpc", "op": "metadata"}])
    assert metadata["server"]["name"] == "epdserve" and metadata["model"]["name"] == MODEL


def test_a_cancelled_stream_frees_everything(triton_python, v2):
    base, _, app = v2
    gw = app.state.server
    long = _inputs("Tell me everything.", stream=True, max_tokens=2000)
    cancelled, unary_stream = _client(triton_python, v2, [
        {"proto": "grpc", "op": "cancel", "inputs": long, "id": "v2-cancelled"},
        # stream=true is for ModelStreamInfer: ModelInfer refuses it.
        {"proto": "grpc", "op": "infer", "inputs": _inputs("Hi", stream=True)}])
    assert cancelled["ok"], cancelled
    assert unary_stream["status"] == "StatusCode.INVALID_ARGUMENT" and "ModelStreamInfer" in unary_stream["error"]
    assert wait_for(lambda: not at_baseline(details(base)) and len(gw.requests) == 0, 15), at_baseline(details(base))
    assert gw.metrics.value("epdserve:errors_total", kind="client_disconnected") >= 1


def _watch(python: str, v2, seconds: float) -> subprocess.Popen:
    base, grpc_addr, _ = v2
    return subprocess.Popen([python, str(CLIENT), "watch", grpc_addr, base.removeprefix("http://"), MODEL,
                             str(seconds)], stdout=subprocess.PIPE, text=True)


def _until(watcher: subprocess.Popen, want: bool, timeout_s: float) -> float:
    """The time the watcher saw both clients' is_server_ready() equal ``want``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = watcher.stdout.readline()
        if not line:
            break
        state = json.loads(line)
        if state["grpc"] is want and state["http"] is want:
            return state["t"]
    raise AssertionError(f"is_server_ready() never became {want}")


def test_server_ready_follows_decode(triton_python, v2, stage_procs):
    _, _, app = v2
    timeout_s = app.state.server.config.stage_timeout_s
    watcher = _watch(triton_python, v2, 120)
    try:
        _until(watcher, True, 30)
        killed_at = time.time()
        stage_procs.kill("decode")
        assert _until(watcher, False, 30) - killed_at <= timeout_s
        stage_procs.start("decode")
        _until(watcher, True, 60)
    finally:
        watcher.kill()
        watcher.wait()
        if not stage_procs.alive("decode"):
            stage_procs.start("decode")
    assert wait_for(lambda: httpx.get(f"{v2[0]}/health").status_code == 200, 30)
    (after,) = _client(triton_python, v2, [{"proto": "grpc", "op": "infer", "inputs": _inputs("Hi", max_tokens=2)}])
    assert after["ok"], after


def test_launch_passes_the_grpc_port_to_the_gateway():
    """``epdserve launch --kserve-grpc-port`` reaches the gateway's own config through its command line (off by
    default)."""
    import argparse

    from epdserve.config import GatewayConfig, LaunchConfig, add_config_args, config_from_args
    from epdserve.entry.launch_plan import plan_launch

    def gateway_config(launch_flags: list[str]) -> GatewayConfig:
        parser = argparse.ArgumentParser()
        add_config_args(parser, LaunchConfig)
        commands = plan_launch(config_from_args(LaunchConfig, parser.parse_args(launch_flags)), "/models/m",
                               False).commands
        cmd = commands["gateway"]
        gw_parser = argparse.ArgumentParser()
        add_config_args(gw_parser, GatewayConfig)
        return config_from_args(GatewayConfig, gw_parser.parse_args(cmd[cmd.index("gateway") + 1:]))

    assert gateway_config([]).kserve_grpc_port == GatewayConfig().kserve_grpc_port == 0
    assert gateway_config(["--kserve-grpc-port", "8765"]).kserve_grpc_port == 8765


def test_a_starting_gateway_is_live_not_ready_and_guards_its_key(tiny_model_path):
    """No stage answers this gateway: v2 says live, not ready, and refuses inference with UNAVAILABLE / 503; with
    --api-key every route but health needs the key (epdserve's own stubs of the protocol, in this process)."""
    import grpc

    from epdserve.config import GatewayConfig
    from epdserve.proto import grpc_predict_v2_pb2 as pb
    from epdserve.proto import grpc_predict_v2_pb2_grpc as pb_grpc

    grpc_port, nowhere = free_port(), free_port()
    config = GatewayConfig(model_path=tiny_model_path, served_model_name=MODEL, kserve_grpc_port=grpc_port,
                           api_key="sesame", encoder_addr=f"127.0.0.1:{nowhere}",
                           prefill_addr=f"tcp://127.0.0.1:{nowhere}", decode_addr=f"tcp://127.0.0.1:{nowhere}")
    key = [("authorization", "Bearer sesame")]
    request = pb.ModelInferRequest(model_name=MODEL, inputs=[pb.ModelInferRequest.InferInputTensor(
        name="text_input", datatype="BYTES", shape=[1], contents=pb.InferTensorContents(bytes_contents=[b"hi"]))])
    with serve_gateway(config, wait_healthy=False) as (base, _), grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        assert not stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=10).ready
        assert httpx.get(f"{base}/v2/health/live").status_code == 200
        assert httpx.get(f"{base}/v2/health/ready").status_code == 503
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(request, metadata=key, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
        assert stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL), metadata=key, timeout=10).name == MODEL
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelMetadata(pb.ModelMetadataRequest(name="other"), metadata=key, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        r = httpx.post(f"{base}/v2/models/{MODEL}/generate", json={"text_input": "hi"})
        assert r.status_code == 401 and "API key" in r.json()["error"], r.text
        r = httpx.post(f"{base}/v2/models/{MODEL}/generate", json={"text_input": "hi"},
                       headers={"Authorization": "Bearer sesame"})
        assert r.status_code == 503 and "starting" in r.json()["error"], r.text
