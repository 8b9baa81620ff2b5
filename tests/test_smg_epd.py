"""EPD behind smg (issue 29, first part): what smg's ``--epd-disaggregation`` mode accepts, and the EPD topology smg
fronts today.

smg 1.13 runs ``--epd-disaggregation`` only over gRPC with TokenSpeed workers (its encode stage calls
``tokenspeed.grpc.encoder.TokenSpeedEncoder/Encode`` and hands the prefill a TokenSpeed ``EncodeBootstrapInfo``;
docs/architecture.md, "smg's own EPD mode"). Two tests pin that evidence (HTTP workers are refused; our encoder
as a ``grpc://`` encode worker is never registered), so a newer smg that lifts it fails here and points at the
work. The others run the topology that does work: smg in PD mode in front of two epdserve encoders, one prefill
and one decode server, the prefill spreading images over the encoders by content hash.
Checks: the parity prompts (text, one photo, two photos, two turns) through the official openai client equal
transformers' generate(), streaming and not; each image's embedding is cached on exactly the encoder that
rendezvous hashing picks for it, and a repeated request hits that cache without encoding anything again.
Skipped when smg is not installed.
"""

from __future__ import annotations

import hashlib
import subprocess
import time

import grpc
import pytest

from epdserve.frontend.encoders import rendezvous_order
from epdserve.proto import encoder_pb2, encoder_pb2_grpc
from epdserve.wire.transport import free_port
from smg_cluster import smg_executable, start_cluster
from test_e2e import CASES, _hf_reference, _openai_messages, _resolve, hf  # noqa: F401 (hf: a fixture)

pytestmark = pytest.mark.skipif(smg_executable() is None, reason="smg is not installed")

NEW_TOKENS = 16


def test_smg_epd_mode_needs_tokenspeed_grpc_workers():
    """smg refuses ``--epd-disaggregation`` with HTTP workers before it serves anything: its EPD router exists only
    for gRPC TokenSpeed workers (model_gateway/src/routers/factory.rs)."""
    url = lambda: f"http://127.0.0.1:{free_port()}"  # noqa: E731 (nothing listens there: smg fails first)
    cmd = [smg_executable(), "launch", "--epd-disaggregation", "--encode", url(), "--prefill", url(),
           str(free_port()), "--decode", url(), "--encode-policy", "consistent_hashing", "--host", "127.0.0.1",
           "--port", str(free_port()), "--prometheus-port", str(free_port()), "--log-level", "warn"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "EPD mode requires gRPC connection_mode and TokenSpeed" in done.stdout + done.stderr


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    c = start_cluster(tiny_model_path, tmp_path_factory.mktemp("smg-epd"), encoders=2, prefills=1, decodes=1,
                      policy="cache_aware")
    yield c
    c.stop()


def test_smg_epd_mode_does_not_register_our_encoder(cluster, tmp_path):
    """With ``grpc://`` workers smg starts, then detects each worker's runtime by the scheduler ``HealthCheck`` of
    SGLang, vLLM, TRT-LLM, MLX and TokenSpeed in turn; our encoder answers none of them (it serves
    ``epdserve.v1.Encoder`` and ``grpc.health.v1``), so smg never takes it as an encode worker."""
    enc = next(s.grpc for s in cluster.servers.values() if s.grpc)
    log_path = tmp_path / "smg-epd.log"
    cmd = [smg_executable(), "launch", "--epd-disaggregation", "--encode", f"grpc://{enc}",
           "--prefill", f"grpc://127.0.0.1:{free_port()}", str(free_port()), "--decode", f"grpc://127.0.0.1:{free_port()}",
           "--host", "127.0.0.1", "--port", str(free_port()), "--prometheus-port", str(free_port())]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        want = f"worker URL grpc://{enc}: gRPC not reachable"
        while want not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        assert "tokenspeed=" in log_path.read_text(errors="replace")  # TokenSpeed's health was tried too
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _encoder_stats(cluster) -> dict[str, encoder_pb2.GetServerInfoResponse]:
    """Each encoder's GetServerInfo (cache entries, hits, misses), by its gRPC address."""
    out = {}
    for s in cluster.servers.values():
        if s.grpc:
            with grpc.insecure_channel(s.grpc) as ch:
                out[s.grpc] = encoder_pb2_grpc.EncoderStub(ch).GetServerInfo(encoder_pb2.GetServerInfoRequest(),
                                                                             timeout=30)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_openai_client_through_smg_matches_transformers(cluster, hf, tiny_model_path, photo_paths, case):
    openai = pytest.importorskip("openai")
    turns = _resolve(case, photo_paths)
    ref_prompt, ref_ids, ref_text = _hf_reference(hf, turns, NEW_TOKENS)
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="EMPTY", max_retries=0)
    kw = dict(model=tiny_model_path, messages=_openai_messages(turns), temperature=0, max_completion_tokens=NEW_TOKENS)
    resp = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert (resp.model_extra or {})["prompt_token_ids"] == ref_prompt
    assert resp.choices[0].model_extra["token_ids"] == ref_ids
    assert resp.choices[0].message.content == ref_text
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS and chunks[-1].usage.prompt_tokens == len(ref_prompt)


def test_repeated_images_hit_the_same_encoders_cache(cluster, tiny_model_path, photo_paths):
    """Every image goes to the encoder that rendezvous hashing over its SHA-256 picks (epdserve/frontend/encoders.py,
    the prefill's ``--encoder-urls`` pool), so its embedding is encoded and cached there and nowhere else, and asking
    again encodes nothing: the repeat is all cache hits on the same encoders."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="EMPTY", max_retries=0)
    photos = list(photo_paths.values())  # every photo: some were sent before (cache hits), some not
    addrs = [s.grpc for s in cluster.servers.values() if s.grpc]
    homes = [addrs[rendezvous_order(hashlib.sha256(p.read_bytes()).digest(), addrs)[0]] for p in photos]
    want = {a: homes.count(a) for a in addrs}

    def ask(text: str) -> dict[str, encoder_pb2.GetServerInfoResponse]:
        messages = _openai_messages([("user", [*photos, text])])
        client.chat.completions.create(model=tiny_model_path, messages=messages, temperature=0, max_completion_tokens=2)
        return _encoder_stats(cluster)

    before = _encoder_stats(cluster)
    first = ask("What is in these pictures?")
    for a in addrs:  # each image looked up once, on its home encoder only; a miss is encoded and cached there
        misses = first[a].cache_misses - before[a].cache_misses
        assert misses + first[a].cache_hits - before[a].cache_hits == want[a], (a, want)
        assert first[a].cache_entries - before[a].cache_entries == misses, a
    second = ask("And now, in one word?")  # another prompt, the same images
    for a in addrs:
        assert second[a].cache_hits - first[a].cache_hits == want[a], (a, want)
        assert second[a].cache_misses == first[a].cache_misses, a
        assert second[a].cache_entries == first[a].cache_entries, a
