"""KV across a network link through a transfer engine: the prefill server runs in a network namespace of its own,
joined to this one (encoder, decode, gateway, the test) by a veth pair, so every byte between prefill and decode,
the engine's KV writes included, crosses that link. Greedy output must equal the same request's on one host,
and the link must have carried at least the prompt's KV.

Needs root and ``ip netns`` (skipped otherwise) and the engine's package (skipped per engine). NIXL is told to use
UCX's TCP transport on the veth ends (``UCX_TLS``, ``UCX_NET_DEVICES``); otherwise UCX would take shared memory,
which two namespaces of one machine still share.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from cluster import StageProcs, body, noise_png, serve_gateway, stream
from test_kv_engines import ENGINES

NET = os.getpid() % 200 + 20
NS, HOST_IF, NS_IF = f"epdkv{os.getpid()}", f"epdkv{NET}a", f"epdkv{NET}b"
HOST_IP, NS_IP = f"10.231.{NET}.1", f"10.231.{NET}.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    try:
        _ip("netns", "add", NS)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"ip netns not allowed here: {e.stderr.decode().strip()}")
    try:
        _ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _ip("link", "set", NS_IF, "netns", NS)
        _ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        _ip("link", "set", HOST_IF, "up")
        _ip("netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        _ip("netns", "exec", NS, "ip", "link", "set", NS_IF, "up")
        _ip("netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield
    finally:
        subprocess.run(["ip", "link", "del", HOST_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def _rx_bytes() -> int:
    """Bytes this namespace's end of the veth pair received (what prefill sent across)."""
    with open(f"/sys/class/net/{HOST_IF}/statistics/rx_bytes") as f:
        return int(f.read())


class NetnsStages(StageProcs):
    """:class:`StageProcs` with prefill in namespace ``NS`` on ``NS_IP`` and decode on ``HOST_IP``."""

    @property
    def prefill_addr(self) -> str:
        return f"tcp://{NS_IP}:{self.ports['prefill']}"

    @property
    def decode_addr(self) -> str:
        return f"tcp://{HOST_IP}:{self.ports['decode']}"

    def _command(self, name: str) -> list[str]:
        cmd = super()._command(name)
        ucx = ["UCX_TLS=tcp", f"UCX_NET_DEVICES={NS_IF if name == 'prefill' else HOST_IF}"]
        if name == "prefill":
            return ["ip", "netns", "exec", NS, "env", *ucx, *cmd, "--host", NS_IP]
        if name == "decode":
            return ["env", *ucx, *cmd, "--host", HOST_IP]
        return cmd


@pytest.mark.parametrize("name", ENGINES)
def test_kv_crosses_a_veth_link(netns, name, tiny_model_path, tmp_path_factory):
    # The reference: the same request on one host, through the engine (test_kv_engines.py checks that path
    # against transformers).
    req = body(tiny_model_path, "What is in this picture? Say it in many words.", image=noise_png(3), max_tokens=12)
    local = StageProcs(tiny_model_path, tmp_path_factory.mktemp(f"local-{name}"), lm_args=("--kv-transfer", name))
    local.start()
    try:
        with serve_gateway(local.gateway_config()) as (base, _):
            want = stream(base, req).token_ids
    finally:
        local.stop_all()
    procs = NetnsStages(tiny_model_path, tmp_path_factory.mktemp(f"netns-{name}"), lm_args=("--kv-transfer", name))
    procs.start()
    try:
        with serve_gateway(procs.gateway_config(stage_timeout_s=10.0)) as (base, _):
            before = _rx_bytes()
            got = stream(base, req)
            crossed = _rx_bytes() - before
        assert got.error is None and got.token_ids == want and len(want) == 12
        log = procs.log_path("prefill").read_text() + procs.log_path("decode").read_text()
        assert f"KV hand-off {name}" in log and "cannot start" not in log
        # The prompt's KV (layers x 2 x tokens x kv heads x head dim x 4 bytes) went over the link.
        with open(os.path.join(tiny_model_path, "config.json")) as f:
            cfg = json.load(f)
        text = cfg.get("text_config", cfg)
        per_token = text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * \
            (text["hidden_size"] // text["num_attention_heads"]) * 4
        assert crossed > per_token * 20, (crossed, per_token)
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
