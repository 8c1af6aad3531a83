from . import llm_pb2 as _llm_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoRARequest(_message.Message):
    __slots__ = ("lora",)
    LORA_FIELD_NUMBER: _ClassVar[int]
    lora: _llm_pb2.LoRARef
    def __init__(self, lora: _Optional[_Union[_llm_pb2.LoRARef, _Mapping]] = ...) -> None: ...

class UnloadLoRARequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoRAResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class LoRAInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "key", "resident", "num_requests")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    key: str
    resident: bool
    num_requests: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., key: _Optional[str] = ..., resident: _Optional[bool] = ..., num_requests: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "cache_salt", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _llm_pb2.SamplingParams
    cache_salt: str
    lora: _llm_pb2.LoRARef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_llm_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[_Union[_llm_pb2.LoRARef, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first", "transfer_id", "source_address", "model_fingerprint", "num_blocks", "num_prompt_tokens")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first: _llm_pb2.GenerateResponse
    transfer_id: str
    source_address: str
    model_fingerprint: str
    num_blocks: int
    num_prompt_tokens: int
    def __init__(self, first: _Optional[_Union[_llm_pb2.GenerateResponse, _Mapping]] = ..., transfer_id: _Optional[str] = ..., source_address: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "params", "transfer_id", "source_address", "model_fingerprint", "cache_salt", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    params: _llm_pb2.SamplingParams
    transfer_id: str
    source_address: str
    model_fingerprint: str
    cache_salt: str
    lora: _llm_pb2.LoRARef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., params: _Optional[_Union[_llm_pb2.SamplingParams, _Mapping]] = ..., transfer_id: _Optional[str] = ..., source_address: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., cache_salt: _Optional[str] = ..., lora: _Optional[_Union[_llm_pb2.LoRARef, _Mapping]] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("transfer_id", "model_fingerprint", "max_chunk_bytes", "gpu_transports", "gpu_node_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    GPU_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    model_fingerprint: str
    max_chunk_bytes: int
    gpu_transports: _containers.RepeatedScalarFieldContainer[str]
    gpu_node_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., gpu_transports: _Optional[_Iterable[str]] = ..., gpu_node_id: _Optional[str] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "num_blocks", "num_tokens", "model_fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_blocks: int
    num_tokens: int
    model_fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class GpuKVHandle(_message.Message):
    __slots__ = ("transport", "ipc_handle", "buffer_bytes", "offset", "num_bytes", "checksum", "nccl_unique_id", "node_id")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    transport: str
    ipc_handle: bytes
    buffer_bytes: int
    offset: int
    num_bytes: int
    checksum: int
    nccl_unique_id: bytes
    node_id: str
    def __init__(self, transport: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., buffer_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., num_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., nccl_unique_id: _Optional[bytes] = ..., node_id: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layout", "first_block", "num_blocks", "data", "crc32", "gpu")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    first_block: int
    num_blocks: int
    data: bytes
    crc32: int
    gpu: GpuKVHandle
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., gpu: _Optional[_Union[GpuKVHandle, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("max_block_hashes", "kv_events", "kv_events_epoch", "kv_events_after")
    MAX_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    max_block_hashes: int
    kv_events: bool
    kv_events_epoch: int
    kv_events_after: int
    def __init__(self, max_block_hashes: _Optional[int] = ..., kv_events: _Optional[bool] = ..., kv_events_epoch: _Optional[int] = ..., kv_events_after: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("role", "address", "model_id", "model_fingerprint", "block_size", "max_model_len", "num_waiting", "num_running", "num_free_blocks", "num_usable_blocks", "num_held_transfers", "requests_total", "prompt_tokens_total", "cached_prompt_tokens_total", "kv_sent_blocks", "kv_sent_bytes", "kv_received_blocks", "kv_received_bytes", "kv_loaded_tokens", "kv_pull_failures", "transfers_expired", "cached_block_hashes", "num_preemptions", "cached_prompt_tokens_local", "cached_prompt_tokens_store", "cached_prompt_tokens_transfer", "kv_store_bytes_read", "kv_store_bytes_written", "spec_method", "num_speculative_tokens", "spec_proposed_tokens", "spec_accepted_tokens", "kv_stored", "kv_removed", "kv_events_epoch", "kv_events_seq", "kv_events_reset", "lora_enabled", "max_loras", "max_lora_rank", "loras")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_SENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_STORE_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SPEC_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_REMOVED_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_SEQ_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_RESET_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    model_id: str
    model_fingerprint: str
    block_size: int
    max_model_len: int
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_usable_blocks: int
    num_held_transfers: int
    requests_total: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    kv_sent_blocks: int
    kv_sent_bytes: int
    kv_received_blocks: int
    kv_received_bytes: int
    kv_loaded_tokens: int
    kv_pull_failures: int
    transfers_expired: int
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_preemptions: int
    cached_prompt_tokens_local: int
    cached_prompt_tokens_store: int
    cached_prompt_tokens_transfer: int
    kv_store_bytes_read: int
    kv_store_bytes_written: int
    spec_method: str
    num_speculative_tokens: int
    spec_proposed_tokens: int
    spec_accepted_tokens: int
    kv_stored: _containers.RepeatedScalarFieldContainer[bytes]
    kv_removed: _containers.RepeatedScalarFieldContainer[bytes]
    kv_events_epoch: int
    kv_events_seq: int
    kv_events_reset: bool
    lora_enabled: bool
    max_loras: int
    max_lora_rank: int
    loras: _containers.RepeatedCompositeFieldContainer[LoRAInfo]
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., model_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_usable_blocks: _Optional[int] = ..., num_held_transfers: _Optional[int] = ..., requests_total: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., cached_prompt_tokens_total: _Optional[int] = ..., kv_sent_blocks: _Optional[int] = ..., kv_sent_bytes: _Optional[int] = ..., kv_received_blocks: _Optional[int] = ..., kv_received_bytes: _Optional[int] = ..., kv_loaded_tokens: _Optional[int] = ..., kv_pull_failures: _Optional[int] = ..., transfers_expired: _Optional[int] = ..., cached_block_hashes: _Optional[_Iterable[bytes]] = ..., num_preemptions: _Optional[int] = ..., cached_prompt_tokens_local: _Optional[int] = ..., cached_prompt_tokens_store: _Optional[int] = ..., cached_prompt_tokens_transfer: _Optional[int] = ..., kv_store_bytes_read: _Optional[int] = ..., kv_store_bytes_written: _Optional[int] = ..., spec_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., spec_proposed_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ..., kv_stored: _Optional[_Iterable[bytes]] = ..., kv_removed: _Optional[_Iterable[bytes]] = ..., kv_events_epoch: _Optional[int] = ..., kv_events_seq: _Optional[int] = ..., kv_events_reset: _Optional[bool] = ..., lora_enabled: _Optional[bool] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., loras: _Optional[_Iterable[_Union[LoRAInfo, _Mapping]]] = ...) -> None: ...
