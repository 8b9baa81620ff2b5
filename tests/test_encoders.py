"""Several encoders behind one gateway: rendezvous routing, split requests, down/retry/rejoin, off-loop media work.

Routing tests use fake encoders; one test runs two real gRPC encoders (the tiny model) through the pool.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import io
import threading
import time

import pytest
import zmq

from epdserve.frontend.encoders import EncoderPool, parse_encoder_addrs, rendezvous_order
from epdserve.frontend.media import MediaPolicy, load_image, run_cpu_bound
from epdserve.frontend.prompt import EncodedImage
from epdserve.frontend.encoder_client import GrpcEncoderClient
from epdserve.frontend.errors import StageError
from epdserve.wire.messages import ImageEmbeddings, decode

TARGETS = ["tcp://127.0.0.1:39101"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeEncoder:
    """A pooled encoder: answers with each image's hash; ``down`` makes it refuse (503) and fail health checks."""

    def __init__(self, addr: str):
        self.addr = addr
        self.calls: list[tuple[str, list[bytes], list[str]]] = []
        self.down = False
        self.error: StageError | None = None  # raised by encode() when set (a non-503 failure)
        self.ready = True

    async def encode(self, rid, images, targets):
        self.calls.append((rid, list(images), list(targets)))
        await asyncio.sleep(0)
        if self.down:
            raise StageError(f"encoder {self.addr} unavailable: connection refused", 503)
        if self.error is not None:
            raise self.error
        return [EncodedImage(_sha(d), len(d), [1, 2, 2]) for d in images]

    async def serving(self) -> bool:
        return not self.down

    async def wait_ready(self, timeout_s):
        if not self.ready:
            raise TimeoutError

    async def close(self):
        pass


def _images(n: int, prefix: bytes = b"img") -> list[bytes]:
    return [prefix + str(i).encode() for i in range(n)]


def _top(pool: EncoderPool, image: bytes) -> int:
    return rendezvous_order(hashlib.sha256(image).digest(), pool.names)[0]


def _by_top(pool: EncoderPool, n: int = 40) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {i: [] for i in range(len(pool.names))}
    for img in _images(n):
        out[_top(pool, img)].append(img)
    return out


# ---------------------------------------------------------------------------------------------------- routing

def test_parse_encoder_addrs():
    assert parse_encoder_addrs("127.0.0.1:50051") == ["127.0.0.1:50051"]
    assert parse_encoder_addrs(" a:1, b:2,,a:1 ") == ["a:1", "b:2"]
    for bad in ("", " , "):
        with pytest.raises(ValueError):
            parse_encoder_addrs(bad)


def test_rendezvous_spreads_and_moves_only_the_changed_share():
    names = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(600)]
    tops = [rendezvous_order(d, names)[0] for d in digests]
    assert all(sorted(rendezvous_order(d, names)) == [0, 1, 2] for d in digests[:20])
    assert all(tops.count(i) > 120 for i in range(3))  # about 200 each: no encoder is left idle
    # Removing encoder 2 moves only its images; each goes to its second choice.
    for d, top in zip(digests, tops):
        order = rendezvous_order(d, names)
        assert rendezvous_order(d, names[:2])[0] == (top if top != 2 else order[1])
    # Adding an encoder moves images only onto it.
    grown = names + ["10.0.0.4:50051"]
    moved = [(t, rendezvous_order(d, grown)[0]) for d, t in zip(digests, tops)]
    assert all(new in (old, 3) for old, new in moved)
    assert 100 < sum(new == 3 for _, new in moved) < 200


def test_same_image_same_encoder_and_both_get_work():
    async def run():
        a, b = FakeEncoder("a:1"), FakeEncoder("b:2")
        pool = EncoderPool([a, b])
        images = _images(24)
        first = [await pool.encode(f"r{i}", [img], TARGETS) for i, img in enumerate(images)]
        assert [r[0].image_hash for r in first] == [_sha(img) for img in images]
        served = {c[1][0]: enc.addr for enc in (a, b) for c in enc.calls}
        assert set(served.values()) == {"a:1", "b:2"}
        assert all(served[img] == pool.names[_top(pool, img)] for img in images)
        for enc in (a, b):
            enc.calls.clear()
        for i, img in enumerate(images + images):
            await pool.encode(f"s{i}", [img], TARGETS)
        assert {c[1][0]: enc.addr for enc in (a, b) for c in enc.calls} == served
        await pool.close()

    asyncio.run(run())


def test_request_split_across_encoders_keeps_image_order():
    async def run():
        a, b = FakeEncoder("a:1"), FakeEncoder("b:2")
        pool = EncoderPool([a, b])
        tops = _by_top(pool)
        a1, a2, b1 = tops[0][0], tops[0][1], tops[1][0]
        images = [a1, b1, a2]
        out = await pool.encode("r1", images, TARGETS)
        assert out == [EncodedImage(_sha(d), len(d), [1, 2, 2]) for d in images]
        assert a.calls == [("r1", [a1, a2], TARGETS)]
        assert b.calls == [("r1", [b1], TARGETS)]
        await pool.close()

    asyncio.run(run())


def test_down_encoder_retried_elsewhere_probed_and_rejoins():
    async def run():
        a, b = FakeEncoder("a:1"), FakeEncoder("b:2")
        pool = EncoderPool([a, b], probe_interval_s=0.05)
        tops = _by_top(pool)
        a_imgs, b_imgs = tops[0], tops[1]
        a.down = True
        # The first request that meets the dead encoder still succeeds: its images go to their second choice.
        out = await pool.encode("r1", [b_imgs[0], a_imgs[0]], TARGETS)
        assert [r.image_hash for r in out] == [_sha(b_imgs[0]), _sha(a_imgs[0])]
        assert [c[1] for c in a.calls] == [[a_imgs[0]]]
        assert [c[1] for c in b.calls] == [[b_imgs[0]], [a_imgs[0]]]
        assert pool.up == ["b:2"]
        # After the detection nothing is sent to it.
        for i, img in enumerate(a_imgs):
            assert (await pool.encode(f"s{i}", [img], TARGETS))[0].image_hash == _sha(img)
        assert len(a.calls) == 1
        # Back up: the probe lets it rejoin, and its images go to it again.
        a.down = False
        for _ in range(200):
            if pool.up == ["a:1", "b:2"]:
                break
            await asyncio.sleep(0.05)
        assert pool.up == ["a:1", "b:2"]
        b.calls.clear()
        await pool.encode("t", a_imgs[:2], TARGETS)
        assert a.calls[-1] == ("t", a_imgs[:2], TARGETS) and b.calls == []
        await pool.close()

    asyncio.run(run())


def test_all_down_is_503_and_other_errors_pass_through():
    async def run():
        a, b = FakeEncoder("a:1"), FakeEncoder("b:2")
        pool = EncoderPool([a, b], probe_interval_s=60)
        tops = _by_top(pool)
        # A non-503 error is the request's fault: raised as is, and the encoder stays up.
        b.error = StageError("image 0 cannot be decoded", 400)
        with pytest.raises(StageError) as e:
            await pool.encode("r1", [tops[0][0], tops[1][0]], TARGETS)
        assert e.value.status == 400 and pool.up == ["a:1", "b:2"]
        b.error = None
        # Both die: the first try and the retry fail, both are marked down; later requests fail at once.
        a.down = b.down = True
        with pytest.raises(StageError) as e:
            await pool.encode("r2", [tops[0][0]], TARGETS)
        assert e.value.status == 503 and pool.up == []
        calls = len(a.calls) + len(b.calls)
        with pytest.raises(StageError) as e:
            await pool.encode("r3", [tops[1][0]], TARGETS)
        assert e.value.status == 503 and len(a.calls) + len(b.calls) == calls
        await pool.close()

    asyncio.run(run())


def test_wait_ready_needs_one_encoder():
    async def run():
        a, b = FakeEncoder("a:1"), FakeEncoder("b:2")
        b.ready = False
        pool = EncoderPool([a, b], probe_interval_s=60)
        await pool.wait_ready(5)
        assert pool.up == ["a:1"]
        await pool.close()
        a.ready = False
        pool = EncoderPool([a, b], probe_interval_s=60)
        with pytest.raises(TimeoutError, match="a:1, b:2"):
            await pool.wait_ready(5)
        await pool.close()

    asyncio.run(run())


def test_encoder_still_loading_is_not_up_until_it_serves():
    """Connected is not serving: an encoder whose health check does not say SERVING yet (its model loads) is down,
    ``not_serving`` says why while none serves, and the encoder joins within moments of serving."""
    async def run():
        a, b = FakeEncoder("a:1"), FakeEncoder("b:2")
        a.down = b.down = True  # reachable, health NOT_SERVING
        pool = EncoderPool([a, b], probe_interval_s=60)  # the default: a never-served encoder is probed often
        assert pool.not_serving() == "waiting for the encoders to answer"
        await pool.wait_ready(5)
        assert pool.up == [] and "SERVING" in pool.not_serving() and "a:1" in pool.not_serving()
        with pytest.raises(StageError) as e:
            await pool.encode("r1", [b"x"], TARGETS)
        assert e.value.status == 503 and a.calls == b.calls == []
        b.down = False
        assert await _eventually(lambda: pool.up == ["b:2"], 2.0)
        assert pool.not_serving() is None
        assert (await pool.encode("r2", [b"x"], TARGETS))[0].image_hash == _sha(b"x")
        await pool.close()

    asyncio.run(run())


async def _eventually(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.02)
    return pred()


# ---------------------------------------------------------------------------------------------------- off the loop

def test_large_media_work_runs_off_the_event_loop():
    async def run():
        loop_thread = threading.get_ident()
        assert await run_cpu_bound(10, threading.get_ident) == loop_thread
        assert await run_cpu_bound(1 << 20, threading.get_ident) != loop_thread
        data = bytes(range(256)) * 4096  # 1 MiB: decoded on a worker thread
        url = "data:image/png;base64," + base64.b64encode(data).decode()
        assert await load_image(url, MediaPolicy(max_bytes=2 << 20)) == data

    asyncio.run(run())


# ---------------------------------------------------------------------------------------------------- real encoders

class RecordingClient(GrpcEncoderClient):
    """The real gRPC client, noting each Encode call's request id and images."""

    def __init__(self, addr: str):
        super().__init__(addr)
        self.calls: list[tuple[str, list[bytes]]] = []

    async def encode(self, rid, images, targets):
        self.calls.append((rid, list(images)))
        return await super().encode(rid, images, targets)


def _png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32 + 4 * (i % 4), 32), ((37 * i) % 256, (91 * i) % 256, (53 * i + 7) % 256)).save(buf, "PNG")
    return buf.getvalue()


def test_two_real_encoders_route_retry_and_rejoin(tiny_model_path):
    from test_encoder import ServerThread  # the in-process encoder server of the encoder tests

    servers = [ServerThread(tiny_model_path).start(), ServerThread(tiny_model_path).start()]
    ctx = zmq.Context()
    target = ctx.socket(zmq.PULL)
    port = target.bind_to_random_port("tcp://127.0.0.1")
    targets = [f"tcp://127.0.0.1:{port}"]

    def pushed() -> dict[str, set[str]]:
        """rid -> image hashes of the ImageEmbeddings received so far on the target."""
        out: dict[str, set[str]] = {}
        while target.poll(200):
            msg = decode(target.recv_multipart())
            assert isinstance(msg, ImageEmbeddings)
            out.setdefault(msg.rid, set()).update(msg.image_hashes)
        return out

    async def run():
        a, b = RecordingClient(servers[0].address), RecordingClient(servers[1].address)
        pool = EncoderPool([a, b], probe_interval_s=0.2)
        await pool.wait_ready(30)
        by_top: dict[int, list[bytes]] = {0: [], 1: []}
        i = 0
        while min(map(len, by_top.values())) < 3:  # distinct images until each encoder is the top choice of 3
            img = _png(i)
            by_top[_top(pool, img)].append(img)
            i += 1
        images = by_top[0] + by_top[1]

        # Every image goes to its encoder, and again to the same one; both encoders got work.
        for rnd in range(2):
            for k, img in enumerate(images):
                out = await pool.encode(f"r{rnd}-{k}", [img], targets)
                assert out[0].image_hash == _sha(img) and out[0].num_tokens > 0
        for idx, client in enumerate((a, b)):
            assert sorted(c[1][0] for c in client.calls) == sorted(by_top[idx] * 2)
        # Two images on two encoders: one RPC each, results in the request's order, embeddings from both.
        a.calls.clear(), b.calls.clear()
        pair = [by_top[1][0], by_top[0][0]]
        out = await pool.encode("pair", pair, targets)
        assert [r.image_hash for r in out] == [_sha(d) for d in pair]
        assert a.calls == [("pair", [pair[1]])] and b.calls == [("pair", [pair[0]])]
        assert pushed()["pair"] == {_sha(d) for d in pair}

        # Stop encoder b: the first request that hits it succeeds on a through the retry; after that b gets
        # nothing and every request succeeds.
        await asyncio.to_thread(servers[1].stop)
        a.calls.clear(), b.calls.clear()
        for k, img in enumerate(by_top[1] + by_top[0]):
            out = await pool.encode(f"down-{k}", [img], targets)
            assert out[0].image_hash == _sha(img)
        assert len(b.calls) == 1 and pool.up == [a.addr]
        assert sorted(c[1][0] for c in a.calls) == sorted(by_top[0] + by_top[1])

        # Bring b back on its address: it rejoins and gets its images again.
        again = ServerThread(tiny_model_path)
        again.config.port, again.address = servers[1].config.port, servers[1].address
        servers[1] = await asyncio.to_thread(again.start)
        for _ in range(300):
            if pool.up == [a.addr, b.addr]:
                break
            await asyncio.sleep(0.1)
        assert pool.up == [a.addr, b.addr], "the restarted encoder did not rejoin"
        a.calls.clear(), b.calls.clear()
        for k, img in enumerate(by_top[1]):
            assert (await pool.encode(f"back-{k}", [img], targets))[0].image_hash == _sha(img)
        assert sorted(c[1][0] for c in b.calls) == sorted(by_top[1]) and a.calls == []
        await pool.close()

    try:
        asyncio.run(run())
    finally:
        for srv in servers:
            if srv._thread.is_alive():
                srv.stop()
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------------------------------------- launch

def test_launch_starts_num_encoders_and_gives_the_gateway_all_addresses():
    import argparse

    from epdserve.config import LaunchConfig, add_config_args, config_from_args
    from epdserve.entry.launch import launch
    from epdserve.entry.launch_plan import plan_launch

    parser = argparse.ArgumentParser()
    add_config_args(parser, LaunchConfig)
    cfg = config_from_args(LaunchConfig, parser.parse_args(["--num-encoders", "3"]))
    assert cfg.num_encoders == 3 and LaunchConfig().num_encoders == 1
    plan = plan_launch(cfg, "/models/m", on_gpus=False)
    commands, addrs = plan.commands, plan.encoders
    assert sorted(n for n in commands if n.startswith("encoder")) == ["encoder0", "encoder1", "encoder2"]
    assert len(set(addrs)) == 3
    for name, addr in zip(["encoder0", "encoder1", "encoder2"], addrs):
        cmd = commands[name]
        assert "encoder" in cmd and cmd.count("--port") == 1
        assert addr == f"127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    gateway = commands["gateway"]
    assert parse_encoder_addrs(gateway[gateway.index("--encoder-addr") + 1]) == addrs
    with pytest.raises(ValueError, match="num-encoders"):
        launch(LaunchConfig(num_encoders=0))


def test_launch_passes_the_encoder_flags_its_config_mirrors():
    # Each encoder switch of `epdserve launch` reaches every encoder's own config through its command line.
    import argparse

    from epdserve.config import EncoderConfig, LaunchConfig, add_config_args, config_from_args
    from epdserve.entry.launch_plan import plan_launch

    def encoder_config(launch_flags: list[str]) -> EncoderConfig:
        parser = argparse.ArgumentParser()
        add_config_args(parser, LaunchConfig)
        commands = plan_launch(config_from_args(LaunchConfig, parser.parse_args(launch_flags)), "/models/m",
                               False).commands
        cmd = commands["encoder0"]
        enc_parser = argparse.ArgumentParser()
        add_config_args(enc_parser, EncoderConfig)
        return config_from_args(EncoderConfig, enc_parser.parse_args(cmd[cmd.index("encoder") + 1:]))

    default = encoder_config([])
    assert default.gpu_jpeg_decode and default.compile and default.cuda_graphs == LaunchConfig().encoder_cuda_graphs
    off = encoder_config(["--no-encoder-gpu-jpeg-decode", "--no-encoder-compile", "--encoder-cuda-graphs", "0"])
    assert not off.gpu_jpeg_decode and not off.compile and off.cuda_graphs == 0
    assert (default.max_video_frames, default.max_video_duration_s) == (EncoderConfig().max_video_frames,
                                                                         EncoderConfig().max_video_duration_s)
    limits = encoder_config(["--max-video-frames", "12", "--max-video-duration-s", "7.5"])
    assert limits.max_video_frames == 12 and limits.max_video_duration_s == 7.5


def test_an_encoder_still_starting_is_not_reported_as_down(caplog):
    # At launch the gateway may meet an encoder that is still loading (compiling its tower takes seconds): an
    # INFO line, not a warning. Once it has served, losing it is a warning.
    async def run():
        a, b = FakeEncoder("a:1"), FakeEncoder("b:2")
        pool = EncoderPool([a, b], probe_interval_s=0.05)
        a_imgs = _by_top(pool)[0]
        a.down = True
        with caplog.at_level(logging.INFO, logger="epdserve.gateway"):
            await pool.encode("r1", a_imgs[:1], TARGETS)
            a.down = False
            for _ in range(200):
                if pool.up == ["a:1", "b:2"]:
                    break
                await asyncio.sleep(0.05)
            a.down = True
            await pool.encode("r2", a_imgs[:1], TARGETS)
        await pool.close()
        return [(r.levelno, r.getMessage()) for r in caplog.records if "encoder a:1" in r.getMessage()]

    lines = asyncio.run(run())
    assert [lvl for lvl, _ in lines] == [logging.INFO, logging.INFO, logging.WARNING], lines
    assert "a:1 is not serving yet" in lines[0][1] and lines[1][1] == "encoder a:1 is serving"
    assert "a:1 is down" in lines[2][1]


class SharingEncoder(FakeEncoder):
    """A pooled encoder that also takes the targets' machine (``share_host_id``)."""

    async def encode(self, rid, images, targets, share_host_id=""):
        self.shared_with = share_host_id
        return await super().encode(rid, images, targets)


def test_share_host_id_reaches_the_encoder_only_when_set():
    # The prefill server's machine travels to the encoder (for the GPU-memory hand-off) when it is known, and an
    # encoder client that predates it still gets the plain call.
    async def run():
        sharing, plain = SharingEncoder("a:1"), FakeEncoder("b:2")
        for enc, host in ((sharing, "boot/host"), (plain, "")):
            pool = EncoderPool([enc])
            out = await pool.encode("r1", [b"img"], TARGETS, share_host_id=host)
            assert [o.image_hash for o in out] == [_sha(b"img")]
            await pool.close()
        assert sharing.shared_with == "boot/host" and plain.calls[0][0] == "r1"

    asyncio.run(run())


def test_launch_passes_the_prefill_batching_flags():
    # `epdserve launch --prefill-max-prefill-tokens/--prefill-chunked-prefill-size` reach the prefill server's config.
    import argparse

    from epdserve.config import LaunchConfig, PrefillConfig, add_config_args, config_from_args
    from epdserve.entry.launch_plan import plan_launch

    parser = argparse.ArgumentParser()
    add_config_args(parser, LaunchConfig)
    flags = ["--prefill-max-prefill-tokens", "4096", "--prefill-chunked-prefill-size", "1024"]
    cmd = plan_launch(config_from_args(LaunchConfig, parser.parse_args(flags)), "/models/m", False).commands["prefill"]
    pre_parser = argparse.ArgumentParser()
    add_config_args(pre_parser, PrefillConfig)
    got = config_from_args(PrefillConfig, pre_parser.parse_args(cmd[cmd.index("prefill") + 1:]))
    assert (got.max_prefill_tokens, got.chunked_prefill_size) == (4096, 1024)
    default = plan_launch(LaunchConfig(), "/models/m", False).commands["prefill"]
    assert default[default.index("--max-prefill-tokens") + 1] == str(PrefillConfig().max_prefill_tokens)
