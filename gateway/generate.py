"""SGLang's native ``/generate`` answers, for a request prepared by ``ChatService.prepare_ids``.

Shapes follow SGLang's ``/generate`` (``sglang/srt/entrypoints/http_server.py``): ``{"text", "output_ids",
"meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``,
where ``finish_reason`` is ``{"type": "length", "length": n}``, ``{"type": "stop", "matched": null}`` (epdserve
does not report which stop matched) or null while running. Streamed, each SSE event carries the text and ids so
far (SGLang's default, not deltas), then ``data: [DONE]``. Used by the gateway and by the prefill/decode HTTP
fronts behind a PD router.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from epdserve.gateway.chat import APIError, ChatService, PreparedChat
from epdserve.messages import TokenOutput


def _meta_info(chat: PreparedChat, final: TokenOutput | None, n_out: int, t0: float) -> dict[str, Any]:
    finish = None
    if final is not None and final.finish_reason == "length":
        finish = {"type": "length", "length": final.completion_tokens or n_out}
    elif final is not None and final.finish_reason == "stop":
        finish = {"type": "stop", "matched": None}
    return {"id": chat.rid, "finish_reason": finish,
            "prompt_tokens": (final.prompt_tokens if final else 0) or len(chat.prompt.input_ids),
            "completion_tokens": (final.completion_tokens if final else 0) or n_out,
            "cached_tokens": final.cached_tokens if final else 0, "e2e_latency": time.monotonic() - t0}


async def generate_json(service: ChatService, chat: PreparedChat) -> dict[str, Any]:
    """Run ``chat`` to the end; the ``/generate`` JSON body.

    Raises:
        APIError: as :meth:`ChatService.outputs`.
    """
    t0 = time.monotonic()
    texts, ids, final = [], [], None
    async for text, final in service.outputs(chat):
        texts.append(text)
        ids += final.token_ids
    return {"text": "".join(texts), "output_ids": ids, "meta_info": _meta_info(chat, final, len(ids), t0)}


async def generate_events(service: ChatService, chat: PreparedChat) -> AsyncIterator[str]:
    """The ``/generate`` SSE events of ``chat``; a failure once streaming has begun becomes an
    ``{"error": {"message", "code"}}`` event before ``[DONE]``. Closing the iterator early aborts the request."""
    t0 = time.monotonic()
    text, ids = "", []
    try:
        async for delta, out in service.outputs(chat):
            text += delta
            ids += out.token_ids
            body = {"text": text, "output_ids": ids, "meta_info": _meta_info(chat, out, len(ids), t0)}
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
    except APIError as e:
        yield f"data: {json.dumps({'error': {'message': e.message, 'code': e.status}}, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
