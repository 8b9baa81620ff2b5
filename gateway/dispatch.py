"""Which prefill and decode server each request goes to, and what that choice tells the encoder and decode.

:class:`Dispatcher` applies :mod:`epdserve.gateway.routing`'s rules over the servers that are up: prefill by smg's
cache_aware rule over the prompt's radix key (:func:`prefill_key`: token ids, each image token as its image's hash
id, exactly as the prefill server keys its radix cache), with each server's load the gateway's own count of
requests it sent there and prefill has not finished; decode by the requests in flight there (the gateway's count),
then its free KV pages (its last ``Load``).
The result, a :class:`Placement`, carries the chosen prefill server's embedding endpoints (for the encoder, which
pushes to every TP rank of that server) and its bootstrap address (for the ``DecodeRequest``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from epdserve.frontend.errors import StageError
from epdserve.frontend.scheduler_client import OutputRoute
from epdserve.gateway.routing import CacheAwareConfig, PrefillRouter, choose_decode
from epdserve.gateway.servers import LMServer
from epdserve.hashing import image_pad_id
from epdserve.wire.messages import DecodeRequest, PrefillRequest


@dataclass(frozen=True)
class Placement:
    """Where one request runs, and what the other stages need to know of it.

    Attributes:
        prefill: index of the prefill server (``--prefill-addr`` order).
        decode: index of the decode server.
        embed_endpoints: that prefill server's embedding endpoints, one per TP rank (the encoder pushes to all).
        embed_host_id: its machine id for same-host embedding hand-off (``ServerInfo.embed_host_id``; "" none).
        bootstrap_host: its bootstrap address, where the decode server registers for the request's KV.
        bootstrap_port: likewise.
    """

    prefill: int
    decode: int
    embed_endpoints: tuple[str, ...]
    embed_host_id: str
    bootstrap_host: str
    bootstrap_port: int

    @classmethod
    def on(cls, prefill: LMServer, decode: LMServer) -> Placement:
        """The placement on ``prefill`` and ``decode`` (``prefill`` must have answered its handshake)."""
        info = prefill.info
        return cls(prefill.index, decode.index, tuple(info.embed_endpoints), info.embed_host_id, info.bootstrap_host,
                   info.bootstrap_port)

    def decode_request(self, req: DecodeRequest) -> DecodeRequest:
        """``req`` naming this placement's prefill server as the one to take the KV from."""
        return replace(req, bootstrap_host=self.bootstrap_host, bootstrap_port=self.bootstrap_port)


def prefill_key(req: PrefillRequest) -> list[int]:
    """The prompt's radix-cache key as the prefill server builds it: its token ids, each image's (and video
    run's) tokens replaced by that image's hash id (:func:`epdserve.hashing.image_pad_id`)."""
    key = list(req.input_ids)
    for span in req.images:
        key[span.offset:span.offset + span.length] = [image_pad_id(span.image_hash)] * span.length
    return key


class Dispatcher:
    """Places requests on the gateway's prefill and decode servers (module docstring).

    Args:
        prefills: the prefill servers, by index.
        decodes: the decode servers, by index.
        routes: the gateway's routes (rid -> outputs): a request whose route has ``started`` (decode sent an output)
            is done at prefill and no longer counts as prefill load.
        config: the cache_aware rule's knobs; its ``page_size`` should be the prefill servers' (whole pages are
            what a radix cache shares).
    """

    def __init__(self, prefills: Sequence[LMServer], decodes: Sequence[LMServer], routes: Mapping[str, OutputRoute],
                 config: CacheAwareConfig):
        self.prefills, self.decodes, self._routes = prefills, decodes, routes
        self.router = PrefillRouter(len(prefills), config)

    def prefill_load(self, server: LMServer) -> int:
        """Requests the gateway placed on prefill ``server`` that prefill has not finished."""
        return sum(1 for rid in server.rids if (r := self._routes.get(rid)) is not None and not r.started)

    def decode_load(self, server: LMServer) -> int:
        """Requests the gateway placed on decode ``server`` that have not finished (a finished one's last output
        came: its route is gone, though the gateway may not have released it yet)."""
        return sum(1 for rid in server.rids if rid in self._routes)

    def place(self, req: PrefillRequest, prefill: int | None = None) -> Placement:
        """Choose the servers of ``req`` and record its prompt as cached on the chosen prefill server.

        Args:
            prefill: the prefill server already fixed for it (its embeddings went there before the prompt existed),
                or None to choose.

        Raises:
            StageError: 503 when no server of a role is up, or the fixed prefill server is down.
        """
        up = [s.up for s in self.prefills]
        if prefill is not None and not up[prefill]:
            raise StageError(f"the {self.prefills[prefill].describe()} went down; retry later", 503)
        # One prefill server: nothing to choose and no tree to keep (every prompt goes there).
        key = prefill_key(req) if len(self.prefills) > 1 else None
        if prefill is None:
            if not any(up):
                raise StageError(_none_up("prefill", self.prefills), 503)
            prefill = 0 if key is None else self.router.choose(key, [self.prefill_load(s) for s in self.prefills], up)
        if key is not None:
            self.router.record(prefill, key)
        dec_up = [s.up for s in self.decodes]
        if not any(dec_up):
            raise StageError(_none_up("decode", self.decodes), 503)
        decode = choose_decode([self.decode_load(s) for s in self.decodes], [s.free_pages() for s in self.decodes],
                               dec_up)
        return Placement.on(self.prefills[prefill], self.decodes[decode])

    def forget(self, prefill: int) -> None:
        """Prefill server ``prefill`` went down or came back: it caches nothing the gateway knows of."""
        self.router.forget(prefill)


def _none_up(role: str, servers: Sequence[LMServer]) -> str:
    """The 503 message when no ``role`` server is up: each one's reason."""
    def reason(s: LMServer) -> str:
        return s.liveness.reason if s.liveness is not None else "not connected"

    if len(servers) == 1:
        return f"the {role} server is unavailable ({reason(servers[0])}); retry later"
    why = "; ".join(f"{s.index} ({s.addr}): {reason(s)}" for s in servers)
    return f"no {role} server is up ({why}); retry later"


def unavailable_reason(role: str, servers: Sequence[LMServer]) -> str | None:
    """Why no new request can go to a ``role`` server now (none is up), or None."""
    return None if any(s.up for s in servers) else _none_up(role, servers)
