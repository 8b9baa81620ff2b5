"""Random-weight checkpoints with the shapes of released Qwen-VL models (:func:`make_preset_model`), so GPU
benchmarks pay the real compute and memory cost.

Where the numbers come from (``PRESETS``): the released ``config.json`` of each model. Qwen2-VL / Qwen2.5-VL: the
Qwen/Qwen2-VL-2B-Instruct, Qwen/Qwen2.5-VL-{3B,7B}-Instruct configs. Qwen3-VL (dense, released with transformers
4.57.0.dev0): Qwen/Qwen3-VL-{2B,4B,8B}-Instruct's ``config.json``, read as quoted verbatim in public repositories
(found with the code-search corpus, 2026-11: an 8B model report listing the config and all 750 tensor shapes, test
fixtures of the 2B and 4B configs); their processors from the quoted ``preprocessor_config.json`` (see
:mod:`epdserve.models.qwen3_vl_checkpoint`). Qwen3.5 (dense, hybrid LM): only ``qwen3.5-9b``, whose text sizes are
transformers 5's ``Qwen3_5TextConfig`` defaults and agree with a public test fixture quoting Qwen/Qwen3.5-9B's
``config.json`` (24 DeltaNet + 8 gated-attention layers, 16 key / 32 value DeltaNet heads of 128, kernel 4), and
whose tower (27 blocks of 1152, no DeepStack, out 4096) is quoted alike by several public repositories (code
search, 2026-11). Its processor is assumed to be Qwen3-VL's released one (patch 16, merge 2; not checked).
``qwen3.5-0.8b``, ``qwen3.5-4b`` and ``qwen3.5-27b`` (2026-11, sources at each entry of ``PRESETS``): the released
``config.json`` as quoted verbatim in public files (0.8B: a full ``curl`` of it; 4B: a plan listing every text field
of the fetched file; 27B: THUDM/slime's launch script plus a full ``Qwen3_5Config`` copy). Qwen3.5-2B is left out:
its text sizes are public (model card: 24 layers of 2048, 16 K / 16 V DeltaNet heads, 8 Q / 2 KV heads of 256, FFN
6144, tied) but only the depth (24) and width (1024) of its tower were found, not its MLP width or head count.
The released DeltaNet grouping is not one ratio: value heads = key heads (16) in 0.8B and 2B, twice in 4B and 9B,
three times in 27B. Qwen3.5-MoE: only ``qwen3.5-35b-a3b``, the smallest (transformers' ``qwen3_5_moe`` model page
lists 35B-A3B, 122B-A10B and 397B-A17B, and Qwen3.6-35B-A3B of the same architecture); sources at its entry.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# qwen2.5-vl-3b is untied here although the released 3B ties its head: the baseline this preset reproduces
# measured the untied model (3.40B LM parameters).
_QWEN25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, hidden_act="silu")
# Qwen3-VL: every text model has head_dim 128, 8 KV heads, rope theta 5e6, interleaved mrope_section [24, 20, 20]
# and 262144 positions; 2B and 4B share a 24-block tower (DeepStack from blocks 5, 11, 17), 8B has 27 blocks.
_QWEN3_TEXT = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                   mrope_section=[24, 20, 20])
_QWEN3_VISION_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                           deepstack_visual_indexes=[5, 11, 17])


def _qwen35_layers(groups: int) -> list[str]:
    """The released Qwen3.5 layout: ``groups`` times three DeltaNet layers, then one gated-attention layer
    (``full_attention_interval`` 4)."""
    return (["linear_attention"] * 3 + ["full_attention"]) * groups


# Every released dense Qwen3.5: vocabulary 248320 (padded), 262144 positions, attention heads of 256 (partial rotary
# 0.25: 64 rotated features, interleaved mrope_section [11, 11, 10]), DeltaNet heads of 128 (key = value dim), conv
# kernel 4 (all quoted in each source below).
_QWEN35_TEXT = dict(vocab_size=248320, head_dim=256, max_position_embeddings=262144, linear_num_key_heads=16,
                    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                    mrope_section=[11, 11, 10])
# The 27-block tower of 1152 (Qwen3.5-9B, -27B and -35B-A3B; out_hidden_size is the text width, set by
# qwen3_5_config).
_QWEN35_VISION_LARGE = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16)
_QWEN35_9B_LAYERS = _qwen35_layers(8)
PRESETS = {
    "qwen2.5-vl-3b": dict(
        arch="qwen2_5_vl", tie_word_embeddings=False,
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=2, head_dim=128, max_position_embeddings=128000),
        vision=dict(_QWEN25_VISION, out_hidden_size=2048)),
    "qwen2.5-vl-7b": dict(
        arch="qwen2_5_vl", tie_word_embeddings=False,
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, head_dim=128, max_position_embeddings=128000),
        vision=dict(_QWEN25_VISION, out_hidden_size=3584)),
    "qwen2-vl-2b": dict(
        arch="qwen2_vl", tie_word_embeddings=True,
        text=dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, head_dim=128, max_position_embeddings=32768),
        vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, hidden_size=1536)),
    "qwen3-vl-2b": dict(
        arch="qwen3_vl", tie_word_embeddings=True,
        text=dict(_QWEN3_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16),
        vision=dict(_QWEN3_VISION_SMALL)),
    "qwen3-vl-4b": dict(
        arch="qwen3_vl", tie_word_embeddings=True,  # 32 heads of 128 over a hidden size of 2560
        text=dict(_QWEN3_TEXT, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                  num_attention_heads=32),
        vision=dict(_QWEN3_VISION_SMALL)),
    "qwen3-vl-8b": dict(
        arch="qwen3_vl", tie_word_embeddings=False,
        text=dict(_QWEN3_TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    deepstack_visual_indexes=[8, 16, 24])),
    # Qwen/Qwen3-VL-30B-A3B-Instruct (mixture of experts): the released config.json, sources and fields in
    # epdserve.models.qwen3_vl_moe_checkpoint: every one of 48 layers routes 128 experts of 768, top-8 (no shared
    # expert; the dense intermediate_size 6144 is never built), 32 Q / 4 KV heads of 128, untied; the 8B's tower
    # with out 2048. ~61 GB of bf16 weights, experts written transposed as released.
    "qwen3-vl-30b-a3b": dict(
        arch="qwen3_vl_moe", tie_word_embeddings=False,
        text=dict(_QWEN3_TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                  num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[]),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                    deepstack_visual_indexes=[8, 16, 24])),
    # Qwen/Qwen3.5-9B: transformers 5's Qwen3_5TextConfig defaults; checked again 2026-11 against two public
    # copies of the released text_config (cpehle/tyr Tyr/Model/Qwen35/Config.lean `qwen35_9B`, and a Rust test
    # fixture found with find_string '"model_type": "qwen3_5_text",': 4096 x 32 layers, FFN 12288, 16 Q / 4 KV
    # heads of 256, 16 K / 32 V DeltaNet heads of 128, kernel 4, untied).
    "qwen3.5-9b": dict(
        arch="qwen3_5", tie_word_embeddings=False,
        text=dict(_QWEN35_TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                  num_attention_heads=16, num_key_value_heads=4, layer_types=_QWEN35_9B_LAYERS,
                  linear_num_value_heads=32),
        vision=dict(_QWEN35_VISION_LARGE)),
    # Qwen/Qwen3.5-0.8B: https://huggingface.co/Qwen/Qwen3.5-0.8B/resolve/main/config.json, quoted whole (a curl of
    # it in a public agent session log; find_string '"linear_num_value_heads": 16,' / 'Qwen3.5-0.8B'): 24 layers
    # (6 x 3+1) of 1024, FFN 3584, 8 Q / 2 KV heads, 16 K / 16 V DeltaNet heads, tied; tower 12 blocks of 768, MLP
    # 3072, 12 heads, out 1024. The text part agrees with cpehle/tyr Tyr/Model/Qwen35/Config.lean `qwen35_0_8B`.
    "qwen3.5-0.8b": dict(
        arch="qwen3_5", tie_word_embeddings=True,
        text=dict(_QWEN35_TEXT, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, layer_types=_qwen35_layers(6),
                  linear_num_value_heads=16),
        vision=dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)),
    # Qwen/Qwen3.5-4B: text from https://huggingface.co/Qwen/Qwen3.5-4B/resolve/main/config.json as listed field by
    # field in a public implementation plan that fetched it (find_string 'Qwen3.5-4B/resolve/main/config.json'):
    # 32 layers (8 x 3+1) of 2560, FFN 9216, 16 Q / 4 KV heads of 256, 16 K / 32 V DeltaNet heads of 128, kernel 4,
    # rope theta 1e7, partial rotary 0.25; tie_word_embeddings true (a second public file, hash-checked against the
    # same URL). The tower (24 blocks of 1024, MLP 4096, 16 heads, out 2560) is read from public copies of the
    # config.json of a fine-tune of Qwen3.5-4B (find_string '"out_hidden_size": 2560'), not the released file: a
    # fine-tune keeps the architecture; it is the tower of Qwen3-VL-2B/4B too.
    "qwen3.5-4b": dict(
        arch="qwen3_5", tie_word_embeddings=True,
        text=dict(_QWEN35_TEXT, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                  num_attention_heads=16, num_key_value_heads=4, layer_types=_qwen35_layers(8),
                  linear_num_value_heads=32),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)),
    # Qwen/Qwen3.5-27B: THUDM/slime scripts/models/qwen3.5-27B.sh (64 layers of 5120, FFN 17408, 24 Q heads in 4
    # KV groups of 256, rotary 25 %, base 1e7, untied, vocabulary 248320), and a full copy of the released
    # Qwen3_5Config in public benchmark code (find_string '"linear_num_value_heads": 48'): 16 K / 48 V DeltaNet
    # heads of 128, kernel 4, mrope_section [11, 11, 10], layer_types 16 x 3+1; tower 27 blocks of 1152, MLP 4304,
    # 16 heads, out 5120. 16 K / 48 V are also the defaults of Modular MAX's Qwen3_5Config
    # (https://docs.modular.com/max/api/python/pipelines.architectures.qwen3_5/). ~54 GB of bf16 weights: one
    # H200 with room for its pools.
    "qwen3.5-27b": dict(
        arch="qwen3_5", tie_word_embeddings=False,
        text=dict(_QWEN35_TEXT, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, layer_types=_qwen35_layers(16),
                  linear_num_value_heads=48),
        vision=dict(_QWEN35_VISION_LARGE)),
    # Qwen/Qwen3.5-35B-A3B (mixture of experts, 35B total / 3B active): the text sizes are transformers 5's
    # Qwen3_5MoeTextConfig defaults (its docstring's checkpoint; but for 262144 positions: the default is 32768), and
    # agree with THUDM/slime scripts/models/qwen3.5-35B-A3B.sh (40 layers of 2048, 16 Q heads in 2 KV groups of 256,
    # rotary 25 %, base 1e7, untied, vocabulary 248320, 256 experts top-8 of 512, a gated shared expert of 512,
    # DeltaNet every layer but each 4th: 16 K / 32 V heads of 128, kernel 4) and with a public research note listing
    # the fetched config.json field by field (find_string 'Qwen3.5-35B-A3B/resolve/main/config.json': also 262144
    # positions, mrope_section [11, 11, 10] interleaved, partial rotary 0.25). Every layer sparse, no dense MLP. The
    # tower (27 blocks of 1152, MLP 4304, 16 heads, patch 16, merge 2, out 2048) is Qwen3_5MoeVisionConfig's defaults
    # but for out_hidden_size (default 3584), as quoted in public copies of the config.json of Qwen3.6-35B-A3B (same
    # architecture; find_string '"shared_expert_intermediate_size": 512,') and of a 35B qwen3_5_moe fine-tune
    # (find_string '"model_type": "qwen3_5_moe_vision"'); no copy of Qwen3.5-35B-A3B's own vision_config was found.
    # ~70 GB of bf16 weights, experts fused [E, 2I, hidden] / [E, hidden, I] as released.
    "qwen3.5-35b-a3b": dict(
        arch="qwen3_5_moe", tie_word_embeddings=False,
        text=dict(_QWEN35_TEXT, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                  num_key_value_heads=2, layer_types=_qwen35_layers(10), linear_num_value_heads=32,
                  num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512),
        vision=dict(_QWEN35_VISION_LARGE)),
}
# The image processor of the released Qwen2-VL / Qwen2.5-VL checkpoints (preprocessor_config.json).
PRESET_MIN_PIXELS, PRESET_MAX_PIXELS = 56 * 56, 12845056
_MAX_SHARD_BYTES = 2 * 1000**3


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from ``seed`` and a tensor name, stable across processes (unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _init_kind(module, param_name: str) -> str:
    """``"normal"``, ``"zeros"``, ``"ones"`` or ``"a_log"``: what transformers' ``_init_weights`` does to one
    parameter of ``module`` (linear/conv weights and embeddings normal, their biases 0, norm weights 1 and
    norm biases 0; Qwen3.5's zero-centred ``Qwen3_5RMSNorm`` (and Qwen3.5-MoE's ``Qwen3_5MoeRMSNorm``) weights 0, a
    DeltaNet's ``dt_bias`` 1 and ``A_log`` the log of U(0.01, 16); fused experts and routers normal).

    Raises:
        ValueError: a module kind ``_init_weights`` treats otherwise (so a new layer type is not silently wrong).
    """
    from torch import nn

    name = type(module).__name__
    if name in ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet") and param_name in ("dt_bias", "A_log"):
        return "ones" if param_name == "dt_bias" else "a_log"
    if name in ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"):  # applied as (1 + weight)
        return "zeros"
    # fused experts and the router (Qwen3-VL-MoE's MoeText*, Qwen3.5-MoE's Moe*): normal
    if name.endswith(("MoeTextExperts", "MoeTextTopKRouter", "MoeExperts", "MoeTopKRouter")):
        return "normal"
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)):
        return "zeros" if param_name == "bias" else "normal"
    if "LayerNorm" in name or "RMSNorm" in name:
        return "zeros" if param_name == "bias" else "ones"
    raise ValueError(f"no random init rule for parameter {param_name!r} of {name}")


def _tensor_plan(model) -> list[tuple[str, str, tuple[int, ...], str, int | None]]:
    """``(saved name, in-memory name, shape, init kind, embedding padding_idx)`` of every tensor that
    ``save_pretrained`` would write for ``model`` (a meta-device model): tied copies left out, names in the
    checkpoint layout that transformers writes (``model.layers.*``, ``visual.*``, ``lm_head.weight``), fused experts
    in the released layouts: Qwen3-VL-MoE's transposed, Qwen3.5-MoE's as held in memory under the in-memory name
    (``save_pretrained`` would split those per expert).

    Raises:
        ValueError: see :func:`_init_kind`; a name that transformers' reverse renaming maps to != 1 name.
    """
    from torch import nn
    from transformers.core_model_loading import revert_weight_conversion

    from epdserve.models.qwen3_vl_moe_checkpoint import is_fused_expert

    tied = set(model.all_tied_weights_keys)
    plan = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if name in tied:
                continue
            saved = list(revert_weight_conversion(model, {name: param}))
            shape = tuple(param.shape)
            if is_fused_expert(name) and len(saved) > 1:  # Qwen3.5-MoE: [E, 2I, hidden] / [E, hidden, I]
                saved = [name]
            elif is_fused_expert(saved[0]):  # Qwen3-VL-MoE, released as [E, hidden, 2I] and [E, I, hidden]
                shape = (shape[0], shape[2], shape[1])
            if len(saved) != 1:
                raise ValueError(f"{name} saves as {saved}; expected one name")
            padding_idx = module.padding_idx if isinstance(module, nn.Embedding) else None
            plan.append((saved[0], name, shape, _init_kind(module, param_name), padding_idx))
    return plan


def _preset_config(spec: dict, tokenizer, overrides: dict):
    """``(config, model class, write_processor(out))`` of a preset with ``overrides`` merged into its sizes:
    Qwen3-VL, Qwen3.5 and their MoE with :mod:`epdserve.models.qwen3_vl_checkpoint`'s processor (released bounds),
    the others through :mod:`epdserve.models.tiny` (``PRESET_MIN_PIXELS`` .. ``PRESET_MAX_PIXELS``)."""
    from epdserve.models import tiny
    from epdserve.models.qwen3_5_checkpoint import qwen3_5_config, qwen3_5_moe_config
    from epdserve.models.qwen3_vl_checkpoint import RELEASED_IMAGE_PIXELS, qwen3_vl_config, write_qwen3_vl_processor
    from epdserve.models.qwen3_vl_moe_checkpoint import qwen3_vl_moe_config

    text = {**spec["text"], **overrides.get("text", {})}
    vision = {**spec["vision"], **overrides.get("vision", {})}
    tie = spec["tie_word_embeddings"]
    make = {"qwen3_vl": qwen3_vl_config, "qwen3_5": qwen3_5_config, "qwen3_vl_moe": qwen3_vl_moe_config,
            "qwen3_5_moe": qwen3_5_moe_config}.get(spec["arch"])
    if make is not None:
        config, model_cls = make(tokenizer, text=text, vision=vision, tie_word_embeddings=tie)
        return config, model_cls, lambda out: write_qwen3_vl_processor(out, tokenizer,
                                                                       image_pixels=RELEASED_IMAGE_PIXELS)
    config, model_cls, processor_cls = tiny._build_config(spec["arch"], tokenizer, text=text, vision=vision,
                                                          tie_word_embeddings=tie)
    return config, model_cls, lambda out: tiny._write_generation_and_processor(
        out, tokenizer, processor_cls, min_pixels=PRESET_MIN_PIXELS, max_pixels=PRESET_MAX_PIXELS)


def _shards(plan: list, nbytes: dict[str, int]) -> list[list]:
    """``plan`` cut in model order into shards of at most ``_MAX_SHARD_BYTES`` (a larger tensor gets its own)."""
    shards: list[list] = [[]]
    size = 0
    for entry in plan:
        if shards[-1] and size + nbytes[entry[0]] > _MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes[entry[0]]
    return shards


def _write_shards(out: Path, plan: list, *, seed: int, device, std: float, head: str, zero_rows,
                  desc: str) -> int:
    """Draw every tensor of ``plan`` in bfloat16 on ``device`` (see :func:`make_preset_model`), zero the
    ``zero_rows`` of the ``head`` tensor, write the safetensors shards and their index to ``out``. Returns the
    number of parameters."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    nbytes = {entry[0]: 2 * int(torch.Size(entry[2]).numel()) for entry in plan}  # bf16: 2 bytes a value
    shards = _shards(plan, nbytes)
    for old in out.glob("model*.safetensors*"):  # a previous, differently sharded checkpoint
        old.unlink()
    total_bytes = sum(nbytes.values())
    weight_map = {}
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc) as bar:
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for saved, name, shape, kind, padding_idx in shard:
                gen = torch.Generator(device=device).manual_seed(_tensor_seed(seed, saved))
                if kind == "normal":
                    t = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=gen)
                    if padding_idx is not None:
                        t[padding_idx] = 0
                elif kind == "a_log":  # drawn in float32, as transformers does, then cast
                    t = torch.empty(shape, device=device).uniform_(0.01, 16, generator=gen).log_().bfloat16()
                else:
                    t = (torch.ones if kind == "ones" else torch.zeros)(shape, dtype=torch.bfloat16, device=device)
                if name == head:
                    t[zero_rows.to(device)] = 0
                tensors[saved] = t.cpu()
                weight_map[saved] = file
                bar.update(nbytes[saved])
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_parameters": total_bytes // 2, "total_size": total_bytes},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total_bytes // 2


def _zero_rows(tokenizer, vocab: int, tied: bool):
    """int64 ids of the LM-head rows :func:`make_preset_model` zeroes.

    Readable output: random weights would make greedy decoding emit special tokens, ids past the tokenizer
    and lone UTF-8 bytes. So the LM-head row of every id whose ``tokenizer.decode([id],
    skip_special_tokens=True)`` is not visible text (empty, as for special tokens; all whitespace; containing
    U+FFFD or a non-printable character), and of every id >= ``len(tokenizer)``, is set to 0: its logit is
    exactly 0 while visible ids' logits are random with std ~0.9 (sqrt(hidden) * 0.02), so greedy decoding streams
    visible text (and never EOS: run with a length limit). Untied models zero rows of ``lm_head.weight``. In a tied
    model (``qwen2-vl-2b``, ``qwen3-vl-2b``, ``qwen3-vl-4b``, ``qwen3.5-0.8b``, ``qwen3.5-4b``) the head IS the input
    embedding, so the zeroed rows also zero those ids' input embeddings, which is harmless for ids that never appear in
    prompts; the special tokens prompts use (``<|im_start|>``, ``<|image_pad|>``, ... all of ``SPECIAL_TOKENS``) keep
    their embedding rows there.
    """
    import torch

    from epdserve.models.checkpoint_parts import SPECIAL_TOKENS, invisible_ids

    keep = {tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} if tied else set()
    return torch.tensor(invisible_ids(tokenizer, vocab, keep), dtype=torch.long)


def make_preset_model(out_dir: str | Path, preset: str, *, seed: int = 0, device: str = "cpu",
                      overrides: dict | None = None) -> Path:
    """Write a random-weight checkpoint with the shapes of a released Qwen-VL model and return its path.

    ``preset`` is one of ``PRESETS`` (``qwen2.5-vl-3b``, ``qwen2.5-vl-7b``, ``qwen2-vl-2b``, ``qwen3-vl-2b``,
    ``qwen3-vl-4b``, ``qwen3-vl-8b``, ``qwen3-vl-30b-a3b``, ``qwen3.5-0.8b``, ``qwen3.5-4b``, ``qwen3.5-9b``,
    ``qwen3.5-27b``, ``qwen3.5-35b-a3b``): the real text and vision sizes and vocabulary size (151936 / 152064 /
    248320 rows, more than the offline tokenizer's ~550 ids: only the shapes matter), and the released image
    processor (Qwen2/2.5-VL: ``min_pixels`` 3136, ``max_pixels`` 12845056, so a 1280x720 image gives 1196 image
    tokens; Qwen3-VL, and assumed for Qwen3.5: 65536 .. 16777216 pixels, patch 16). Tokenizer, processor, chat
    template and generation config are those of :func:`~epdserve.models.tiny.make_tiny_model` for the same
    architecture.

    Weights: the HF model class is built on the ``meta`` device only for the tensor names and shapes; each
    tensor is then drawn directly in bfloat16 on ``device`` from its own generator, seeded by ``seed`` and a
    SHA-256 of the tensor's checkpoint name, with transformers' ``_init_weights`` rules (linear/conv weights and
    embeddings ~ N(0, 0.02), the embedding's padding row 0, biases 0, norm weights 1). Files: safetensors shards
    of at most 2 GB with ``model.safetensors.index.json``. The same ``seed``, ``device`` and ``overrides`` give
    byte-identical files; the CPU and CUDA generators differ, so cpu and cuda give different weights.

    Readable output: the LM-head rows of ids that do not decode to visible text are 0 (see :func:`_zero_rows`),
    so greedy decoding streams visible text (and never EOS: run with a length limit); the count of zeroed rows
    is written to ``epdserve_preset.json`` (preset, seed, device, overrides, parameters).

    Args:
        out_dir: target directory (created; existing files are overwritten).
        preset: a key of ``PRESETS``.
        seed: seed of the random weights.
        device: where the weights are drawn (``"cpu"``, ``"cuda"``, ``"cuda:1"``; CUDA is much faster). At most
            one 2 GB shard is held in host memory at a time.
        overrides: for tests only: ``{"text": {...}, "vision": {...}}`` merged into the preset's sizes (e.g.
            ``{"text": {"num_hidden_layers": 1}, "vision": {"depth": 1}}``).

    Raises:
        ValueError: unknown ``preset`` or unknown override section.
        RuntimeError: ``device`` is CUDA and CUDA is not available (from torch).
    """
    import torch

    from epdserve.models.checkpoint_parts import build_tokenizer

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    overrides = overrides or {}
    if set(overrides) - {"text", "vision"}:
        raise ValueError(f"overrides may have 'text' and 'vision' only, got {sorted(overrides)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config, model_cls, write_processor = _preset_config(spec, tokenizer, overrides)
    with torch.device("meta"):
        meta_model = model_cls(config)
    plan = _tensor_plan(meta_model)
    head = meta_model.all_tied_weights_keys.get("lm_head.weight", "lm_head.weight")
    if head not in {name for _, name, *_ in plan}:
        raise ValueError(f"no LM head tensor {head!r} in {model_cls.__name__}")
    del meta_model

    zero_rows = _zero_rows(tokenizer, config.text_config.vocab_size, spec["tie_word_embeddings"])
    dev = torch.device(device)
    # Older transformers 5 releases keep initializer_range only in the sub-configs.
    std = getattr(config, "initializer_range", None) or config.text_config.initializer_range
    num_params = _write_shards(out, plan, seed=seed, device=dev, std=std, head=head, zero_rows=zero_rows,
                               desc=f"{preset} weights")

    config.architectures = [model_cls.__name__]
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    write_processor(out)
    note = {"preset": preset, "seed": seed, "device": dev.type, "overrides": overrides or None,
            "num_parameters": num_params, "zeroed_lm_head_rows": len(zero_rows),
            "zeroed_rows_note": "LM-head rows of ids that do not decode to visible text (and ids past the "
                                "tokenizer) are 0, so greedy decoding emits visible text"}
    (out / "epdserve_preset.json").write_text(json.dumps(note, indent=2) + "\n")
    return out
