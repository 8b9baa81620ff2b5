"""deploy/: the Kubernetes manifests and docker-compose.yml parse, and their command lines, ports and probes agree
with the servers' own CLI parsers (epdserve's configs, smg's router arguments)."""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import urlparse

import pytest

from epdserve.config import DecodeConfig, EncoderConfig, PrefillConfig, add_config_args, config_from_args

yaml = pytest.importorskip("yaml")
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
_CONFIGS = {"encoder": EncoderConfig, "prefill": PrefillConfig, "decode": DecodeConfig}


def _parse_epdserve(argv: list[str], env: dict[str, str]):
    """``epdserve STAGE ...`` -> the stage's config, parsed by the CLI's own flag definitions."""
    argv = [a.replace("$(POD_IP)", env.get("POD_IP", "10.0.0.1")) for a in argv]
    assert argv[0] in _CONFIGS, argv
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_args(parser, _CONFIGS[argv[0]])
    return argv[0], config_from_args(_CONFIGS[argv[0]], parser.parse_args(argv[1:]))


def _parse_smg(argv: list[str]):
    smg_launch = pytest.importorskip("smg.launch_router")
    assert argv[0] == "launch"
    return smg_launch.parse_router_args(argv[1:])


def _k8s() -> dict[str, dict]:
    docs = [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _check_stage(stage: str, cfg, ports: set[int], probe_port) -> None:
    """The ports a stage's peers reach are exposed, and its probe hits the port it serves health on."""
    if stage != "encoder" and cfg.grpc_port:  # SGLang's gRPC worker, for smg's grpc:// mode
        assert cfg.grpc_port in ports
    if stage == "encoder":
        assert cfg.host == "0.0.0.0" and cfg.port in ports and probe_port == cfg.port
    elif stage == "prefill":
        assert {cfg.port, cfg.bootstrap_port, cfg.embed_port} <= ports and probe_port == cfg.port
        assert cfg.encoder_urls
    else:
        assert {cfg.port, cfg.kv_port} <= ports and probe_port == cfg.port


def test_k8s_manifests_agree_with_the_clis():
    objs = _k8s()
    stages: dict[str, tuple] = {}
    services = {name.split("/", 1)[1]: o for name, o in objs.items() if name.startswith("Service/")}
    for name, dep in objs.items():
        if not name.startswith("Deployment/"):
            continue
        spec = dep["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        assert dep["spec"]["selector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
        ports = {p["containerPort"] for p in c["ports"]}
        if c["command"] == ["smg"]:
            stages["smg"] = (_parse_smg(c["args"]), ports)
            assert c["readinessProbe"]["httpGet"]["port"] in ports
            continue
        env = {e["name"]: "10.0.0.1" for e in c.get("env", [])}
        stage, cfg = _parse_epdserve(c["args"], env)
        ready, live = c["readinessProbe"], c["livenessProbe"]
        if stage == "encoder":  # gRPC health (grpc.health.v1) on the encoder, HTTP /health elsewhere
            probe = ready["grpc"]["port"]
            assert live["grpc"]["port"] == probe
        else:
            # Readiness: serves every request it takes; liveness: the process answers (a slow load is no failure).
            assert (ready["httpGet"]["path"], live["httpGet"]["path"]) == ("/health", "/health/live")
            probe = ready["httpGet"]["port"]
            assert live["httpGet"]["port"] == probe
            assert cfg.host == "10.0.0.1"  # the pod IP: the server advertises it to its peers
        _check_stage(stage, cfg, ports, probe)
        svc = services[dep["metadata"]["name"]]
        assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
        stages[stage] = (cfg, {p["port"] for p in svc["spec"]["ports"]}, dep["metadata"]["name"])
    assert set(stages) == {"encoder", "prefill", "decode", "smg"}
    router, _ = stages["smg"]
    assert router.pd_disaggregation
    (prefill_url, boot), = router.prefill_urls
    (decode_url,) = router.decode_urls
    pre_cfg, pre_svc_ports, pre_name = stages["prefill"]
    dec_cfg, dec_svc_ports, dec_name = stages["decode"]
    assert urlparse(prefill_url).hostname == pre_name and urlparse(prefill_url).port == pre_cfg.port
    assert boot == pre_cfg.bootstrap_port and {pre_cfg.port, boot} <= pre_svc_ports
    assert urlparse(decode_url).hostname == dec_name and urlparse(decode_url).port == dec_cfg.port
    enc_cfg, enc_svc_ports, enc_name = stages["encoder"]
    assert pre_cfg.encoder_urls == f"{enc_name}:{enc_cfg.port}" and enc_cfg.port in enc_svc_ports


def test_compose_has_the_same_topology():
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = doc["services"]
    assert set(services) == {"encoder", "prefill", "decode", "smg"}
    ips = {n: s["networks"]["epd"]["ipv4_address"] for n, s in services.items()}
    cfgs = {}
    for name in ("encoder", "prefill", "decode"):
        cmd = services[name]["command"]
        assert cmd[0] == "epdserve"
        stage, cfg = _parse_epdserve(cmd[1:], {})
        assert stage == name
        if name != "encoder":
            assert cfg.host == ips[name]  # advertised to peers, so the service's own fixed address
            assert f"http://{ips[name]}:{cfg.port}/health" in " ".join(services[name]["healthcheck"]["test"])
        else:
            assert f"127.0.0.1:{cfg.port}" in " ".join(services[name]["healthcheck"]["test"])
        cfgs[name] = cfg
    assert cfgs["prefill"].encoder_urls == f"{ips['encoder']}:{cfgs['encoder'].port}"
    cmd = services["smg"]["command"]
    assert cmd[0] == "smg"
    router = _parse_smg(cmd[1:])
    assert router.pd_disaggregation
    assert router.prefill_urls == [(f"http://{ips['prefill']}:{cfgs['prefill'].port}", cfgs["prefill"].bootstrap_port)]
    assert router.decode_urls == [f"http://{ips['decode']}:{cfgs['decode'].port}"]
    assert services["smg"]["ports"] == [f"{router.port}:{router.port}"]


def test_port_defaults_match_the_docs():
    """The HTTP ports of the fronts are ``--port``; the own gateway's defaults still reach the ZMQ sockets."""
    from epdserve.config import GatewayConfig

    assert GatewayConfig().prefill_addr == [f"tcp://127.0.0.1:{PrefillConfig().zmq_port}"]
    assert GatewayConfig().decode_addr == [f"tcp://127.0.0.1:{DecodeConfig().zmq_port}"]
    ports = [PrefillConfig().port, PrefillConfig().zmq_port, PrefillConfig().embed_port, PrefillConfig().bootstrap_port,
             DecodeConfig().port, DecodeConfig().zmq_port, DecodeConfig().kv_port, EncoderConfig().port]
    assert len(set(ports)) == len(ports)  # every stage can run on one machine with its defaults


def test_smg_epd_topology_agrees_with_the_clis():
    """deploy/smg-epd/: smg --epd-disaggregation's --encode, --prefill and --decode URLs and bootstrap ports are the
    encoders' --port/--bootstrap-port and the TokenSpeed gRPC ports of prefill and decode, in both files."""
    compose = yaml.safe_load((DEPLOY / "smg-epd" / "docker-compose.yml").read_text())["services"]
    ips = {n: s["networks"]["epd"]["ipv4_address"] for n, s in compose.items()}
    cfgs = {n: _parse_epdserve(s["command"][1:], {})[1] for n, s in compose.items() if n != "smg"}
    router = _parse_smg(compose["smg"]["command"][1:])
    assert router.epd_disaggregation and router.encode_policy == "consistent_hashing"
    encoders = sorted(n for n in cfgs if n.startswith("encoder"))
    assert len(encoders) == 2
    assert router.encode_urls == [(f"grpc://{ips[n]}:{cfgs[n].port}", cfgs[n].bootstrap_port) for n in encoders]
    assert all(cfgs[n].host == "0.0.0.0" for n in encoders)
    for role in ("prefill", "decode"):
        assert cfgs[role].grpc_protocol == "tokenspeed" and cfgs[role].host == ips[role]
    assert router.prefill_urls == [(f"grpc://{ips['prefill']}:{cfgs['prefill'].grpc_port}",
                                    cfgs["prefill"].bootstrap_port)]
    assert router.decode_urls == [f"grpc://{ips['decode']}:{cfgs['decode'].grpc_port}"]
    assert not cfgs["prefill"].encoder_urls  # smg picks the encoder
    docs = [d for d in yaml.safe_load_all((DEPLOY / "smg-epd" / "k8s.yaml").read_text()) if d]
    objs = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    args = {}
    for name, o in objs.items():
        if o["kind"] in ("Deployment", "StatefulSet"):
            (c,) = o["spec"]["template"]["spec"]["containers"]
            ports = {p["containerPort"] for p in c["ports"]}
            if c["command"] == ["smg"]:
                args["smg"] = _parse_smg(c["args"])
                continue
            stage, cfg = _parse_epdserve(c["args"], {"POD_IP": "10.0.0.1"})
            wanted = {cfg.port, cfg.bootstrap_port} if stage == "encoder" else {cfg.grpc_port}
            assert wanted <= ports, name
            args[stage] = (cfg, o)
    enc_cfg, sts = args["encoder"]
    k8s_router = args["smg"]
    assert k8s_router.epd_disaggregation and k8s_router.encode_policy == "consistent_hashing"
    headless = objs[f"Service/{sts['spec']['serviceName']}"]
    assert headless["spec"]["clusterIP"] == "None"
    assert k8s_router.encode_urls == [
        (f"grpc://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}:{enc_cfg.port}", enc_cfg.bootstrap_port)
        for i in range(sts["spec"]["replicas"])]
    pre_cfg, pre = args["prefill"]
    dec_cfg, dec = args["decode"]
    assert pre_cfg.grpc_protocol == dec_cfg.grpc_protocol == "tokenspeed"
    pre_url = f"grpc://{pre['metadata']['name']}:{pre_cfg.grpc_port}"  # the Service is named as its Deployment
    assert k8s_router.prefill_urls == [(pre_url, pre_cfg.bootstrap_port)]
    assert k8s_router.decode_urls == [f"grpc://{dec['metadata']['name']}:{dec_cfg.grpc_port}"]
    svc_ports = {n: {p["port"] for p in objs[f"Service/{o['metadata']['name']}"]["spec"]["ports"]}
                 for n, o in (("prefill", pre), ("decode", dec))}
    assert {pre_cfg.grpc_port, pre_cfg.bootstrap_port} <= svc_ports["prefill"]
    assert dec_cfg.grpc_port in svc_ports["decode"]
