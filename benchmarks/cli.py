"""``epdserve bench``: the command line of the serving benchmark.

    epdserve bench --base-url URL [--model NAME] [dataset, load and output flags]   one run
    epdserve bench sweep --request-rates 1,2,4 [same flags]                         one run per rate
    epdserve bench stub [--port P --ttft-ms MS --itl-ms MS]                         a stub server to calibrate on

Exit status: 0 when every measured request succeeded, 1 when any failed (they are counted and summarised) or
the run could not start (e.g. every warm-up request failed), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import httpx

from .client import request_body
from .datasets import DATASETS, DatasetOptions, build_requests, with_output_lens
from .metrics import parse_slo, summarize
from .plot import plot_run, plot_sweep
from .report import format_summary, format_sweep, run_payload, sweep_payload, write_json
from .runner import BenchmarkError, LoadConfig, run_benchmark
from .server_metrics import format_server_figures, parse_urls, scrape, server_figures
from .synth import parse_size


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be positive or inf, got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()]


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple(parse_size(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--endpoint", default="/v1/chat/completions", help="chat completions path (default: %(default)s)")
    g.add_argument("--model", help="model name to send (default: the first id from GET /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--header", action="append", default=[], metavar="KEY=VALUE", help="extra HTTP header (repeatable)")

    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random-mm", help="request set (default: %(default)s)")
    g.add_argument("--num-prompts", type=int, help="measured requests (default 100; with --duration: enough for "
                   "1.5x rate*duration, or 1000 at an infinite rate)")
    g.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times (default: 0)")
    g.add_argument("--tokenizer", help="local tokenizer.json or checkpoint dir: exact text token lengths "
                   "(default: one word counts as one token)")
    g.add_argument("--input-len", type=int, default=128, help="text tokens per prompt; for shared-prefix the "
                   "question after the prefix (default: %(default)s)")
    g.add_argument("--output-len", type=int, default=128, help="max_completion_tokens (default: %(default)s)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="draw lengths uniformly from "
                   "[len*(1-r), len*(1+r)] (default: %(default)s)")
    g.add_argument("--image-sizes", type=_sizes, default=((448, 448),), metavar="WxH[,WxH...]",
                   help="synthetic image sizes in pixels, one drawn per image (default: 448x448)")
    g.add_argument("--images-per-request", type=int, default=1, help="images per request (default: %(default)s)")
    g.add_argument("--image-format", choices=("jpeg", "png"), default="jpeg", help="synthetic image encoding")
    g.add_argument("--image-dir", help="image-dir: folder of photos")
    g.add_argument("--prompts-file", help="image-dir: prompts, one per line (default: built-in prompts)")
    g.add_argument("--video-size", type=_size, default=(640, 360), metavar="WxH",
                   help="random-video: clip size in pixels, even numbers (default: 640x360)")
    g.add_argument("--video-frames", type=int, default=16, help="random-video: frames per clip (default: %(default)s)")
    g.add_argument("--video-fps", type=float, default=2.0, help="random-video: frame rate (default: %(default)s)")
    g.add_argument("--video-dir", help="video-dir: folder of video files (mp4, webm, mov, mkv, avi)")
    g.add_argument("--shared-fraction", type=float, default=0.5, help="shared-prefix: share of requests that "
                   "reuse the one system prompt and image (default: %(default)s)")
    g.add_argument("--prefix-len", type=int, default=256,
                   help="shared-prefix: system prompt tokens (default: %(default)s)")
    g.add_argument("--jsonl", help="jsonl: file of OpenAI chat requests (or Batch API lines), one per line")

    g = p.add_argument_group("load")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, help="most requests in flight (default: unlimited)")
    g.add_argument("--duration", type=float, help="stop issuing requests after this many seconds")
    g.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds (default: %(default)s)")

    g = p.add_argument_group("request")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="send ignore_eos: false")
    g.add_argument("--temperature", type=float, help="sampling temperature to send (default: the server's)")
    g.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON", help="fields merged into every body")
    g.add_argument("--output-lens-from", metavar="FILE",
                   help="each request's max_completion_tokens from what the request at its position got in an "
                        "earlier --output-json (e.g. a JSON-schema run, for a plain run of equal token counts)")

    g = p.add_argument_group("output")
    g.add_argument("--output-json", metavar="FILE", help="write every request record and the summary")
    g.add_argument("--plot", metavar="FILE.png", help="write a PNG plot")
    g.add_argument("--slo", help="goodput SLOs in ms, e.g. ttft=500,tpot=50 (keys: ttft, tpot, e2e)")
    g.add_argument("--save-text", action="store_true", help="keep generated text in the JSON records")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    g.add_argument("--label", default="", help="title for tables and plots")
    g.add_argument("--scrape-metrics", metavar="URL[,URL...]", help="Prometheus /metrics URLs of the servers "
                   "(epdserve: the gateway's and each stage's, see `epdserve launch`'s log) to scrape before and "
                   "after the measured requests; their figures are printed beside the client's and saved under "
                   "summary.server_metrics")


def build_parser(sweep: bool = False) -> argparse.ArgumentParser:
    """The argument parser of ``epdserve bench`` (``sweep=True``: of ``epdserve bench sweep``)."""
    p = argparse.ArgumentParser(
        prog="epdserve bench sweep" if sweep else "epdserve bench",
        description=("Run the benchmark once per request rate and plot latency vs throughput."
                     if sweep else "Benchmark an OpenAI-compatible vision chat server (streamed requests)."),
        epilog=None if sweep else "Subcommands: 'epdserve bench sweep --help', 'epdserve bench stub --help'.",
    )
    _add_common(p)
    if sweep:
        p.add_argument("--request-rates", type=_rates, required=True, metavar="R1,R2,...",
                       help="request rates (req/s; 'inf' allowed); run i uses seed+i so runs share no cache")
    else:
        p.add_argument("--request-rate", type=_rate, default=math.inf, help="mean req/s, or inf (default: inf)")
    return p


def _stub_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epdserve bench stub", description="Serve a stub OpenAI chat server with "
                                "injected timings, to calibrate the benchmark client against.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="stub-model")
    p.add_argument("--ttft-ms", type=float, default=200.0)
    p.add_argument("--itl-ms", type=float, default=50.0)
    p.add_argument("--fail-every", type=int, default=0, help="every k-th request answers HTTP 500")
    return p


def chat_url(base_url: str, endpoint: str) -> str:
    """Join base URL and endpoint, tolerating an OpenAI-style base URL that already ends in ``/v1``."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and endpoint.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + "/" + endpoint.lstrip("/")


def _headers(args: argparse.Namespace) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--header must look like KEY=VALUE, got {item!r}")
        headers[key.strip()] = value.strip()
    return headers


def _resolve_model(args: argparse.Namespace, headers: dict[str, str]) -> str:
    if args.model:
        return args.model
    url = chat_url(args.base_url, "/v1/models")
    resp = httpx.get(url, headers=headers, timeout=30.0, trust_env=False)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise BenchmarkError(f"{url} lists no models; pass --model")
    return models[0]["id"]


def _num_prompts(args: argparse.Namespace, rate: float) -> int:
    if args.num_prompts is not None:
        return args.num_prompts
    if args.duration is None:
        return 100
    # Enough requests that the pool outlasts the duration at this rate, without cycling identical requests.
    return 1000 if math.isinf(rate) else math.ceil(rate * args.duration * 1.5) + 10


def _jsonable(value: Any) -> Any:
    """``inf`` as the string ``"inf"``, tuples as lists: strict JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _one_run(args, model: str, url: str, headers: dict[str, str], rate: float, seed: int, slo) -> dict[str, Any]:
    """Build the requests, run them at ``rate`` and print the table; returns ``{config, summary, result}``."""
    num = _num_prompts(args, rate)
    if num <= 0 or args.warmup < 0:
        raise ValueError("--num-prompts must be positive and --warmup not negative")
    opts = DatasetOptions(
        name=args.dataset, seed=seed, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, image_sizes=args.image_sizes, images_per_request=args.images_per_request,
        image_format=args.image_format, image_dir=args.image_dir, prompts_file=args.prompts_file,
        shared_fraction=args.shared_fraction, prefix_len=args.prefix_len, jsonl_path=args.jsonl,
        tokenizer=args.tokenizer, video_size=args.video_size, video_frames=args.video_frames,
        video_fps=args.video_fps, video_dir=args.video_dir,
    )
    if not args.disable_tqdm:
        print(f"preparing {args.warmup} + {num} requests ({args.dataset}, seed {seed})", file=sys.stderr)
    requests = build_requests(opts, args.warmup + num)
    if args.output_lens_from:
        with open(args.output_lens_from) as f:
            requests = with_output_lens(requests, json.load(f))
    bodies = [request_body(r, model, ignore_eos=args.ignore_eos, temperature=args.temperature,
                           extra_body=args.extra_body) for r in requests]
    load = LoadConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      duration_s=args.duration, warmup=args.warmup, seed=seed, timeout_s=args.timeout)
    metrics_urls = parse_urls(args.scrape_metrics)
    scraped: list = []
    result = run_benchmark(url, bodies, requests, load, headers=headers, show_progress=not args.disable_tqdm,
                           keep_text=args.save_text,
                           before_measured=(lambda: scraped.append((scrape(metrics_urls), time.monotonic())))
                           if metrics_urls else None)
    summary = summarize(result, load, slo)
    title = " ".join(x for x in ("Serving Benchmark Result", args.label,
                                 f"@ {rate:g} req/s" if getattr(args, "request_rates", None) else "") if x)
    print(format_summary(summary, title))
    if metrics_urls:
        (before, t0), t1 = scraped[0], time.monotonic()  # the window between the scrapes: the measured run
        summary["server_metrics"] = server_figures(before, scrape(metrics_urls), t1 - t0)
        print(format_server_figures(summary["server_metrics"], summary))
    # No secrets in result files: the API key is dropped and header values (often tokens) are left out.
    config = _jsonable({**{k: v for k, v in vars(args).items() if k != "api_key"}, "model": model, "url": url,
                        "header": [h.partition("=")[0] for h in args.header],
                        "num_prompts": num, "request_rate": rate, "seed": seed})
    return {"config": config, "summary": _jsonable(summary), "result": result}


def _prepare(parser: argparse.ArgumentParser, argv: list[str]):
    """Parse and resolve what every run shares; returns ``(args, model, url, headers, slo)``."""
    args = parser.parse_args(argv)
    headers = _headers(args)
    slo = parse_slo(args.slo)
    model = _resolve_model(args, headers)
    return args, model, chat_url(args.base_url, args.endpoint), headers, slo


def _single(argv: list[str]) -> int:
    args, model, url, headers, slo = _prepare(build_parser(), argv)
    run = _one_run(args, model, url, headers, args.request_rate, args.seed, slo)
    if args.output_json:
        write_json(args.output_json, run_payload(run["config"], run["summary"], run["result"]))
    if args.plot:
        plot_run(run["summary"], run["result"].records, args.plot, args.label or model)
    return 0 if run["summary"]["failed_requests"] == 0 else 1


def _sweep(argv: list[str]) -> int:
    args, model, url, headers, slo = _prepare(build_parser(sweep=True), argv)
    runs = []
    for i, rate in enumerate(args.request_rates):
        # A fresh seed per rate: identical requests in a later run would hit the caches the earlier one filled.
        runs.append(_one_run(args, model, url, headers, rate, args.seed + i, slo))
    print(format_sweep(runs))
    docs = [run_payload(r["config"], r["summary"], r["result"]) for r in runs]
    if args.output_json:
        config = _jsonable({**runs[0]["config"], "request_rate": None, "seed": args.seed,
                            "request_rates": args.request_rates})
        write_json(args.output_json, sweep_payload(config, docs))
    if args.plot:
        plot_sweep(docs, args.plot, args.label or f"{model}: latency vs throughput")
    return 0 if all(r["summary"]["failed_requests"] == 0 for r in runs) else 1


def _stub(argv: list[str]) -> int:
    from .stub import StubBehavior, serve

    a = _stub_parser().parse_args(argv)
    print(f"stub server on http://{a.host}:{a.port} (TTFT {a.ttft_ms:g} ms, ITL {a.itl_ms:g} ms)", file=sys.stderr)
    serve(StubBehavior(ttft_s=a.ttft_ms / 1e3, itl_s=a.itl_ms / 1e3, fail_every=a.fail_every), a.host, a.port, a.model)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``epdserve bench`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status (see module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"sweep": _sweep, "stub": _stub}
    command = commands.get(argv[0], _single) if argv else _single
    rest = argv[1:] if argv and argv[0] in commands else argv
    try:
        return command(rest)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2); the caller gets a status, not an exit
        return e.code if isinstance(e.code, int) else 2
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as e:
        print(f"epdserve bench: error: {e}", file=sys.stderr)
        return 2
    except (BenchmarkError, httpx.HTTPError) as e:
        print(f"epdserve bench: error: {e}", file=sys.stderr)
        return 1
