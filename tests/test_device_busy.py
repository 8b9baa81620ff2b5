"""The device-busy clock behind ``device_busy_seconds_total`` (epdserve/engine/busy.py): on the CPU a block's
wall time; a ModelRunner's forwards are measured once a server tracks them, and only then."""

from __future__ import annotations

import time

import pytest
import torch

from epdserve.engine.busy import DeviceBusy, track_device_busy


def test_cpu_blocks_add_their_wall_time():
    got: list[float] = []
    busy = DeviceBusy(torch.device("cpu"), got.append)
    with busy.measure():
        time.sleep(0.05)
    with pytest.raises(RuntimeError), busy.measure():
        raise RuntimeError("a failed forward still held the device")
    assert len(got) == 2 and 0.05 <= got[0] < 0.5 and 0 <= got[1] < 0.05


def test_a_tracked_runner_counts_its_forwards(tiny_model_path):
    from test_model_runtime import Pages, Seq, make_batch

    from epdserve.engine.forward_batch import ForwardBatch
    from epdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=32, page_size=4)
    def forward():  # a fresh 30-token prompt's prefill
        seq = Seq(list(range(10, 40)), [], Pages(runner.num_pages).take(9), 4)
        b = make_batch([seq.extend_part(30)], False)
        runner.forward(ForwardBatch(b.is_decode, b.input_ids, b.positions, b.out_slots, b.q_lens, b.kv_lens,
                                    b.page_table))

    forward()  # untracked: nothing to add to
    got: list[float] = []
    track_device_busy(runner, got.append)
    t0 = time.perf_counter()
    forward()
    forward()
    wall = time.perf_counter() - t0
    assert len(got) == 2 and 0 < sum(got) <= wall
