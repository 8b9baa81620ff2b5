"""One request, from the core's request model (:mod:`epdserve.frontend.request`) to its outputs: a protocol package
turns its wire format into a :class:`~epdserve.frontend.request.ChatRequest` or
:class:`~epdserve.frontend.request.PromptRequest` and its answer out of :meth:`ChatService.outputs` (no HTTP
plumbing and no protocol here).

Steps: fetch images -> start encoding (embeddings go straight to prefill) -> image slots from the file headers,
tokenize with them, check lengths -> send ``DecodeRequest`` then ``PrefillRequest`` (an image request before the
encoder answers) -> check the encoder's answer against the slots -> detokenize the ``TokenOutput``s' ids (one
:class:`IncrementalDetokenizer` per choice, stop strings matched here: :mod:`epdserve.frontend.choices`).
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace

import httpx

from epdserve.frontend.choices import Choices, check_n, prepend
from epdserve.frontend.detokenizer import IncrementalDetokenizer, TokenBytes, special_ids
from epdserve.frontend.image_slots import image_slots
from epdserve.frontend.media import MediaPolicy, run_cpu_bound
from epdserve.frontend.prompt import EncodedImage, Prompt, PromptBuilder, PromptError, VideoInput
from epdserve.frontend.request import ChatRequest, PromptRequest, Usage
from epdserve.frontend.request_media import check_encoded, fetch_media
from epdserve.frontend.errors import APIError, GenerationFailed, StageError
from epdserve.frontend.stages import Stages
from epdserve.wire.messages import DecodeRequest, PrefillRequest, SamplingParams, TokenLogprob, TokenOutput
from epdserve.metrics import GatewayMetrics, RequestTrace
from epdserve.video import VideoLimits
from epdserve.frontend import logger


@dataclass
class PreparedChat:
    """A request ready to send to the stages."""

    rid: str
    prompt: Prompt
    prefill: PrefillRequest
    decode: DecodeRequest
    trace: RequestTrace  # its timings and usage, recorded in the gateway's metrics
    deadline: float | None = None  # time.monotonic() value after which the request ends with 504
    # (first output, the rest) of a request whose outputs began before its answer did (ChatService.prime)
    head: tuple[TokenOutput, AsyncIterator[TokenOutput]] | None = None
    choices: Choices | None = None  # its choices' outputs so far, once they are read (ChatService.outputs)


class ChatService:
    """Runs requests against the stages. One per server; safe for concurrent requests.

    Args:
        stages: started (or starting) :class:`~epdserve.frontend.stages.Stages`.
        builder: the prompt builder; its calls are serialized on one worker thread (see :class:`PromptBuilder`).
        model_name: the served model name put in responses.
        media: image and video URL policy.
        max_tokens_default: completion budget when the request gives none (0 = up to the context length).
        metrics: the gateway's metrics (a fresh one by default).
        video_limits: bounds of a request's videos (duration, sampled frames).
        max_n: most choices (``n``) one request may ask for.
    """

    def __init__(self, stages: Stages, builder: PromptBuilder, model_name: str, media: MediaPolicy,
                 max_tokens_default: int = 0, http: httpx.AsyncClient | None = None,
                 metrics: GatewayMetrics | None = None, video_limits: VideoLimits = VideoLimits(), max_n: int = 16):
        self.video_limits, self.max_n = video_limits, max_n
        self.metrics = metrics if metrics is not None else GatewayMetrics()
        self.stages = stages
        self.builder = builder
        self.model_name = model_name
        self.media = media
        self.max_tokens_default = max_tokens_default
        self.http = http
        # One thread: keeps tokenization off the event loop without using the tokenizer from two threads.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epdserve-tokenize")
        # Detokenization runs on the event loop, so it gets its own copy of the tokenizer.
        self._detok_tokenizer = copy.deepcopy(builder.tokenizer)
        self._skip_ids = special_ids(self._detok_tokenizer)
        self.token_bytes = TokenBytes(self._detok_tokenizer)  # a token id's exact bytes (logprobs)
        self._image_processor = builder.processor.image_processor

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def prepare(self, rid: str, req: ChatRequest, deadline: float | None = None) -> PreparedChat:
        """Fetch and encode images and videos, build the prompt, check lengths and build the stage requests; an
        image or video request is sent to the stages before the encoder answers where they take it so
        (``stages.sends_before_encoded``), and the encoder's answer is checked against the image and video slots.
        A video is planned from its metadata (:mod:`epdserve.frontend.video_slots`) before any encoder sees it.

        Args:
            deadline: ``time.monotonic()`` value after which the request ends with 504 (None: none); it is kept in
                the result for :meth:`outputs`.

        Raises:
            APIError: 400/413 for bad images, videos or prompts, the encoder's status for encoder failures, 500
                when the encoder counts an image's or video's tokens differently, 503 when the stages are not ready
                or a stage goes down, 504 past ``deadline``. The stages have dropped the request whenever this raises.
        """
        self._check_logit_bias(req.sampling.logit_bias)  # before any image goes to an encoder
        check_n(req.sampling.n, self.max_n)
        trace = self.metrics.trace()
        logger.debug("rid=%s received (%d images, %d videos)", rid, len(req.image_urls), len(req.video_urls))
        media = await fetch_media(req.image_urls, req.video_urls, req.video_sampling, self.media, self.http,
                                  self.builder.processor, self.video_limits)
        images, videos = media.images, media.videos
        # The chat template and the text's tokens do not depend on the images: they run while the encoder works.
        pieces = asyncio.get_running_loop().run_in_executor(self._executor, self.builder.tokenize_template,
                                                            req.messages, [v.placeholder for v in videos], req.tools)
        encoding = (asyncio.ensure_future(self._encode(trace, rid, images, [v.input for v in videos], deadline))
                    if (images or videos) and self.stages.encodes else None)
        try:
            # Each image's hash, token count and grid follow from its bytes and header, as the encoder's processor
            # computes them: the prompt is built and sent to prefill and decode while the encoder still works, so
            # prefill starts when the embeddings land instead of after a round trip through this gateway.
            slots = [await run_cpu_bound(len(b), image_slots, self._image_processor, b) for b in images]
            prompt = self.builder.splice(await pieces, slots, videos)
            max_new = self._max_new_tokens(req.max_tokens, len(prompt.input_ids), "messages",
                                           "max_completion_tokens")
            prefill, decode = self._stage_requests(rid, prompt, replace(req.sampling, max_new_tokens=max_new))
            if encoding is not None:
                if self.stages.sends_before_encoded:
                    self.stages.send(prefill, decode)
                check_encoded(await encoding, slots + [v.encoded for v in videos])
                logger.debug("rid=%s encoder answered", rid)
        except BaseException as e:
            pieces.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved"
            if encoding is not None:
                encoding.cancel()
                encoding.add_done_callback(lambda f: f.cancelled() or f.exception())
                # The encoder may already have pushed this request's embeddings to prefill (and the request may
                # be there): let the stages drop them.
                self.stages.abort(rid)
            if isinstance(e, StageError):
                raise APIError.from_stage(e) from None
            if isinstance(e, PromptError):
                raise APIError(400, str(e), param="messages") from None
            raise
        logger.debug("rid=%s prompt_tokens=%d images=%d videos=%d max_new_tokens=%d", rid, len(prompt.input_ids),
                     len(images), len(videos), max_new)
        return PreparedChat(rid, prompt, prefill, decode, trace, deadline)

    async def _encode(self, trace: RequestTrace, rid: str, images: list[bytes], videos: list[VideoInput],
                      deadline: float | None) -> list[EncodedImage]:
        # A coroutine of its own, so the encoder call is only created once the task runs: a request that fails
        # (and cancels the task) before then leaves no never-awaited coroutine behind.
        return await trace.encode(self.stages.encode(rid, images, deadline, videos))

    async def prepare_ids(self, rid: str, req: PromptRequest, deadline: float | None = None) -> PreparedChat:
        """The stage requests of a prompt without a chat template: ``req.text`` tokenized as is (the tokenizer's
        own special-token rule) or ``req.input_ids`` taken as they are.

        Raises:
            APIError: 400 for a token id outside the vocabulary, an empty prompt, too many choices or a prompt
                over the context length; 503 when the stages are not ready.
        """
        if req.input_ids is not None:
            ids = list(req.input_ids)
            vocab = len(self._detok_tokenizer)
            if ids and max(ids) >= vocab:
                raise APIError(400, f"token id {max(ids)} is outside the vocabulary ({vocab} ids)", param="input_ids")
        else:
            tokenizer = self.builder.tokenizer
            ids = await asyncio.get_running_loop().run_in_executor(self._executor, tokenizer.encode, req.text)
        if not ids:
            raise APIError(400, "the prompt is empty", param="text")
        check_n(req.sampling.n, self.max_n, "sampling_params.n")
        max_new = self._max_new_tokens(req.max_tokens, len(ids), "input_ids", "max_new_tokens")
        self._check_logit_bias(req.sampling.logit_bias)
        prompt = Prompt(ids, [], req.text or "")
        logger.debug("rid=%s prompt-in prompt_tokens=%d max_new_tokens=%d", rid, len(ids), max_new)
        return PreparedChat(rid, prompt, *self._stage_requests(rid, prompt, replace(req.sampling,
                                                                                    max_new_tokens=max_new)),
                            self.metrics.trace(), deadline)

    def _check_logit_bias(self, bias: list[list]) -> None:
        """Raise APIError 400 when ``bias`` (``[token id, bias]`` pairs) names a token id outside the vocabulary."""
        vocab = len(self._detok_tokenizer)
        if bias and (top := max(t for t, _ in bias)) >= vocab:
            raise APIError(400, f"logit_bias names token id {top}, outside the vocabulary ({vocab} ids)",
                           param="logit_bias")

    def _stage_requests(self, rid: str, prompt: Prompt, sampling: SamplingParams) -> tuple[PrefillRequest,
                                                                                          DecodeRequest]:
        room = secrets.randbits(63)  # rendezvous key between this request's prefill and decode
        host, port = self.stages.bootstrap or ("", 0)  # no address: the PD router names it (pd.bind_room)
        prefill = PrefillRequest(rid=rid, input_ids=prompt.input_ids, images=prompt.images, sampling=sampling,
                                 bootstrap_room=room)
        decode = DecodeRequest(rid=rid, prompt_len=len(prompt.input_ids), sampling=sampling, bootstrap_host=host,
                               bootstrap_port=port, bootstrap_room=room)
        return prefill, decode

    def _max_new_tokens(self, wanted: int | None, prompt_len: int, prompt_param: str, max_param: str) -> int:
        context = self.stages.context_length
        if prompt_len >= context:
            raise APIError(400, f"the prompt has {prompt_len} tokens, but the model's context length is "
                                f"{context} tokens", param=prompt_param, code="context_length_exceeded")
        left = context - prompt_len
        if wanted is not None:
            if prompt_len + wanted > context:
                raise APIError(400, f"the prompt has {prompt_len} tokens and {wanted} completion tokens were "
                                    f"requested, {prompt_len + wanted} in all, but the model's context length "
                                    f"is {context} tokens", param=max_param, code="context_length_exceeded")
            return wanted
        # A server default must never make a request fail, so it is clipped to what is left of the context.
        return min(self.max_tokens_default, left) if self.max_tokens_default > 0 else left

    async def outputs(self, chat: PreparedChat) -> AsyncIterator[tuple[str, TokenOutput]]:
        """``chat``'s outputs as ``(text delta, output)``, up to the one with a finish reason (cut at a stop
        string), each recorded in the request's trace; the trace is finished once that last one has been taken.
        A request left early (client gone, stop string) is aborted by its lifetime. The one loop over a request's
        outputs behind every protocol's answer.

        Raises:
            GenerationFailed: a stage reported an error for the request (500).
            APIError: 503 when a stage it needs is or goes down, 504 past the deadline.
        """
        t0 = time.monotonic()
        chat.choices = choices = Choices(chat.prefill.sampling.n, lambda: self._detokenizer(chat))
        n_tokens = 0
        try:
            async with aclosing(self._stage_outputs(chat)) as outputs:
                async for out in outputs:
                    if out.finish_reason == "error":
                        logger.warning("rid=%s failed: %s", chat.rid, out.error)
                        raise GenerationFailed(500, out.error or "generation failed")
                    if (fed := choices.feed(out)) is None:
                        continue  # a choice that ended at a stop string: its fork's later tokens
                    text, final = fed
                    if final.finish_reason is not None and out.finish_reason is None and not choices.done:
                        self.stages.abort_choice(chat.rid, out.index)  # cut at a stop string: its fork can stop
                    chat.trace.output(len(final.token_ids))
                    if n_tokens == 0:
                        logger.debug("rid=%s first output", chat.rid)
                    n_tokens += len(final.token_ids)
                    yield text, final
                    if choices.done:
                        break  # on a stop string: the request's lifetime aborts it at prefill and decode
        except StageError as e:
            logger.warning("rid=%s failed: %s", chat.rid, e.message)
            raise APIError.from_stage(e) from None
        usage = self.usage(chat, final, n_tokens)
        chat.trace.finish(final.finish_reason, usage)
        logger.debug("rid=%s finished (%s): %d+%d tokens in %.3f s", chat.rid, final.finish_reason,
                     usage.prompt_tokens, usage.completion_tokens, time.monotonic() - t0)

    async def prime(self, chat: PreparedChat) -> TokenOutput:
        """Start ``chat`` at the stages and wait for its first output (the first token, or an error); the answer's
        outputs (:meth:`outputs`) then begin with it. A stream answered only then keeps its HTTP status open until
        the first token exists (the decode leg behind a PD router: a failure before it stays retryable).

        Raises:
            StageError: as ``Stages.generate``.
        """
        outputs = self.stages.generate(chat.prefill, chat.decode, chat.deadline)
        try:
            first = await anext(outputs)
        except BaseException:
            await outputs.aclose()
            raise
        chat.head = (first, outputs)
        return first

    def _stage_outputs(self, chat: PreparedChat) -> AsyncIterator[TokenOutput]:
        if chat.head is None:
            return self.stages.generate(chat.prefill, chat.decode, chat.deadline)
        head, chat.head = chat.head, None
        return prepend(*head)

    async def collect(self, chat: PreparedChat) -> tuple[str, list[int], list[TokenLogprob], TokenOutput]:
        """Run ``chat`` to the end: its whole text, its output token ids, their log-probabilities (empty unless the
        request asked), and the last output (with the finish reason and the stage's counts). Raises as
        :meth:`outputs`."""
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        async with aclosing(self.outputs(chat)) as outputs:
            async for text, final in outputs:
                texts.append(text)
                token_ids += final.token_ids
                logprobs += final.logprobs
        return "".join(texts), token_ids, logprobs, final

    async def sse(self, chat: PreparedChat, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Yield the SSE ``events`` of a started response, then ``data: [DONE]``. A failure on the way (a stage
        error, a stage going down, the deadline) can only be reported in the stream: it becomes an
        ``{"error": ...}`` event before ``[DONE]``, and the request's trace records it."""
        try:
            async with aclosing(events):  # a client gone closes this; the request is aborted at once
                async for event in events:
                    yield event
        except GenerationFailed as e:
            chat.trace.fail("generation_failed")
            yield f"data: {e.body().model_dump_json()}\n\n"
        except APIError as e:
            chat.trace.fail(f"http_{e.status}")
            yield f"data: {e.body().model_dump_json()}\n\n"
        except Exception as e:
            logger.exception("rid=%s stream failed", chat.rid)
            chat.trace.fail("internal")
            yield f"data: {APIError(500, f'internal error: {e}').body().model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    def _detokenizer(self, chat: PreparedChat) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._detok_tokenizer, chat.prefill.sampling.stop, self._skip_ids)

    @staticmethod
    def usage(chat: PreparedChat, final: TokenOutput, n_tokens: int) -> Usage:
        """The usage of ``chat`` after its last output ``final`` and ``n_tokens`` output ids. The stage's counts
        are authoritative; ours are the fallback when a stage leaves them at 0. With ``n`` choices: the prompt
        once, the choices' completion tokens summed."""
        done = final.completion_tokens or n_tokens
        if chat.choices is not None and len(chat.choices.finals) > 1:
            done = chat.choices.completion_tokens()
        return Usage.of(final.prompt_tokens or len(chat.prompt.input_ids), done, final.cached_tokens)
