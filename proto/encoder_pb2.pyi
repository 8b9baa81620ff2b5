from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncoderLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncoderLoad(_message.Message):
    __slots__ = ("num_requests", "num_images_encoding", "cached_embeddings", "cache_bytes", "push_sockets")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_ENCODING_FIELD_NUMBER: _ClassVar[int]
    CACHED_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_SOCKETS_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    num_images_encoding: int
    cached_embeddings: int
    cache_bytes: int
    push_sockets: int
    def __init__(self, num_requests: _Optional[int] = ..., num_images_encoding: _Optional[int] = ..., cached_embeddings: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., push_sockets: _Optional[int] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "targets")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    targets: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., targets: _Optional[_Iterable[str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImageResult(_message.Message):
    __slots__ = ("image_hash", "num_tokens", "grid_thw", "cache_hit", "embedding")
    IMAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    image_hash: str
    num_tokens: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    cache_hit: bool
    embedding: Tensor
    def __init__(self, image_hash: _Optional[str] = ..., num_tokens: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., cache_hit: bool = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("request_id", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImageResult]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageResult, _Mapping]]] = ...) -> None: ...
