"""The ``epdserve`` command: one subcommand per server, ``launch`` for all of them, and tools."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import signal
import sys

from epdserve.config import (DecodeConfig, EncoderConfig, GatewayConfig, LaunchConfig, PrefillConfig,
                             add_config_args, config_from_args)
from epdserve.logging_setup import FORMATS, configure_logging
from epdserve.models.presets import PRESETS
from epdserve.models.tiny import ARCH_ALIASES, ARCHS, SIZES

_SERVERS = {
    "encoder": (EncoderConfig, "the encoder (gRPC): images -> embeddings, pushed to prefill TP ranks"),
    "prefill": (PrefillConfig, "the prefill server: prompt KV with a radix cache, sent to decode"),
    "decode": (DecodeConfig, "the decode server: continuous batching, streams tokens"),
    "gateway": (GatewayConfig, "the OpenAI-compatible HTTP gateway"),
    "launch": (LaunchConfig, "all four servers on this machine; Ctrl-C stops them"),
}


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """One line per event (``text``: ``time level logger: message``; ``json``: one object per line), with the
    request id; third-party libraries only above WARNING. See :mod:`epdserve.logging_setup`."""
    configure_logging(level, fmt)


def _run_server(name: str, config) -> int:
    from epdserve.entry.extras import MissingExtra, check_extras
    from epdserve.models.hub import ModelSourceError

    try:  # before anything loads: a bad --model-path or a missing extra is one line, no traceback
        config = _local_model(config)
        check_extras(config)
    except (ModelSourceError, MissingExtra) as e:
        print(f"epdserve {name}: {e}", file=sys.stderr)
        return 2
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr: how to see where a stuck server waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if name == "encoder":
        from epdserve.encoder.server import main
    elif name == "prefill":
        from epdserve.prefill.server import serve as main
    elif name == "decode":
        from epdserve.decode.server import serve as main
    elif name == "gateway":
        from epdserve.gateway.app import main
    else:
        from epdserve.entry.launch import launch as main
    return main(config) or 0


def _local_model(config):
    """``config`` with a hub id ``--model-path`` replaced by its local directory (downloaded first where it is not
    in the Hugging Face cache), the id kept as the served model name unless one is given (as vLLM does); a local
    path is only checked ("", the default model, is left to the stage).

    Raises:
        ModelSourceError: no usable checkpoint at ``config.model_path``.
    """
    from epdserve.models.hub import is_hub_id
    from epdserve.models.paths import resolve_model_path

    if not config.model_path:
        return config
    changes = {"model_path": resolve_model_path(config.model_path, config.revision)}
    if is_hub_id(config.model_path) and not getattr(config, "served_model_name", "x"):
        changes["served_model_name"] = config.model_path
    return dataclasses.replace(config, **changes)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``epdserve`` console script. Returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":  # the benchmark has its own parser (and `bench sweep`)
        from epdserve.bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="epdserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="log level of epdserve's own loggers")
    log_format_help = "log lines as text (default) or JSON objects, one per line"
    parser.add_argument("--log-format", choices=FORMATS, default="text", help=log_format_help)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, help_) in _SERVERS.items():
        server = sub.add_parser(name, help=help_, description=cls.__doc__)
        add_config_args(server, cls)
        # Also after the subcommand (`epdserve prefill --log-format json`); SUPPRESS keeps the global value.
        server.add_argument("--log-format", choices=FORMATS, default=argparse.SUPPRESS, help=log_format_help)
    tiny = sub.add_parser("make-tiny-model", help="write a random-weight checkpoint to DIR (a test model, or a "
                                                  "released model's shapes with --preset)")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", choices=[*ARCH_ALIASES, *ARCHS],
                      help="for --size: qwen2.5-vl (default), qwen2-vl, qwen3-vl, qwen3.5, or qwen3-vl-moe and "
                           "qwen3.5-moe (tiny only) (or the model types qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3_5, "
                           "qwen3_vl_moe, qwen3_5_moe)")
    tiny.add_argument("--seed", type=int, default=0)
    shape = tiny.add_mutually_exclusive_group()
    shape.add_argument("--size", choices=sorted(SIZES), help="tiny for CPU tests, small for GPUs (default tiny)")
    shape.add_argument("--preset", choices=sorted(PRESETS),
                       help="a released model's shapes, bf16 random weights, sharded (GBs: see make_preset_model)")
    tiny.add_argument("--device", help="where --preset weights are drawn (cpu, cuda; default cpu)")
    sub.add_parser("bench", help="the serving benchmark (see `epdserve bench --help`)")
    fetch = sub.add_parser("download", help="fetch a hub checkpoint into the Hugging Face cache (to prepare a "
                                            "machine or an image) and print its local directory")
    fetch.add_argument("model", help="hub id, org/name")
    fetch.add_argument("--revision", default="", help="branch, tag or commit (default: the repo's default branch)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    if args.command == "download":
        from epdserve.models.hub import ModelSourceError, download, is_hub_id

        if not is_hub_id(args.model):
            fetch.error(f"{args.model!r} is not a hub id (org/name)")
        try:
            print(download(args.model, args.revision))
        except ModelSourceError as e:
            print(f"epdserve download: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "make-tiny-model":
        from epdserve.models import presets
        from epdserve.models import tiny as tiny_models

        if args.preset:
            if args.arch:
                tiny.error("--arch applies to --size only (a preset fixes the architecture)")
            print(presets.make_preset_model(args.dir, args.preset, seed=args.seed, device=args.device or "cpu"))
            return 0
        if args.device:
            tiny.error("--device applies to --preset only")
        print(tiny_models.make_tiny_model(args.dir, arch=args.arch or "qwen2_5_vl", seed=args.seed,
                                          size=args.size or "tiny"))
        return 0
    cls, _ = _SERVERS[args.command]
    try:
        config = config_from_args(cls, args)
    except ValueError as e:  # flags that parse but do not fit together: one line and exit 2, as argparse does
        sub.choices[args.command].error(str(e))
    return _run_server(args.command, config)


if __name__ == "__main__":
    sys.exit(main())
