"""Checkpoints by Hugging Face hub id (``--model-path Qwen/Qwen2.5-VL-7B-Instruct``), through ``huggingface_hub``.

:func:`download` fetches the files a stage needs (config, safetensors weights, tokenizer, processor, chat template:
:data:`CHECKPOINT_FILES`) with ``snapshot_download`` into the Hugging Face cache, which honours ``HF_HOME`` /
``HF_HUB_CACHE``, ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE=1`` (then only the cache is read); a second
call finds the files there. Every failure a user can meet (no such repo, a gated one without a token, an unknown
revision, no network and nothing cached, a checkpoint without weights or of an architecture epdserve does not
serve) is one :class:`ModelSourceError` line naming the id. ``epdserve launch`` downloads once, before starting the
stages, and hands them the local directory (:mod:`epdserve.entry.launch`); ``epdserve download ID`` prepares a
machine ahead of time.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

# What a stage reads; the rest of a repo (PyTorch .bin copies, GGUF, ONNX, images of the model card) is skipped.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class ModelSourceError(FileNotFoundError):
    """``--model-path`` names no usable checkpoint; ``str()`` is one line saying why and what to do."""


def is_hub_id(model_path: str) -> bool:
    """Whether ``model_path`` reads as a hub id (``org/name``) and is not a local path."""
    return bool(_HUB_ID.fullmatch(model_path)) and not Path(model_path).exists()


def download(repo_id: str, revision: str = "") -> Path:
    """The local directory of ``repo_id``'s checkpoint (at ``revision``: a branch, tag or commit; "" = the default
    branch), downloaded into the Hugging Face cache where it is not there yet. Shows a progress bar on a terminal,
    two log lines otherwise.

    Raises:
        ModelSourceError: the repo, revision or files cannot be had (see the module docstring), or the checkpoint
            is not one epdserve can serve.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    from huggingface_hub.utils import disable_progress_bars

    at = f"{repo_id}@{revision}" if revision else repo_id
    if not sys.stderr.isatty():
        disable_progress_bars()
    t0 = time.monotonic()
    log.info("fetching %s from %s into %s", at, "the cache only (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE
             else constants.ENDPOINT, constants.HF_HUB_CACHE)
    try:
        path = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=CHECKPOINT_FILES))
    except GatedRepoError as e:
        raise ModelSourceError(f"{at} is a gated repository: accept its terms on the hub, then set HF_TOKEN "
                               f"({_first_line(e)})") from e
    except RevisionNotFoundError as e:
        raise ModelSourceError(f"{at}: no revision {revision!r} in that repository") from e
    except RepositoryNotFoundError as e:
        raise ModelSourceError(f"{at}: no such model repository on {constants.ENDPOINT} (or it is private: set "
                               f"HF_TOKEN)") from e
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
        raise ModelSourceError(f"{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}") from e
    except (HfHubHTTPError, OSError) as e:
        raise ModelSourceError(f"{at} cannot be downloaded: {_first_line(e)}") from e
    check_checkpoint(path, at)
    log.info("%s is in %s (%.1f s)", at, path, time.monotonic() - t0)
    return path


def tokenizer_file(repo_id: str, revision: str = "") -> Path:
    """``repo_id``'s ``tokenizer.json`` in the Hugging Face cache, downloaded first where it is missing (what
    ``epdserve bench --tokenizer ID`` counts tokens with).

    Raises:
        ModelSourceError: the repo has no ``tokenizer.json`` or it cannot be had.
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, "tokenizer.json", revision=revision or None))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise ModelSourceError(f"{repo_id}: no tokenizer.json to be had ({_first_line(e)})") from e


def check_checkpoint(path: Path, name: str) -> None:
    """Raise :class:`ModelSourceError` unless ``path`` holds a ``config.json`` of a served architecture,
    safetensors weights, a ``tokenizer.json`` and an image processor config (``name``: what the user gave, for the
    message)."""
    from epdserve.models.config import SUPPORTED_MODEL_TYPES

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelSourceError(f"{name} has no config.json: not a transformers checkpoint")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelSourceError(f"{name} is a {model_type!r} model; epdserve serves {', '.join(SUPPORTED_MODEL_TYPES)}")
    if not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"{name} has no safetensors weights (epdserve loads no other format)")
    for needed, files in (("tokenizer", ("tokenizer.json",)),
                          ("image processor config", ("preprocessor_config.json", "processor_config.json"))):
        if not any((path / f).is_file() for f in files):
            raise ModelSourceError(f"{name} has no {needed} ({' or '.join(files)}), which the stages need")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
