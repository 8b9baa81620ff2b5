"""Video through the whole pipeline (`epdserve launch`: gateway, two encoders, prefill, decode) against transformers'
generate() on the same tiny Qwen2.5-VL checkpoint: a short generated clip, and a clip with a photo, streaming and
not; bad videos are 400s and the next request still equals transformers. test_qwen3_vl_e2e.py runs the same cases
on Qwen3-VL (timestamp text, one token run per temporal patch, DeepStack rows).

The reference is transformers' own processor on every decoded frame, sampling them itself at the checkpoint's
rate (tests/test_video_prompt.py's ``reference``), then ``generate(do_sample=False)``.
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch

from test_e2e import NEW_TOKENS, _chat
from test_video import make_clip
from test_video_prompt import reference

pytest.importorskip("av")

CLIP = dict(frames=24, fps=8, size=(112, 84))  # 3 s at 8 fps: 6 frames sampled at 2 fps


def _url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def video_messages(case: str, clip: bytes, photo: bytes | None = None) -> list[dict]:
    """OpenAI messages of a video ``case``: ``video`` (a clip and a question) or ``video_photo`` (a photo, then the
    clip, then the question)."""
    parts = [{"type": "video_url", "video_url": {"url": _url(clip, "video/mp4")}},
             {"type": "text", "text": "What happens in this video? Describe the motion."}]
    if case == "video_photo":
        parts.insert(0, {"type": "image_url", "image_url": {"url": _url(photo, "image/jpeg")}})
    return [{"role": "user", "content": parts}]


def video_reference(path: str, hf, messages: list[dict], clip: bytes, photo: bytes | None):
    """transformers' ``(prompt ids, greedy ids, text)`` for ``messages`` (EOS ignored, like ``ignore_eos``)."""
    from transformers import GenerationConfig

    processor, model = hf
    inputs = reference(path, messages, None, [clip], photo)
    gen = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=gen)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return inputs["input_ids"][0].tolist(), ids, processor.tokenizer.decode(ids, skip_special_tokens=True)


def stream_text(url: str, model: str, messages: list) -> str:
    """The streamed answer's text, deltas joined."""
    body = {"model": model, "messages": messages, "temperature": 0, "max_completion_tokens": NEW_TOKENS,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1])
                   if c["choices"])


def check_video_case(url: str, path: str, hf, case: str, photo: bytes) -> None:
    """A video ``case`` through the server at ``url`` equals transformers, streaming and not."""
    clip = make_clip(**CLIP)
    messages = video_messages(case, clip, photo)
    ref_prompt, ref_ids, ref_text = video_reference(path, hf, messages, clip, photo)
    resp = _chat(url, path, messages)
    assert resp["prompt_token_ids"] == ref_prompt
    assert resp["choices"][0]["token_ids"] == ref_ids
    assert resp["choices"][0]["message"]["content"] == ref_text
    assert stream_text(url, path, messages) == ref_text


def check_bad_videos(url: str, path: str, hf, photo: bytes) -> None:
    """Each bad video is a 400 naming the problem; a good video request right after still equals transformers."""
    good = make_clip(**CLIP)
    bad = {"cannot read the video": b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4,  # mp4 header, garbage
           "cannot sample the video": photo,  # a JPEG sent as a video: one frame
           "over the limit of 20 s": make_clip(frames=30, fps=1, size=(64, 48))}  # 30 s; the launch allows 20
    for words, data in bad.items():
        body = {"model": path, "max_tokens": 4, "messages": video_messages("video", data)}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, (words, r.text)
        assert words in r.json()["error"]["message"], r.text
    messages = video_messages("video", good)
    _, ref_ids, _ = video_reference(path, hf, messages, good, None)
    assert _chat(url, path, messages)["choices"][0]["token_ids"] == ref_ids


@pytest.fixture(scope="module")
def hf25(tiny_model_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return (AutoProcessor.from_pretrained(tiny_model_path),
            AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval())


@pytest.mark.parametrize("case", ["video", "video_photo"])
def test_video_through_launch_matches_transformers(server, hf25, tiny_model_path, photo_paths, case):
    url, _ = server
    check_video_case(url, tiny_model_path, hf25, case, photo_paths["rocket"].read_bytes())


def test_bad_videos_are_400_and_the_server_keeps_serving(tiny_model_path, hf25, photo_paths, tmp_path_factory):
    from conftest import launched

    with launched(tiny_model_path, tmp_path_factory.mktemp("video-limits"), "--max-video-duration-s", "20") as (
            url, _):
        check_bad_videos(url, tiny_model_path, hf25, photo_paths["rocket"].read_bytes())


def test_repeated_video_hits_the_radix_cache(server, hf25, tiny_model_path):
    """The same clip again: its tokens come from the radix cache (key: the video's content hash and sampling) and
    the answer is unchanged; another sampling of the same file is a different key and misses."""
    url, _ = server
    clip = make_clip(frames=20, fps=10, size=(96, 64), seed=3)
    messages = video_messages("video", clip)
    messages[0]["content"][1]["text"] += " Then say what colours you see, and where they are in the frame."
    first, second = (_chat(url, tiny_model_path, messages) for _ in range(2))
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    pad = hf25[1].config.video_token_id
    ids = second["prompt_token_ids"]
    video_end = max(i for i, t in enumerate(ids) if t == pad) + 1
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < video_end
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= video_end
    other = _chat(url, tiny_model_path, messages, mm_processor_kwargs={"num_frames": 4})
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < min(i for i, t in enumerate(ids) if t == pad) + 1
