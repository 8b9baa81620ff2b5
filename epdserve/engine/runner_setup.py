"""Building the model runner a prefill or decode server uses: one process (TP=1), or rank 0 of a
tensor-parallel group that starts the other ranks (:mod:`epdserve.engine.tp_runner`)."""

from __future__ import annotations

import torch

from epdserve.engine.distributed import TPGroup, rank_device
from epdserve.engine.model_runner import ModelRunner, build_runner
from epdserve.engine.tp_runner import start_tp_runner
from epdserve.models.paths import resolve_model_path


def runner_from_config(cfg, cuda_graph_max_bs: int = 0, share_kv: bool = False) -> tuple[str, ModelRunner, int]:
    """Build and warm up the model runner of a prefill or decode server from its
    :class:`~epdserve.config.LMServerConfig`, with decode CUDA graphs up to ``cuda_graph_max_bs`` (0: none).
    Returns ``(model_path, runner, context_length)``.

    ``share_kv``: see :class:`ModelRunner` (TP=1 only: the ranks of a TP server keep their KV to themselves,
    and their KV hand-off goes through host memory).

    With ``cfg.tp > 1`` this process becomes TP rank 0: it starts ranks 1..tp-1 and returns a
    :class:`~epdserve.engine.tp_runner.TPRunner` (the same interface) that runs every call on all ranks.

    Raises:
        FileNotFoundError: ``cfg.model_path`` is not a local checkpoint.
        ValueError: unknown device, dtype or attention backend; a bad ``tp``/``base_gpu_id``.
        RuntimeError: a TP rank failed to start.
    """
    model_path = resolve_model_path(cfg.model_path)
    if cfg.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {cfg.tp}")
    if cfg.tp > 1:
        runner = start_tp_runner(cfg, model_path, cuda_graph_max_bs)
    else:
        tp = TPGroup.single(rank_device(cfg.device, cfg.base_gpu_id, 0))
        if tp.device.type == "cuda":  # kernels, streams and graphs of this process go to that GPU
            torch.cuda.set_device(tp.device)
        runner = build_runner(cfg, model_path, tp, cuda_graph_max_bs, share_kv=share_kv)
    return model_path, runner, cfg.context_length or runner.config.max_position_embeddings
