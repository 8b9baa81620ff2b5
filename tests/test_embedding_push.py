"""The encoder's embedding push (encoder/pusher.py): once ``push`` returns (and the encoder answers ``Encode``), the
embeddings have left the process, so an encoder killed right after its answer loses nothing that prefill then
waits for (a request stuck for prefill's whole request timeout, seen in tests/test_faults.py's encoder kill)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import zmq

# Pushes one 64 MB message, then SIGKILLs itself the moment push() returns: what is still queued in ZMQ is lost.
_PUSH_THEN_DIE = textwrap.dedent("""
    import asyncio, os, signal, sys
    import zmq.asyncio
    from epdserve.encoder.pusher import EmbeddingPusher

    async def main():
        pusher = EmbeddingPusher(zmq.asyncio.Context(), timeout_s=20)
        await pusher.push([sys.argv[1]], [[b"head", memoryview(bytearray(64 << 20))]])
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
""")


def test_a_push_has_left_the_process_when_it_returns():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        proc = subprocess.run([sys.executable, "-c", _PUSH_THEN_DIE, f"tcp://127.0.0.1:{port}"], timeout=60,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.returncode == -signal.SIGKILL
        assert pull.poll(10_000), "the pushed message never arrived"
        head, body = pull.recv_multipart()
        assert head == b"head" and len(body) == 64 << 20
    finally:
        pull.close(linger=0)
        ctx.term()
