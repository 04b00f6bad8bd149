"""Plain-Python views of everything that crosses the wire.

The coordinator and the workers speak in these types; only `gradserver.common.codec` converts them
to and from protobuf. A `TensorKey` names one reduction (one tensor of one step); a key's `slot`
(kind and index, without the step) is what successive steps of training reuse.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from .components import NonBlockComponent


class KeyKind(enum.Enum):
    BLOCK = "block"
    NON_BLOCK = "non_block"
    WHOLE_MODEL = "whole_model"
    COLLECTIVE = "collective"


class ReduceOp(enum.IntEnum):
    """How a collective key combines contributions; values are those of the proto's ReduceOp."""

    AVG = 0
    SUM = 1


class CollectiveKind(enum.IntEnum):
    """What a collective key does with the contributions; values are those of the proto's
    CollectiveKind (docs/PROTOCOL.md, "Native collectives")."""

    REDUCE = 0
    ALL_GATHER = 1
    BROADCAST = 2
    REDUCE_SCATTER = 3
    ALL_TO_ALL = 4


class DType(enum.IntEnum):
    """Wire dtypes; values are those of the proto's DType enum. BYTES: raw bytes of any tensor
    dtype, never reduced (only the byte-moving collective kinds carry it). INT8_BLOCK64,
    INT4_BLOCK64: block-quantized records (common/quantized_wire.py)."""

    UNSPECIFIED = 0
    FLOAT32 = 1
    BFLOAT16 = 2
    FLOAT16 = 3
    BYTES = 4
    INT8_BLOCK64 = 5
    INT4_BLOCK64 = 6


# The block-quantized dtypes (common/quantized_wire.py): records of a float32 scale and 64 codes,
# carried as 4-byte words; summed by the coordinator (REDUCE and the training keys), never by a
# host group or into a REDUCE_SCATTER's parts.
QUANTIZED_DTYPES = frozenset({DType.INT8_BLOCK64, DType.INT4_BLOCK64})
# The dtypes a reduction (REDUCE, REDUCE_SCATTER and the training keys) accepts.
ALLOWED_DTYPES = frozenset({DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16}) | QUANTIZED_DTYPES
ITEM_SIZE = {
    DType.FLOAT32: 4,
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.BYTES: 1,
    DType.INT8_BLOCK64: 4,
    DType.INT4_BLOCK64: 4,
}
# The collective kinds that move bytes unreduced, and so carry DType.BYTES (and only it).
BYTE_KINDS = frozenset({CollectiveKind.ALL_GATHER, CollectiveKind.BROADCAST, CollectiveKind.ALL_TO_ALL})


@dataclasses.dataclass(frozen=True)
class TensorKey:
    """One reduction. `num_blocks` travels with block keys but is not part of the identity."""

    step: int
    kind: KeyKind
    index: int = 0
    num_blocks: int = dataclasses.field(default=0, compare=False)
    # Collective keys only; like num_blocks, checked across workers but not part of the identity.
    op: ReduceOp = dataclasses.field(default=ReduceOp.AVG, compare=False)
    # Collective keys only: NaN/Inf in, or a float32 overflow, give NaN/Inf out (torch's
    # semantics) instead of failing the step.
    propagate_non_finite: bool = dataclasses.field(default=False, compare=False)
    # Collective keys only, like `op`: what the operation does, the broadcast root, and the
    # all-to-all byte counts this worker sends to each rank.
    collective_kind: CollectiveKind = dataclasses.field(default=CollectiveKind.REDUCE, compare=False)
    root: int = dataclasses.field(default=0, compare=False)
    split_bytes: tuple[int, ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def block(cls, step: int, block_idx: int, num_blocks: int) -> TensorKey:
        return cls(step, KeyKind.BLOCK, block_idx, num_blocks)

    @classmethod
    def non_block(cls, step: int, component: NonBlockComponent) -> TensorKey:
        return cls(step, KeyKind.NON_BLOCK, int(component))

    @classmethod
    def whole_model(cls, step: int) -> TensorKey:
        return cls(step, KeyKind.WHOLE_MODEL, 0)

    @classmethod
    def collective(
        cls,
        sequence: int,
        group: int,
        op: ReduceOp = ReduceOp.AVG,
        *,
        propagate_non_finite: bool = False,
        kind: CollectiveKind = CollectiveKind.REDUCE,
        root: int = 0,
        split_bytes: tuple[int, ...] = (),
    ) -> TensorKey:
        """Operation `sequence` of process group `group`: the sequence number is the step."""
        return cls(
            sequence,
            KeyKind.COLLECTIVE,
            group,
            op=op,
            propagate_non_finite=propagate_non_finite,
            collective_kind=kind,
            root=root,
            split_bytes=tuple(split_bytes),
        )

    @property
    def slot(self) -> tuple[KeyKind, int]:
        return (self.kind, self.index)

    def describe(self) -> str:
        """The key without its step, e.g. 'block 3 of 24' or 'non-block LM_HEAD'."""
        if self.kind is KeyKind.BLOCK:
            return f"block {self.index} of {self.num_blocks}"
        if self.kind is KeyKind.NON_BLOCK:
            try:
                return f"non-block {NonBlockComponent(self.index).name}"
            except ValueError:
                return f"non-block component {self.index}"
        if self.kind is KeyKind.COLLECTIVE:
            kind = self.collective_kind
            if kind is CollectiveKind.REDUCE:
                return f"collective {self.op.name} of group {self.index}"
            if kind is CollectiveKind.REDUCE_SCATTER:
                return f"collective REDUCE_SCATTER {self.op.name} of group {self.index}"
            if kind is CollectiveKind.BROADCAST:
                return f"collective BROADCAST from rank {self.root} of group {self.index}"
            return f"collective {kind.name} of group {self.index}"
        return "whole-model gradient"

    def __str__(self) -> str:
        if self.kind is KeyKind.COLLECTIVE:
            return f"operation {self.step} {self.describe()}"
        return f"step {self.step} {self.describe()}"


@dataclasses.dataclass(frozen=True)
class SampleStats:
    loss: float
    correct: int
    total: int


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    """What every chunk of one contribution repeats; all workers must agree on it per key."""

    dtype: DType
    total_elements: int
    component_sizes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ShmRef:
    """Where a payload lies in a shared-memory arena: its name, byte offset and byte length
    (docs/PROTOCOL.md, "Shared memory"). A chunk names "in" (the sender's input arena) or "inout"
    (there too, and its average is wanted over it); an average names "out" (the output arena) or
    "in" (written over the recipient's own "inout" chunk)."""

    name: str
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class ChunkIn:
    """A piece of one worker's contribution. `data` holds little-endian elements of
    `header.dtype` (float32, or the raw 16 bits of bfloat16 / float16); with `shm` set, `data` is
    empty until the coordinator resolves the reference in the sender's arena."""

    worker_id: int
    key: TensorKey
    header: ChunkHeader
    offset: int
    data: bytes | memoryview
    stats: SampleStats | None = None
    shm: ShmRef | None = None
    # A host group's partial sum: the workers whose contributions `data` sums, in order, the
    # sender among them (docs/PROTOCOL.md "Host groups"); empty: the sender's own contribution.
    covers: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class BarrierIn:
    worker_id: int
    step: int
    name: str
    # A digest of the worker's replicated state at the boundary of `step` (None: a plain barrier).
    digest: int | None = None


@dataclasses.dataclass(frozen=True)
class StartAtIn:
    """A worker that joined a running job takes part from `step`, later than its plan's (at most
    `START_AT_WINDOW` steps later)."""

    worker_id: int
    step: int


# The most steps a StartAt may move a worker's first step past its recovery plan's. Replica groups
# (HSDP) line their shards' plans up on the latest, which differ by a step or two; every step in
# between runs without the worker while it waits for a donor to reach the new step's boundary, so
# a step further on only keeps it out of the job longer (and 2^64-1 would keep it out for good).
START_AT_WINDOW = 16


@dataclasses.dataclass(frozen=True)
class SampleRangeRequestIn:
    worker_id: int
    step: int
    dataset_size: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class HeartbeatIn:
    worker_id: int
    sequence: int


@dataclasses.dataclass(frozen=True)
class LeaveIn:
    reason: str


@dataclasses.dataclass(frozen=True)
class StepFailureIn:
    """A host group member found what fails `step` on its host (a member's non-finite value, a
    host sum beyond its dtype): the coordinator fails the step for everyone, naming `culprit`.
    `worker_id` is the sender: the stream it came on says (it does not travel)."""

    worker_id: int
    code: int
    message: str
    step: int
    key: TensorKey | None = None
    culprit: int | None = None


@dataclasses.dataclass(frozen=True)
class PeerPiece:
    """A point-to-point message, or one piece of it (docs/PROTOCOL.md "Point-to-point"): bytes
    [offset, offset + len(data)) of message `sequence` (the sender's number) of `total_bytes`.
    From a worker, `peer` is the receiver; from the coordinator, the sender. In an error that
    refuses it, `data` is empty."""

    peer: int
    tag: int
    sequence: int
    total_bytes: int
    offset: int
    data: bytes | memoryview = b""


WorkerEvent = (
    ChunkIn | BarrierIn | SampleRangeRequestIn | HeartbeatIn | LeaveIn | StepFailureIn | PeerPiece | StartAtIn
)


@dataclasses.dataclass(frozen=True)
class AveragedChunkOut:
    key: TensorKey
    header: ChunkHeader
    offset: int
    data: bytes | memoryview
    num_contributors: int
    stats: SampleStats | None = None
    # Set for a shared-memory recipient: the average lies there and `data` is empty.
    shm: ShmRef | None = None


@dataclasses.dataclass(frozen=True)
class BarrierReleaseOut:
    step: int
    name: str


@dataclasses.dataclass(frozen=True)
class SampleRange:
    start: int
    stop: int
    stride: int

    def indices(self) -> range:
        return range(self.start, self.stop, self.stride)


@dataclasses.dataclass(frozen=True)
class SampleRangeAssignmentOut:
    step: int
    worker_id: int
    ranges: tuple[SampleRange, ...]


@dataclasses.dataclass(frozen=True)
class HeartbeatAckOut:
    sequence: int


@dataclasses.dataclass(frozen=True)
class ShutdownOut:
    reason: str


@dataclasses.dataclass(frozen=True)
class ErrorOut:
    """An error inside the stream. Exactly what it concerns: a key, a barrier, a sample-range request,
    a point-to-point message, a later first step (`StartAtIn`), or (all of them unset) the whole
    step."""

    code: int
    message: str
    step: int
    key: TensorKey | None = None
    culprit_worker_id: int | None = None
    barrier_name: str | None = None
    sample_range_step: int | None = None
    step_failed: bool = False
    # A refused point-to-point message (its data left out).
    peer_message: PeerPiece | None = None
    # A refused later first step, as the worker sent it.
    start_at: StartAtIn | None = None


@dataclasses.dataclass(frozen=True)
class MemberLeftOut:
    """A member of the job left or was lost: the recipient's host group (if it is in it) stops
    summing on its host, and point-to-point messages to and from it fail. `aborts`: the job runs
    with --on-worker-loss abort, so every operation in flight fails."""

    worker_id: int
    reason: str
    aborts: bool = False


@dataclasses.dataclass(frozen=True)
class MemberJoinedOut:
    """A worker took the place of one that left: point-to-point messages with it are relayed,
    and it takes part from `first_step`."""

    worker_id: int
    first_step: int = 0


@dataclasses.dataclass(frozen=True)
class PeerDeliveredOut:
    """The receiver `peer`'s stream took message `sequence` up to byte `upto` (one notice per
    piece): at the message's size, the send is done."""

    peer: int
    sequence: int
    upto: int


ServerEvent = (
    AveragedChunkOut
    | BarrierReleaseOut
    | SampleRangeAssignmentOut
    | HeartbeatAckOut
    | ShutdownOut
    | ErrorOut
    | MemberLeftOut
    | PeerPiece
    | PeerDeliveredOut
    | MemberJoinedOut
)


@dataclasses.dataclass(frozen=True)
class JoinRequestIn:
    node_id: str
    gpu_count: int
    device_type: str
    protocol_version: int
    committed_step: int | None = None
    fingerprint: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The worker id asked for (a torch rank); None: the lowest free one.
    rank: int | None = None
    # Partitioned coordinators: the partition index the joiner believes it reaches (partitions 1..K-1).
    partition_index: int | None = None
    # The worker will send through shared memory when offered (the job's chunk size depends on it).
    shared_memory: bool = False
    # Bytes per second the worker's link to the coordinator carried in a `Probe` before joining;
    # 0: unknown.
    link_bytes_per_s: int = 0
    # What the worker sends gradients as (sizes its chunks on a link: 16 bits carry twice the elements).
    wire_dtype: DType = DType.FLOAT32
    # Partitions 1..K-1: the chunk size partition 0 gave this worker; 0: none.
    job_chunk_bytes: int = 0
    # What the worker shares a host with (machine, network namespace, user; "": it cannot sum
    # with others on its host), and for partitions 1..K-1 the host group partition 0 gave it.
    host_id: str = ""
    job_host_group: tuple[int, ...] = ()
    # What the worker shares memory with for point-to-point messages ("": nothing).
    peer_host_id: str = ""


@dataclasses.dataclass(frozen=True)
class JoinAccepted:
    """The coordinator's answer to Join: identity, session and the limits every worker obeys."""

    worker_id: int
    total_workers: int
    session_id: int
    member_token: int
    protocol_version: int
    chunk_bytes: int
    max_message_bytes: int
    max_tensor_elements: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    step_timeout_s: float
    max_steps: int
    resume_step: int | None = None
    local_workers: int = 1
    # Partitioned coordinators: every partition's address in partition order (empty: one coordinator), and
    # the answering partition's index in it.
    partition_map: tuple[str, ...] = ()
    partition_index: int = 0
    # Same-host fast path: the coordinator's Unix socket and its nonce ("" and b"" when off).
    shm_socket: str = ""
    shm_nonce: bytes = b""
    # Host groups: this worker's group in order (empty: none) and the key naming its shared memory.
    host_group: tuple[int, ...] = ()
    host_key: bytes = b""
    # Point-to-point: the members sharing this worker's peer_host_id (itself included, in order)
    # and the key naming that host's mailboxes (empty: none).
    host_peers: tuple[int, ...] = ()
    peer_key: bytes = b""
    # Live recovery: joined a running job, this worker takes part from `recovery_step` and first
    # takes the state at that step's boundary from one of `donors`, asked in order (None: it
    # joined as the job began, or rejoined a restarted coordinator).
    recovery_step: int | None = None
    donors: tuple[int, ...] = ()
