"""The request sets a benchmark sends: ``random-mm``, ``image-dir``, ``random-video``, ``video-dir``,
``shared-prefix`` and ``jsonl``.

Each builder returns a list of :class:`BenchRequest` (OpenAI chat ``messages`` plus what the metrics need to
know about the prompt). All randomness comes from one ``numpy`` generator seeded by ``DatasetOptions.seed``,
so a seed names a request set exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .synth import (
    VIDEO_SUFFIXES, TextMaker, file_data_url, image_data_url, list_images, random_image, random_video, video_data_url,
)

DATASETS = ("random-mm", "image-dir", "random-video", "video-dir", "shared-prefix", "jsonl")

DEFAULT_PROMPTS = (
    "Describe this image in detail.",
    "What is in the picture?",
    "List every object you can see in this image.",
    "Write a short story inspired by this picture.",
    "What colours dominate this image, and where?",
    "Where might this photo have been taken? Explain your reasoning.",
    "Describe the mood of this image in three sentences.",
    "Count the distinct objects in the image and name them.",
)

# Body fields the benchmark itself sets; a jsonl line's own values for these are replaced.
_BENCH_FIELDS = ("model", "stream", "stream_options", "messages", "max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class BenchRequest:
    """One chat request of a dataset.

    Attributes:
        messages: OpenAI chat messages; images are ``image_url`` parts with ``data:`` URLs.
        max_completion_tokens: output tokens asked for (with ``ignore_eos`` the server should produce exactly
            this many).
        text_tokens: estimated tokens of the prompt's text (exact with ``--tokenizer``, words without); image
            tokens are not included since only the server knows its image processor. Used for input
            throughput only when the server reports no ``usage``.
        num_images: images in the request (videos count in ``num_videos``).
        group: dataset-defined tag kept in each result record (``shared``/``unique`` for shared-prefix, the
            photo names for image-dir, empty otherwise).
        extra: other body fields to send (e.g. ``temperature`` from a jsonl line).
    """

    messages: list[dict[str, Any]]
    max_completion_tokens: int
    text_tokens: int
    num_images: int
    group: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    num_videos: int = 0


@dataclass(frozen=True)
class DatasetOptions:
    """What to build. Lengths are in tokens (approximate without a tokenizer), image sizes in pixels."""

    name: str = "random-mm"
    seed: int = 0
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    image_sizes: tuple[tuple[int, int], ...] = ((448, 448),)
    images_per_request: int = 1
    image_format: str = "jpeg"
    image_dir: str | None = None
    prompts_file: str | None = None
    shared_fraction: float = 0.5
    prefix_len: int = 256
    jsonl_path: str | None = None
    tokenizer: str | None = None
    video_size: tuple[int, int] = (640, 360)
    video_frames: int = 16
    video_fps: float = 2.0
    video_dir: str | None = None


def with_output_lens(requests: list[BenchRequest], run: dict[str, Any]) -> list[BenchRequest]:
    """``requests`` with each one's ``max_completion_tokens`` set to the ``completion_tokens`` its position got in
    ``run``, an earlier ``--output-json`` with at least as many requests and the same warm-up count (another seed
    of the same dataset keeps the server's caches cold).

    Why: a JSON schema ends some outputs early. An A/B of constrained against plain decoding then compares runs of
    different loads (shorter requests free their slots sooner, so more prefills run between the decode steps);
    the constrained run's lengths replayed in the plain run make the token counts, and so the load, equal.

    Raises:
        ValueError: ``run`` has no record for one of ``requests``' positions, or that request failed there.
    """
    records = [*run.get("warmup_requests", []), *run.get("requests", [])]
    warmup = len(run.get("warmup_requests", []))
    lens = {r["index"] + warmup: r.get("completion_tokens") for r in records}  # index counts from the first measured
    out = []
    for i, req in enumerate(requests):
        n = lens.get(i)
        if not n:
            raise ValueError(f"the earlier run has no completed request at position {i} (index {i - warmup})")
        out.append(replace(req, max_completion_tokens=int(n)))
    return out


def build_requests(opts: DatasetOptions, num: int) -> list[BenchRequest]:
    """Build ``num`` requests of dataset ``opts.name``; the same ``opts`` always gives the same list."""
    if opts.name not in DATASETS:
        raise ValueError(f"unknown dataset {opts.name!r}; choose one of {', '.join(DATASETS)}")
    if not 0.0 <= opts.range_ratio < 1.0:
        raise ValueError("range ratio must be in [0, 1)")
    rng = np.random.default_rng(opts.seed)
    if opts.name == "jsonl":
        return _jsonl(opts, num)
    text = TextMaker(opts.tokenizer)
    if opts.name == "random-mm":
        return _random_mm(opts, num, rng, text)
    if opts.name == "image-dir":
        return _image_dir(opts, num, rng, text)
    if opts.name in ("random-video", "video-dir"):
        return _videos(opts, num, rng, text)
    return _shared_prefix(opts, num, rng, text)


def _length(rng: np.random.Generator, mean: int, ratio: float) -> int:
    """A length drawn uniformly from ``[mean*(1-ratio), mean*(1+ratio)]`` (vLLM's ``--random-range-ratio``)."""
    lo, hi = int(mean * (1 - ratio)), int(mean * (1 + ratio))
    return max(1, int(rng.integers(lo, hi + 1))) if hi > lo else max(1, mean)


def _user(image_urls: list[str], text: str, video_urls: tuple[str, ...] = ()) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "video_url", "video_url": {"url": u}} for u in video_urls]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _random_images(opts: DatasetOptions, rng: np.random.Generator, count: int) -> list[str]:
    sizes = [opts.image_sizes[int(rng.integers(len(opts.image_sizes)))] for _ in range(count)]
    return [image_data_url(random_image(rng, w, h), opts.image_format) for w, h in sizes]


def _random_mm(opts: DatasetOptions, num: int, rng: np.random.Generator, text: TextMaker) -> list[BenchRequest]:
    out = []
    for _ in range(num):
        prompt = text.text(rng, _length(rng, opts.input_len, opts.range_ratio))
        out_len = _length(rng, opts.output_len, opts.range_ratio)
        urls = _random_images(opts, rng, opts.images_per_request)
        out.append(BenchRequest([_user(urls, prompt)], out_len, text.count(prompt), len(urls)))
    return out


def _image_dir(opts: DatasetOptions, num: int, rng: np.random.Generator, text: TextMaker) -> list[BenchRequest]:
    if not opts.image_dir:
        raise ValueError("dataset image-dir needs --image-dir")
    photos = list_images(opts.image_dir)
    prompts = DEFAULT_PROMPTS
    if opts.prompts_file:
        prompts = tuple(s for s in Path(opts.prompts_file).read_text().splitlines() if s.strip())
        if not prompts:
            raise ValueError(f"no prompts in {opts.prompts_file}")
    urls: dict[Path, str] = {}  # each photo is read and encoded once, however often it is drawn
    out = []
    for _ in range(num):
        k = opts.images_per_request
        picks = rng.choice(len(photos), size=k, replace=k > len(photos))
        chosen = [photos[int(i)] for i in picks]
        for p in chosen:
            urls.setdefault(p, file_data_url(p))
        prompt = prompts[int(rng.integers(len(prompts)))]
        out_len = _length(rng, opts.output_len, opts.range_ratio)
        group = ",".join(p.name for p in chosen)
        out.append(BenchRequest([_user([urls[p] for p in chosen], prompt)], out_len, text.count(prompt), k, group))
    return out


def _videos(opts: DatasetOptions, num: int, rng: np.random.Generator, text: TextMaker) -> list[BenchRequest]:
    """One video per request (vLLM's and SGLang's ``video_url`` part): a new synthetic clip each time
    (``random-video``: ``video_size``, ``video_frames`` at ``video_fps``), or a file drawn from ``video_dir``."""
    files: list[Path] = []
    if opts.name == "video-dir":
        if not opts.video_dir:
            raise ValueError("dataset video-dir needs --video-dir")
        files = list_images(opts.video_dir, VIDEO_SUFFIXES)
    urls: dict[Path, str] = {}
    out = []
    for _ in range(num):
        if files:
            path = files[int(rng.integers(len(files)))]
            url, group = urls.setdefault(path, file_data_url(path)), path.name
        else:
            w, h = opts.video_size
            url, group = video_data_url(random_video(rng, w, h, opts.video_frames, opts.video_fps)), ""
        prompt = text.text(rng, _length(rng, opts.input_len, opts.range_ratio))
        out_len = _length(rng, opts.output_len, opts.range_ratio)
        out.append(BenchRequest([_user([], prompt, (url,))], out_len, text.count(prompt), 0, group, num_videos=1))
    return out


def _shared_prefix(opts: DatasetOptions, num: int, rng: np.random.Generator, text: TextMaker) -> list[BenchRequest]:
    """A share ``opts.shared_fraction`` of requests repeat one system prompt and one image (the prefix that radix
    and embedding caches can reuse); the rest have their own system prompt and image of the same sizes. Each
    request ends with its own random question. Shared requests are spread over the run in a seeded order."""
    if not 0.0 <= opts.shared_fraction <= 1.0:
        raise ValueError("shared fraction must be in [0, 1]")
    n_shared = round(num * opts.shared_fraction)
    shared_mask = np.zeros(num, dtype=bool)
    shared_mask[rng.permutation(num)[:n_shared]] = True
    shared_system = text.text(rng, opts.prefix_len)
    shared_images = _random_images(opts, rng, opts.images_per_request)
    out = []
    for is_shared in shared_mask:
        system, images = (
            (shared_system, shared_images)
            if is_shared
            else (text.text(rng, opts.prefix_len), _random_images(opts, rng, opts.images_per_request))
        )
        question = text.text(rng, _length(rng, opts.input_len, opts.range_ratio))
        out_len = _length(rng, opts.output_len, opts.range_ratio)
        messages = [{"role": "system", "content": system}, _user(images, question)]
        tokens = text.count(system) + text.count(question)
        out.append(BenchRequest(messages, out_len, tokens, len(images), "shared" if is_shared else "unique"))
    return out


def _jsonl(opts: DatasetOptions, num: int) -> list[BenchRequest]:
    """One OpenAI chat request per line: a body ``{"messages": [...], ...}`` or an OpenAI Batch API line
    ``{"custom_id": ..., "body": {...}}``. Lines are used in file order and cycled when ``num`` exceeds them.
    An ``image_url`` that is neither ``http(s):`` nor ``data:`` is a local file (relative to the jsonl file)
    and is sent inline as a ``data:`` URL. The line's ``max_completion_tokens``/``max_tokens`` wins over
    ``output_len``."""
    if not opts.jsonl_path:
        raise ValueError("dataset jsonl needs --jsonl PATH")
    path = Path(opts.jsonl_path)
    text = TextMaker(opts.tokenizer)
    base: list[BenchRequest] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
        body = obj.get("body", obj) if isinstance(obj, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise ValueError(f"{path}:{lineno}: expected an object with a 'messages' list (or a 'body' holding one)")
        messages, num_images, tokens = _inline_local_images(body["messages"], path.parent, text)
        max_out = body.get("max_completion_tokens") or body.get("max_tokens") or opts.output_len
        extra = {k: v for k, v in body.items() if k not in _BENCH_FIELDS}
        base.append(BenchRequest(messages, int(max_out), tokens, num_images, str(obj.get("custom_id", "")), extra))
    if not base:
        raise ValueError(f"{path} has no requests")
    return [base[i % len(base)] for i in range(num)]


def _inline_local_images(messages: list[dict], root: Path, text: TextMaker) -> tuple[list[dict], int, int]:
    """Copy ``messages`` with local image paths turned into ``data:`` URLs; also count images and text tokens."""
    out, num_images, tokens = [], 0, 0
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, str):
            tokens += text.count(content)
            out.append(msg)
            continue
        parts = []
        for part in content or []:
            if part.get("type") == "image_url":
                num_images += 1
                url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                if not url.startswith(("http://", "https://", "data:")):
                    p = Path(url) if Path(url).is_absolute() else root / url
                    part = {**part, "image_url": {"url": file_data_url(p)}}
            elif part.get("type") == "text":
                tokens += text.count(part.get("text", ""))
            parts.append(part)
        out.append({**msg, "content": parts})
    return out, num_images, tokens
