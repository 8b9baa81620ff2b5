"""Several encoders behind one front end (the gateway, a prefill front): each image goes to the encoder its content
hash picks.

Routing is rendezvous (highest-random-weight) hashing (Thaler and Ravishankar, "A name-based mapping scheme for
rendezvous", 1996): for an image with SHA-256 digest ``d`` (a video: the digest of its
:func:`~epdserve.hashing.video_key`, so the same file sampled alike goes where its embeddings are cached), every
encoder ``e`` gets the score
``blake2b(e.addr + NUL + d)`` and the image goes to the highest-scoring encoder that is up. A repeated image therefore
always reaches the same encoder (and its embedding cache), and adding or removing an encoder moves only the
images whose top choice it is.

An encoder whose RPC fails with status 503 (UNAVAILABLE, connection refused, deadline) is marked down, its images
are retried once on the next encoder of each image's rendezvous order, and it is probed in the background (gRPC
health) until it is SERVING again. With a heartbeat, the encoders that are up are probed too: one whose health
check has not said SERVING for ``stage_timeout_s`` seconds (hung, stopped, unreachable) is marked down the same
way, and its calls in flight are cancelled, so their images are retried elsewhere or fail with 503 at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from epdserve.hashing import sha256_all, video_key
from epdserve.frontend.media import run_cpu_bound
from epdserve.frontend.encoder_client import encode_options
from epdserve.frontend.prompt import EncodedImage, VideoInput
from epdserve.frontend.errors import StageError
from epdserve.frontend import logger


PROBE_INTERVAL_S = 2.0
# An encoder that has never served is most likely loading its model: probe it often, so the gateway (and its
# readiness) follows within a moment of the encoder's health turning SERVING.
STARTUP_PROBE_INTERVAL_S = 0.2


class PooledEncoder(Protocol):
    """An :class:`~epdserve.frontend.encoder_client.EncoderClient` that the pool can name and probe."""

    addr: str  # the rendezvous name: it must stay the same across gateway restarts

    async def encode(self, rid: str, images: list[bytes], targets: list[str],
                     videos: Sequence[VideoInput] = (), share_host_id: str = "") -> list[EncodedImage]: ...

    async def serving(self) -> bool:
        """True when the encoder answers its health check with SERVING (never raises)."""
        ...

    async def wait_ready(self, timeout_s: float) -> None: ...

    async def close(self) -> None: ...


def parse_encoder_addrs(spec: str) -> list[str]:
    """``"host:port,host:port"`` (``GatewayConfig.encoder_addr``) -> the addresses, in order, duplicates dropped.

    Raises:
        ValueError: no address in ``spec``.
    """
    addrs = list(dict.fromkeys(a.strip() for a in spec.split(",") if a.strip()))
    if not addrs:
        raise ValueError(f"no encoder address in {spec!r}; expected host:port[,host:port...]")
    return addrs


def rendezvous_order(digest: bytes, names: Sequence[str]) -> list[int]:
    """Indices of ``names``, best first, for the key ``digest`` (highest-random-weight hashing).

    Args:
        digest: the key, here the SHA-256 digest (32 bytes) of an image's bytes.
        names: the encoders' stable names (their addresses).
    """
    def score(i: int) -> bytes:
        return hashlib.blake2b(names[i].encode() + b"\0" + digest, digest_size=8).digest()

    return sorted(range(len(names)), key=score, reverse=True)


async def _false() -> bool:
    return False


def _digests(images: list[bytes], videos: Sequence[VideoInput]) -> list[bytes]:
    """The routing keys: each image's SHA-256 digest, then each video's key as bytes.

    Raises:
        StageError: 400 for a video whose key cannot be made (both fps and num_frames, or one not positive).
    """
    try:
        keys = [bytes.fromhex(video_key(v.data, v.fps, v.num_frames)) for v in videos]
    except ValueError as e:
        raise StageError(f"bad video sampling: {e}", 400) from None
    return sha256_all(images) + keys


class EncoderPool:
    """An :class:`~epdserve.frontend.encoder_client.EncoderClient` over several encoders, routing each image by content.

    A request's images that map to different encoders go to those encoders concurrently, one ``encode`` per
    encoder with that encoder's images (same request id, same targets); results come back in the request's image
    order. All methods run on one event loop.

    Args:
        clients: the encoders; their ``addr`` must be distinct.
        probe_interval_s: seconds between health probes of an encoder that is down.
        heartbeat_interval_s: seconds between health probes of the encoders that are up (0: none).
        stage_timeout_s: seconds without a SERVING answer after which an encoder that is up is marked down.
    """

    def __init__(self, clients: Sequence[PooledEncoder], probe_interval_s: float = PROBE_INTERVAL_S, *,
                 heartbeat_interval_s: float = 0.0, stage_timeout_s: float = 10.0):
        if not clients:
            raise ValueError("an encoder pool needs at least one encoder")
        self.clients = list(clients)
        self.names = [c.addr for c in self.clients]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"duplicate encoder addresses in {self.names}")
        self.probe_interval_s = probe_interval_s
        self.heartbeat_interval_s, self.stage_timeout_s = heartbeat_interval_s, stage_timeout_s
        self._probes: dict[int, asyncio.Task] = {}  # encoder index -> its probe task, while it is down
        self._reasons: dict[int, str] = {}  # encoder index -> why it is down
        self._calls: dict[int, set[asyncio.Task]] = {i: set() for i in range(len(self.clients))}  # in flight
        self._last_ok = [time.monotonic()] * len(self.clients)  # last SERVING answer (or start)
        self._ever_up = [False] * len(self.clients)  # whether it ever answered SERVING (else: still starting)
        self._heartbeat: asyncio.Task | None = None
        self._checked = False  # wait_ready has found out which encoders serve
        self._starting: asyncio.Task | None = None

    @property
    def up(self) -> list[str]:
        """Addresses of the encoders taken as up now."""
        return [n for i, n in enumerate(self.names) if i not in self._probes]

    def start(self, timeout_s: float) -> None:
        """Run :meth:`wait_ready` in the background, so that requests needing no encoder are served meanwhile
        (:meth:`not_serving` says why images cannot be); a timeout is logged, and the encoders are probed."""
        self._starting = asyncio.get_running_loop().create_task(self._start(timeout_s))

    async def _start(self, timeout_s: float) -> None:
        try:
            await self.wait_ready(timeout_s)
        except TimeoutError as e:
            logger.warning("%s", e)

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until one encoder's channel connects, then up to ``probe_interval_s`` more for the others; those
        still unconnected, and those connected whose health check does not say SERVING yet (their model is still
        loading), are marked down and probed until they serve.

        Raises:
            TimeoutError: no encoder connected within ``timeout_s`` seconds (all are probed from then on).
        """
        waits = [asyncio.ensure_future(c.wait_ready(timeout_s)) for c in self.clients]

        def connected(t: asyncio.Future) -> bool:
            return t.done() and not t.cancelled() and t.exception() is None

        try:
            pending = set(waits)
            while pending and not any(map(connected, waits)):
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if pending:  # encoders started together connect within moments of each other
                await asyncio.wait(pending, timeout=self.probe_interval_s)
        finally:
            for t in waits:
                t.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        serving = await asyncio.gather(*(self._serving(i) if connected(t) else _false()
                                         for i, t in enumerate(waits)))
        for i, t in enumerate(waits):
            if not connected(t):
                self._mark_down(i, "not reachable at startup")
            elif not serving[i]:
                self._mark_down(i, "its health check does not say SERVING yet (the vision model is loading)")
            else:
                self._ever_up[i] = True
        self._checked = True
        if self.heartbeat_interval_s > 0 and self._heartbeat is None:
            self._last_ok = [time.monotonic()] * len(self.clients)
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        if not any(map(connected, waits)):  # all are marked down and probed: one may still come
            raise TimeoutError(f"no encoder of {', '.join(self.names)} is reachable")

    async def encode(self, rid: str, images: list[bytes], targets: list[str],
                     videos: Sequence[VideoInput] = (), share_host_id: str = "") -> list[EncodedImage]:
        """See :class:`~epdserve.frontend.encoder_client.EncoderClient`. Each video is routed by its key as an
        image is by its hash (same failover); one call per encoder carries its images and videos.

        Raises:
            StageError: 503 when no encoder is up (or an image's retry also failed), 400 for a video with both
                ``fps`` and ``num_frames`` (or one not positive), else the first other error an encoder raised
                (400, 413, 500).
        """
        items: list[bytes | VideoInput] = [*images, *videos]
        if len(self.clients) == 1:
            orders = [[0]] * len(items)
        else:
            digests = await run_cpu_bound(sum(map(len, images)) + sum(len(v.data) for v in videos), _digests,
                                          images, videos)
            orders = [rendezvous_order(d, self.names) for d in digests]
        results: list[EncodedImage | None] = [None] * len(items)
        todo = list(range(len(items)))
        for attempt in range(2):  # the first try, then one retry of a down encoder's images elsewhere
            groups: dict[int, list[int]] = {}
            for pos in todo:
                enc = next((i for i in orders[pos] if i not in self._probes), None)
                if enc is None:
                    raise StageError("encoder unavailable: every encoder is down", 503)
                groups.setdefault(enc, []).append(pos)
            failed = await self._encode_groups(rid, items, targets, groups, results, share_host_id)
            if not failed:
                return results
            todo = sorted(failed)
            logger.info("rid=%s retrying %d images on other encoders", rid, len(todo))
        raise StageError("encoder unavailable: the retry failed too", 503)

    async def _encode_groups(self, rid: str, items: list[bytes | VideoInput], targets: list[str],
                             groups: dict[int, list[int]], results: list[EncodedImage | None],
                             share_host_id: str) -> list[int]:
        """Run one ``encode`` per group (positions in ``items``, images first, in order) concurrently and fill
        ``results``; return the positions of down encoders.

        Raises:
            StageError: the first non-503 error, in encoder order, after every call has finished.
        """
        encs = list(groups)
        calls = []
        for e in encs:
            images = [items[p] for p in groups[e] if isinstance(items[p], bytes)]
            videos = [items[p] for p in groups[e] if not isinstance(items[p], bytes)]
            logger.debug("rid=%s %d image(s)%s -> encoder %s", rid, len(images),
                         f", {len(videos)} video(s)" if videos else "", self.names[e])
            options = encode_options(videos, share_host_id)
            call = asyncio.ensure_future(self.clients[e].encode(rid, images, targets, **options))
            self._calls[e].add(call)  # so that marking the encoder down cancels it
            call.add_done_callback(self._calls[e].discard)
            calls.append(call)
        outs = await asyncio.gather(*calls, return_exceptions=True)
        failed: list[int] = []
        error: BaseException | None = None
        for e, out in zip(encs, outs):
            if isinstance(out, asyncio.CancelledError) and e in self._probes:  # cancelled by _mark_down
                failed += groups[e]
            elif isinstance(out, StageError) and out.status == 503:
                self._mark_down(e, out.message)
                failed += groups[e]
            elif isinstance(out, BaseException):
                error = error or out
            else:
                self._ever_up[e] = True
                for p, r in zip(groups[e], out):
                    results[p] = r
        if error is not None:
            raise error
        return failed

    def _mark_down(self, i: int, why: str) -> None:
        if i in self._probes:
            return
        # An encoder that never answered is most likely still loading (compiling its tower takes seconds):
        # that is not an incident worth a warning.
        level = logging.WARNING if self._ever_up[i] else logging.INFO
        logger.log(level, "encoder %s is %s (%s); probing it every %g s", self.names[i],
                   "down" if self._ever_up[i] else "not serving yet", why, self._probe_interval(i))
        self._reasons[i] = why
        # A fresh context: the probe outlives the request that found the encoder down, and its log lines are
        # not about that request.
        self._probes[i] = asyncio.get_running_loop().create_task(self._probe(i), context=contextvars.Context())
        for call in list(self._calls[i]):  # their images are retried elsewhere (or fail with 503) at once
            call.cancel()

    async def _beat(self) -> None:
        """Probe every encoder that is up each ``heartbeat_interval_s``; mark one down after ``stage_timeout_s``
        seconds without a SERVING answer."""
        async def check(i: int) -> None:
            try:
                ok = await self.clients[i].serving()
            except Exception:
                ok = False
            now = time.monotonic()
            if ok:
                self._last_ok[i], self._ever_up[i] = now, True
            elif i not in self._probes and now - self._last_ok[i] > self.stage_timeout_s:
                self._mark_down(i, f"no healthy answer for {self.stage_timeout_s:g} s")

        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            up = [i for i in range(len(self.clients)) if i not in self._probes]
            await asyncio.gather(*(check(i) for i in up))

    async def status(self) -> list[dict[str, Any]]:
        """Each encoder's address, whether it is up (and why not), and its ``GetLoad`` answer when it gives one."""
        async def one(i: int) -> dict[str, Any]:
            out: dict[str, Any] = {"addr": self.names[i], "up": i not in self._probes}
            if i in self._probes:
                out["reason"] = self._reasons.get(i, "")
            load = getattr(self.clients[i], "load", None)
            if load is not None and (got := await load()) is not None:
                out["load"] = got
            return out

        return list(await asyncio.gather(*(one(i) for i in range(len(self.clients)))))

    def _probe_interval(self, i: int) -> float:
        return self.probe_interval_s if self._ever_up[i] else min(self.probe_interval_s, STARTUP_PROBE_INTERVAL_S)

    async def _serving(self, i: int) -> bool:
        try:
            return await self.clients[i].serving()
        except Exception:  # a probe must never die: the encoder would stay out forever
            logger.exception("health probe of encoder %s failed", self.names[i])
            return False

    async def _probe(self, i: int) -> None:
        while True:
            await asyncio.sleep(self._probe_interval(i))
            if await self._serving(i):
                del self._probes[i]
                self._last_ok[i] = time.monotonic()
                logger.info("encoder %s is serving%s", self.names[i], " again" if self._ever_up[i] else "")
                self._ever_up[i] = True
                return

    def not_serving(self) -> str | None:
        """Why no encoder can take an image now (each one's reason), or None while at least one is up."""
        if not self._checked:
            return "waiting for the encoders to answer"
        if self.up:
            return None
        return "no encoder is serving: " + "; ".join(f"{n}: {self._reasons.get(i, '')}"
                                                     for i, n in enumerate(self.names))

    async def close(self) -> None:
        """Stop the probes and close every client."""
        probes = list(self._probes.values())
        self._probes.clear()
        if self._starting is not None:
            probes.append(self._starting)
        if self._heartbeat is not None:
            probes.append(self._heartbeat)
            self._heartbeat = None
        for t in probes:
            t.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
