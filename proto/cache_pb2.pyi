from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferDescriptor(_message.Message):
    __slots__ = ("name", "offset", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("instance_id", "tier", "backend", "handle", "size_bytes", "dtype", "num_layers", "kv_heads", "head_dim", "page_size", "num_slots", "mla", "layout", "buffers", "gpu_uuid", "device_index", "pinned")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    tier: str
    backend: str
    handle: bytes
    size_bytes: int
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    num_slots: int
    mla: bool
    layout: str
    buffers: _containers.RepeatedCompositeFieldContainer[BufferDescriptor]
    gpu_uuid: str
    device_index: int
    pinned: bool
    def __init__(self, instance_id: _Optional[str] = ..., tier: _Optional[str] = ..., backend: _Optional[str] = ..., handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., mla: _Optional[bool] = ..., layout: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[BufferDescriptor, _Mapping]]] = ..., gpu_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("instance_id", "page_size", "device_pools", "host_pool", "eviction_policy", "version", "capacity_tokens", "max_batch_tokens", "write_policy", "storage", "storage_format", "metrics_url", "swa_pool", "state_pool", "hybrid", "pressure_segment")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_POOLS_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    SWA_POOL_FIELD_NUMBER: _ClassVar[int]
    STATE_POOL_FIELD_NUMBER: _ClassVar[int]
    HYBRID_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    page_size: int
    device_pools: _containers.RepeatedCompositeFieldContainer[PoolDescriptor]
    host_pool: PoolDescriptor
    eviction_policy: str
    version: str
    capacity_tokens: int
    max_batch_tokens: int
    write_policy: str
    storage: str
    storage_format: str
    metrics_url: str
    swa_pool: PoolDescriptor
    state_pool: PoolDescriptor
    hybrid: HybridInfo
    pressure_segment: str
    def __init__(self, instance_id: _Optional[str] = ..., page_size: _Optional[int] = ..., device_pools: _Optional[_Iterable[_Union[PoolDescriptor, _Mapping]]] = ..., host_pool: _Optional[_Union[PoolDescriptor, _Mapping]] = ..., eviction_policy: _Optional[str] = ..., version: _Optional[str] = ..., capacity_tokens: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., write_policy: _Optional[str] = ..., storage: _Optional[str] = ..., storage_format: _Optional[str] = ..., metrics_url: _Optional[str] = ..., swa_pool: _Optional[_Union[PoolDescriptor, _Mapping]] = ..., state_pool: _Optional[_Union[PoolDescriptor, _Mapping]] = ..., hybrid: _Optional[_Union[HybridInfo, _Mapping]] = ..., pressure_segment: _Optional[str] = ...) -> None: ...

class HybridInfo(_message.Message):
    __slots__ = ("sliding_window", "mamba_chunk", "swa_capacity_tokens", "mamba_states", "full_layers", "swa_layers", "state_layers")
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SWA_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_STATES_FIELD_NUMBER: _ClassVar[int]
    FULL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SWA_LAYERS_FIELD_NUMBER: _ClassVar[int]
    STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    sliding_window: int
    mamba_chunk: int
    swa_capacity_tokens: int
    mamba_states: int
    full_layers: _containers.RepeatedScalarFieldContainer[int]
    swa_layers: _containers.RepeatedScalarFieldContainer[int]
    state_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sliding_window: _Optional[int] = ..., mamba_chunk: _Optional[int] = ..., swa_capacity_tokens: _Optional[int] = ..., mamba_states: _Optional[int] = ..., full_layers: _Optional[_Iterable[int]] = ..., swa_layers: _Optional[_Iterable[int]] = ..., state_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("client_name",)
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    def __init__(self, client_name: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "instance_id", "message", "transfer_id", "transfer_ok", "expired_receipt_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_OK_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    instance_id: str
    message: str
    transfer_id: int
    transfer_ok: bool
    expired_receipt_id: int
    def __init__(self, session_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., message: _Optional[str] = ..., transfer_id: _Optional[int] = ..., transfer_ok: _Optional[bool] = ..., expired_receipt_id: _Optional[int] = ...) -> None: ...

class AllocRequest(_message.Message):
    __slots__ = ("session_id", "num_tokens", "mamba_states")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_STATES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    mamba_states: int
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[_Iterable[int]] = ..., mamba_states: _Optional[int] = ...) -> None: ...

class Slots(_message.Message):
    __slots__ = ("indices", "swa_indices")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SWA_INDICES_FIELD_NUMBER: _ClassVar[int]
    indices: bytes
    swa_indices: bytes
    def __init__(self, indices: _Optional[bytes] = ..., swa_indices: _Optional[bytes] = ...) -> None: ...

class AllocResponse(_message.Message):
    __slots__ = ("allocations", "evicted_tokens", "states", "swa_evicted_tokens", "mamba_evicted")
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    SWA_EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_EVICTED_FIELD_NUMBER: _ClassVar[int]
    allocations: _containers.RepeatedCompositeFieldContainer[Slots]
    evicted_tokens: int
    states: bytes
    swa_evicted_tokens: int
    mamba_evicted: int
    def __init__(self, allocations: _Optional[_Iterable[_Union[Slots, _Mapping]]] = ..., evicted_tokens: _Optional[int] = ..., states: _Optional[bytes] = ..., swa_evicted_tokens: _Optional[int] = ..., mamba_evicted: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("session_id", "indices", "states", "swa_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    SWA_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    indices: bytes
    states: bytes
    swa_only: bool
    def __init__(self, session_id: _Optional[str] = ..., indices: _Optional[bytes] = ..., states: _Optional[bytes] = ..., swa_only: _Optional[bool] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("freed", "freed_states")
    FREED_FIELD_NUMBER: _ClassVar[int]
    FREED_STATES_FIELD_NUMBER: _ClassVar[int]
    freed: int
    freed_states: int
    def __init__(self, freed: _Optional[int] = ..., freed_states: _Optional[int] = ...) -> None: ...

class InsertItem(_message.Message):
    __slots__ = ("tokens", "indices", "extra_key", "cache_salt", "prev_prefix_len", "priority", "swa_evicted_seqlen", "mamba_value")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREV_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SWA_EVICTED_SEQLEN_FIELD_NUMBER: _ClassVar[int]
    MAMBA_VALUE_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    indices: bytes
    extra_key: str
    cache_salt: str
    prev_prefix_len: int
    priority: int
    swa_evicted_seqlen: int
    mamba_value: int
    def __init__(self, tokens: _Optional[bytes] = ..., indices: _Optional[bytes] = ..., extra_key: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prev_prefix_len: _Optional[int] = ..., priority: _Optional[int] = ..., swa_evicted_seqlen: _Optional[int] = ..., mamba_value: _Optional[int] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[InsertItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[InsertItem, _Mapping]]] = ...) -> None: ...

class InsertResult(_message.Message):
    __slots__ = ("prefix_len", "node_id", "freed_duplicates", "adopted", "backup_transfer_ids", "mamba_exist")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    BACKUP_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_EXIST_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    node_id: int
    freed_duplicates: int
    adopted: int
    backup_transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    mamba_exist: bool
    def __init__(self, prefix_len: _Optional[int] = ..., node_id: _Optional[int] = ..., freed_duplicates: _Optional[int] = ..., adopted: _Optional[int] = ..., backup_transfer_ids: _Optional[_Iterable[int]] = ..., mamba_exist: _Optional[bool] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[InsertResult]
    def __init__(self, results: _Optional[_Iterable[_Union[InsertResult, _Mapping]]] = ...) -> None: ...

class MatchItem(_message.Message):
    __slots__ = ("tokens", "extra_key", "cache_salt", "lock", "mamba_cow", "skip_mamba")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LOCK_FIELD_NUMBER: _ClassVar[int]
    MAMBA_COW_FIELD_NUMBER: _ClassVar[int]
    SKIP_MAMBA_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    extra_key: str
    cache_salt: str
    lock: bool
    mamba_cow: bool
    skip_mamba: bool
    def __init__(self, tokens: _Optional[bytes] = ..., extra_key: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lock: _Optional[bool] = ..., mamba_cow: _Optional[bool] = ..., skip_mamba: _Optional[bool] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[MatchItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[MatchItem, _Mapping]]] = ...) -> None: ...

class MatchResult(_message.Message):
    __slots__ = ("device_indices", "matched_len", "host_hit_len", "node_id", "receipt_id", "best_node_id", "prefetch_len", "swa_indices", "full_hit_len", "swa_branching_seqlen", "mamba_branching_seqlen", "mamba_src", "mamba_slot")
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    MATCHED_LEN_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_LEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    BEST_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_LEN_FIELD_NUMBER: _ClassVar[int]
    SWA_INDICES_FIELD_NUMBER: _ClassVar[int]
    FULL_HIT_LEN_FIELD_NUMBER: _ClassVar[int]
    SWA_BRANCHING_SEQLEN_FIELD_NUMBER: _ClassVar[int]
    MAMBA_BRANCHING_SEQLEN_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SRC_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOT_FIELD_NUMBER: _ClassVar[int]
    device_indices: bytes
    matched_len: int
    host_hit_len: int
    node_id: int
    receipt_id: int
    best_node_id: int
    prefetch_len: int
    swa_indices: bytes
    full_hit_len: int
    swa_branching_seqlen: int
    mamba_branching_seqlen: int
    mamba_src: int
    mamba_slot: int
    def __init__(self, device_indices: _Optional[bytes] = ..., matched_len: _Optional[int] = ..., host_hit_len: _Optional[int] = ..., node_id: _Optional[int] = ..., receipt_id: _Optional[int] = ..., best_node_id: _Optional[int] = ..., prefetch_len: _Optional[int] = ..., swa_indices: _Optional[bytes] = ..., full_hit_len: _Optional[int] = ..., swa_branching_seqlen: _Optional[int] = ..., mamba_branching_seqlen: _Optional[int] = ..., mamba_src: _Optional[int] = ..., mamba_slot: _Optional[int] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[MatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[MatchResult, _Mapping]]] = ...) -> None: ...

class PrefetchItem(_message.Message):
    __slots__ = ("tokens", "extra_key", "cache_salt")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    extra_key: str
    cache_salt: str
    def __init__(self, tokens: _Optional[bytes] = ..., extra_key: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("items", "wait")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefetchItem]
    wait: bool
    def __init__(self, items: _Optional[_Iterable[_Union[PrefetchItem, _Mapping]]] = ..., wait: _Optional[bool] = ...) -> None: ...

class PrefetchResult(_message.Message):
    __slots__ = ("prefetch_len", "host_len")
    PREFETCH_LEN_FIELD_NUMBER: _ClassVar[int]
    HOST_LEN_FIELD_NUMBER: _ClassVar[int]
    prefetch_len: int
    host_len: int
    def __init__(self, prefetch_len: _Optional[int] = ..., host_len: _Optional[int] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrefetchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PrefetchResult, _Mapping]]] = ...) -> None: ...

class LockRequest(_message.Message):
    __slots__ = ("session_id", "node_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    node_id: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., node_id: _Optional[_Iterable[int]] = ...) -> None: ...

class LockResponse(_message.Message):
    __slots__ = ("receipt_id",)
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    receipt_id: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, receipt_id: _Optional[_Iterable[int]] = ...) -> None: ...

class UnlockRequest(_message.Message):
    __slots__ = ("session_id", "receipt_id", "swa_only")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    SWA_ONLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    receipt_id: _containers.RepeatedScalarFieldContainer[int]
    swa_only: bool
    def __init__(self, session_id: _Optional[str] = ..., receipt_id: _Optional[_Iterable[int]] = ..., swa_only: _Optional[bool] = ...) -> None: ...

class UnlockResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishedItem(_message.Message):
    __slots__ = ("tokens", "indices", "extra_key", "cache_salt", "prev_prefix_len", "priority", "receipt_id", "swa_evicted_seqlen", "mamba_value")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PREV_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    SWA_EVICTED_SEQLEN_FIELD_NUMBER: _ClassVar[int]
    MAMBA_VALUE_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    indices: bytes
    extra_key: str
    cache_salt: str
    prev_prefix_len: int
    priority: int
    receipt_id: int
    swa_evicted_seqlen: int
    mamba_value: int
    def __init__(self, tokens: _Optional[bytes] = ..., indices: _Optional[bytes] = ..., extra_key: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prev_prefix_len: _Optional[int] = ..., priority: _Optional[int] = ..., receipt_id: _Optional[int] = ..., swa_evicted_seqlen: _Optional[int] = ..., mamba_value: _Optional[int] = ...) -> None: ...

class CacheFinishedRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[FinishedItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[FinishedItem, _Mapping]]] = ...) -> None: ...

class CacheFinishedResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[InsertResult]
    def __init__(self, results: _Optional[_Iterable[_Union[InsertResult, _Mapping]]] = ...) -> None: ...

class CacheUnfinishedRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[FinishedItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[FinishedItem, _Mapping]]] = ...) -> None: ...

class UnfinishedResult(_message.Message):
    __slots__ = ("insert", "device_indices", "matched_len", "node_id", "receipt_id", "swa_indices")
    INSERT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    MATCHED_LEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    SWA_INDICES_FIELD_NUMBER: _ClassVar[int]
    insert: InsertResult
    device_indices: bytes
    matched_len: int
    node_id: int
    receipt_id: int
    swa_indices: bytes
    def __init__(self, insert: _Optional[_Union[InsertResult, _Mapping]] = ..., device_indices: _Optional[bytes] = ..., matched_len: _Optional[int] = ..., node_id: _Optional[int] = ..., receipt_id: _Optional[int] = ..., swa_indices: _Optional[bytes] = ...) -> None: ...

class CacheUnfinishedResponse(_message.Message):
    __slots__ = ("results", "event_seq")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[UnfinishedResult]
    event_seq: int
    def __init__(self, results: _Optional[_Iterable[_Union[UnfinishedResult, _Mapping]]] = ..., event_seq: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("num_tokens", "host_tokens", "swa_tokens", "mamba_states")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_STATES_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    host_tokens: int
    swa_tokens: int
    mamba_states: int
    def __init__(self, num_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., swa_tokens: _Optional[int] = ..., mamba_states: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted_tokens", "host_evicted_tokens", "swa_evicted_tokens", "mamba_evicted")
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted_tokens: int
    host_evicted_tokens: int
    swa_evicted_tokens: int
    mamba_evicted: int
    def __init__(self, evicted_tokens: _Optional[int] = ..., host_evicted_tokens: _Optional[int] = ..., swa_evicted_tokens: _Optional[int] = ..., mamba_evicted: _Optional[int] = ...) -> None: ...

class LoadBackItem(_message.Message):
    __slots__ = ("receipt_id", "mem_quota")
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    MEM_QUOTA_FIELD_NUMBER: _ClassVar[int]
    receipt_id: int
    mem_quota: int
    def __init__(self, receipt_id: _Optional[int] = ..., mem_quota: _Optional[int] = ...) -> None: ...

class LoadBackRequest(_message.Message):
    __slots__ = ("session_id", "items")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    items: _containers.RepeatedCompositeFieldContainer[LoadBackItem]
    def __init__(self, session_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[LoadBackItem, _Mapping]]] = ...) -> None: ...

class LoadBackResult(_message.Message):
    __slots__ = ("device_indices", "loaded_len", "receipt_id", "transfer_id", "ipc_event_handle", "reason")
    DEVICE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LOADED_LEN_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    device_indices: bytes
    loaded_len: int
    receipt_id: int
    transfer_id: int
    ipc_event_handle: bytes
    reason: str
    def __init__(self, device_indices: _Optional[bytes] = ..., loaded_len: _Optional[int] = ..., receipt_id: _Optional[int] = ..., transfer_id: _Optional[int] = ..., ipc_event_handle: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class LoadBackResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LoadBackResult]
    def __init__(self, results: _Optional[_Iterable[_Union[LoadBackResult, _Mapping]]] = ...) -> None: ...

class WaitTransfersRequest(_message.Message):
    __slots__ = ("transfer_ids", "timeout_ms", "storage")
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    storage: bool
    def __init__(self, transfer_ids: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ..., storage: _Optional[bool] = ...) -> None: ...

class WaitTransfersResponse(_message.Message):
    __slots__ = ("storage_idle", "completed", "failed")
    STORAGE_IDLE_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    storage_idle: bool
    completed: _containers.RepeatedScalarFieldContainer[int]
    failed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, storage_idle: _Optional[bool] = ..., completed: _Optional[_Iterable[int]] = ..., failed: _Optional[_Iterable[int]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("capacity_tokens", "free_tokens", "cached_tokens", "evictable_tokens", "protected_tokens", "held_tokens", "in_flight_tokens", "num_nodes", "sessions", "hit_tokens_total", "queried_tokens_total", "evicted_tokens_total", "host_capacity_tokens", "host_free_tokens", "host_cached_tokens", "receipts", "host_evictable_tokens", "host_protected_tokens", "host_in_flight_tokens", "host_hit_tokens_total", "backup_tokens_total", "load_back_tokens_total", "host_evicted_tokens_total", "transfers_in_flight", "transfer_failures_total", "storage_hit_tokens_total", "storage_put_pages_total", "storage_get_pages_total", "storage_put_skipped_pages_total", "storage_put_bytes_total", "storage_get_bytes_total", "storage_errors_total", "prefetches_in_flight", "swa_capacity_tokens", "swa_free_tokens", "swa_held_tokens", "swa_evictable_tokens", "swa_protected_tokens", "mamba_capacity", "mamba_free", "mamba_held", "mamba_evictable", "mamba_protected", "host_swa_capacity_tokens", "host_swa_free_tokens", "host_swa_cached_tokens", "host_mamba_capacity", "host_mamba_free", "host_mamba_cached")
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_PROTECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_IN_FLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BACKUP_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_BACK_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PUT_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_GET_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PUT_SKIPPED_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PUT_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_GET_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFETCHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SWA_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_EVICTABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_PROTECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAMBA_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    MAMBA_FREE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_HELD_FIELD_NUMBER: _ClassVar[int]
    MAMBA_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    MAMBA_PROTECTED_FIELD_NUMBER: _ClassVar[int]
    HOST_SWA_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_SWA_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_SWA_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_MAMBA_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOST_MAMBA_FREE_FIELD_NUMBER: _ClassVar[int]
    HOST_MAMBA_CACHED_FIELD_NUMBER: _ClassVar[int]
    capacity_tokens: int
    free_tokens: int
    cached_tokens: int
    evictable_tokens: int
    protected_tokens: int
    held_tokens: int
    in_flight_tokens: int
    num_nodes: int
    sessions: int
    hit_tokens_total: int
    queried_tokens_total: int
    evicted_tokens_total: int
    host_capacity_tokens: int
    host_free_tokens: int
    host_cached_tokens: int
    receipts: int
    host_evictable_tokens: int
    host_protected_tokens: int
    host_in_flight_tokens: int
    host_hit_tokens_total: int
    backup_tokens_total: int
    load_back_tokens_total: int
    host_evicted_tokens_total: int
    transfers_in_flight: int
    transfer_failures_total: int
    storage_hit_tokens_total: int
    storage_put_pages_total: int
    storage_get_pages_total: int
    storage_put_skipped_pages_total: int
    storage_put_bytes_total: int
    storage_get_bytes_total: int
    storage_errors_total: int
    prefetches_in_flight: int
    swa_capacity_tokens: int
    swa_free_tokens: int
    swa_held_tokens: int
    swa_evictable_tokens: int
    swa_protected_tokens: int
    mamba_capacity: int
    mamba_free: int
    mamba_held: int
    mamba_evictable: int
    mamba_protected: int
    host_swa_capacity_tokens: int
    host_swa_free_tokens: int
    host_swa_cached_tokens: int
    host_mamba_capacity: int
    host_mamba_free: int
    host_mamba_cached: int
    def __init__(self, capacity_tokens: _Optional[int] = ..., free_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., evictable_tokens: _Optional[int] = ..., protected_tokens: _Optional[int] = ..., held_tokens: _Optional[int] = ..., in_flight_tokens: _Optional[int] = ..., num_nodes: _Optional[int] = ..., sessions: _Optional[int] = ..., hit_tokens_total: _Optional[int] = ..., queried_tokens_total: _Optional[int] = ..., evicted_tokens_total: _Optional[int] = ..., host_capacity_tokens: _Optional[int] = ..., host_free_tokens: _Optional[int] = ..., host_cached_tokens: _Optional[int] = ..., receipts: _Optional[int] = ..., host_evictable_tokens: _Optional[int] = ..., host_protected_tokens: _Optional[int] = ..., host_in_flight_tokens: _Optional[int] = ..., host_hit_tokens_total: _Optional[int] = ..., backup_tokens_total: _Optional[int] = ..., load_back_tokens_total: _Optional[int] = ..., host_evicted_tokens_total: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., transfer_failures_total: _Optional[int] = ..., storage_hit_tokens_total: _Optional[int] = ..., storage_put_pages_total: _Optional[int] = ..., storage_get_pages_total: _Optional[int] = ..., storage_put_skipped_pages_total: _Optional[int] = ..., storage_put_bytes_total: _Optional[int] = ..., storage_get_bytes_total: _Optional[int] = ..., storage_errors_total: _Optional[int] = ..., prefetches_in_flight: _Optional[int] = ..., swa_capacity_tokens: _Optional[int] = ..., swa_free_tokens: _Optional[int] = ..., swa_held_tokens: _Optional[int] = ..., swa_evictable_tokens: _Optional[int] = ..., swa_protected_tokens: _Optional[int] = ..., mamba_capacity: _Optional[int] = ..., mamba_free: _Optional[int] = ..., mamba_held: _Optional[int] = ..., mamba_evictable: _Optional[int] = ..., mamba_protected: _Optional[int] = ..., host_swa_capacity_tokens: _Optional[int] = ..., host_swa_free_tokens: _Optional[int] = ..., host_swa_cached_tokens: _Optional[int] = ..., host_mamba_capacity: _Optional[int] = ..., host_mamba_free: _Optional[int] = ..., host_mamba_cached: _Optional[int] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ("ok", "violations")
    OK_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    violations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., violations: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("freed_tokens",)
    FREED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    freed_tokens: int
    def __init__(self, freed_tokens: _Optional[int] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq", "follow", "snapshot")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    follow: bool
    snapshot: bool
    def __init__(self, from_seq: _Optional[int] = ..., follow: _Optional[bool] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class BlockStoredEvent(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "cache_salt", "lora_name", "bigram", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    BIGRAM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SPEC_SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    cache_salt: str
    lora_name: str
    bigram: bool
    group_idx: int
    kv_cache_spec_kind: str
    kv_cache_spec_sliding_window: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., bigram: _Optional[bool] = ..., group_idx: _Optional[int] = ..., kv_cache_spec_kind: _Optional[str] = ..., kv_cache_spec_sliding_window: _Optional[int] = ...) -> None: ...

class BlockRemovedEvent(_message.Message):
    __slots__ = ("block_hashes", "medium", "group_idx")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDX_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    group_idx: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ..., group_idx: _Optional[int] = ...) -> None: ...

class AllBlocksClearedEvent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStoredEvent
    removed: BlockRemovedEvent
    cleared: AllBlocksClearedEvent
    def __init__(self, stored: _Optional[_Union[BlockStoredEvent, _Mapping]] = ..., removed: _Optional[_Union[BlockRemovedEvent, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksClearedEvent, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("seq", "ts", "events", "gap", "lost", "first_seq", "message", "snapshot", "snapshot_more")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_MORE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    gap: bool
    lost: bool
    first_seq: int
    message: str
    snapshot: bool
    snapshot_more: bool
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., gap: _Optional[bool] = ..., lost: _Optional[bool] = ..., first_seq: _Optional[int] = ..., message: _Optional[str] = ..., snapshot: _Optional[bool] = ..., snapshot_more: _Optional[bool] = ...) -> None: ...
