"""Qwen3.5's vision side through the encoder (issue 33): gRPC Encode of photos and of a clip equals transformers'
``Qwen3_5Model.get_image_features`` / ``get_video_features`` on the processor's own output, and the embeddings
are ``hidden`` wide (Qwen3-VL's tower without DeepStack)."""

from __future__ import annotations

import hashlib
import io

import grpc
import pytest
import torch
from PIL import Image

from epdserve.encoder.grpc_codec import tensor_from_proto
from epdserve.hashing import video_key
from epdserve.proto import encoder_pb2, encoder_pb2_grpc
from epdserve.video import probe_video
from test_encoder import _CHANNEL_OPTIONS, ServerThread
from test_video import all_frames, make_clip


@pytest.fixture(scope="module")
def stub(tiny_qwen3_5_path):
    srv = ServerThread(tiny_qwen3_5_path, max_video_frames=16, max_video_duration_s=5.0).start()
    with grpc.insecure_channel(srv.address, options=_CHANNEL_OPTIONS) as channel:
        yield encoder_pb2_grpc.EncoderStub(channel)
    srv.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_5_path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32).eval()


def test_model_info_has_no_deepstack(stub, tiny_qwen3_5_path):
    from transformers import AutoConfig

    info = stub.GetModelInfo(encoder_pb2.GetModelInfoRequest(), timeout=10)
    assert info.model_type == "qwen3_5" and info.num_deepstack_levels == 0
    assert info.out_hidden_size == AutoConfig.from_pretrained(tiny_qwen3_5_path).text_config.hidden_size


@pytest.mark.parametrize("names", [["chelsea"], ["rocket", "page"]])
def test_photos_equal_transformers(stub, hf_model, tiny_qwen3_5_path, photo_paths, names):
    from transformers import AutoProcessor

    datas = [photo_paths[n].read_bytes() for n in names]
    response = stub.Encode(encoder_pb2.EncodeRequest(
        request_id="-".join(names), images=[encoder_pb2.Image(data=d) for d in datas]), timeout=60)
    processor = AutoProcessor.from_pretrained(tiny_qwen3_5_path).image_processor
    inputs = processor(images=[Image.open(io.BytesIO(d)).convert("RGB") for d in datas], return_tensors="pt")
    with torch.inference_mode():
        refs = hf_model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    assert len(response.images) == len(datas)
    for result, data, grid, ref in zip(response.images, datas, inputs["image_grid_thw"].tolist(), refs):
        assert result.image_hash == hashlib.sha256(data).hexdigest() and list(result.grid_thw) == grid
        emb = tensor_from_proto(result.embedding)
        assert emb.shape == ref.shape == (grid[0] * grid[1] * grid[2] // 4, hf_model.config.text_config.hidden_size)
        torch.testing.assert_close(emb, ref, atol=1e-5, rtol=0)


def test_video_equals_transformers(stub, hf_model, tiny_qwen3_5_path):
    from transformers import AutoProcessor

    clip = make_clip(frames=24, fps=8, size=(96, 64))
    response = stub.Encode(encoder_pb2.EncodeRequest(request_id="v", videos=[encoder_pb2.Video(data=clip)]),
                           timeout=120)
    [result] = response.videos
    processor = AutoProcessor.from_pretrained(tiny_qwen3_5_path).video_processor
    fps = getattr(processor, "fps", None) or 2.0
    inputs = processor(videos=[all_frames(clip)], video_metadata=[probe_video(clip)], do_sample_frames=True,
                       fps=fps, return_tensors="pt")
    with torch.inference_mode():
        ref = hf_model.model.get_video_features(inputs["pixel_values_videos"],
                                                inputs["video_grid_thw"]).pooler_output[0]
    grid = inputs["video_grid_thw"][0].tolist()
    assert result.image_hash == video_key(clip, None, None) and list(result.grid_thw) == grid and grid[0] > 1
    emb = tensor_from_proto(result.embedding)
    assert emb.shape == ref.shape
    torch.testing.assert_close(emb, ref, atol=1e-5, rtol=0)
