"""One typed config per server; each field is one CLI flag (``--field-name``), so the two never drift.

Internal ports bind 127.0.0.1 unless ``--host`` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field


def _f(default, help: str):
    if isinstance(default, list):  # a list flag: every instance gets its own copy of the default
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _like(cls: type, name: str, help: str = ""):
    """The field ``name`` of ``cls`` again, same default (and help unless given): a launcher flag that sets a
    stage's flag cannot drift from it."""
    src = cls.__dataclass_fields__[name]
    return field(default=src.default, metadata={"help": help or src.metadata["help"]})


def as_list(value, item: type, flag: str) -> list:
    """A list flag's value as a list of ``item``: a list as is, or one value or a comma-separated string (what a
    caller building a config by hand may pass), each item converted by ``item``.

    Raises:
        ValueError: an item ``item`` does not take, or no item at all (``flag`` names the flag).
    """
    parts = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        out = [item(p.strip()) if isinstance(p, str) else item(p) for p in parts if not isinstance(p, str) or p.strip()]
    except (TypeError, ValueError):
        raise ValueError(f"{flag}: {value!r} is not a list of {item.__name__} (comma-separated)") from None
    if not out:
        raise ValueError(f"{flag} needs at least one value")
    return out


@dataclass
class EncoderConfig:
    """The encoder server (gRPC): vision tower + image and video processors + embedding cache."""

    model_path: str = _f("", "local Hugging Face checkpoint directory, or a hub id (org/name: downloaded into the "
                             "Hugging Face cache, or found there) (default: the tiny model)")
    revision: str = _f("", "branch, tag or commit of a hub id --model-path (default: the repo's default branch)")
    host: str = _f("127.0.0.1", "address to bind the gRPC server to")
    port: int = _f(50051, "gRPC port")
    device: str = _f("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    dtype: str = _f("auto", "float32, bfloat16, float16, or auto (bfloat16 on cuda, float32 on cpu)")
    cache_size_mb: int = _f(1024, "embedding cache capacity in MiB (LRU by image hash)")
    max_message_mb: int = _f(256, "largest gRPC message accepted or sent, in MiB")
    max_image_pixels: int = _f(64_000_000, "largest decoded image (width*height) accepted; also per video frame")
    max_video_frames: int = _f(768, "most frames sampled from one video (after the checkpoint's fps sampling or a "
                                    "request's num_frames); more is an INVALID_ARGUMENT")
    max_video_duration_s: float = _f(600.0, "longest video accepted, in seconds of playback")
    batch_wait_ms: float = _f(2.0, "how long an image may wait, while the tower is idle, for images of other "
                                   "requests already being decoded to share its tower call, in ms; 0 = run as "
                                   "soon as the tower is free")
    max_batch_patches: int = _f(65536, "most patches (before the 2x2 merge) in one tower call (64 images of "
                                       "448x448); a larger image runs alone")
    metrics_port: int = _f(50151, "HTTP port of /metrics (Prometheus text format) next to the gRPC port; 0 = a "
                                  "free port")
    cuda_graphs: int = _f(32, "vision-tower CUDA graphs to keep, one per image grid, for tower calls of one image "
                              "(batches run eagerly), captured on a grid's second lone use (CUDA, bf16/fp16); 0 = "
                              "none. Cuts one-image latency (see docs/performance.md)")
    compile: bool = _f(True, "run the vision tower's blocks through torch.compile on CUDA in bf16/fp16 (fused "
                             "elementwise kernels, aligned GEMMs); compiles on a thread beside serving (seconds: "
                             "the eager tower serves until then)")
    gpu_jpeg_decode: bool = _f(True, "decode JPEGs on the GPU with nvJPEG when the device is CUDA (1280x720: "
                                     "20 ms less per image on an H100 host); its pixels differ from PIL's (under a "
                                     "level on photos; its chroma upsampling differs where colour changes every "
                                     "pixel); --no-gpu-jpeg-decode decodes every image with PIL, as transformers "
                                     "does")
    bootstrap_port: int = _f(0, "serve smg's --epd-disaggregation encode protocol (TokenSpeed's TokenSpeedEncoder "
                                "and its scheduler's discovery RPCs, on --port) and hold each embedding under its "
                                "bootstrap room on this ZMQ port until the prefill smg chose claims it (smg: "
                                "--encode grpc://HOST:PORT BOOTSTRAP_PORT); 0 = off")
    room_timeout_s: float = _f(60.0, "drop an embedding held for a bootstrap room that no prefill claims within this "
                                     "many seconds of its Encode (smg never says when a request is abandoned)")


@dataclass
class LMServerConfig:
    """What the prefill and decode servers share: the language model, its KV pool, and the bind address."""

    model_path: str = _f("", "local Hugging Face checkpoint directory, or a hub id (org/name: downloaded into the "
                             "Hugging Face cache, or found there) (default: the tiny model)")
    revision: str = _f("", "branch, tag or commit of a hub id --model-path (default: the repo's default branch)")
    host: str = _f("127.0.0.1", "address to bind all sockets to, and to advertise")
    device: str = _f("auto", "cpu, cuda, cuda:N, or auto")
    dtype: str = _f("auto", "float32, bfloat16, float16, or auto")
    page_size: int = _f(16, "tokens per KV page")
    num_pages: int = _f(0, "KV pages in the pool; 0 sizes it from --mem-fraction on cuda, 4096 on cpu")
    mem_fraction: float = _f(0.5, "share of free GPU memory given to the KV pool when --num-pages is 0")
    context_length: int = _f(0, "longest prompt + output in tokens; 0 = the model's max_position_embeddings")
    attention_backend: str = _f("auto", "sdpa, flashinfer, or auto (flashinfer on cuda)")
    decode_attention_backend: str = _f("auto", "decode batches' attention kernel under the flashinfer backend: "
                                               "'flashinfer' (its paged decode), 'triton' (epdserve's split-KV "
                                               "kernel), or auto (triton up to head_dim 128, where it was measured)")
    request_timeout_s: float = _f(120.0, "drop a request whose inputs (embeddings, KV, registration) never come; "
                                         "also how long a bootstrap room whose partner never comes holds its KV")
    served_model_name: str = _f("", "model name the HTTP front serves (see --port); default: the model path")
    grpc_port: int = _f(0, "port of SGLang's scheduler gRPC service (sglang.grpc.scheduler.SglangScheduler, for smg "
                           "with grpc:// workers; needs the smg-grpc extra), served by the front process beside "
                           "--port; 0 = off")
    grpc_protocol: str = _f("sglang", "what --grpc-port speaks: 'sglang' (SGLang's scheduler protocol: smg's "
                                      "--pd-disaggregation) or 'tokenspeed' (TokenSpeed's, whose prefill takes image "
                                      "embeddings from smg's encode workers: smg's --epd-disaggregation)")
    kv_transfer: str = _f("auto", "prefill->decode KV path: 'zmq' (through host memory and ZeroMQ), 'shared' "
                                  "(decode maps the prefill KV pool when both run on this machine and copies pages "
                                  "device to device: CUDA IPC, or /dev/shm on CPU; zmq otherwise), or 'auto' "
                                  "(shared on CUDA, zmq on CPU). On a CUDA prefill server, anything but 'zmq' also "
                                  "takes embeddings from an encoder on this machine through GPU memory (CUDA IPC). "
                                  "'nixl' or 'mooncake': prefill writes the KV (and a hybrid model's DeltaNet "
                                  "state) straight into decode's pages (and state slot) through that transfer "
                                  "engine, any TP sizes on either side (pip install 'epdserve[nixl]' / "
                                  "'[mooncake]')")
    tp: int = _f(1, "tensor-parallel ranks: this process is rank 0 and starts ranks 1..tp-1 (one GPU each)")
    base_gpu_id: int = _f(0, "TP rank r runs on cuda:(base_gpu_id + r) (when the device is cuda or auto)")
    disable_custom_all_reduce: bool = _f(False, "TP on CUDA: every all-reduce through NCCL, none through the "
                                                "one-shot kernel over symmetric memory (decode-sized messages)")


@dataclass
class PrefillConfig(LMServerConfig):
    """The prefill server (ZMQ): builds KV with a radix cache and ships it to decode servers."""

    port: int = _f(30000, "HTTP port (OpenAI API + SGLang-style bootstrap fields, for a PD router such as smg); "
                          "0 = no HTTP front")
    zmq_port: int = _f(30001, "ZMQ port for requests from epdserve gateways and the HTTP front")
    encoder_urls: str = _f("", "encoders (gRPC host:port[,host:port...]) the HTTP front sends a request's images to, "
                               "each image to one chosen by its content hash")
    embed_port: int = _f(30101, "ZMQ port receiving image embeddings (TP rank 0; other ranks bind free ports)")
    bootstrap_port: int = _f(8998, "ZMQ port where decode servers register for a request's KV (bootstrap)")
    max_prefill_tokens: int = _f(8192, "new tokens computed in one prefill forward (several requests batch)")
    chunked_prefill_size: int = _f(2048, "most new tokens of one request in one prefill forward: a longer prompt is "
                                         "prefilled in chunks over several forwards, beside other requests' "
                                         "chunks, so it does not stall them; 0 = up to --max-prefill-tokens")
    cuda_graph_max_tokens: int = _f(2048, "longest one-request prefill forward (new tokens) replayed from a CUDA "
                                          "graph (flashinfer backend); longer ones and batches of several requests "
                                          "run eagerly; 0 = every prefill eagerly")
    state_snapshot_slots: int = _f(32, "hybrid models (Qwen3.5): linear-attention state snapshots the radix cache "
                                       "keeps at chunk ends (LRU), so a prefix hit also has the state at its end; "
                                       "each takes one request's state memory; 0 = no prefix hits")
    metrics_port: int = _f(30301, "HTTP port of /metrics (Prometheus text format); 0 = a free port")


@dataclass
class DecodeConfig(LMServerConfig):
    """The decode server (ZMQ): receives KV, continuous batching, streams tokens to gateways."""

    port: int = _f(30010, "HTTP port (OpenAI API + SGLang-style bootstrap fields, for a PD router such as smg); "
                          "0 = no HTTP front")
    zmq_port: int = _f(30002, "ZMQ port for requests from epdserve gateways and the HTTP front")
    kv_port: int = _f(30201, "ZMQ port receiving KV transfers from prefill servers")
    max_running_requests: int = _f(256, "most requests in one decode batch")
    cuda_graph_max_bs: int = _f(256, "largest decode batch replayed from a CUDA graph (capped at "
                                     "--max-running-requests); larger batches run eagerly")
    disable_cuda_graph: bool = _f(False, "run every decode step eagerly (CUDA graphs need the flashinfer backend)")
    metrics_port: int = _f(30302, "HTTP port of /metrics (Prometheus text format); 0 = a free port")


@dataclass
class GatewayConfig:
    """The OpenAI-compatible HTTP gateway that coordinates encoder, prefill and decode."""

    model_path: str = _f("", "local Hugging Face checkpoint directory, or a hub id (org/name: downloaded into the "
                             "Hugging Face cache, or found there) (default: the tiny model)")
    revision: str = _f("", "branch, tag or commit of a hub id --model-path (default: the repo's default branch)")
    served_model_name: str = _f("", "model name clients send; default: the model path")
    host: str = _f("127.0.0.1", "address to bind the HTTP server to")
    port: int = _f(8000, "HTTP port")
    encoder_addr: str = _f("127.0.0.1:50051", "encoder gRPC address host:port, or several as host:port,host:port "
                                              "(each image goes to one, chosen by its content hash)")
    prefill_addr: list[str] = _f(["tcp://127.0.0.1:30001"], "prefill server ZMQ endpoint; several: repeat the flag "
                                                            "or comma-separate (each request goes to one, chosen "
                                                            "cache-aware: see --cache-threshold)")
    decode_addr: list[str] = _f(["tcp://127.0.0.1:30002"], "decode server ZMQ endpoint; several: repeat the flag or "
                                                           "comma-separate (each request goes to the one with the "
                                                           "fewest requests in flight, then the most free KV pages)")
    cache_threshold: float = _f(0.3, "several prefill servers: a prompt goes to the server whose cache (as the "
                                     "gateway recorded it) holds its longest prefix when that prefix is over this "
                                     "share of the prompt, else to the server with the least cached (smg's "
                                     "cache_aware rule)")
    balance_abs_threshold: int = _f(64, "several prefill servers: they count as imbalanced, and the least loaded "
                                        "takes the request whatever is cached, when the most and least loaded differ "
                                        "by more than this many requests in flight ...")
    balance_rel_threshold: float = _f(1.5, "... and the most loaded has more than this many times the least's")
    routing_tree_pages: int = _f(1 << 16, "largest record of one prefill server's cache that the gateway keeps for "
                                          "routing, in KV pages (least recently used parts dropped beyond it)")
    api_key: str = _f("", "require 'Authorization: Bearer KEY' when set")
    max_image_bytes: int = _f(20 * 1024 * 1024, "largest image accepted, in bytes (after base64 decoding)")
    max_video_bytes: int = _f(250 * 1024 * 1024, "largest video accepted, in bytes (after base64 decoding; under "
                                                 "the encoder's 256 MiB gRPC message)")
    max_video_frames: int = _f(768, "most frames sampled from one video (after fps/num_frames sampling); a request "
                                    "over it gets 400")
    max_video_duration_s: float = _f(600.0, "longest video accepted, in seconds of playback; longer ones get 400")
    allow_remote_images: bool = _f(False, "allow http(s) image URLs (fetched by the gateway)")
    allowed_local_media_path: str = _f("", "allow file:// image URLs under this directory")
    max_tokens_default: int = _f(0, "max completion tokens when the request gives none; 0 = up to the context")
    max_n: int = _f(16, "most choices (n, sampling_params.n) one request may ask for; more get 400. The choices "
                        "share one prefill and the prompt's KV pages at decode, but each takes a decode batch slot")
    stage_timeout_s: float = _f(10.0, "seconds of silence after which prefill, decode or an encoder is taken as "
                                      "down: its requests end with 503, new ones get 503 until it answers again")
    heartbeat_interval_s: float = _f(1.0, "seconds between liveness probes of each stage")
    request_timeout_s: float = _f(0.0, "longest a chat request may take end to end, in seconds (then 504, or an "
                                       "error event on a stream); 0 = no limit")
    max_inflight_requests: int = _f(1024, "chat requests in flight at once; more wait in the queue (0 = no limit)")
    max_queued_requests: int = _f(1024, "requests waiting for a slot; beyond this 429 with Retry-After")
    queue_timeout_s: float = _f(30.0, "longest wait for a slot in seconds, then 503 with Retry-After")
    kserve_grpc_port: int = _f(0, "port of the Open Inference Protocol v2 gRPC service (inference."
                                  "GRPCInferenceService, KServe's and Triton's; bound on --host); 0 = off. The v2 "
                                  "HTTP routes (/v2/...) are always on --port")

    def __post_init__(self):
        # A config built by hand may name one address or a comma-separated string, as the flag does.
        for name in ("prefill_addr", "decode_addr"):
            addrs = as_list(getattr(self, name), str, "--" + name.replace("_", "-"))
            if len(set(addrs)) != len(addrs):
                raise ValueError(f"--{name.replace('_', '-')} names a server twice: {addrs}")
            setattr(self, name, addrs)
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be within [0, 1], got {self.cache_threshold}")


@dataclass
class LaunchConfig:
    """``epdserve launch``: all four servers (``--num-encoders`` encoders) on this machine, internal ports free."""

    model_path: str = _like(LMServerConfig, "model_path")
    revision: str = _like(LMServerConfig, "revision")
    served_model_name: str = _like(GatewayConfig, "served_model_name")
    host: str = _f("127.0.0.1", "address the gateway binds to (internal servers always bind 127.0.0.1)")
    port: int = _f(8000, "gateway HTTP port; internal ports are taken from free ports")
    device: str = _like(LMServerConfig, "device", "device for every stage: cpu, cuda, cuda:N, or auto")
    dtype: str = _like(LMServerConfig, "dtype", "dtype for every stage: float32, bfloat16, float16, or auto")
    page_size: int = _like(LMServerConfig, "page_size")
    num_pages: int = _like(LMServerConfig, "num_pages", "KV pages per pool (prefill and decode each); 0 = automatic")
    api_key: str = _like(GatewayConfig, "api_key")
    kserve_grpc_port: int = _like(GatewayConfig, "kserve_grpc_port")
    max_video_bytes: int = _like(GatewayConfig, "max_video_bytes")
    max_n: int = _like(GatewayConfig, "max_n")
    stage_timeout_s: float = _like(GatewayConfig, "stage_timeout_s")
    # One pair of video limits for the gateway (400 before encoding) and every encoder (its own check).
    max_video_frames: int = _like(GatewayConfig, "max_video_frames")
    max_video_duration_s: float = _like(GatewayConfig, "max_video_duration_s")
    num_encoders: int = _f(1, "encoder processes to start; the gateway routes each image to one by content hash")
    num_prefills: int = _f(1, "prefill servers to start; the gateway chooses one per request (cache-aware)")
    num_decodes: int = _f(1, "decode servers to start; the gateway chooses one per request (by load)")
    prefill_tp: list[int] = _f([1], "tensor-parallel ranks of each prefill server (one GPU each): one value for "
                                    "every server, or one per server (comma-separated)")
    decode_tp: list[int] = _f([1], "tensor-parallel ranks of each decode server: one value for every server, or "
                                   "one per server")
    encoder_gpus: list[int] = _f([0], "GPU index of each encoder (cuda:N) when the device is cuda or auto: one for "
                                      "every encoder, or one per encoder")
    prefill_gpus: list[int] = _f([0], "first GPU of each prefill server: TP rank r of server i runs on GPU "
                                      "prefill_gpus[i] + r; one value for every server, or one per server")
    decode_gpus: list[int] = _f([0], "first GPU of each decode server (as --prefill-gpus)")
    kv_transfer: str = _like(LMServerConfig, "kv_transfer")
    disable_custom_all_reduce: bool = _like(LMServerConfig, "disable_custom_all_reduce")
    encoder_cuda_graphs: int = _like(EncoderConfig, "cuda_graphs")
    prefill_cuda_graph_max_tokens: int = _like(PrefillConfig, "cuda_graph_max_tokens")
    prefill_chunked_prefill_size: int = _like(PrefillConfig, "chunked_prefill_size")
    prefill_max_prefill_tokens: int = _like(PrefillConfig, "max_prefill_tokens")
    encoder_compile: bool = _like(EncoderConfig, "compile")
    encoder_gpu_jpeg_decode: bool = _like(EncoderConfig, "gpu_jpeg_decode")
    mps: bool = _f(True, "run the stages that share a GPU under CUDA MPS (a daemon the launcher starts and stops; "
                         "kernels of several stages run at once); --no-mps: the GPU time-slices between them")

    def __post_init__(self):
        for name in ("num_encoders", "num_prefills", "num_decodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("prefill_tp", "decode_tp", "encoder_gpus", "prefill_gpus", "decode_gpus"):
            setattr(self, name, as_list(getattr(self, name), int, "--" + name.replace("_", "-")))
            self.per_server(name)  # as many values as servers (or one), each in range: a clear error now

    def per_server(self, name: str) -> list[int]:
        """The list flag ``name`` (``prefill_tp``, ``decode_gpus``, ``encoder_gpus``..) with one value per server of
        its role: a single value repeats for every server.

        Raises:
            ValueError: as many values as neither 1 nor the servers of that role, or a value out of range (TP
                below 1, a negative GPU index).
        """
        role = name.split("_")[0]
        count = {"encoder": self.num_encoders, "prefill": self.num_prefills, "decode": self.num_decodes}[role]
        values, flag = getattr(self, name), "--" + name.replace("_", "-")
        if len(values) not in (1, count):
            raise ValueError(f"{flag} has {len(values)} values for {count} {role} server(s): give one, or one each")
        low = 1 if name.endswith("_tp") else 0
        if min(values) < low:
            raise ValueError(f"{flag} values must be at least {low}, got {values}")
        return values * count if len(values) == 1 else list(values)


def _base_type(tp):
    """``int | None`` -> ``int``; plain types unchanged."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--kebab-case`` flag per field of the config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        elif typing.get_origin(tp) is list:
            default = f.default_factory()
            parser.add_argument(flag, action=_ListAction, item=typing.get_args(tp)[0], default=default,
                                help=f"{help_} (default: {','.join(map(str, default))})")
        else:
            parser.add_argument(flag, type=tp, default=f.default, help=f"{help_} (default: {f.default!r})")


class _ListAction(argparse.Action):
    """A list flag: comma-separated values, the flag repeatable; the values given replace the default."""

    def __init__(self, *args, item: type = str, **kwargs):
        super().__init__(*args, **kwargs)
        self.item = item

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            new = as_list(values, self.item, option_string)
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        seen = getattr(namespace, self.dest)
        # The first use replaces the default; later ones add to it.
        setattr(namespace, self.dest, new if seen is self.default else [*seen, *new])


def config_from_args(cls: type, args: argparse.Namespace):
    """Build ``cls`` from parsed arguments made by :func:`add_config_args`."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
