"""SGLang's native ``/generate``: its request in the core's terms (a prompt without a chat template, for
``ChatService.prepare_ids``) and its answers.

Shapes follow SGLang's ``/generate`` (``sglang/srt/entrypoints/http_server.py``): ``{"text", "output_ids",
"meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}``,
where ``finish_reason`` is ``{"type": "length", "length": n}``, ``{"type": "stop", "matched": null}`` (epdserve
does not report which stop matched) or null while running. Streamed, each SSE event carries the text and ids so
far (SGLang's default, not deltas), then ``data: [DONE]``; a failure once streaming has begun is an OpenAI-style
``{"error": {...}}`` event, as on every streamed route.

Used by the gateway and by the prefill/decode HTTP fronts behind a PD router.

``n > 1`` (``sampling_params.n``): the answer is a list of ``n`` bodies (SGLang's shape), each ``meta_info``
counting its own choice's tokens; streamed, each event carries its choice's ``index``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from epdserve.frontend.chat import ChatService, PreparedChat
from epdserve.frontend.choices import collect_choices
from epdserve.frontend.native.protocol import GenerateRequest
from epdserve.frontend.request import PromptRequest, bias_pairs
from epdserve.frontend.structured import generate_grammar
from epdserve.wire.messages import SamplingParams, TokenOutput


async def prompt_request(req: GenerateRequest) -> PromptRequest:
    """``req`` (its :meth:`~GenerateRequest.unsupported` said None) in the core's terms, its grammar checked.

    Raises:
        APIError: 400 for more than one constraint, or one xgrammar rejects.
    """
    sp = req.sampling_params
    grammar = await generate_grammar(sp.json_schema, sp.regex, sp.ebnf, req.structured_outputs)
    sampling = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop_list(),
                              stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos,
                              seed=sp.sampling_seed, frequency_penalty=sp.frequency_penalty,
                              presence_penalty=sp.presence_penalty, logit_bias=bias_pairs(sp.logit_bias),
                              grammar=grammar, n=sp.n)
    return PromptRequest(sampling, req.text, req.input_ids, sp.max_new_tokens)


def _meta_info(service: ChatService, chat: PreparedChat, out: TokenOutput, n_out: int, t0: float) -> dict[str, Any]:
    finish = None
    if out.finish_reason == "length":
        finish = {"type": "length", "length": out.completion_tokens or n_out}
    elif out.finish_reason == "stop":
        finish = {"type": "stop", "matched": None}
    return {"id": chat.rid, "finish_reason": finish, "prompt_tokens": out.prompt_tokens or len(chat.prompt.input_ids),
            "completion_tokens": out.completion_tokens or n_out, "cached_tokens": out.cached_tokens,
            "e2e_latency": time.monotonic() - t0}


async def generate_json(service: ChatService, chat: PreparedChat) -> dict[str, Any] | list[dict[str, Any]]:
    """Run ``chat`` to the end; the ``/generate`` JSON body (a list of one per choice when ``n > 1``).

    Raises:
        APIError: as :meth:`ChatService.outputs`.
    """
    t0 = time.monotonic()
    async with aclosing(service.outputs(chat)) as outputs:
        results = await collect_choices(outputs, chat.prefill.sampling.n)
    bodies = [{"text": r.text, "output_ids": r.token_ids,
               "meta_info": _meta_info(service, chat, r.final, len(r.token_ids), t0)} for r in results]
    return bodies if len(bodies) > 1 else bodies[0]


def generate_events(service: ChatService, chat: PreparedChat) -> AsyncIterator[str]:
    """The ``/generate`` SSE events of ``chat``, each with the text and ids so far, then ``[DONE]``; a failure
    once streaming has begun becomes an error event (:meth:`ChatService.sse`). Closing it aborts the request."""

    async def events() -> AsyncIterator[str]:
        t0, n = time.monotonic(), chat.prefill.sampling.n
        texts, ids = [""] * n, [[] for _ in range(n)]
        async with aclosing(service.outputs(chat)) as outputs:
            async for delta, out in outputs:
                i = out.index
                texts[i] += delta
                ids[i] += out.token_ids
                body = {"text": texts[i], "output_ids": ids[i],
                        "meta_info": _meta_info(service, chat, out, len(ids[i]), t0)}
                if n > 1:
                    body["index"] = i
                yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    return service.sse(chat, events())
