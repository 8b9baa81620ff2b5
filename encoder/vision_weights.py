"""Reading a Qwen-VL checkpoint's vision tower: its transformers class and only its tensors from the safetensors
files, so the encoder never holds the language model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# transformers 5 names the tower ``model.visual``; checkpoints written by older versions (and the hub's
# Qwen2-VL / Qwen2.5-VL releases) name it ``visual``. transformers 5 itself still saves the older layout.
_VISUAL_PREFIXES = ("model.visual.", "visual.")


def vision_class(model_type: str) -> type:
    """transformers' vision tower class of ``model_type``.

    Raises:
        ValueError: not ``qwen2_5_vl``, ``qwen2_vl``, ``qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5`` or ``qwen3_5_moe``.
    """
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VisionTransformerPretrainedModel
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        return Qwen2VisionTransformerPretrainedModel
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel
    if model_type == "qwen3_vl_moe":  # the MoE LM's tower: Qwen3-VL's, DeepStack included
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        return Qwen3VLMoeVisionModel
    if model_type == "qwen3_5":  # Qwen3-VL's tower without the DeepStack mergers
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel
    if model_type == "qwen3_5_moe":  # the MoE LM's tower: Qwen3.5's
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel
    raise ValueError(f"unsupported model_type {model_type!r}; expected 'qwen2_5_vl', 'qwen2_vl', 'qwen3_vl', "
                     "'qwen3_vl_moe', 'qwen3_5' or 'qwen3_5_moe'")


def _safetensors_files(model_path: Path) -> list[Path]:
    """The safetensors files that hold vision tower tensors (only those shards, for a sharded checkpoint)."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names = sorted({f for k, f in weight_map.items() if k.startswith(_VISUAL_PREFIXES)})
        if not names:
            raise ValueError(f"{index} lists no vision tower tensors ({' or '.join(_VISUAL_PREFIXES)}*)")
        return [model_path / n for n in names]
    single = model_path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_path}")


def load_vision_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Read only the vision tower tensors of a checkpoint, with the ``model.visual.``/``visual.`` prefix removed.

    Returns CPU tensors in the checkpoint's dtype.

    Raises:
        FileNotFoundError: no safetensors file in ``model_path``.
        ValueError: no vision tensors, or one tensor under both prefixes.
    """
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(model_path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                prefix = next((p for p in _VISUAL_PREFIXES if key.startswith(p)), None)
                if prefix is None:
                    continue
                name = key[len(prefix):]
                if name in state:
                    raise ValueError(f"vision tensor {name!r} appears twice in {model_path}")
                state[name] = f.get_tensor(key)
    if not state:
        raise ValueError(f"no vision tower tensors in {model_path}")
    return state
