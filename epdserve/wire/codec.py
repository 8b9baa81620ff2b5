"""The one wire codec (never pickle): a multipart ZeroMQ message whose first frame is a msgpack map
``{"kind": <class name>, **fields}`` and whose further frames are raw tensor bytes. A ``torch.Tensor`` field is
written in the map as ``{"__tensor__": i, "dtype": "float32", "shape": [...]}`` and its bytes travel in frame
``i + 1``. Nested dataclasses are maps tagged with their ``kind``. Only the classes a :class:`Codec` is built with
decode; :mod:`epdserve.wire.messages` builds the one every socket uses.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import msgpack

if TYPE_CHECKING:
    import torch

# The dtypes a wire tensor may have, by name. torch is imported only where a tensor is met: the gateway passes
# tensor-free messages alone, and importing torch costs it seconds of start-up (issue 43).
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8")
# The float dtypes a wire tensor of activations may have (embeddings, KV, states).
FLOAT_DTYPE_NAMES = ("float32", "float16", "bfloat16")


class WireError(ValueError):
    """Raised when frames do not decode to a known message (unknown kind, bad tensor header, bad msgpack)."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian, row-major bytes of ``t`` (moved to CPU and made contiguous; no further copy)."""
    import torch

    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def tensor_from_bytes(buf, dtype: str, shape: list[int]) -> torch.Tensor:
    """A zero-copy CPU view of ``buf`` (any buffer) as a ``dtype`` tensor of ``shape``; read-only when ``buf`` is.

    Raises:
        WireError: unknown ``dtype``, or ``buf`` does not hold exactly ``shape`` elements.
    """
    import torch

    if dtype not in TENSOR_DTYPES:
        raise WireError(f"unknown tensor dtype {dtype!r}")
    view = memoryview(buf)
    if view.nbytes:
        with warnings.catch_warnings():  # read-only is fine: receivers copy or only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(view, dtype=torch.uint8)
    else:
        flat = torch.empty(0, dtype=torch.uint8)
    try:
        return flat.view(getattr(torch, dtype)).reshape(shape)
    except RuntimeError as e:
        raise WireError(f"tensor data does not match {dtype}{list(shape)}: {e}") from e


class Codec:
    """Encodes and decodes the dataclasses it is built with (``kinds``), by class name.

    Raises:
        ValueError: two kinds with one class name.
    """

    def __init__(self, kinds: Iterable[type]):
        self._kinds: dict[str, type] = {}
        for cls in kinds:
            if cls.__name__ in self._kinds:
                raise ValueError(f"two message kinds named {cls.__name__}")
            self._kinds[cls.__name__] = cls
        self._fields = {name: frozenset(f.name for f in dataclasses.fields(cls)) for name, cls in self._kinds.items()}

    @property
    def kinds(self) -> Mapping[str, type]:
        """Class name -> class of every kind this codec handles (read-only)."""
        return MappingProxyType(self._kinds)

    def encode(self, msg: Any) -> list[bytes | memoryview]:
        """Encode a registered dataclass to ZeroMQ frames (header + one raw frame per tensor).

        Tensors are moved to CPU and made contiguous; their bytes are exported without a further copy.

        Raises:
            TypeError: ``msg`` (or a nested value) is not a registered dataclass or plain msgpack data.
        """
        frames: list[bytes | memoryview] = []
        # No tensor exists before torch is imported, so a process without torch skips the check.
        torch = sys.modules.get("torch")
        tensor_type = torch.Tensor if torch is not None else ()

        # msgpack walks the message in C and calls this only for what it cannot pack itself (messages and
        # tensors), so long lists of ids and page tables cost no Python per element: a TP decode step's
        # TPForward at batch 128 took 4.4 ms to encode that way on a 2-core machine, 0.27 ms this way.
        def default(value: Any) -> Any:
            if isinstance(value, tensor_type):
                frames.append(tensor_bytes(value))
                return {"__tensor__": len(frames) - 1, "dtype": str(value.dtype).removeprefix("torch."),
                        "shape": list(value.shape)}
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                if type(value).__name__ not in self._kinds:
                    raise TypeError(f"{type(value).__name__} is not a registered message kind")
                out = {"kind": type(value).__name__}
                for f in dataclasses.fields(value):
                    out[f.name] = getattr(value, f.name)
                return out
            raise TypeError(f"cannot encode a {type(value).__name__} on the wire")

        header = msgpack.packb(msg, default=default, use_bin_type=True)
        return [header, *frames]

    def decode(self, frames: list) -> Any:
        """Decode frames made by :func:`encode` (bytes, memoryviews or ``zmq.Frame``) back to the dataclass.

        Tensors are zero-copy, read-only CPU views of their frames (a KV transfer is megabytes per request): clone
        one before writing to it.

        Raises:
            WireError: malformed msgpack, unknown kind, unknown dtype, or a tensor frame of the wrong size.
        """
        if not frames:
            raise WireError("empty message")

        # Called by msgpack for each map once its contents are decoded (innermost first), so lists of scalars are
        # never walked in Python: a map is a tensor header or a message, nothing else is sent.
        def hook(value: dict) -> Any:
            if "__tensor__" in value:
                idx, dtype, shape = value["__tensor__"], value.get("dtype"), value.get("shape")
                if not isinstance(idx, int) or not 0 <= idx < len(frames) - 1 or not isinstance(shape, list):
                    raise WireError(f"bad tensor header {value!r}")
                return tensor_from_bytes(frames[idx + 1], dtype, shape)
            kind = value.get("kind")
            cls = self._kinds.get(kind) if isinstance(kind, str) else None
            if cls is None:
                raise WireError(f"unknown message kind {kind!r}")
            names = self._fields[kind]
            try:
                return cls(**{k: v for k, v in value.items() if k in names})
            except TypeError as e:
                raise WireError(f"bad fields for {kind}: {e}") from e

        try:
            msg = msgpack.unpackb(frames[0], raw=False, strict_map_key=False, object_hook=hook)
        except WireError:
            raise
        except Exception as e:  # msgpack raises several unrelated types
            raise WireError(f"malformed header: {e}") from e
        if not dataclasses.is_dataclass(msg):
            raise WireError("header is not a message")
        return msg
