"""Triton's own Python client (``tritonclient.grpc`` and ``tritonclient.http``) against a gateway's v2 services.

Runs in a virtual environment of its own (tests/test_kserve.py makes it): tritonclient's gRPC half needs
protobuf < 7, the server's environment has 7. Imports nothing of epdserve.

Usage:
    python kserve_client.py jobs GRPC_ADDR HTTP_ADDR MODEL < jobs.json   (prints one JSON result per job, a list)
    python kserve_client.py watch GRPC_ADDR HTTP_ADDR MODEL SECONDS      (prints a JSON line at every readiness change)

A job: ``{"proto": "grpc"|"http", "op": "infer"|"stream"|"cancel"|"ready"|"metadata", "inputs": [tensor, ...],
"outputs": [name, ...] (optional), "id": str (optional)}``; a stream job has ``"requests": [{"inputs", "id"}]``
instead (all sent on one stream). A tensor: ``{"name", "datatype", "shape", "data"}``, BYTES data as strings or
``{"path": file}`` for a file's bytes.
"""

from __future__ import annotations

import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def _array(t: dict) -> np.ndarray:
    if t["datatype"] == "BYTES":
        data = [open(d["path"], "rb").read() if isinstance(d, dict) else d.encode() for d in t["data"]]
        return np.array(data, dtype=np.object_).reshape(t["shape"])
    if t["datatype"] == "BOOL":
        return np.array(t["data"], dtype=bool).reshape(t["shape"])
    return np.array(t["data"], dtype=np.int32).reshape(t["shape"])


def _inputs(mod, spec: list[dict]) -> list:
    out = []
    for t in spec:
        inp = mod.InferInput(t["name"], t["shape"], t["datatype"])
        inp.set_data_from_numpy(_array(t))
        out.append(inp)
    return out


def _outputs(result, names: list[str]) -> dict:
    out = {}
    for name in names:
        arr = result.as_numpy(name)
        if arr is not None:
            out[name] = [v.decode() if isinstance(v, bytes) else int(v) for v in arr.reshape(-1)]
    return out


_NAMES = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens"]


def _error(e: InferenceServerException) -> dict:
    return {"ok": False, "status": str(e.status()), "error": e.message()}


def _infer(client, mod, model: str, job: dict) -> dict:
    outputs = [mod.InferRequestedOutput(n) for n in job["outputs"]] if job.get("outputs") else None
    result = client.infer(model, _inputs(mod, job["inputs"]), outputs=outputs, request_id=job.get("id", ""))
    response = result.get_response()
    rid = response.id if job["proto"] == "grpc" else response.get("id")
    return {"ok": True, "id": rid, "outputs": _outputs(result, _NAMES)}


def _stream(client: grpcclient.InferenceServerClient, model: str, job: dict) -> dict:
    events: queue.Queue = queue.Queue()

    def callback(result, error):
        if error is not None:
            events.put({"error": error.message()})
            return
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        events.put({"id": response.id, "final": final, "outputs": _outputs(result, _NAMES)})

    client.start_stream(callback=callback)
    for req in job["requests"]:
        client.async_stream_infer(model, _inputs(grpcclient, req["inputs"]), request_id=req.get("id", ""))
    got, done = [], 0
    while done < len(job["requests"]):
        event = events.get(timeout=120)
        got.append(event)
        done += "error" in event or event["final"]
    client.stop_stream()
    return {"ok": True, "events": got}


def _cancel(client: grpcclient.InferenceServerClient, model: str, job: dict) -> dict:
    """Start a stream, wait for its first response, then cancel the request by closing the stream."""
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put(error))
    client.async_stream_infer(model, _inputs(grpcclient, job["inputs"]), request_id=job.get("id", ""))
    error = events.get(timeout=120)
    client.stop_stream(cancel_requests=True)
    return {"ok": error is None, "error": None if error is None else error.message()}


def _run(job: dict, clients: dict, model: str) -> dict:
    client = clients[job["proto"]]
    mod = grpcclient if job["proto"] == "grpc" else httpclient
    try:
        if job["op"] == "infer":
            return _infer(client, mod, model, job)
        if job["op"] == "stream":
            return _stream(client, model, job)
        if job["op"] == "cancel":
            return _cancel(client, model, job)
        if job["op"] == "ready":
            return {"ok": True, "live": client.is_server_live(), "server": client.is_server_ready(),
                    "model": client.is_model_ready(model)}
        if job["op"] == "metadata":
            if job["proto"] == "grpc":
                return {"ok": True, "server": client.get_server_metadata(as_json=True),
                        "model": client.get_model_metadata(model, as_json=True)}
            return {"ok": True, "server": client.get_server_metadata(), "model": client.get_model_metadata(model)}
    except InferenceServerException as e:
        return _error(e)
    raise ValueError(f"unknown op {job['op']!r}")


def _ready(client) -> bool:
    try:
        return bool(client.is_server_ready())
    except Exception:
        return False


def main(argv: list[str]) -> int:
    mode, grpc_addr, http_addr, model = argv[:4]
    clients = {"grpc": grpcclient.InferenceServerClient(grpc_addr),
               "http": httpclient.InferenceServerClient(http_addr, network_timeout=120, connection_timeout=120)}
    if mode == "jobs":
        print(json.dumps([_run(job, clients, model) for job in json.load(sys.stdin)]))
        return 0
    end, last = time.time() + float(argv[4]), None
    while time.time() < end:
        state = (_ready(clients["grpc"]), _ready(clients["http"]))
        if state != last:
            print(json.dumps({"t": time.time(), "grpc": state[0], "http": state[1]}), flush=True)
            last = state
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
