"""Reading a Qwen-VL checkpoint's vision tower: its transformers class and only its tensors from the safetensors
files, so the encoder never holds the language model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.nn import functional as F

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


def pad_mlp_intermediate(model: torch.nn.Module, multiple: int = 64) -> int:
    """Zero-pad the intermediate width of every vision block's MLP, in place, up to a multiple of ``multiple``
    when it is not already a multiple of 8 (16 bytes of fp16/bf16: cuBLAS's alignment for its fast kernels).

    Why: Qwen2.5-VL's tower has an intermediate size of 3420. Its gate/up/down GEMMs then run on Ampere
    CUTLASS kernels with 2-element alignment, 70 % of the compiled tower's GPU time for 16 images of 448² on an
    H200, and Inductor's own padding of those GEMMs puts guards on the patch count that recompile the blocks
    mid-serving (docs/performance.md, "2026-11-29, twelfth session"). Padding the weights once at load removes both.

    Exact: the added rows of the up-projections (``in_features`` = hidden, e.g. ``gate_proj``, ``up_proj``,
    ``linear_fc1``) and their biases are zero, and so are the added input columns of the down-projection (``in``
    = intermediate: ``down_proj``, ``linear_fc2``), so whatever the activation makes of the padded lanes is
    multiplied by zero. The sums only gain zero terms.

    Args:
        model: a vision tower whose ``blocks[i].mlp`` hold ``torch.nn.Linear`` children (every Qwen-VL tower).
        multiple: the padded width's multiple.

    Returns:
        The MLPs' intermediate width afterwards.

    Raises:
        ValueError: a block's MLP is not one or two up-projections from the hidden width and one down-projection.
    """
    width = 0
    for block in model.blocks:
        linears = [m for m in block.mlp.children() if isinstance(m, torch.nn.Linear)]
        hidden = linears[-1].out_features if linears else 0
        ups = [m for m in linears if m.in_features == hidden and m.out_features != hidden]
        downs = [m for m in linears if m.out_features == hidden and m.in_features != hidden]
        if not ups or len(downs) != 1 or len(ups) + 1 != len(linears):
            raise ValueError(f"unexpected vision MLP layout: {block.mlp}")
        width = ups[0].out_features
        if width % 8 == 0:
            continue
        extra = -(-width // multiple) * multiple - width
        width += extra
        for up in ups:  # F.pad's pairs count from the last dim: (0, 0, 0, extra) appends rows
            up.weight = torch.nn.Parameter(F.pad(up.weight, (0, 0, 0, extra)), requires_grad=False)
            if up.bias is not None:
                up.bias = torch.nn.Parameter(F.pad(up.bias, (0, extra)), requires_grad=False)
            up.out_features = width
        downs[0].weight = torch.nn.Parameter(F.pad(downs[0].weight, (0, extra)), requires_grad=False)
        downs[0].in_features = width
    return width
