"""The vision MLP's zero padding (``pad_mlp_intermediate``): same tower output, aligned widths, layouts refused."""

import pytest
import torch
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from epdserve.encoder.vision_weights import pad_mlp_intermediate


def _qwen2_5(intermediate: int) -> torch.nn.Module:
    config = Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=intermediate, num_heads=2,
                                    out_hidden_size=48, fullatt_block_indexes=[1])
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=torch.float32).eval()


def _qwen3(intermediate: int) -> torch.nn.Module:
    config = Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=intermediate, num_heads=2,
                                 out_hidden_size=48, num_position_embeddings=64, deepstack_visual_indexes=[0])
    return Qwen3VLVisionModel._from_config(config, dtype=torch.float32).eval()


def _inputs(model: torch.nn.Module, grids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    c = model.config
    patches = sum(t * h * w for t, h, w in grids)
    width = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
    return torch.randn(patches, width, generator=torch.Generator().manual_seed(1)), torch.tensor(grids)


@pytest.mark.parametrize("make", [_qwen2_5, _qwen3])
def test_padding_keeps_the_tower_output(make):
    torch.manual_seed(0)
    model = make(44)
    for block in model.blocks:  # non-zero biases, so a padded lane that leaked would show
        for m in block.mlp.children():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.bias)
    pixels, grid = _inputs(model, [[1, 8, 8], [1, 4, 12]])
    with torch.no_grad():
        before = model(pixels, grid_thw=grid).pooler_output
        assert pad_mlp_intermediate(model) == 64
        after = model(pixels, grid_thw=grid).pooler_output
    linears = [m for m in model.blocks[0].mlp.children() if isinstance(m, torch.nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears[:-1]] == [(64, 32)] * (len(linears) - 1)
    assert tuple(linears[-1].weight.shape) == (32, 64)
    assert not linears[0].weight[44:].any() and not linears[-1].weight[:, 44:].any()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_aligned_width_is_left_alone():
    model = _qwen2_5(48)
    weight = model.blocks[0].mlp.down_proj.weight
    assert pad_mlp_intermediate(model) == 48
    assert model.blocks[0].mlp.down_proj.weight is weight


def test_unknown_mlp_layout_is_refused():
    model = _qwen2_5(44)
    model.blocks[0].mlp.extra = torch.nn.Linear(32, 32)
    with pytest.raises(ValueError, match="unexpected vision MLP layout"):
        pad_mlp_intermediate(model)
