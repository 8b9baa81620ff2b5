"""What ``epdserve launch`` starts: every process's command line, ports and GPUs (:func:`plan_launch`).

Processes, in start order: ``--num-encoders`` encoders (``encoder0``..), ``--num-prefills`` prefill servers and
``--num-decodes`` decode servers (``prefill`` and ``decode`` when there is one of the role, else ``prefill0``..,
``decode0``..), and the gateway, which gets every encoder's, prefill server's and decode server's address. Internal
servers bind 127.0.0.1 on ports taken from the free ports in one go, so no two collide.

GPU placement applies when the stages go on GPUs (device ``cuda`` or ``auto`` with CUDA): encoder ``i`` runs on
``cuda:encoder_gpus[i]``; prefill server ``i``'s TP rank ``r`` on GPU ``prefill_gpus[i] + r`` (``--prefill-tp``
ranks), likewise decode. Each list flag takes one value for every server of its role or one per server.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from epdserve.config import LaunchConfig
from epdserve.logging_setup import active_format
from epdserve.wire.ports import LOCAL, free_ports


@dataclass
class LaunchPlan:
    """Every process of one launch.

    Attributes:
        commands: process name -> its command line, in start order (the gateway last).
        roles: process name -> ``"encoder"``, ``"prefill"``, ``"decode"`` or ``"gateway"``.
        encoders: the encoders' gRPC addresses (host:port), in order.
        metrics: process name -> its ``/metrics`` URL.
        gpus: process name -> the GPUs it runs on (every TP rank's); empty when the stages are not on GPUs.
    """

    commands: dict[str, list[str]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    encoders: list[str] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)
    gpus: dict[str, list[int]] = field(default_factory=dict)

    def names(self, role: str) -> list[str]:
        """The processes of ``role``, in order."""
        return [name for name, r in self.roles.items() if r == role]


def server_names(role: str, count: int) -> list[str]:
    """Process names of ``count`` servers of ``role``: ``encoder0``.. always; ``prefill``/``decode`` alone when there
    is one, else ``prefill0``.. (one server keeps the name launch has always given it)."""
    if count == 1 and role != "encoder":
        return [role]
    return [f"{role}{i}" for i in range(count)]


def plan_launch(cfg: LaunchConfig, model_path: str, on_gpus: bool) -> LaunchPlan:
    """The processes ``cfg`` asks for, serving ``model_path`` (a local directory).

    Args:
        on_gpus: whether the stages go on GPUs (the placement flags apply; else every stage gets ``cfg.device``).

    Raises:
        ValueError: a per-server list flag with as many values as neither 1 nor its servers (see
            :meth:`LaunchConfig.per_server`).
    """
    enc_gpus = cfg.per_server("encoder_gpus")
    pre_tp, pre_gpus = cfg.per_server("prefill_tp"), cfg.per_server("prefill_gpus")
    dec_tp, dec_gpus = cfg.per_server("decode_tp"), cfg.per_server("decode_gpus")
    # The gateway binds its own ports later: none of the drawn ones may be one of them.
    ports = iter(free_ports(2 * cfg.num_encoders + 4 * cfg.num_prefills + 3 * cfg.num_decodes,
                            exclude={cfg.port, cfg.kserve_grpc_port}))
    plan = LaunchPlan()
    level = logging.getLevelName(logging.getLogger("epdserve").getEffectiveLevel())
    exe = [sys.executable, "-m", "epdserve", "--log-level", level, "--log-format", active_format()]
    common = ["--model-path", model_path, "--dtype", cfg.dtype]
    lm = [*common, "--device", cfg.device, "--page-size", str(cfg.page_size), "--num-pages", str(cfg.num_pages),
          "--kv-transfer", cfg.kv_transfer,
          "--disable-custom-all-reduce" if cfg.disable_custom_all_reduce else "--no-disable-custom-all-reduce"]

    def add(name: str, role: str, args: list[str], metrics_port: int, gpus: list[int]) -> None:
        plan.commands[name] = [*exe, role, *args, "--metrics-port", str(metrics_port)]
        plan.roles[name] = role
        plan.metrics[name] = f"http://{LOCAL}:{metrics_port}/metrics"
        if on_gpus:
            plan.gpus[name] = gpus

    for name, gpu in zip(server_names("encoder", cfg.num_encoders), enc_gpus):
        port = next(ports)
        plan.encoders.append(f"{LOCAL}:{port}")
        add(name, "encoder", [*common, "--device", f"cuda:{gpu}" if on_gpus else cfg.device, "--port", str(port),
                              "--cuda-graphs", str(cfg.encoder_cuda_graphs),
                              "--compile" if cfg.encoder_compile else "--no-compile",
                              "--gpu-jpeg-decode" if cfg.encoder_gpu_jpeg_decode else "--no-gpu-jpeg-decode",
                              "--max-video-frames", str(cfg.max_video_frames),
                              "--max-video-duration-s", repr(cfg.max_video_duration_s)], next(ports), [gpu])
    prefills, decodes = [], []
    for name, tp, gpu in zip(server_names("prefill", cfg.num_prefills), pre_tp, pre_gpus):
        zmq_port = next(ports)
        prefills.append(f"tcp://{LOCAL}:{zmq_port}")
        # --port 0: no HTTP front (that is for a PD router such as smg); the gateway speaks ZMQ to the stages.
        add(name, "prefill", [*lm, "--port", "0", "--zmq-port", str(zmq_port), "--embed-port", str(next(ports)),
                              "--bootstrap-port", str(next(ports)), "--tp", str(tp), "--base-gpu-id", str(gpu),
                              "--cuda-graph-max-tokens", str(cfg.prefill_cuda_graph_max_tokens),
                              "--chunked-prefill-size", str(cfg.prefill_chunked_prefill_size),
                              "--max-prefill-tokens", str(cfg.prefill_max_prefill_tokens)],
            next(ports), list(range(gpu, gpu + tp)))
    for name, tp, gpu in zip(server_names("decode", cfg.num_decodes), dec_tp, dec_gpus):
        zmq_port = next(ports)
        decodes.append(f"tcp://{LOCAL}:{zmq_port}")
        add(name, "decode", [*lm, "--port", "0", "--zmq-port", str(zmq_port), "--kv-port", str(next(ports)),
                             "--tp", str(tp), "--base-gpu-id", str(gpu)], next(ports), list(range(gpu, gpu + tp)))
    plan.commands["gateway"] = [
        *exe, "gateway", "--model-path", model_path, "--served-model-name", cfg.served_model_name, "--host", cfg.host,
        "--port", str(cfg.port), "--encoder-addr", ",".join(plan.encoders), "--prefill-addr", ",".join(prefills),
        "--decode-addr", ",".join(decodes), "--api-key", cfg.api_key, "--kserve-grpc-port", str(cfg.kserve_grpc_port),
        "--max-video-bytes", str(cfg.max_video_bytes), "--max-n", str(cfg.max_n), "--stage-timeout-s",
        repr(cfg.stage_timeout_s), "--max-video-frames", str(cfg.max_video_frames), "--max-video-duration-s",
        str(cfg.max_video_duration_s)]
    plan.roles["gateway"] = "gateway"
    gateway_host = LOCAL if cfg.host in ("0.0.0.0", "::") else cfg.host
    plan.metrics = {"gateway": f"http://{gateway_host}:{cfg.port}/metrics", **plan.metrics}
    return plan
