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
    __slots__ = ("num_requests", "num_images_encoding", "cached_embeddings", "cache_bytes", "push_sockets", "num_videos_encoding")
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_ENCODING_FIELD_NUMBER: _ClassVar[int]
    CACHED_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUSH_SOCKETS_FIELD_NUMBER: _ClassVar[int]
    NUM_VIDEOS_ENCODING_FIELD_NUMBER: _ClassVar[int]
    num_requests: int
    num_images_encoding: int
    cached_embeddings: int
    cache_bytes: int
    push_sockets: int
    num_videos_encoding: int
    def __init__(self, num_requests: _Optional[int] = ..., num_images_encoding: _Optional[int] = ..., cached_embeddings: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., push_sockets: _Optional[int] = ..., num_videos_encoding: _Optional[int] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("data", "fps", "num_frames")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    fps: float
    num_frames: int
    def __init__(self, data: _Optional[bytes] = ..., fps: _Optional[float] = ..., num_frames: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "targets", "videos", "share_host_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    SHARE_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    targets: _containers.RepeatedScalarFieldContainer[str]
    videos: _containers.RepeatedCompositeFieldContainer[Video]
    share_host_id: str
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., targets: _Optional[_Iterable[str]] = ..., videos: _Optional[_Iterable[_Union[Video, _Mapping]]] = ..., share_host_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("request_id", "images", "videos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[ImageResult]
    videos: _containers.RepeatedCompositeFieldContainer[ImageResult]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImageResult, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[ImageResult, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_path", "model_type", "device", "dtype", "patch_size", "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_deepstack_levels")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPORAL_PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUT_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEEPSTACK_LEVELS_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    model_type: str
    device: str
    dtype: str
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_deepstack_levels: int
    def __init__(self, model_path: _Optional[str] = ..., model_type: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., patch_size: _Optional[int] = ..., temporal_patch_size: _Optional[int] = ..., spatial_merge_size: _Optional[int] = ..., out_hidden_size: _Optional[int] = ..., num_deepstack_levels: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("flags", "version", "ready", "metrics_port", "cache_entries", "cache_bytes", "cache_capacity_bytes", "cache_hits", "cache_misses", "tower_calls", "queued_images", "running_requests")
    class FlagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    TOWER_CALLS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    flags: _containers.ScalarMap[str, str]
    version: str
    ready: bool
    metrics_port: int
    cache_entries: int
    cache_bytes: int
    cache_capacity_bytes: int
    cache_hits: int
    cache_misses: int
    tower_calls: int
    queued_images: int
    running_requests: int
    def __init__(self, flags: _Optional[_Mapping[str, str]] = ..., version: _Optional[str] = ..., ready: bool = ..., metrics_port: _Optional[int] = ..., cache_entries: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_capacity_bytes: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., tower_calls: _Optional[int] = ..., queued_images: _Optional[int] = ..., running_requests: _Optional[int] = ...) -> None: ...
