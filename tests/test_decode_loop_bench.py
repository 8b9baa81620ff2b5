"""``python -m epdserve.bench.decode_loop`` (issue 46's constrained-against-unconstrained decode loop) on the tiny
checkpoint: both modes run full batches through the real scheduler, and only the schema runs fill masks."""

from __future__ import annotations

import json


def test_decode_loop_runs_both_modes_at_full_batches(tiny_model_path, tmp_path):
    from epdserve.bench.decode_loop import main

    out = tmp_path / "loop.json"
    assert main(["--model-path", tiny_model_path, "--batch-sizes", "1", "3", "--context", "20", "--steps", "4",
                 "--warmup", "2", "--repeats", "1", "--device", "cpu", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "none"), (1, "schema"), (3, "none"), (3, "schema")]
    for r in rows:
        assert r["rows_mean"] == r["batch"] and r["ms_per_turn"] > 0 and r["step_launch_ms"] > 0
        assert (r["grammar_fill_ms"] is not None and r["grammar_fill_ms"] > 0) == (r["mode"] == "schema")
