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


def test_timeline_summary_takes_unions_overlaps_idle_time_and_decode_gaps():
    from epdserve.bench.device_timeline import Block, summary

    blocks = [Block("decode", 1, 0.0, 1.0, 4), Block("decode", 1, 1.5, 2.0, 4), Block("decode", 1, 3.0, 4.0, 2),
              Block("prefill", 2, 0.5, 1.2, 1, 300), Block("prefill", 2, 1.1, 1.4, 1, 200),  # overlapping blocks
              Block("encoder", 3, 2.5, 2.6, 8, 8192)]
    got = summary(blocks)
    assert got["window_s"] == 4.0
    # busy: decode [0,1] [1.5,2] [3,4]; prefill [0.5,1.4]; encoder [2.5,2.6]: none in [1.4,1.5] [2,2.5] [2.6,3]
    assert got["idle_share"] == 0.25
    d, p, e = (got["stages"][s] for s in ("decode", "prefill", "encoder"))
    assert d["busy_s"] == 2.5 and d["overlap_share"] == round(0.5 / 2.5, 4) and d["blocks"] == 3
    assert p["busy_s"] == 0.9 and p["overlap_share"] == round(0.5 / 0.9, 4)
    assert e["busy_share"] == round(0.1 / 4, 4) and e["overlap_share"] == 0
    assert d["gap_ms_median"] == 750.0 and d["gap_ms_p90"] == 1000.0 and d["rows_mean"] == round(10 / 3, 2)


def test_a_tracked_runner_writes_its_forwards_to_the_timeline(tiny_model_path, tmp_path, monkeypatch):
    from test_model_runtime import Pages, Seq, make_batch

    from epdserve.bench.device_timeline import load, main
    from epdserve.engine.busy import TIMELINE_ENV
    from epdserve.engine.forward_batch import ForwardBatch
    from epdserve.engine.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_path, device=torch.device("cpu"), dtype=torch.float32, num_pages=32, page_size=4)
    monkeypatch.setenv(TIMELINE_ENV, str(tmp_path / "timeline"))
    got: list[float] = []
    track_device_busy(runner, got.append, "prefill")
    t0 = time.time()
    for _ in range(2):
        seq = Seq(list(range(10, 40)), [], Pages(runner.num_pages).take(9), 4)
        b = make_batch([seq.extend_part(30)], False)
        runner.forward(ForwardBatch(b.is_decode, b.input_ids, b.positions, b.out_slots, b.q_lens, b.kv_lens,
                                    b.page_table))
    t1 = time.time()
    blocks = load(tmp_path / "timeline")
    assert [(b.stage, b.rows, b.tokens) for b in blocks] == [("prefill", 1, 30)] * 2
    assert blocks[0].start == 0 and blocks[0].end <= blocks[1].start <= blocks[1].end <= t1 - t0
    # The file keeps start and end to the microsecond (each rounded once, on unix times whose float64 step is
    # 0.24 us), so a block's length is the measured seconds to within 1 us plus that step; rounding both sides to
    # 5 decimals instead failed whenever they straddled a rounding boundary (CI, 0.26923 against 0.26922).
    assert len(blocks) == len(got)
    lengths = [b.end - b.start for b in blocks]
    assert all(abs(n - s) <= 1.5e-6 for n, s in zip(lengths, got)), (lengths, got)
    assert main([str(tmp_path / "timeline"), "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000
