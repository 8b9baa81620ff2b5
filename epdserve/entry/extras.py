"""Optional features and the extras that bring them, checked before a server loads anything.

A flag that asks for a feature whose package is not installed stops the server at once with one line naming the
flag and the ``pip install`` that brings it (exit code 2, no traceback: :func:`epdserve.entry.cli.main`), instead
of a ``ModuleNotFoundError`` after the model has loaded. What is checked, per server config:

- ``--grpc-port`` (prefill, decode) and the encoder's ``--bootstrap-port``: smg's generated gRPC modules
  (``smg-grpc``);
- ``--kv-transfer nixl|mooncake`` (prefill, decode, launch): the engine's package (``nixl``, ``mooncake``);
- a CUDA device with ``--attention-backend auto|flashinfer`` (prefill, decode; launch's stages take ``auto``):
  flashinfer (``gpu``); ``--attention-backend sdpa`` opts out;
- a hybrid checkpoint (Qwen3.5) on CUDA: flash-linear-attention's kernels (``hybrid-gpu``); ``--attention-backend
  sdpa`` opts out too, to the PyTorch path throughout.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from epdserve.config import EncoderConfig, LaunchConfig, LMServerConfig
from epdserve.kvcache.engine_names import KV_ENGINES


class MissingExtra(Exception):
    """A flag asks for a feature whose package does not import. ``str()`` is the one line to print: the flag, the
    import error, and the install command."""


def require(module: str, feature: str, install: str, load: bool = True) -> None:
    """Import ``module`` (discarded) or raise :class:`MissingExtra` saying that ``feature`` needs it.

    Args:
        module: the module to import, e.g. ``"smg_grpc_proto"``.
        feature: what asks for it, flag first, e.g. ``"--grpc-port (SGLang's scheduler gRPC)"``.
        install: how to get it, e.g. ``"pip install 'epdserve[smg-grpc]'"``.
        load: False only checks that the module is installed, without importing it (the launcher: flashinfer's
            import brings torch's, seconds before any stage starts; each stage then imports it for real).

    Raises:
        MissingExtra: the import failed (not installed, or a build whose shared libraries this machine lacks).
    """
    if not load:
        try:
            found = importlib.util.find_spec(module) is not None
        except ValueError:  # in sys.modules without a spec: imported already
            found = True
        if not found:
            raise MissingExtra(f"{feature} needs {module.split('.')[0]}, which is not installed: {install}")
        return
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{feature} needs {module.split('.')[0]}, which does not import ({e}): {install}") from e


def _on_cuda(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    from epdserve.cuda_probe import cuda_available

    return cuda_available()


def _is_hybrid(model_path: str) -> bool:
    """Whether the local checkpoint at ``model_path`` has linear-attention layers (False when it has no readable
    config: the server then reports that itself)."""
    from epdserve.models.config import ModelConfig

    try:
        return ModelConfig.load(model_path).is_hybrid
    except (OSError, ValueError):
        return False


def check_extras(config: Any) -> None:
    """Check that what ``config`` (any server's config dataclass) asks for imports.

    Raises:
        MissingExtra: the first feature asked for whose package is missing.
    """
    if getattr(config, "grpc_port", 0):
        require("smg_grpc_proto", f"--grpc-port with --grpc-protocol {getattr(config, 'grpc_protocol', 'sglang')}",
                "pip install 'epdserve[smg-grpc]'")
    if isinstance(config, EncoderConfig) and config.bootstrap_port:
        require("smg_grpc_proto", "--bootstrap-port (smg's EPD encode protocol)", "pip install 'epdserve[smg-grpc]'")
    engine = getattr(config, "kv_transfer", "")
    if engine in KV_ENGINES:
        module, _, install = KV_ENGINES[engine]
        require(module, f"--kv-transfer {engine}", install)
    backend = getattr(config, "attention_backend", "auto")  # launch's stages take auto
    if not isinstance(config, (LMServerConfig, LaunchConfig)) or backend == "sdpa" or not _on_cuda(config.device):
        return  # only the LM servers attend, and only on CUDA are the kernels needed
    load = not isinstance(config, LaunchConfig)
    require("flashinfer", "attention on CUDA (--attention-backend auto or flashinfer)",
            "pip install 'epdserve[gpu]', or --attention-backend sdpa for PyTorch's attention", load)
    if _is_hybrid(config.model_path):
        require("fla", "a hybrid model (Qwen3.5) on CUDA", "pip install 'epdserve[hybrid-gpu]', or "
                "--attention-backend sdpa for the PyTorch path throughout", load)
