"""deploy/kserve/: the ServingRuntime and the InferenceService validate against KServe's own CRD schemas (vendored in
deploy/kserve/schemas/, checked strictly: a field the CRD does not declare is an error, as kubeconform -strict
has it), and their command lines, ports and probes agree with epdserve's CLI parsers.

``kubectl apply --dry-run=client`` cannot check them without an API server (it asks one for the CRDs even on a
client dry run), so the schemas are checked with jsonschema, where it is installed (the ``test`` extra has it).
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
from pathlib import Path

import pytest

from epdserve.config import DecodeConfig, EncoderConfig, GatewayConfig, PrefillConfig, add_config_args, config_from_args

yaml = pytest.importorskip("yaml")
KSERVE = Path(__file__).resolve().parents[1] / "deploy" / "kserve"
SCHEMAS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntime-v1alpha1.json.gz",
           ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-v1beta1.json.gz"}
CONFIGS = {"gateway": GatewayConfig, "encoder": EncoderConfig, "prefill": PrefillConfig, "decode": DecodeConfig}


def _objects() -> dict[str, dict]:
    docs = [d for f in sorted(KSERVE.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _strict(schema):
    """``schema`` with every object that lists its properties closed to others (unless it keeps unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def test_manifests_validate_against_the_kserve_crd_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    objects = _objects()
    assert set(objects) == {"ServingRuntime", "InferenceService"}
    for obj in objects.values():
        name = SCHEMAS[(obj["apiVersion"], obj["kind"])]
        schema = _strict(json.loads(gzip.decompress((KSERVE / "schemas" / name).read_bytes())))
        # Draft 4 is what OpenAPI v3 schemas build on; the schema itself is not checked against the meta-schema
        # (most of the time jsonschema.validate would spend).
        validator = jsonschema.Draft4Validator(schema)
        validator.validate(obj)
        # The check can fail: a misspelt field is refused.
        broken = copy.deepcopy(obj)
        broken["spec"]["replicaz"] = 1
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(broken)
    broken = copy.deepcopy(objects["ServingRuntime"])  # deep inside too: a container's misspelt probe
    broken["spec"]["containers"][0]["readinesProbe"] = broken["spec"]["containers"][0].pop("readinessProbe")
    schema = _strict(json.loads(gzip.decompress((KSERVE / "schemas" / SCHEMAS[
        ("serving.kserve.io/v1alpha1", "ServingRuntime")]).read_bytes())))
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        jsonschema.Draft4Validator(schema).validate(broken)


def _parse(args: list[str]):
    stage = args[0]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_args(parser, CONFIGS[stage])
    return stage, config_from_args(CONFIGS[stage], parser.parse_args(args[1:]))


def _bound_ports(stage: str, cfg) -> list[int]:
    """Every port a server binds (all containers of the pod share one network namespace)."""
    if stage == "gateway":
        return [cfg.port, cfg.kserve_grpc_port]
    if stage == "encoder":
        return [cfg.port, cfg.metrics_port]
    if stage == "prefill":
        return [cfg.zmq_port, cfg.embed_port, cfg.bootstrap_port, cfg.metrics_port]
    return [cfg.zmq_port, cfg.kv_port, cfg.metrics_port]


def test_the_pod_wires_the_gateway_to_its_stages():
    objects = _objects()
    runtime, isvc = objects["ServingRuntime"], objects["InferenceService"]
    containers = {c["name"]: c for c in runtime["spec"]["containers"]}
    configs = {}
    for c in containers.values():
        assert c["command"] == ["epdserve"]
        stage, configs[stage] = _parse(c["args"])
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert configs[stage].model_path.startswith(mounts["models"] + "/")
    gw, enc, pre, dec = (configs[s] for s in ("gateway", "encoder", "prefill", "decode"))
    predictor = containers["kserve-container"]
    assert predictor["args"][0] == "gateway"  # the gateway is KServe's predictor container
    ports = {p["name"]: p["containerPort"] for p in predictor["ports"]}
    assert gw.host == "0.0.0.0" and ports == {"http1": gw.port, "h2c": gw.kserve_grpc_port}
    assert predictor["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": gw.port}
    assert predictor["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": gw.port}
    assert gw.served_model_name == "{{.Name}}"  # the InferenceService's name, as KServe's URLs have it
    # The stages stay on the pod's loopback, where the gateway finds them.
    assert enc.host == pre.host == dec.host == "127.0.0.1"
    assert gw.encoder_addr == f"127.0.0.1:{enc.port}"
    assert gw.prefill_addr == [f"tcp://127.0.0.1:{pre.zmq_port}"]
    assert gw.decode_addr == [f"tcp://127.0.0.1:{dec.zmq_port}"]
    assert pre.port == dec.port == 0 and pre.kv_transfer == dec.kv_transfer == "zmq"
    bound = [p for stage, cfg in configs.items() for p in _bound_ports(stage, cfg)]
    assert len(bound) == len(set(bound)), bound
    assert len({cfg.model_path for cfg in configs.values()}) == 1
    volumes = {v["name"] for v in runtime["spec"]["volumes"]}
    assert all(m["name"] in volumes for c in containers.values() for m in c["volumeMounts"])
    # The InferenceService picks this runtime and a format it supports, over the v2 protocol.
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"] in runtime["spec"]["supportedModelFormats"] or any(
        f["name"] == model["modelFormat"]["name"] and f.get("version") == model["modelFormat"].get("version")
        for f in runtime["spec"]["supportedModelFormats"])
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
