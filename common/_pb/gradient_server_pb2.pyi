from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockComponent(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_COMPONENT_W_Q: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_W_K: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_W_V: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_W_O: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_GATE: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_UP: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_DOWN: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_INPUT_NORM: _ClassVar[BlockComponent]
    BLOCK_COMPONENT_POST_ATTN_NORM: _ClassVar[BlockComponent]

class NonBlockComponent(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NON_BLOCK_COMPONENT_LM_HEAD: _ClassVar[NonBlockComponent]
    NON_BLOCK_COMPONENT_FINAL_NORM: _ClassVar[NonBlockComponent]
    NON_BLOCK_COMPONENT_EMBEDDING: _ClassVar[NonBlockComponent]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BYTES: _ClassVar[DType]
    DTYPE_INT8_BLOCK64: _ClassVar[DType]
    DTYPE_INT4_BLOCK64: _ClassVar[DType]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_OP_AVG: _ClassVar[ReduceOp]
    REDUCE_OP_SUM: _ClassVar[ReduceOp]

class CollectiveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COLLECTIVE_KIND_REDUCE: _ClassVar[CollectiveKind]
    COLLECTIVE_KIND_ALL_GATHER: _ClassVar[CollectiveKind]
    COLLECTIVE_KIND_BROADCAST: _ClassVar[CollectiveKind]
    COLLECTIVE_KIND_REDUCE_SCATTER: _ClassVar[CollectiveKind]
    COLLECTIVE_KIND_ALL_TO_ALL: _ClassVar[CollectiveKind]
BLOCK_COMPONENT_W_Q: BlockComponent
BLOCK_COMPONENT_W_K: BlockComponent
BLOCK_COMPONENT_W_V: BlockComponent
BLOCK_COMPONENT_W_O: BlockComponent
BLOCK_COMPONENT_GATE: BlockComponent
BLOCK_COMPONENT_UP: BlockComponent
BLOCK_COMPONENT_DOWN: BlockComponent
BLOCK_COMPONENT_INPUT_NORM: BlockComponent
BLOCK_COMPONENT_POST_ATTN_NORM: BlockComponent
NON_BLOCK_COMPONENT_LM_HEAD: NonBlockComponent
NON_BLOCK_COMPONENT_FINAL_NORM: NonBlockComponent
NON_BLOCK_COMPONENT_EMBEDDING: NonBlockComponent
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_BYTES: DType
DTYPE_INT8_BLOCK64: DType
DTYPE_INT4_BLOCK64: DType
REDUCE_OP_AVG: ReduceOp
REDUCE_OP_SUM: ReduceOp
COLLECTIVE_KIND_REDUCE: CollectiveKind
COLLECTIVE_KIND_ALL_GATHER: CollectiveKind
COLLECTIVE_KIND_BROADCAST: CollectiveKind
COLLECTIVE_KIND_REDUCE_SCATTER: CollectiveKind
COLLECTIVE_KIND_ALL_TO_ALL: CollectiveKind

class JoinRequest(_message.Message):
    __slots__ = ("node_id", "gpu_count", "device_type", "protocol_version", "committed_step", "job_fingerprint", "rank", "shared_memory", "link_bytes_per_s", "wire_dtype", "host_id", "peer_host_id", "partition_index", "job_chunk_bytes", "job_host_group")
    class JobFingerprintEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    JOB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_INDEX_FIELD_NUMBER: _ClassVar[int]
    JOB_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOB_HOST_GROUP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    gpu_count: int
    device_type: str
    protocol_version: int
    committed_step: int
    job_fingerprint: _containers.ScalarMap[str, str]
    rank: int
    shared_memory: bool
    link_bytes_per_s: int
    wire_dtype: DType
    host_id: str
    peer_host_id: str
    partition_index: int
    job_chunk_bytes: int
    job_host_group: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., gpu_count: _Optional[int] = ..., device_type: _Optional[str] = ..., protocol_version: _Optional[int] = ..., committed_step: _Optional[int] = ..., job_fingerprint: _Optional[_Mapping[str, str]] = ..., rank: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., link_bytes_per_s: _Optional[int] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., host_id: _Optional[str] = ..., peer_host_id: _Optional[str] = ..., partition_index: _Optional[int] = ..., job_chunk_bytes: _Optional[int] = ..., job_host_group: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkProbe(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class LinkProbeAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("worker_id", "total_workers", "session_id", "member_token", "protocol_version", "chunk_bytes", "max_message_bytes", "max_tensor_elements", "heartbeat_interval_ms", "heartbeat_timeout_ms", "step_timeout_ms", "max_steps", "resume_step", "local_workers", "partition_map", "partition_index", "shm_socket", "shm_nonce", "host_group", "host_key", "host_peers", "peer_key", "recovery")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_MAP_FIELD_NUMBER: _ClassVar[int]
    PARTITION_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    HOST_GROUP_FIELD_NUMBER: _ClassVar[int]
    HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    HOST_PEERS_FIELD_NUMBER: _ClassVar[int]
    PEER_KEY_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    total_workers: int
    session_id: int
    member_token: int
    protocol_version: int
    chunk_bytes: int
    max_message_bytes: int
    max_tensor_elements: int
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    step_timeout_ms: int
    max_steps: int
    resume_step: int
    local_workers: int
    partition_map: _containers.RepeatedScalarFieldContainer[str]
    partition_index: int
    shm_socket: str
    shm_nonce: bytes
    host_group: _containers.RepeatedScalarFieldContainer[int]
    host_key: bytes
    host_peers: _containers.RepeatedScalarFieldContainer[int]
    peer_key: bytes
    recovery: RecoveryPlan
    def __init__(self, worker_id: _Optional[int] = ..., total_workers: _Optional[int] = ..., session_id: _Optional[int] = ..., member_token: _Optional[int] = ..., protocol_version: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_tensor_elements: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., step_timeout_ms: _Optional[int] = ..., max_steps: _Optional[int] = ..., resume_step: _Optional[int] = ..., local_workers: _Optional[int] = ..., partition_map: _Optional[_Iterable[str]] = ..., partition_index: _Optional[int] = ..., shm_socket: _Optional[str] = ..., shm_nonce: _Optional[bytes] = ..., host_group: _Optional[_Iterable[int]] = ..., host_key: _Optional[bytes] = ..., host_peers: _Optional[_Iterable[int]] = ..., peer_key: _Optional[bytes] = ..., recovery: _Optional[_Union[RecoveryPlan, _Mapping]] = ...) -> None: ...

class RecoveryPlan(_message.Message):
    __slots__ = ("step", "donors")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DONORS_FIELD_NUMBER: _ClassVar[int]
    step: int
    donors: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., donors: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorKey(_message.Message):
    __slots__ = ("step", "block", "non_block", "whole_model", "collective")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    NON_BLOCK_FIELD_NUMBER: _ClassVar[int]
    WHOLE_MODEL_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    step: int
    block: BlockKey
    non_block: NonBlockComponent
    whole_model: WholeModelKey
    collective: CollectiveKey
    def __init__(self, step: _Optional[int] = ..., block: _Optional[_Union[BlockKey, _Mapping]] = ..., non_block: _Optional[_Union[NonBlockComponent, str]] = ..., whole_model: _Optional[_Union[WholeModelKey, _Mapping]] = ..., collective: _Optional[_Union[CollectiveKey, _Mapping]] = ...) -> None: ...

class BlockKey(_message.Message):
    __slots__ = ("block_idx", "num_blocks")
    BLOCK_IDX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_idx: int
    num_blocks: int
    def __init__(self, block_idx: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class WholeModelKey(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CollectiveKey(_message.Message):
    __slots__ = ("group", "op", "propagate_non_finite", "kind", "root", "split_bytes")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PROPAGATE_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    group: int
    op: ReduceOp
    propagate_non_finite: bool
    kind: CollectiveKind
    root: int
    split_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group: _Optional[int] = ..., op: _Optional[_Union[ReduceOp, str]] = ..., propagate_non_finite: _Optional[bool] = ..., kind: _Optional[_Union[CollectiveKind, str]] = ..., root: _Optional[int] = ..., split_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("name", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class SampleStats(_message.Message):
    __slots__ = ("loss", "correct", "total")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    loss: float
    correct: int
    total: int
    def __init__(self, loss: _Optional[float] = ..., correct: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class GradientChunk(_message.Message):
    __slots__ = ("worker_id", "key", "dtype", "total_elements", "component_sizes", "offset", "data", "shm", "stats", "covers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_SIZES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    COVERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    key: TensorKey
    dtype: DType
    total_elements: int
    component_sizes: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    shm: SharedMemoryRef
    stats: SampleStats
    covers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[int] = ..., key: _Optional[_Union[TensorKey, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ..., total_elements: _Optional[int] = ..., component_sizes: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., stats: _Optional[_Union[SampleStats, _Mapping]] = ..., covers: _Optional[_Iterable[int]] = ...) -> None: ...

class AveragedChunk(_message.Message):
    __slots__ = ("key", "dtype", "total_elements", "component_sizes", "offset", "data", "shm", "num_contributors", "global_loss", "correct", "total")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_SIZES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    key: TensorKey
    dtype: DType
    total_elements: int
    component_sizes: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    shm: SharedMemoryRef
    num_contributors: int
    global_loss: float
    correct: int
    total: int
    def __init__(self, key: _Optional[_Union[TensorKey, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ..., total_elements: _Optional[int] = ..., component_sizes: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ..., num_contributors: _Optional[int] = ..., global_loss: _Optional[float] = ..., correct: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class Barrier(_message.Message):
    __slots__ = ("worker_id", "step", "name", "digest")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    name: str
    digest: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., name: _Optional[str] = ..., digest: _Optional[int] = ...) -> None: ...

class BarrierRelease(_message.Message):
    __slots__ = ("step", "name")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    step: int
    name: str
    def __init__(self, step: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class SampleRangeRequest(_message.Message):
    __slots__ = ("worker_id", "step", "dataset_size", "batch_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATASET_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    dataset_size: int
    batch_size: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., dataset_size: _Optional[int] = ..., batch_size: _Optional[int] = ...) -> None: ...

class SampleRange(_message.Message):
    __slots__ = ("start", "stop", "stride")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    stride: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ..., stride: _Optional[int] = ...) -> None: ...

class SampleRangeAssignment(_message.Message):
    __slots__ = ("step", "worker_id", "ranges")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    step: int
    worker_id: int
    ranges: _containers.RepeatedCompositeFieldContainer[SampleRange]
    def __init__(self, step: _Optional[int] = ..., worker_id: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[SampleRange, _Mapping]]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_id", "sequence")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    sequence: int
    def __init__(self, worker_id: _Optional[int] = ..., sequence: _Optional[int] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    def __init__(self, sequence: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "step", "key", "culprit_worker_id", "barrier", "sample_range_request", "peer_message", "start_at", "step_failed")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RANGE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PEER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    START_AT_FIELD_NUMBER: _ClassVar[int]
    STEP_FAILED_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    step: int
    key: TensorKey
    culprit_worker_id: int
    barrier: Barrier
    sample_range_request: SampleRangeRequest
    peer_message: PeerMessage
    start_at: StartAt
    step_failed: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., step: _Optional[int] = ..., key: _Optional[_Union[TensorKey, _Mapping]] = ..., culprit_worker_id: _Optional[int] = ..., barrier: _Optional[_Union[Barrier, _Mapping]] = ..., sample_range_request: _Optional[_Union[SampleRangeRequest, _Mapping]] = ..., peer_message: _Optional[_Union[PeerMessage, _Mapping]] = ..., start_at: _Optional[_Union[StartAt, _Mapping]] = ..., step_failed: _Optional[bool] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("chunk", "barrier", "sample_range_request", "heartbeat", "shutdown", "step_failure", "peer_message", "start_at")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    BARRIER_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RANGE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    STEP_FAILURE_FIELD_NUMBER: _ClassVar[int]
    PEER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    START_AT_FIELD_NUMBER: _ClassVar[int]
    chunk: GradientChunk
    barrier: Barrier
    sample_range_request: SampleRangeRequest
    heartbeat: Heartbeat
    shutdown: Shutdown
    step_failure: Error
    peer_message: PeerMessage
    start_at: StartAt
    def __init__(self, chunk: _Optional[_Union[GradientChunk, _Mapping]] = ..., barrier: _Optional[_Union[Barrier, _Mapping]] = ..., sample_range_request: _Optional[_Union[SampleRangeRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., step_failure: _Optional[_Union[Error, _Mapping]] = ..., peer_message: _Optional[_Union[PeerMessage, _Mapping]] = ..., start_at: _Optional[_Union[StartAt, _Mapping]] = ...) -> None: ...

class StartAt(_message.Message):
    __slots__ = ("worker_id", "step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class PeerMessage(_message.Message):
    __slots__ = ("peer", "tag", "sequence", "total_bytes", "offset", "data")
    PEER_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    peer: int
    tag: int
    sequence: int
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, peer: _Optional[int] = ..., tag: _Optional[int] = ..., sequence: _Optional[int] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PeerDelivered(_message.Message):
    __slots__ = ("peer", "sequence", "bytes")
    PEER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    peer: int
    sequence: int
    bytes: int
    def __init__(self, peer: _Optional[int] = ..., sequence: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class MemberLeft(_message.Message):
    __slots__ = ("worker_id", "reason", "aborts")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    reason: str
    aborts: bool
    def __init__(self, worker_id: _Optional[int] = ..., reason: _Optional[str] = ..., aborts: _Optional[bool] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("averaged_chunk", "barrier_release", "sample_range_assignment", "heartbeat_ack", "shutdown", "error", "member_left", "peer_message", "peer_delivered", "member_joined")
    AVERAGED_CHUNK_FIELD_NUMBER: _ClassVar[int]
    BARRIER_RELEASE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RANGE_ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMBER_LEFT_FIELD_NUMBER: _ClassVar[int]
    PEER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PEER_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    MEMBER_JOINED_FIELD_NUMBER: _ClassVar[int]
    averaged_chunk: AveragedChunk
    barrier_release: BarrierRelease
    sample_range_assignment: SampleRangeAssignment
    heartbeat_ack: HeartbeatAck
    shutdown: Shutdown
    error: Error
    member_left: MemberLeft
    peer_message: PeerMessage
    peer_delivered: PeerDelivered
    member_joined: MemberJoined
    def __init__(self, averaged_chunk: _Optional[_Union[AveragedChunk, _Mapping]] = ..., barrier_release: _Optional[_Union[BarrierRelease, _Mapping]] = ..., sample_range_assignment: _Optional[_Union[SampleRangeAssignment, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., member_left: _Optional[_Union[MemberLeft, _Mapping]] = ..., peer_message: _Optional[_Union[PeerMessage, _Mapping]] = ..., peer_delivered: _Optional[_Union[PeerDelivered, _Mapping]] = ..., member_joined: _Optional[_Union[MemberJoined, _Mapping]] = ...) -> None: ...

class MemberJoined(_message.Message):
    __slots__ = ("worker_id", "first_step")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    first_step: int
    def __init__(self, worker_id: _Optional[int] = ..., first_step: _Optional[int] = ...) -> None: ...

class PartitionNotice(_message.Message):
    __slots__ = ("from_partition", "partition_count", "step", "code", "message", "culprit_worker_id", "worker_lost")
    FROM_PARTITION_FIELD_NUMBER: _ClassVar[int]
    PARTITION_COUNT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_LOST_FIELD_NUMBER: _ClassVar[int]
    from_partition: int
    partition_count: int
    step: int
    code: int
    message: str
    culprit_worker_id: int
    worker_lost: bool
    def __init__(self, from_partition: _Optional[int] = ..., partition_count: _Optional[int] = ..., step: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., culprit_worker_id: _Optional[int] = ..., worker_lost: _Optional[bool] = ...) -> None: ...

class PartitionNoticeAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
