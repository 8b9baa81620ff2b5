"""What the two gRPC protocols (SGLang's scheduler and TokenSpeed's) share when reading a request: the error that
refuses one (:class:`InvalidRequest`, answered as INVALID_ARGUMENT) and the one byte-to-tensor decoder of a proto
``TensorData`` (:func:`decode_tensor`). Both protos carry a tensor as raw little-endian bytes, a shape and a dtype
name; only the field holding the bytes differs (SGLang's ``data``, TokenSpeed's ``inline``), so each caller passes
its bytes here.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["InvalidRequest", "decode_tensor"]

_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INTS = {"int64": np.int64, "int32": np.int32, "uint32": np.uint32}


class InvalidRequest(ValueError):
    """A request the worker refuses: gRPC INVALID_ARGUMENT with this message."""


def decode_tensor(data: bytes, shape: Iterable[int], dtype: str, what: str) -> torch.Tensor:
    """Little-endian ``data`` of dtype name ``dtype`` as a CPU tensor of ``shape`` (floats keep their dtype;
    integers become int64, so ids and grids read the same whatever width the client sent).

    Raises:
        InvalidRequest: an unknown dtype, or bytes that do not fill the shape (``what`` names the tensor).
    """
    shape = [int(d) for d in shape]
    if dtype in _FLOATS:
        # bytearray: torch.frombuffer wants a writable buffer; an empty one it refuses outright.
        out = torch.frombuffer(bytearray(data), dtype=_FLOATS[dtype]) if data else torch.empty(0)
    elif dtype in _INTS:
        out = torch.from_numpy(np.frombuffer(data, dtype=np.dtype(_INTS[dtype]).newbyteorder("<")).astype(np.int64))
    else:
        raise InvalidRequest(f"{what} has dtype {dtype!r}; expected one of {sorted(_FLOATS | _INTS)}")
    if out.numel() != int(np.prod(shape)):
        raise InvalidRequest(f"{what} carries {out.numel()} values for shape {shape}")
    return out.reshape(shape)
