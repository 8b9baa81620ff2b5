"""Where a checkpoint comes from: a local directory, or (no ``--model-path``) the default tiny model, built once."""

from pathlib import Path


def default_model_path() -> Path:
    """The tiny Qwen2.5-VL checkpoint used when no ``--model-path`` is given, created once, with readable
    greedy answers (``make_tiny_model(readable=True)``).

    It lives in ``$EPDSERVE_CACHE`` (default ``~/.cache/epdserve``). Concurrent first calls are safe: each
    writes to a private temporary directory and the first rename wins.
    """
    import os
    import shutil
    import tempfile

    root = Path(os.environ.get("EPDSERVE_CACHE", Path.home() / ".cache" / "epdserve"))
    target = root / "tiny-qwen2.5-vl-readable"  # a new name: caches of the older, unreadable default stay unused
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tiny-"))
    from epdserve.models.tiny import make_tiny_model  # transformers and a tokenizer: only when building it

    make_tiny_model(tmp, readable=True)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model_path: str, revision: str = "") -> str:
    """``""`` -> the default tiny model; a local checkpoint directory -> itself; a Hugging Face hub id
    (``org/name``, at ``revision``) -> its local directory in the Hugging Face cache, downloaded there first where
    it is missing (:func:`epdserve.models.hub.download`).

    Raises:
        ModelSourceError (a FileNotFoundError): ``model_path`` is neither a local checkpoint (a directory with a
            ``config.json``) nor a hub id whose checkpoint can be had; one line says why.
    """
    from epdserve.models.hub import ModelSourceError, download, is_hub_id

    if not model_path:
        return str(default_model_path())
    if (Path(model_path) / "config.json").is_file():
        return model_path
    if is_hub_id(model_path):
        return str(download(model_path, revision))
    raise ModelSourceError(f"{model_path!r} is neither a local Hugging Face checkpoint (a directory with a "
                           f"config.json) nor a hub id (org/name)")
