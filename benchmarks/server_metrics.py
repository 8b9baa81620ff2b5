"""Server-side figures for ``epdserve bench --scrape-metrics URL[,URL...]``: scrape the servers' Prometheus
``/metrics`` before and after a run, and report what moved beside the client's own figures.

Works on epdserve's metrics (``epdserve:*``, every sample labelled with its ``stage``); samples of several URLs
with the same name and labels (two encoders) are added up. Histograms give means over the run
(delta sum / delta count). Figures are ``None`` where a server exported nothing for them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
P = "epdserve:"


def parse_exposition(text: str) -> Samples:
    """Prometheus text format -> ``{(sample name, sorted label pairs): value}``.

    Raises:
        ValueError: the text does not parse.
    """
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(urls: list[str], timeout_s: float = 10.0) -> Samples:
    """Scrape every URL and add up equal samples.

    Raises:
        httpx.HTTPError: a URL did not answer 200.
        ValueError: an answer is not the Prometheus text format.
    """
    total: Samples = defaultdict(float)
    for url in urls:
        resp = httpx.get(url, timeout=timeout_s, trust_env=False)
        resp.raise_for_status()
        for key, value in parse_exposition(resp.text).items():
            total[key] += value
    return dict(total)


def parse_urls(text: str | None) -> list[str]:
    """``"URL,URL"`` -> the URLs (``/metrics`` appended to a bare ``http://host:port``)."""
    urls = []
    for u in (text or "").split(","):
        u = u.strip()
        if not u:
            continue
        if u.rstrip("/").count("/") == 2:  # scheme://host:port
            u = u.rstrip("/") + "/metrics"
        urls.append(u)
    return urls


class _Delta:
    def __init__(self, before: Samples, after: Samples) -> None:
        self.d: Samples = {k: v - before.get(k, 0.0) for k, v in after.items()}

    def total(self, name: str, **labels: str) -> float | None:
        """Sum of the deltas of samples ``name`` whose labels include ``labels``; None when there is none."""
        want = set(labels.items())
        vals = [v for (n, ls), v in self.d.items() if n == name and want <= set(ls)]
        return sum(vals) if vals else None

    def mean(self, hist: str, scale: float = 1.0, **labels: str) -> float | None:
        s, c = self.total(hist + "_sum", **labels), self.total(hist + "_count", **labels)
        return None if not c else s / c * scale

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        want = set(labels.items())
        out: dict[str, float] = defaultdict(float)
        for (n, ls), v in self.d.items():
            if n == name and want <= set(ls) and v:
                out[dict(ls).get(label, "")] += v
        return dict(out)


def server_figures(before: Samples, after: Samples, seconds: float | None = None) -> dict[str, Any]:
    """What moved between two scrapes, by stage (latencies in ms). Keys mirror the metric names.

    ``seconds``, the wall time between the scrapes, gives each stage's ``device_busy_share``: its device seconds
    (``device_busy_seconds_total``, summed over the stage's processes) per second of the run, the share of the
    time its GPU was at its work (issue 45: which stage limits a GPU that stages share)."""
    d = _Delta(before, after)
    ms = 1000.0
    out: dict[str, Any] = {}
    for stage in ("gateway", "encoder", "prefill", "decode"):
        g: dict[str, Any] = {
            "requests": d.total(P + "num_requests_total", stage=stage),
            "requests_by_outcome": d.by_label(P + "num_requests_total", "outcome", stage=stage),
            "errors": d.by_label(P + "errors_total", "kind", stage=stage),
        }
        if stage == "gateway":
            g |= {"prompt_tokens": d.total(P + "prompt_tokens_total", stage=stage),
                  "generation_tokens": d.total(P + "generation_tokens_total", stage=stage),
                  "cached_tokens": d.total(P + "cached_tokens_total", stage=stage),
                  "ttft_ms_mean": d.mean(P + "time_to_first_token_seconds", ms, stage=stage),
                  "tpot_ms_mean": d.mean(P + "time_per_output_token_seconds", ms, stage=stage),
                  "itl_ms_mean": d.mean(P + "inter_token_latency_seconds", ms, stage=stage),
                  "e2e_ms_mean": d.mean(P + "e2e_request_latency_seconds", ms, stage=stage),
                  "encode_wait_ms_mean": d.mean(P + "encode_request_latency_seconds", ms, stage=stage)}
        if stage == "encoder":
            g |= {"images": d.total(P + "encoder_images_total", stage=stage),
                  "images_encoded": d.total(P + "images_encoded_total", stage=stage),
                  "cache_hits": d.total(P + "embedding_cache_hits_total", stage=stage),
                  "cache_misses": d.total(P + "embedding_cache_misses_total", stage=stage),
                  "batch_size_mean": d.mean(P + "batch_size", stage=stage),
                  "encode_latency_ms_mean": d.mean(P + "encode_latency_seconds", ms, stage=stage),
                  "image_decode_ms_mean": d.mean(P + "image_decode_seconds", ms, stage=stage),
                  "embedding_push_ms_mean": d.mean(P + "embedding_push_seconds", ms, stage=stage),
                  "bytes_sent": d.total(P + "embedding_bytes_sent_total", stage=stage)}
        if stage == "prefill":
            g |= {"prompt_tokens": d.total(P + "prompt_tokens_total", stage=stage),
                  "cached_tokens": d.total(P + "cached_tokens_total", stage=stage),
                  "cached_image_tokens": d.total(P + "cached_image_tokens_total", stage=stage),
                  "batch_size_mean": d.mean(P + "batch_size", stage=stage),
                  "kv_bytes_sent": d.total(P + "kv_transfer_bytes_total", stage=stage)}
        if stage == "decode":
            g |= {"generation_tokens": d.total(P + "generation_tokens_total", stage=stage),
                  "tpot_ms_mean": d.mean(P + "time_per_output_token_seconds", ms, stage=stage),
                  "batch_size_mean": d.mean(P + "batch_size", stage=stage),
                  "kv_bytes_received": d.total(P + "kv_transfer_bytes_total", stage=stage),
                  "kv_transfer_latency_ms_mean": d.mean(P + "kv_transfer_latency_seconds", ms, stage=stage),
                  "step_launch_ms_mean": d.mean(P + "step_launch_seconds", ms, stage=stage),
                  "step_wait_ms_mean": d.mean(P + "step_wait_seconds", ms, stage=stage),
                  "grammar_fill_ms_mean": d.mean(P + "grammar_fill_seconds", ms, stage=stage),
                  "grammar_accept_ms_mean": d.mean(P + "grammar_accept_seconds", ms, stage=stage)}
        if stage != "gateway":
            busy = d.total(P + "device_busy_seconds_total", stage=stage)
            g |= {"queue_time_ms_mean": d.mean(P + "queue_time_seconds", ms, stage=stage),
                  "stage_latency_ms_mean": d.mean(P + "stage_latency_seconds", ms, stage=stage),
                  "device_busy_s": busy,
                  "device_busy_share": None if busy is None or not seconds else busy / seconds}
        if stage in ("prefill", "decode"):
            g["kv_failures"] = d.by_label(P + "kv_transfer_failures_total", "reason", stage=stage)
        if g["requests"] is not None or any(v for k, v in g.items() if k not in ("errors", "requests_by_outcome")):
            out[stage] = g
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else f"{v:.2f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in sorted(v.items())) or "none"
    return str(v)


def format_server_figures(figures: dict[str, Any], client: dict[str, Any], width: int = 50) -> str:
    """The server-side section of the summary: client figures beside the gateway's, then each stage's."""
    gw = figures.get("gateway", {})
    rows = [f"{' Server-side Metrics (scraped) ':-^{width}}",
            f"{'':<28} {'client':>10} {'server':>10}"]

    def pair(label: str, c: Any, s: Any) -> None:
        rows.append(f"{label:<28} {_fmt(c):>10} {_fmt(s):>10}")

    pair("Requests", client.get("successful_requests"), gw.get("requests"))
    pair("Prompt tokens", client.get("total_input_tokens"), gw.get("prompt_tokens"))
    pair("Generated tokens", client.get("total_output_tokens"), gw.get("generation_tokens"))
    pair("Cached tokens", client.get("total_cached_tokens"), gw.get("cached_tokens"))
    for key, label in (("ttft", "Mean TTFT (ms)"), ("tpot", "Mean TPOT (ms)"), ("itl", "Mean ITL (ms)"),
                       ("e2e", "Mean E2E (ms)")):
        pair(label, (client.get(f"{key}_ms") or {}).get("mean"), gw.get(f"{key}_ms_mean"))
    for stage in ("gateway", "encoder", "prefill", "decode"):
        if stage not in figures:
            continue
        rows.append(f"{' ' + stage + ' ':-^{width}}")
        for key, value in figures[stage].items():
            if stage == "gateway" and key in ("requests", "prompt_tokens", "generation_tokens", "cached_tokens",
                                              "ttft_ms_mean", "tpot_ms_mean", "itl_ms_mean", "e2e_ms_mean"):
                continue  # already beside the client's
            rows.append(f"{key + ':':<40} {_fmt(value)}")
    return "\n".join(rows)
