"""The Qwen3-VL parts of epdserve's random-weight checkpoints: config, processor, chat template, tiny model.

:func:`make_tiny_qwen3_vl` is what ``make_tiny_model(arch="qwen3_vl")`` runs; :mod:`epdserve.models.presets` uses
:func:`qwen3_vl_config` and :func:`write_qwen3_vl_processor` for the real-shape Qwen3-VL presets. The tokenizer is
the offline one of :func:`epdserve.models.checkpoint_parts.build_tokenizer`, with Qwen3-VL's chat template.

Sources: the released ``config.json``, ``preprocessor_config.json``/``video_preprocessor_config.json`` and
``chat_template.json`` of Qwen/Qwen3-VL-{2B,4B,8B}-Instruct (copies read through public repositories that quote
them; see :mod:`epdserve.models.presets`), and transformers 5 ``configuration_qwen3_vl.py`` for the defaults.
"""

from __future__ import annotations

from pathlib import Path

# Qwen3-VL-{2B,4B,8B}-Instruct's chat template (chat_template.json; 5292 bytes). Unlike Qwen2-VL's it adds no
# default system prompt, and it renders tool calls and tool responses (which may carry images).
QWEN3_VL_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with \
function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The released processors: images 65536 .. 16777216 pixels, videos 4096 .. 25165824 pixels per clip, patch 16,
# merge 2, temporal patch 2, mean = std = 0.5 (preprocessor_config.json, video_preprocessor_config.json).
RELEASED_IMAGE_PIXELS = (65536, 16777216)
RELEASED_VIDEO_PIXELS = (4096, 25165824)
_MEAN_STD = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])

# Test sizes. tiny: head_dim 48 != hidden / heads (as in Qwen3-VL-4B), an mrope_section summing to 24 whose
# interleaving leaves t the last frequencies (as [24, 20, 20] does for 64), three decoder layers of which the first
# two take DeepStack levels from vision blocks 0 and 1 of three. small: head_dim 128 so flashinfer's kernels apply.
QWEN3_VL_SIZES = {
    "tiny": dict(text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=48, mrope_section=[10, 7, 7]),
                 vision=dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=4,
                             deepstack_visual_indexes=[0, 1])),
    "small": dict(text=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=128, mrope_section=[24, 20, 20]),
                  vision=dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4,
                              deepstack_visual_indexes=[0, 1, 2])),
}


def qwen3_vl_config(tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """``(Qwen3VLConfig, Qwen3VLForConditionalGeneration)`` for the given sizes.

    ``text`` holds the text sizes (``mrope_section`` among them; default [24, 20, 20]), completed with the
    released settings: rope theta 5e6, interleaved M-RoPE, RMS eps 1e-6, no attention bias, ``initializer_range``
    0.02. ``vision`` holds the tower's sizes, completed with patch 16, merge 2, temporal patch 2, 2304 learned
    position embeddings, ``gelu_pytorch_tanh`` and ``out_hidden_size`` = the text hidden size. Special token ids
    come from ``tokenizer``.
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    return qwen3_vl_family_config(Qwen3VLConfig, tokenizer, text=text, vision=vision,
                                  tie_word_embeddings=tie_word_embeddings), Qwen3VLForConditionalGeneration


def qwen3_vl_family_config(config_cls: type, tokenizer, *, text: dict, vision: dict, tie_word_embeddings: bool):
    """A ``config_cls`` (``Qwen3VLConfig`` or ``Qwen3VLMoeConfig``) completed as :func:`qwen3_vl_config` says;
    ``text`` may hold the MoE keys, which the MoE text config takes as they are."""
    text = dict(text)
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True,
            "mrope_section": text.pop("mrope_section", [24, 20, 20])}
    text_config, vision_config, ids = qwen3_family_parts(tokenizer, dict(text, attention_bias=False), vision,
                                                         rope, tie_word_embeddings)
    return config_cls(text_config=text_config, vision_config=vision_config,
                      tie_word_embeddings=tie_word_embeddings, **ids)


def qwen3_family_parts(tokenizer, text: dict, vision: dict, rope: dict,
                       tie_word_embeddings: bool) -> tuple[dict, dict, dict]:
    """What Qwen3-VL's and Qwen3.5's configs share: the text config (``text`` sizes + ``rope`` parameters, RMS eps
    1e-6, ``initializer_range`` 0.02, special token ids from ``tokenizer``), the vision config (``vision`` sizes,
    patch 16, merge 2, temporal patch 2, 2304 position embeddings, ``gelu_pytorch_tanh``, ``out_hidden_size`` = the
    text hidden size) and the image/video token ids, as ``(text_config, vision_config, ids)`` keyword dicts."""
    from epdserve.models.checkpoint_parts import special_token_ids

    special = special_token_ids(tokenizer)
    text_config = dict(rms_norm_eps=1e-6, initializer_range=0.02, rope_parameters=rope,
                       tie_word_embeddings=tie_word_embeddings, bos_token_id=special["bos_token_id"],
                       eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"], **text)
    vision_config = dict(in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                         num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", initializer_range=0.02,
                         out_hidden_size=text["hidden_size"], **vision)
    ids = {k: special[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id")}
    return text_config, vision_config, ids


def write_qwen3_vl_processor(out: Path, tokenizer, *, image_pixels: tuple[int, int],
                             video_pixels: tuple[int, int] = RELEASED_VIDEO_PIXELS) -> None:
    """Write ``generation_config.json``, the tokenizer, a ``Qwen3VLProcessor`` (``Qwen2VLImageProcessor`` with
    patch 16, and ``Qwen3VLVideoProcessor``, without which ``AutoProcessor.from_pretrained`` fails) and the
    Qwen3-VL chat template to ``out``. ``image_pixels``/``video_pixels``: ``(min, max)`` pixels per image / clip.
    """
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    from epdserve.models.checkpoint_parts import write_generation_config

    write_generation_config(out, tokenizer)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2,
                                            min_pixels=image_pixels[0], max_pixels=image_pixels[1], **_MEAN_STD)
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": video_pixels[0], "longest_edge": video_pixels[1]}, **_MEAN_STD)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 video_processor=video_processor, chat_template=QWEN3_VL_CHAT_TEMPLATE)
    processor.save_pretrained(out)


def make_tiny_qwen3_vl(out_dir: str | Path, *, seed: int = 0, max_pixels: int = 512 * 32 * 32,
                       size: str = "tiny", readable: bool = False) -> Path:
    """Write a small random-weight Qwen3-VL checkpoint (fp32, transformers' own init under
    ``torch.manual_seed(seed)``) to ``out_dir`` and return its path; see :func:`epdserve.models.tiny.make_tiny_model`
    for ``readable``. ``max_pixels`` bounds image tokens per image to ``max_pixels / 32**2``; the smallest image is
    64x64 pixels (4 tokens).

    Raises:
        ValueError: unknown ``size`` (see ``QWEN3_VL_SIZES``).
    """
    return write_random_qwen3_family(out_dir, QWEN3_VL_SIZES, qwen3_vl_config, seed=seed, max_pixels=max_pixels,
                                     size=size, readable=readable)


def write_random_qwen3_family(out_dir: str | Path, sizes: dict, make_config, *, seed: int, max_pixels: int,
                              size: str, readable: bool) -> Path:
    """The body of :func:`make_tiny_qwen3_vl` for any family with Qwen3-VL's processor: ``sizes[size]`` gives the
    ``text`` and ``vision`` dims, ``make_config(tokenizer, text=, vision=, tie_word_embeddings=)`` returns
    ``(config, model class)``.

    Raises:
        ValueError: ``size`` not in ``sizes``.
    """
    from epdserve.models.checkpoint_parts import build_tokenizer, save_random_model

    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(sizes)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    dims = sizes[size]
    text = dict(vocab_size=len(tokenizer), max_position_embeddings=4096, **dims["text"])
    config, model_cls = make_config(tokenizer, text=text, vision=dims["vision"], tie_word_embeddings=False)
    save_random_model(out, model_cls, config, tokenizer, seed=seed, readable=readable)
    write_qwen3_vl_processor(out, tokenizer, image_pixels=(64 * 64, max_pixels))
    return out
