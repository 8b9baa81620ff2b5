"""Ask an epdserve gateway about a photo with the official OpenAI client, first non-streaming, then streaming.

Start a server first (for example ``epdserve launch``), then::

    python examples/openai_chat.py                       # ../shared/images/chelsea.png, model from /v1/models
    python examples/openai_chat.py --image my.jpg --prompt "What colour is the cup?" --wait 300

The image travels inline as a ``data:`` URL, as the serving benchmarks of vLLM and SGLang send it.
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

DEFAULT_IMAGE = Path(__file__).resolve().parents[2] / "shared" / "images" / "chelsea.png"


def data_url(path: Path) -> str:
    """``data:image/...;base64,...`` for the image file at ``path``."""
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


def wait_ready(base_url: str, timeout_s: float) -> None:
    """Poll ``GET /health`` (next to ``/v1``) until it answers 200. Exits after ``timeout_s`` seconds."""
    health = base_url.rstrip("/").removesuffix("/v1") + "/health"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            sys.exit(f"{health} not ready after {timeout_s:.0f} s")
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    parser.add_argument("--model", default="", help="default: the first model the server lists")
    parser.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    parser.add_argument("--prompt", default="Describe this image.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--wait", type=float, default=0.0, metavar="S", help="wait up to S seconds for /health")
    args = parser.parse_args()

    if args.wait > 0:
        wait_ready(args.base_url, args.wait)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(args.image)}},
        {"type": "text", "text": args.prompt},
    ]}]

    out = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=args.max_tokens,
                                         temperature=0)
    print(f"[non-streaming] {out.choices[0].message.content!r}")
    print(f"  finish_reason={out.choices[0].finish_reason} usage={out.usage.model_dump()}")

    print("[streaming] ", end="", flush=True)
    stream = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=args.max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(f"\n  usage={chunk.usage.model_dump()}")


if __name__ == "__main__":
    main()
