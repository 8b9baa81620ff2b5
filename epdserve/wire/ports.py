"""Free TCP ports on 127.0.0.1, and the address internal ports bind to: no torch, no ZeroMQ (the launcher picks
its stages' ports before it imports anything heavy)."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Collection

LOCAL = "127.0.0.1"  # internal ports bind here unless told otherwise


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    return free_ports(1)[0]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, exclude: Collection[int] = ()) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now, below the kernel's ephemeral range, none of
    ``exclude`` (ports the caller has promised elsewhere but not bound yet, such as a launch's gateway port: CI saw a
    decode server's metrics port drawn equal to it). All are held until the last is chosen: ports picked one at a
    time can repeat once released (a launch on an H100 failed with two servers given one port). Below that range,
    since a port chosen now is bound later, by another process: in between, an ephemeral port (any socket bound to
    port 0, any outgoing connection's local end) could take one from inside the range (CI: a decode server's
    "Address already in use" on a port its launch had chosen). Falls back to ephemeral ports when the range below
    is too small or taken."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for _ in range(64 * n):
            if len(ports) == n or low <= 10_000:
                break
            port = rng.randrange(10_000, low)
            if port in ports or port in exclude:
                continue
            s = stack.enter_context(socket.socket())
            try:
                s.bind((LOCAL, port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < n:
            s = stack.enter_context(socket.socket())  # held open: the kernel hands out another port next time
            s.bind((LOCAL, 0))
            if (port := s.getsockname()[1]) not in exclude:
                ports.append(port)
        return ports
