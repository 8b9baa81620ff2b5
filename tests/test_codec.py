"""The wire codec (epdserve/wire/codec.py): what it carries back unchanged, and what it refuses (WireError) or will
not send (TypeError). msgpack packs and walks the lists itself; the codec only sees messages and tensors."""

from __future__ import annotations

import msgpack
import pytest
import torch

from epdserve.wire.messages import ImageSpan, PrefillRequest, SamplingParams, WireError, decode, encode
from epdserve.wire.tp_messages import TPForward


def test_round_trip_keeps_nested_messages_lists_and_tensors():
    span = ImageSpan(2, 4, "ab" * 32, [1, 4, 4])
    msg = PrefillRequest("r", [1, 2, 5, 5, 5, 5, 3], [span], SamplingParams(temperature=0.0, stop=["x"]), 7)
    out = decode(encode(msg))
    assert out == msg and isinstance(out.images[0], ImageSpan)
    pages = [[i * 40 + j for j in range(32)] for i in range(128)]
    fwd = TPForward(is_decode=True, num_tokens=128, positions=torch.arange(384).view(3, 128),
                    out_slots=torch.arange(128), q_lens=[1] * 128, kv_lens=[512] * 128, page_table=pages,
                    mm_mask=torch.ones(128, dtype=torch.uint8), mm_sources=[["r", "ab", 0, 4]])
    frames = encode(fwd)
    assert len(frames) == 4  # the header and one frame per tensor
    back = decode(frames)
    assert back.page_table == pages and back.kv_lens == fwd.kv_lens and back.mm_sources == fwd.mm_sources
    for name in ("positions", "out_slots", "mm_mask"):
        assert torch.equal(getattr(back, name), getattr(fwd, name)), name


def test_hostile_frames_are_wire_errors():
    good = encode(PrefillRequest("r", [1, 2], [], SamplingParams(), 1))
    header = msgpack.unpackb(good[0])
    cases = {
        "unknown kind": [msgpack.packb({**header, "kind": "Nope"})],
        "a map that is no message": [msgpack.packb({**header, "sampling": {"a": 1}})],
        "not a message at all": [msgpack.packb([1, 2, 3])],
        "malformed msgpack": [b"\xc1\xff"],
        "tensor index past the frames": [msgpack.packb({**header, "rid": {"__tensor__": 3, "dtype": "int64",
                                                                          "shape": [1]}})],
        "tensor of the wrong size": [msgpack.packb({**header, "rid": {"__tensor__": 0, "dtype": "int64",
                                                                      "shape": [2]}}), b"\0" * 8],
        "unknown tensor dtype": [msgpack.packb({**header, "rid": {"__tensor__": 0, "dtype": "complex64",
                                                                  "shape": [1]}}), b"\0" * 8],
        "a field the class does not take positionally": [msgpack.packb({"kind": "ImageSpan", "start": 1})],
        "no frames": [],
    }
    for name, frames in cases.items():
        with pytest.raises(WireError):
            decode(frames)
            pytest.fail(name)


def test_only_registered_messages_and_plain_data_are_sent():
    from dataclasses import dataclass

    @dataclass
    class Stranger:
        x: int

    with pytest.raises(TypeError, match="Stranger"):
        encode(Stranger(1))
    with pytest.raises(TypeError, match="set"):
        encode(PrefillRequest("r", {1, 2}, [], SamplingParams(), 1))
