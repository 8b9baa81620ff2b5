"""The prefill and decode servers behind one gateway, each as the gateway sees it: :class:`LMServer` (its ZeroMQ
client, its liveness, the requests placed on it) and :func:`handshake_all`, the start-up handshake with all of them.

A gateway may have several servers of each role (``--prefill-addr``/``--decode-addr`` lists); each is watched on
its own (:class:`~epdserve.gateway.liveness.StageLiveness`), so one that dies is taken out while the others serve.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from epdserve.frontend.scheduler_client import SchedulerClient
from epdserve.gateway.liveness import StageLiveness
from epdserve.wire.messages import ServerInfo

# Once one server of each role has answered the start-up handshake, how long the others get to answer before the
# gateway starts without them (they join when they answer, as a restarted server does).
_JOIN_GRACE_S = 2.0


@dataclass(eq=False)
class LMServer:
    """One prefill or decode server behind the gateway.

    Attributes:
        index: its place in ``--prefill-addr`` / ``--decode-addr`` (0-based), the name the gateway's logs and
            ``/health?details=1`` give it.
        role: ``"prefill"`` or ``"decode"``.
        client: the ZeroMQ client connected to its ``--zmq-port``.
        liveness: its up/down state, set once the gateway has started.
        rids: the requests placed on it and not yet released by the gateway (its load as the gateway counts it).
    """

    index: int
    role: str
    client: SchedulerClient
    liveness: StageLiveness | None = None
    rids: set[str] = field(default_factory=set)

    @property
    def addr(self) -> str:
        return self.client.addr

    @property
    def up(self) -> bool:
        """Whether it may take new requests now."""
        return self.liveness is not None and self.liveness.up

    @property
    def info(self) -> ServerInfo | None:
        """Its last ``ServerInfo`` (None until it has answered once)."""
        return None if self.liveness is None else self.liveness.info

    def free_pages(self) -> int:
        """KV pages it has free by its last ``Load`` (pages reserved for requests count as used); its whole pool
        before any ``Load`` came; 0 when it never answered."""
        load = None if self.liveness is None else self.liveness.load
        if load is not None:
            return load.kv_pages_total - load.kv_pages_used
        return self.info.num_pages if self.info is not None else 0

    def describe(self) -> str:
        """``"decode server 1 (tcp://...)"``: how log lines and error messages name it."""
        return f"{self.role} server {self.index} ({self.addr})"

    def status(self) -> dict[str, Any]:
        """JSON-ready state for ``/health?details=1``: its index, the liveness fields (address, up, load...) and
        the gateway's requests in flight on it."""
        out: dict[str, Any] = {"index": self.index}
        out |= self.liveness.status() if self.liveness is not None else {"addr": self.addr, "up": False}
        out["inflight"] = len(self.rids)
        return out


async def handshake_all(servers: list[LMServer], deadline: float) -> list[ServerInfo | None]:
    """Ask every server for its ``ServerInfo`` (each retried until ``deadline``, a ``time.monotonic()`` value);
    return once all answered, or once at least one of each role answered and the rest had ``_JOIN_GRACE_S`` more.

    Returns:
        Each server's answer, in order; None for a server that had not answered (it starts down).

    Raises:
        TimeoutError: no server of some role answered by ``deadline``.
        StageError: a server answered with the wrong role (a misconfiguration).
    """
    tasks = {asyncio.ensure_future(s.client.handshake(deadline)): s for s in servers}
    roles = {s.role for s in servers}
    answers: dict[LMServer, ServerInfo] = {}
    timeouts: dict[str, TimeoutError] = {}  # role -> a server of it that never answered
    pending, grace_end = set(tasks), None
    try:
        while pending:
            timeout = None if grace_end is None else max(grace_end - time.monotonic(), 0.0)
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:  # the grace is over: start with those that answered
                break
            for task in done:
                if isinstance(err := task.exception(), TimeoutError):
                    timeouts.setdefault(tasks[task].role, err)
                elif err is not None:
                    raise err
                else:
                    answers[tasks[task]] = task.result()
            if grace_end is None and {s.role for s in answers} == roles:
                grace_end = time.monotonic() + _JOIN_GRACE_S
    finally:
        # Cancelled, not left polling a socket that the reader (or close()) takes over.
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for role in sorted(roles - {s.role for s in answers}):
        raise timeouts.get(role) or TimeoutError(f"no {role} server answered")
    return [answers.get(s) for s in servers]
