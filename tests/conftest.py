"""Shared fixtures: the tiny checkpoints (built once per test session) and the shared photos."""

from __future__ import annotations

from pathlib import Path

import pytest

IMAGES_DIR = Path(__file__).resolve().parents[2] / "shared" / "images"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny Qwen2.5-VL checkpoint (random weights, seed 0) in a session temp dir."""
    from epdserve.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2.5-vl")))


@pytest.fixture(scope="session")
def tiny_qwen2_vl_path(tmp_path_factory) -> str:
    """A tiny Qwen2-VL checkpoint (the older architecture and vision tower)."""
    from epdserve.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-vl"), arch="qwen2_vl"))


@pytest.fixture(scope="session")
def photo_paths() -> dict[str, Path]:
    """The CC0 photos in ../shared/images, by file stem."""
    paths = {p.stem: p for p in sorted(IMAGES_DIR.glob("*")) if p.suffix in (".png", ".jpg")}
    if not paths:  # a silent skip would hide most of the suite
        pytest.fail(f"no photos in {IMAGES_DIR}: the tests expect the repository's sibling folder shared/images")
    return paths


@pytest.fixture(scope="session")
def stage_procs(tiny_model_path, tmp_path_factory):
    """Encoder, prefill and decode of the tiny model as processes (tests/cluster.py), 256 KV pages each; shared by
    the fault and fuzz tests, which leave them running (restarting any they kill)."""
    from cluster import StageProcs

    procs = StageProcs(tiny_model_path, tmp_path_factory.mktemp("stages"))
    procs.start()
    yield procs
    procs.stop_all()
