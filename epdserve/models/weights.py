"""Read the language-model tensors of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL safetensors checkpoint under epdserve's
names.

Layouts: transformers 5 (and the released Qwen3-VL checkpoints) ``model.language_model.*``, ``model.visual.*``,
``lm_head.weight``; the released Qwen2-VL / Qwen2.5-VL checkpoints (and transformers 5's saves of them)
``model.*``, ``visual.*``, ``lm_head.weight``; older ``language_model.model.*``. Qwen3-VL's decoder adds
``layers.N.self_attn.q_norm.weight`` / ``k_norm.weight`` and has no q/k/v biases; the names map the same way.
Qwen3.5 (``model.language_model.*`` too) adds the Gated DeltaNet layers' ``layers.N.linear_attn.{in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a, out_proj}.weight``, ``conv1d.weight``, ``dt_bias``, ``A_log`` and ``norm.weight``
(kept under those names), and its attention layers' ``q_proj`` holds query and gate; the released checkpoints'
multi-token-prediction head (``mtp.*``) is not an LM tensor here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

# Checked in order: the first that matches is stripped. transformers 5 in-memory names, then older hub names.
_LM_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
_VISION_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.")
_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


def checkpoint_files(model_path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards named by its index.

    Raises:
        FileNotFoundError: neither ``model.safetensors`` nor ``model.safetensors.index.json`` exists.
    """
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(model_path)!r}")


def lm_name(key: str) -> str | None:
    """Map a checkpoint key to the LM module name (``layers.0.self_attn.q_proj.weight``, Qwen3's
    ``layers.0.self_attn.q_norm.weight``, ``embed_tokens.weight``, ``norm.weight``, ``lm_head.weight``); None for
    vision (including Qwen3-VL's ``model.visual.deepstack_merger_list.*``) and other non-LM tensors."""
    if key.startswith(_VISION_PREFIXES):
        return None
    if key in _LM_HEAD_KEYS:
        return "lm_head.weight"
    for prefix in _LM_PREFIXES:
        if key.startswith(prefix):
            name = key[len(prefix):]
            if name.startswith(("layers.", "embed_tokens.", "norm.")):
                return name
            return None
    return None


def iter_lm_weights(model_path: str | Path, *, tie_word_embeddings: bool = False,
                    device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(lm_name, tensor)`` for every language-model tensor, skipping the vision tower (the encoder's).

    Tensors are read one at a time (straight onto ``device``) so peak host memory stays near one tensor; their
    dtype is the checkpoint's, callers cast. ``embed_tokens.weight`` is also yielded as ``lm_head.weight`` when
    ``tie_word_embeddings`` is set (a stored ``lm_head`` is then ignored) or when the checkpoint has no lm_head.

    Raises:
        FileNotFoundError: see :func:`checkpoint_files`.
    """
    embed, saw_head = None, False
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = lm_name(key)
                if name is None or (name == "lm_head.weight" and tie_word_embeddings):
                    continue
                tensor = f.get_tensor(key)
                saw_head |= name == "lm_head.weight"
                if name == "embed_tokens.weight":
                    embed = tensor
                yield name, tensor
    if not saw_head and embed is not None:
        yield "lm_head.weight", embed
