"""The vision half of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint: image decoding, the image processor, the
vision tower.

Only the vision tower is built and only its tensors are read from the safetensors files, so the encoder never
holds the language model. The tower is transformers' own class, and it is fed the image processor's own
``pixel_values`` / ``image_grid_thw``: its output is the same as the full model's ``get_image_features`` (pixel
preprocessing differences move logits far more than kernel noise does; see ../shared/notes/qwen-vl-facts.md).

Qwen3-VL's tower (``Qwen3VLVisionModel``) also returns DeepStack features: the outputs of the blocks listed in
``deepstack_visual_indexes``, each through its own patch merger, one ``[num_tokens, hidden]`` level per entry
(transformers' ``Qwen3VLModel.get_image_features``). They travel as extra columns of the embedding: an image's
embedding is ``[num_tokens, hidden * (1 + levels)]``, the merged embedding first, then level 0, 1, ... (vLLM's
layout for Qwen3-VL). Every row still belongs to one image token, so the cache, the wire, chunked prefill and the
TP fan-out need nothing new; the language model splits the columns (:mod:`epdserve.models.qwen3_vl_lm`).

A video runs through the same tower, fed the video processor's ``pixel_values_videos`` / ``video_grid_thw``
(transformers' ``get_video_features``, which for Qwen3-VL returns DeepStack levels as for images): one embedding of
``t*h*w // merge_size**2`` rows in the same column layout.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import torch
from PIL import Image

from epdserve.device import resolve_device, resolve_dtype
from epdserve.encoder.tower_compile import can_compile, compile_blocks, warm_shadow
from epdserve.encoder.vision_weights import load_vision_state_dict, pad_mlp_intermediate, vision_class
from epdserve.logging_setup import process_age_s

log = logging.getLogger("epdserve.encoder")

@dataclass
class PreparedImages:
    """A batch after the image processor, ready for the tower (:meth:`VisionEncoder.preprocess`).

    Attributes:
        pixels: ``[num_patches, channels * temporal_patch * patch**2]`` on the tower's device, in its dtype.
        rows: one ``[t, h, w]`` patch grid per image, in order.
        ready: CUDA: recorded on the preprocessing stream after ``pixels`` was written; None on the CPU.
        eager: run transformers' plain tower call, never the image CUDA graphs (a video: one-off grids).
    """

    pixels: torch.Tensor
    rows: list[list[int]]
    ready: torch.cuda.Event | None
    eager: bool = False


class ImageDecodeError(ValueError):
    """The bytes are not a decodable image, the image is larger than allowed, or its shape is one the image
    processor rejects (an aspect ratio over 200)."""


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode raw image file bytes (PNG, JPEG, WebP, ...) to a fully loaded RGB ``PIL.Image``.

    The size is checked from the header before any pixel is decoded, so a decompression bomb costs nothing.
    Trailing bytes after the image data are ignored (PIL stops at the end of the image stream).

    Raises:
        ImageDecodeError: empty, unknown format, corrupt or truncated data, or ``width * height > max_pixels``.
    """
    if not data:
        raise ImageDecodeError("empty image data")
    try:
        img = Image.open(BytesIO(data))
        width, height = img.size
        if width * height > max_pixels:
            raise ImageDecodeError(f"image of {width}x{height} pixels is larger than the limit of {max_pixels}")
        img.load()
        return img.convert("RGB")
    except ImageDecodeError:
        raise
    # PIL reports bad data through several unrelated types (UnidentifiedImageError, OSError for truncation,
    # DecompressionBombError, SyntaxError from some plugins, ValueError, struct.error ...).
    except Exception as e:
        raise ImageDecodeError(f"cannot decode image: {type(e).__name__}: {e}") from e


class VisionEncoder:
    """Image processor + vision tower of one local Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint.

    Attributes:
        model_path: the checkpoint directory.
        model_type: ``"qwen2_5_vl"``, ``"qwen2_vl"``, ``"qwen3_vl"`` or ``"qwen3_5"`` (Qwen3-VL's tower without
            DeepStack: ``num_deepstack`` 0).
        num_deepstack: DeepStack levels per image (Qwen3-VL: ``len(deepstack_visual_indexes)``; otherwise 0).
        embed_width: columns of an embedding, ``hidden_size * (1 + num_deepstack)``.
        device, dtype: where the tower runs and its parameter dtype.
        merge_size: spatial merge size; an image of grid ``(t, h, w)`` gives ``t*h*w // merge_size**2`` tokens.
        hidden_size: width of the embeddings (the language model's hidden size).
        image_processor: the checkpoint's transformers image processor.
        video_processor: the checkpoint's transformers video processor (:meth:`preprocess_video`).
        model: the vision tower (transformers module, eval mode, no grad). On CUDA in fp16/bf16 its MLP's
            intermediate width is zero-padded to a multiple of 64 when not aligned (Qwen2.5-VL's 3420;
            :func:`~epdserve.encoder.vision_weights.pad_mlp_intermediate`), which keeps its GEMMs on cuBLAS's
            Hopper kernels; the CPU keeps transformers' layout.
        compiled: whether the tower's blocks and merger run through ``torch.compile`` (see ``compile``).
        compile_pending: ``compile`` was asked for and the tower still runs eagerly: :meth:`compile_tower`, then
            :meth:`finish_compile`, are still to run.
        tower: on CUDA with packed attention and ``cuda_graphs > 0``, once the compile is settled, the
            :class:`~epdserve.encoder.vision_graph.TowerGraphs` that runs :attr:`model` from CUDA graphs; otherwise
            None (transformers' plain call). Qwen3-VL's tower runs without them (eager, or compiled): the graphs
            replay Qwen2/2.5-VL towers and return no DeepStack levels.

    Not thread-safe as a whole: :meth:`preprocess` and :meth:`run_tower` may run at the same time on two
    threads, but each one call at a time (and :meth:`encode`, which is both, excludes both).
    """

    def __init__(self, model_path: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype | str = "auto", cuda_graphs: int = 0, compile: bool = False,
                 gpu_jpeg_decode: bool = False) -> None:
        """Load the image processor and the vision tower.

        Args:
            model_path: local checkpoint directory (``config.json``, processor config, safetensors).
            device: a ``torch.device`` or a name understood by :func:`epdserve.device.resolve_device`.
            dtype: a ``torch.dtype`` or a name understood by :func:`epdserve.device.resolve_dtype`.
            cuda_graphs: on CUDA in fp16/bf16, how many vision-tower CUDA graphs (one per image grid, for tower
                calls of one image) to keep, see :mod:`epdserve.encoder.vision_graph`; 0 runs the tower eagerly.
                Ignored for Qwen3-VL (see :attr:`tower`).
            compile: on CUDA in fp16/bf16, run each vision block and the merger through ``torch.compile``
                (``dynamic=True``: one compiled block serves every block and every patch count). Inductor fuses
                the tower's float32 RMSNorm and rotary arithmetic (docs/performance.md). Compiling takes
                seconds: the tower runs eagerly until :meth:`compile_tower` (any thread) and then
                :meth:`finish_compile` (the tower's thread) have run. Ignored on the CPU, which keeps exact
                parity with transformers.
            gpu_jpeg_decode: on CUDA, :meth:`decode` decodes JPEGs on the GPU (nvJPEG, see there). Ignored on the
                CPU.

        Raises:
            ValueError: unsupported model type, missing or unexpected vision tensors, processor/tower mismatch,
                or a CUDA device asked for without CUDA.
            OSError: the checkpoint's config or processor files cannot be read.
            FileNotFoundError: no safetensors file.
        """
        from transformers import AutoConfig, AutoProcessor
        from transformers.initialization import no_init_weights

        t0 = time.monotonic()
        age = process_age_s()  # the interpreter, the imports and the gRPC server's set-up before the model
        self.model_path = str(model_path)
        self.tower = None
        self._graphs = 0  # tower CUDA graphs to keep once the compile question is settled (finish_compile)
        self.compiled = False
        self._prep_stream = None  # CUDA: the stream the image processor runs on (made on first use)
        self._decode_stream = None  # CUDA: the stream of nvJPEG decodes (made on first use)
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, self.device)
        config = AutoConfig.from_pretrained(self.model_path)
        self.model_type: str = config.model_type
        vision_cls = vision_class(self.model_type)
        # AutoProcessor reads both the transformers-5 layout (processor_config.json) and the older
        # preprocessor_config.json of the released checkpoints; AutoImageProcessor alone does not read the former.
        processor = AutoProcessor.from_pretrained(self.model_path)
        self.image_processor = processor.image_processor
        self.video_processor = processor.video_processor
        self.merge_size: int = config.vision_config.spatial_merge_size
        if getattr(self.image_processor, "merge_size", self.merge_size) != self.merge_size:
            raise ValueError(f"image processor merge_size {self.image_processor.merge_size} != vision tower "
                             f"spatial_merge_size {self.merge_size}")
        self.hidden_size: int = config.text_config.hidden_size
        self.num_deepstack: int = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
        self.embed_width: int = self.hidden_size * (1 + self.num_deepstack)

        t1 = time.monotonic()
        # Every weight is overwritten from the checkpoint, so random initialization would be wasted time
        # (seconds for a real tower); the device context builds the tower in place, without a host copy.
        with no_init_weights(), torch.device(self.device):
            model = vision_cls._from_config(config.vision_config, dtype=self.dtype)
        fast_path = self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
        if fast_path:
            self._use_packed_attention(model, cuda_graphs)
        t2 = time.monotonic()
        missing, unexpected = model.load_state_dict(load_vision_state_dict(self.model_path), strict=False)
        # Seconds per part of the construction, for the server's ready line (issue 43): the tower part includes
        # the device's context (CUDA's first call) and the packed-attention kernels' import.
        self.startup_s = {} if age is None else {"process": age}
        self.startup_s.update(processor=t1 - t0, tower=t2 - t1, weights=time.monotonic() - t2)
        if missing or unexpected:
            raise ValueError(f"vision tower weights of {self.model_path} do not match {vision_cls.__name__}: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        if fast_path:
            pad_mlp_intermediate(model)
        self.model = model.eval().requires_grad_(False)
        self.gpu_jpeg_decode = gpu_jpeg_decode and self.device.type == "cuda"
        self.compile_pending = compile and fast_path and can_compile()
        if not self.compile_pending:
            self.finish_compile(False)

    def _use_packed_attention(self, model: torch.nn.Module, cuda_graphs: int) -> None:
        """CUDA fp16/bf16: packed varlen attention in ``model``'s layers, and the number of tower CUDA graphs
        :meth:`finish_compile` keeps (0 for Qwen3-VL's tower: not covered yet)."""
        from epdserve.encoder.varlen_attention import register

        # One packed kernel per layer, not one per window. Set after construction: at construction
        # transformers would look for a "flash" implementation on its kernel hub.
        model.config._attn_implementation = register()
        if cuda_graphs > 0 and self.model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
            log.info("vision-tower CUDA graphs do not cover Qwen3-VL's tower (nor Qwen3.5's) yet: it runs without "
                     "them")
        else:
            self._graphs = cuda_graphs

    def compile_tower(self) -> float:
        """Compile the tower for :meth:`finish_compile` on the calling thread while the tower thread keeps running
        the eager tower (see :mod:`epdserve.encoder.tower_compile`). Returns the seconds it took.

        Raises:
            RuntimeError: compiling failed (the message names the way out: ``--no-compile``).
        """
        return warm_shadow(self.model, self.image_processor, self.device, self.dtype, with_metadata=self._graphs > 0)

    def finish_compile(self, compiled: bool) -> None:
        """On the tower's thread, between tower calls: run the compiled blocks from now on (``compiled``: after
        :meth:`compile_tower` succeeded; False: it failed or was not asked for) and start keeping CUDA graphs.
        Graphs wait for this: a graph captured before would replay the eager tower."""
        if compiled:
            compile_blocks(self.model)
        self.compiled, self.compile_pending = compiled, False
        if self._graphs > 0:
            from epdserve.encoder.vision_graph import TowerGraphs

            self.tower = TowerGraphs(self.model, self.device, self._graphs)

    def warm_up(self) -> None:
        """First-use set-up before the first request: nvJPEG's decoder state (~100 ms). Compiling is not here:
        see :meth:`compile_tower`."""
        if self.gpu_jpeg_decode:
            buf = BytesIO()
            Image.new("RGB", (64, 48), (200, 90, 40)).save(buf, format="JPEG")
            self.decode(buf.getvalue(), 64 * 48)

    def num_tokens(self, grid_thw: list[int]) -> int:
        """Image tokens (embedding rows) of an image with patch grid ``[t, h, w]``."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def num_patches(self, image: Image.Image | torch.Tensor) -> int:
        """Patches (before the spatial merge) the image processor makes of ``image`` (a PIL image or a ``[3, H,
        W]`` uint8 tensor from :meth:`decode`): ``t*h*w`` of its grid.

        Thread-safe (pure arithmetic on the processor's settings), so it can run beside :meth:`encode`.

        Raises:
            ImageDecodeError: the processor rejects the image's shape (aspect ratio over 200), so that such an
                image fails its own request up front instead of the whole batch it would join.
        """
        height, width = image.shape[-2:] if isinstance(image, torch.Tensor) else (image.height, image.width)
        try:
            return self.image_processor.get_number_of_image_patches(height, width, {})
        except ValueError as e:
            raise ImageDecodeError(f"unsupported image shape {width}x{height}: {e}") from e

    def decode(self, data: bytes, max_pixels: int) -> Image.Image | torch.Tensor:
        """Decode image file bytes for :meth:`preprocess`: :func:`decode_image` (PIL), or with ``gpu_jpeg_decode``
        a baseline or progressive RGB/grayscale JPEG on the GPU with nvJPEG (``torchvision.io.decode_jpeg``),
        returned as a ``[3, H, W]`` uint8 tensor on the encoder's device. Thread-safe; blocks until the pixels
        are on the device.

        Why: PIL takes 17 ms of host time for a 1280x720 JPEG of noise on the H100 host, a quarter of a lone
        request's encoder time, and holds a CPU core per image under load (docs/performance.md, ninth session).
        Its pixels are not libjpeg-turbo's. On photos they differ by under a level on average (0-0.8; embedding
        cosine 0.9994-0.99999 on the 3B tower, the size of torch.compile's own deviation). nvJPEG does not
        interpolate chroma as libjpeg's default ("fancy") upsampling does, so where colour changes every pixel
        (noise) RGB differs by ~13 levels and the cosine drops to ~0.9; luma agrees to 0.35 levels. A file
        nvJPEG rejects (CMYK, arithmetic coding, corrupt data) or that has no end-of-image marker (truncated: PIL
        rejects it, nvJPEG would pad it) goes to PIL, which gives the answer and the error message.

        Raises:
            ImageDecodeError: see :func:`decode_image`.
        """
        if self.gpu_jpeg_decode and data[:3] == b"\xff\xd8\xff" and b"\xff\xd9" in data[-64:]:
            try:
                header = Image.open(BytesIO(data))  # reads the header only
                width, height = header.size
                if header.format == "JPEG" and header.mode in ("RGB", "L") and width * height <= max_pixels:
                    return self._decode_jpeg_on_gpu(data)
            except Exception:  # nvJPEG's errors are RuntimeErrors without a reason we could report better
                pass
        return decode_image(data, max_pixels)

    def _decode_jpeg_on_gpu(self, data: bytes) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(self.device)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        # Its own stream: on the default one the decode would wait for the tower calls queued there.
        with torch.cuda.stream(self._decode_stream):
            pixels = decode_jpeg(raw, mode=ImageReadMode.RGB, device=self.device)
            done = torch.cuda.Event()
            done.record()
        done.synchronize()
        return pixels

    @torch.inference_mode()
    def preprocess(self, images: list[Image.Image | torch.Tensor]) -> PreparedImages:
        """Run the image processor on ``images`` (PIL images, or :meth:`decode`'s device tensors) as one batch:
        the first half of :meth:`encode`.

        On CUDA the processor runs on the GPU (its torchvision backend's ``device`` argument) on this encoder's
        own preprocessing stream, so that its blocking host-to-device copies never wait for a tower call queued
        on the default stream: the batcher preprocesses the next batch while the tower runs this one. May run
        on another thread than :meth:`run_tower`, one call at a time.

        Raises:
            ValueError: from the image processor (e.g. an empty list).
        """
        with self._prep_stream_context():
            for image in images:
                if isinstance(image, torch.Tensor) and image.is_cuda:
                    image.record_stream(torch.cuda.current_stream(self.device))  # made on the decode stream
            on_gpu = {"device": self.device} if self.device.type == "cuda" else {}  # CPU: the reference call
            inputs = self.image_processor(images=images, return_tensors="pt", **on_gpu)
            # Same cast as transformers' get_image_features, so the outputs match it exactly.
            pixels = inputs["pixel_values"].to(self.device).type(self.dtype)
            rows = inputs["image_grid_thw"].tolist()
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
        return PreparedImages(pixels, rows, ready)

    @torch.inference_mode()
    def preprocess_video(self, frames, metadata) -> PreparedImages:
        """Run the video processor on one video's already sampled frames, for :meth:`run_tower` (eagerly).

        Args:
            frames: ``[T, H, W, 3]`` uint8 RGB numpy array, the frames :func:`epdserve.video.load_video` sampled.
            metadata: its ``VideoMetadata`` (``frames_indices`` set): the processor's timestamps come from it.

        Returns:
            ``pixels`` = the processor's ``pixel_values_videos`` in the tower's dtype (cast as transformers'
            ``get_video_features`` does), one ``rows`` entry = ``video_grid_thw`` ``[t, h, w]``.

        Raises:
            ValueError: from the video processor (e.g. an aspect ratio over 200).
        """
        with self._prep_stream_context():
            on_gpu = {"device": self.device} if self.device.type == "cuda" else {}
            if on_gpu:
                # One contiguous copy to the GPU, channels-first there: given the channels-last array, the
                # processor copies it on the host first, on this process's one CPU thread (the same result either
                # way: the processor takes [T, 3, H, W] tensors as they are).
                frames = torch.from_numpy(frames).to(self.device).permute(0, 3, 1, 2)
            # The frames are already the sampled ones: sampling again would thin them out a second time.
            inputs = self.video_processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                                          return_tensors="pt", **on_gpu)
            pixels = inputs["pixel_values_videos"].to(self.device).type(self.dtype)
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
        return PreparedImages(pixels, inputs["video_grid_thw"].tolist(), ready, eager=True)

    @torch.inference_mode()
    def run_tower(self, prepared: PreparedImages) -> list[tuple[torch.Tensor, list[int]]]:
        """Run the vision tower on a :meth:`preprocess` (or :meth:`preprocess_video`) output: the second half of
        :meth:`encode`. Waits for the preprocessing on the device (not on the host), then for its own result only.
        One call at a time.

        Returns:
            See :meth:`encode` (for a video: one ``(embedding, video_grid_thw row)``, all its frames' rows).
        """
        pixels, rows = prepared.pixels, prepared.rows
        if prepared.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(prepared.ready)
            pixels.record_stream(stream)  # made on the preprocessing stream, read on this one
        if self.tower is not None and not prepared.eager:
            out = self.tower.run(pixels, [tuple(r) for r in rows])
        else:
            result = self.model(pixels, grid_thw=torch.tensor(rows, dtype=torch.int64, device=self.device))
            out = result.pooler_output
            if self.num_deepstack:  # [tokens, hidden * (1 + levels)]: one copy to the host below
                out = torch.cat([out, *result.deepstack_features], dim=-1)
        sizes = [self.num_tokens(row) for row in rows]
        if out.is_cuda:
            # Left on the GPU: a prefill server on this machine takes it from here (CUDA IPC), and the host copy
            # for the cache is made off the request's path. Waited for on an event, as the callers read it from
            # other threads and streams (a stream sync would also wait for what preprocessing queued since).
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            return [(out, rows[0])] if len(rows) == 1 else list(zip(torch.split(out, sizes), rows))
        if len(rows) == 1:  # the buffer is this item's alone (a lone image, a video: 57 MB for an 8 s Qwen3-VL clip)
            return [(out, rows[0])]
        # clone: each cached embedding owns its memory instead of keeping the whole batch's alive.
        return [(emb.clone(), row) for emb, row in zip(torch.split(out, sizes), rows)]

    def encode(self, images: list[Image.Image]) -> list[tuple[torch.Tensor, list[int]]]:
        """Run the image processor and the vision tower on ``images`` in one batch.

        The tower takes the concatenated ``pixel_values`` with one ``image_grid_thw`` row per image and attends
        within each image only (``cu_seqlens``), as transformers' ``get_image_features`` does for several images.

        Args:
            images: decoded RGB images (see :func:`decode_image`).

        Returns:
            One ``(embedding, grid_thw)`` per image, in order: ``embedding`` is ``[num_tokens_i, embed_width]`` in
            the tower's dtype on the tower's device (Qwen3-VL: the DeepStack levels as extra columns, see the
            module docstring; on CUDA the images of one batch are row slices of one tensor), ``grid_thw`` the
            processor's ``[t, h, w]`` row. An empty list gives an
            empty list.
        """
        if not images:
            return []
        return self.run_tower(self.preprocess(images))

    def encode_video(self, frames, metadata) -> tuple[torch.Tensor, list[int]]:
        """One video's embedding: :meth:`preprocess_video` then :meth:`run_tower` (the plain tower: the image CUDA
        graphs are not used; on CUDA still the packed attention), as transformers' ``get_video_features`` computes
        it (Qwen3-VL: the tower's ``pooler_output`` and ``deepstack_features`` as columns, as for images).

        Returns:
            ``(embedding, grid_thw)``: a contiguous ``[t*h*w // merge_size**2, embed_width]`` tensor in the
            tower's dtype on the tower's device and the processor's ``video_grid_thw`` row ``[t, h, w]``.

        Raises:
            ValueError: see :meth:`preprocess_video`.
        """
        return self.run_tower(self.preprocess_video(frames, metadata))[0]

    def _prep_stream_context(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._prep_stream is None:
            self._prep_stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self._prep_stream)
