"""The encoder's gRPC surface apart from its logic: the status-carrying request error, tensors on the wire, and
registration of the servicer with requests that do not parse answered INVALID_ARGUMENT."""

from __future__ import annotations

import logging

import grpc
import torch

from epdserve.proto import encoder_pb2, encoder_pb2_grpc
from epdserve.wire.codec import tensor_bytes, tensor_from_bytes

SERVICE_NAME: str = encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name  # "epdserve.v1.Encoder"

# Embeddings are floating point; the wire codec itself carries more dtypes.
_EMBEDDING_DTYPES = ("float32", "bfloat16", "float16")


class RequestError(Exception):
    """A request that fails with a specific gRPC status (``code``) and message, not as an internal error."""

    def __init__(self, code: grpc.StatusCode, message: str, log_level: int = logging.DEBUG) -> None:
        super().__init__(message)
        self.code = code
        self.log_level = log_level  # client mistakes stay quiet; operational trouble (a dead target) is a warning


def tensor_to_proto(t: torch.Tensor) -> encoder_pb2.Tensor:
    """Serialize a CPU or device tensor to ``epdserve.v1.Tensor`` (raw little-endian row-major bytes).

    Raises:
        ValueError: dtype other than float32 / bfloat16 / float16.
    """
    name = str(t.dtype).removeprefix("torch.")
    if name not in _EMBEDDING_DTYPES:
        raise ValueError(f"unsupported tensor dtype {t.dtype}")
    return encoder_pb2.Tensor(dtype=name, shape=list(t.shape), data=tensor_bytes(t).tobytes())


def tensor_from_proto(msg: encoder_pb2.Tensor) -> torch.Tensor:
    """Rebuild the tensor of an ``epdserve.v1.Tensor`` (a writable CPU copy).

    Raises:
        ValueError: unknown dtype, or ``data`` does not hold exactly ``shape`` elements.
    """
    if msg.dtype not in _EMBEDDING_DTYPES:
        raise ValueError(f"unknown tensor dtype {msg.dtype!r}")
    return tensor_from_bytes(msg.data, msg.dtype, list(msg.shape)).clone()


class MalformedRequest:
    """What a request that is not valid protobuf deserializes to, so that Encode can answer INVALID_ARGUMENT
    (grpc itself would answer UNKNOWN)."""

    def __init__(self, error: str) -> None:
        self.error = error
        self.request_id = ""


def lenient(parse):
    """Wrap a protobuf ``FromString`` so that bytes it cannot parse become a :class:`MalformedRequest`."""
    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # DecodeError, and whatever else a corrupt wire format raises
            return MalformedRequest(f"malformed request: {e}")

    return deserialize


def add_servicer(servicer: encoder_pb2_grpc.EncoderServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as ``epdserve.v1.Encoder`` on ``server`` (as the generated
    ``add_EncoderServicer_to_server`` does, but with requests that do not parse answered INVALID_ARGUMENT)."""
    pb2 = encoder_pb2
    methods = {"Encode": (pb2.EncodeRequest, pb2.EncodeResponse), "GetLoad": (pb2.EncoderLoadRequest, pb2.EncoderLoad),
               "GetModelInfo": (pb2.GetModelInfoRequest, pb2.GetModelInfoResponse),
               "GetServerInfo": (pb2.GetServerInfoRequest, pb2.GetServerInfoResponse)}
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(servicer, name),
                                                          request_deserializer=lenient(req.FromString),
                                                          response_serializer=resp.SerializeToString)
                for name, (req, resp) in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
