"""The checkpoints the GPU tests run on, and a shallower copy of a large one.

A GPU test that proves a CUDA graph replays what the eager forward computes, or that two kernels agree, needs the
real shapes (hidden size, heads, head dim, vocabulary: they pick the GEMM tiles and the flashinfer kernels), not
the real depth: every decoder layer runs the same code, so 36 layers only repeat what 4 show, at 9x the time and
memory (a float32 reference of the whole 3B preset is 15 GB). :func:`shallow_copy` keeps the first layers of a
checkpoint and everything else as it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

# How many LM layers the GPU tests keep of each checkpoint named in EPDSERVE_GPU_TEST_MODELS (the environment
# variable EPDSERVE_GPU_TEST_LAYERS overrides it; 0 keeps them all). Four: Qwen3.5's layout repeats three DeltaNet
# layers and one attention layer, so four hold one of each kind; Qwen3-VL adds its three DeepStack levels to
# layers 0-2, so four also run a layer without one.
DEFAULT_GPU_TEST_LAYERS = 4

# The ``small`` random checkpoints every GPU run has (conftest.py builds them): test id -> make_tiny_model arch.
SMALL_MODELS = {"small-qwen2.5-vl": "qwen2_5_vl", "small-qwen3-vl": "qwen3_vl"}

_LAYER = re.compile(r"layers\.(\d+)\.")


def gpu_test_layers() -> int:
    """LM layers kept of the EPDSERVE_GPU_TEST_MODELS checkpoints (0: all); see :data:`DEFAULT_GPU_TEST_LAYERS`."""
    return int(os.environ.get("EPDSERVE_GPU_TEST_LAYERS", DEFAULT_GPU_TEST_LAYERS))


def env_models() -> list[str]:
    """The checkpoint directories listed in EPDSERVE_GPU_TEST_MODELS (comma-separated; may be empty)."""
    return [p for p in os.environ.get("EPDSERVE_GPU_TEST_MODELS", "").split(",") if p]


def _num_layers(path: str | Path) -> int:
    """``num_hidden_layers`` of the checkpoint at ``path`` (``text_config`` first, then top level)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return int((cfg.get("text_config") or {}).get("num_hidden_layers") or cfg["num_hidden_layers"])


def kept_layers(path: str | Path) -> int:
    """How many LM layers the GPU tests keep of the EPDSERVE_GPU_TEST_MODELS checkpoint at ``path``: 0 (all of
    them) unless :func:`gpu_test_layers` is fewer than it has. Called at collection: a path without a config
    must not break the collection of the CPU tests, so it gets :func:`gpu_test_layers` unchecked."""
    n = gpu_test_layers()
    if not (Path(path) / "config.json").is_file():  # named in the test id; the fixture's copy raises the error
        return n
    return n if 0 < n < _num_layers(path) else 0


def gpu_model_ids() -> list[str]:
    """Test ids of every GPU test model: :data:`SMALL_MODELS`, then each EPDSERVE_GPU_TEST_MODELS entry as
    ``<dir name>-<n>layers`` (``<dir name>`` where it is used whole). Known at collection time, so a test
    parametrized over them reports each model's duration and failure on its own."""
    return [*SMALL_MODELS, *(Path(p).name + (f"-{n}layers" if (n := kept_layers(p)) else "") for p in env_models())]


def shallow_copy(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write to ``dst`` a copy of the checkpoint at ``src`` whose language model keeps only layers
    ``0 .. num_layers - 1``; returns ``dst``.

    Everything else is the source's: the embeddings, final norm and LM head, the vision tower, every layer's
    weights (bf16 or whatever the source holds, byte for byte), the tokenizer, processor and generation files.
    ``config.json`` gets ``num_hidden_layers = num_layers`` (in ``text_config`` and at top level, where each
    has one) and, for a hybrid model (Qwen3.5), ``layer_types`` cut to its first ``num_layers`` entries. Shards
    keep their names (one source shard in host memory at a time; the 3B preset's copy at 4 layers is ~3 GB).

    Raises:
        ValueError: ``num_layers`` < 1 or not fewer than the source has, or a hybrid model whose first
            ``num_layers`` layers lack an attention layer (its KV pool would be empty).
        FileNotFoundError: no config.json or safetensors weights in ``src``.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from epdserve.models.weights import checkpoint_files, lm_name

    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    sections = [c for c in (cfg.get("text_config"), cfg) if c is not None and "num_hidden_layers" in c]
    if not sections:
        raise ValueError(f"{src}/config.json has no num_hidden_layers")
    total = sections[0]["num_hidden_layers"]
    if not 1 <= num_layers < total:
        raise ValueError(f"keep 1 .. {total - 1} of {src}'s {total} layers, not {num_layers}")
    for c in sections:
        c["num_hidden_layers"] = num_layers
        if "layer_types" in c:
            c["layer_types"] = c["layer_types"][:num_layers]
            if "linear_attention" in c["layer_types"] and "full_attention" not in c["layer_types"]:
                raise ValueError(f"the first {num_layers} layers of {src} hold no attention layer")
    dst.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)  # before copying: raises if there are no weights
    for item in src.iterdir():
        if item.name == "config.json" or item.name.startswith("model.safetensors") or item.suffix == ".safetensors":
            continue
        (shutil.copytree if item.is_dir() else shutil.copy2)(item, dst / item.name)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    weight_map = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keep = {}
            for key in f.keys():
                name = lm_name(key)
                layer = _LAYER.match(name) if name else None
                if layer is None or int(layer.group(1)) < num_layers:
                    keep[key] = f.get_tensor(key)
            metadata = f.metadata()
        save_file(keep, str(dst / file.name), metadata=metadata)
        weight_map.update(dict.fromkeys(keep, file.name))
        del keep
    if (src / "model.safetensors.index.json").is_file():
        index = {"metadata": {"note": f"first {num_layers} of {total} LM layers of {src}"},
                 "weight_map": dict(sorted(weight_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return dst
