"""The wire codec: protobuf bytes to and from the plain types of `gradserver.common.messages`.

This is the only module that touches the generated protobuf classes; the hand-written wire
reader and writer that keep multi-MiB payloads out of message objects are in `_wire`. Decoding validates
everything that can be judged from one message alone (well-formed bytes, known enums, allowed
dtype, sizes within limits, chunk offsets and lengths) and raises an error of the project's
hierarchy naming the worker, step and key; checks that need other workers' messages live in the
coordinator's reduction table.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TypeVar

from google.protobuf.message import DecodeError

from ._pb import gradient_server_pb2 as pb
from ._wire import split_payload, with_payload
from .chunking import check_chunk_length
from .components import BLOCK_GRAD_COMPONENTS, NonBlockComponent
from .errors import (
    GradServerError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    Status,
)
from .messages import (
    ALLOWED_DTYPES,
    BYTE_KINDS,
    ITEM_SIZE,
    AveragedChunkOut,
    BarrierIn,
    BarrierReleaseOut,
    ChunkHeader,
    ChunkIn,
    CollectiveKind,
    DType,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    JoinAccepted,
    JoinRequestIn,
    KeyKind,
    LeaveIn,
    MemberJoinedOut,
    MemberLeftOut,
    PeerDeliveredOut,
    PeerPiece,
    ReduceOp,
    SampleRange,
    SampleRangeAssignmentOut,
    SampleRangeRequestIn,
    SampleStats,
    ServerEvent,
    ShmRef,
    ShutdownOut,
    StartAtIn,
    StepFailureIn,
    TensorKey,
    WorkerEvent,
)

PROTOCOL_VERSION = 1
MAX_NAME_LENGTH = 256
MAX_FINGERPRINT_FIELDS = 64
# The largest link probe a coordinator answers (workers send 1 MiB).
MAX_PROBE_BYTES = 4 * 2**20
# The most workers one host group (and so one partial sum) may cover.
MAX_HOST_GROUP = 1024


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """Bounds a decoder enforces before it trusts any size in a message."""

    chunk_elements: int
    max_tensor_elements: int
    max_blocks: int = 65536
    # The job's worker count when the decoder knows it (0: unknown): a collective's root and
    # split_bytes are then checked against it here, else only by the reduction table.
    world_size: int = 0


# Field numbers of the payload-carrying fields, read from the descriptors so they cannot drift.
_WORKER_CHUNK_FIELD = pb.WorkerMessage.DESCRIPTOR.fields_by_name["chunk"].number
_CHUNK_DATA_FIELD = pb.GradientChunk.DESCRIPTOR.fields_by_name["data"].number
_SERVER_AVERAGED_FIELD = pb.ServerMessage.DESCRIPTOR.fields_by_name["averaged_chunk"].number
_AVERAGED_DATA_FIELD = pb.AveragedChunk.DESCRIPTOR.fields_by_name["data"].number
_WORKER_PEER_FIELD = pb.WorkerMessage.DESCRIPTOR.fields_by_name["peer_message"].number
_SERVER_PEER_FIELD = pb.ServerMessage.DESCRIPTOR.fields_by_name["peer_message"].number
_PEER_DATA_FIELD = pb.PeerMessage.DESCRIPTOR.fields_by_name["data"].number
# The largest point-to-point message, in bytes per element of the largest tensor a job allows.
PEER_BYTES_PER_ELEMENT = 8


# --- keys -------------------------------------------------------------------------------------


def _key_to_pb(key: TensorKey) -> pb.TensorKey:
    if key.kind is KeyKind.BLOCK:
        return pb.TensorKey(step=key.step, block=pb.BlockKey(block_idx=key.index, num_blocks=key.num_blocks))
    if key.kind is KeyKind.NON_BLOCK:
        return pb.TensorKey(step=key.step, non_block=key.index)  # type: ignore[arg-type]
    if key.kind is KeyKind.COLLECTIVE:
        return pb.TensorKey(
            step=key.step,
            collective=pb.CollectiveKey(
                group=key.index,
                op=int(key.op),  # type: ignore[arg-type]
                propagate_non_finite=key.propagate_non_finite,
                kind=int(key.collective_kind),  # type: ignore[arg-type]
                root=key.root,
                split_bytes=key.split_bytes,
            ),
        )
    return pb.TensorKey(step=key.step, whole_model=pb.WholeModelKey())


def _key_from_pb(msg: pb.TensorKey, *, who: str, limits: WireLimits | None) -> TensorKey:
    kind = msg.WhichOneof("kind")
    if kind == "block":
        idx, num = msg.block.block_idx, msg.block.num_blocks
        if num == 0 or idx >= num:
            raise InvalidArgumentError(
                f"{who}, step {msg.step}: block_idx {idx} is out of range for num_blocks {num}",
                step=msg.step,
            )
        if limits is not None and num > limits.max_blocks:
            raise InvalidArgumentError(
                f"{who}, step {msg.step}: num_blocks {num} exceeds the limit of {limits.max_blocks}",
                step=msg.step,
            )
        return TensorKey.block(msg.step, idx, num)
    if kind == "non_block":
        try:
            component = NonBlockComponent(msg.non_block)
        except ValueError:
            names = ", ".join(f"{c.name}={c.value}" for c in NonBlockComponent)
            raise InvalidArgumentError(
                f"{who}, step {msg.step}: unknown non-block component {msg.non_block} (known: {names})",
                step=msg.step,
            ) from None
        return TensorKey.non_block(msg.step, component)
    if kind == "whole_model":
        return TensorKey.whole_model(msg.step)
    if kind == "collective":
        try:
            op = ReduceOp(msg.collective.op)
        except ValueError:
            names = ", ".join(f"{o.name}={o.value}" for o in ReduceOp)
            raise InvalidArgumentError(
                f"{who}, operation {msg.step} of group {msg.collective.group}: unknown reduce op "
                f"{msg.collective.op} (known: {names})",
                step=msg.step,
            ) from None
        return _collective_from_pb(msg.step, msg.collective, op, who=who, limits=limits)
    raise InvalidArgumentError(f"{who}, step {msg.step}: key names no tensor kind", step=msg.step)


def _collective_from_pb(
    step: int, msg: pb.CollectiveKey, op: ReduceOp, *, who: str, limits: WireLimits | None
) -> TensorKey:
    """A collective key; refuses an unknown kind, a root or split_bytes where the kind has none,
    and (when the world size is known) a root or split_bytes that does not fit the world."""
    context = f"{who}, operation {step} of group {msg.group}"
    try:
        kind = CollectiveKind(msg.kind)
    except ValueError:
        names = ", ".join(f"{k.name}={k.value}" for k in CollectiveKind)
        raise InvalidArgumentError(
            f"{context}: unknown collective kind {msg.kind} (known: {names})", step=step
        ) from None
    splits = tuple(msg.split_bytes)
    if msg.root and kind is not CollectiveKind.BROADCAST:
        raise InvalidArgumentError(
            f"{context}: root {msg.root} is only for BROADCAST, not {kind.name}", step=step
        )
    if splits and kind not in (CollectiveKind.ALL_TO_ALL, CollectiveKind.REDUCE_SCATTER):
        raise InvalidArgumentError(
            f"{context}: split_bytes are only for ALL_TO_ALL and REDUCE_SCATTER, not {kind.name}", step=step
        )
    if kind is CollectiveKind.REDUCE_SCATTER and any(b % 4 for b in splits):
        raise InvalidArgumentError(
            f"{context}: REDUCE_SCATTER split_bytes {list(splits)} must be float32 bytes (multiples of 4)",
            step=step,
        )
    world = limits.world_size if limits is not None else 0
    if world and kind is CollectiveKind.BROADCAST and msg.root >= world:
        raise InvalidArgumentError(
            f"{context}: BROADCAST root {msg.root} is out of range for {world} workers", step=step
        )
    if world and splits and len(splits) != world:
        raise InvalidArgumentError(
            f"{context}: {kind.name} has {len(splits)} split_bytes, one per worker needs {world}",
            step=step,
        )
    if world and kind is CollectiveKind.ALL_TO_ALL and not splits:
        raise InvalidArgumentError(
            f"{context}: ALL_TO_ALL has 0 split_bytes, one per worker needs {world}", step=step
        )
    return TensorKey.collective(
        step,
        msg.group,
        op,
        propagate_non_finite=msg.propagate_non_finite,
        kind=kind,
        root=msg.root,
        split_bytes=splits,
    )


def chunk_key(raw: bytes) -> TensorKey | None:
    """The key of the chunk in a serialised WorkerMessage, or None when `raw` holds no chunk or no
    readable key: for naming a chunk that `decode_worker_message` refused after its key was read."""
    try:
        msg = pb.WorkerMessage.FromString(raw)
        if msg.WhichOneof("kind") != "chunk":
            return None
        return _key_from_pb(msg.chunk.key, who="refused chunk", limits=None)
    except (DecodeError, GradServerError, ValueError):
        return None


def _dtype_from_pb(value: int, *, context: str, key: TensorKey | None = None) -> DType:
    """The dtype of a chunk of `key`: BYTES for the byte-moving collective kinds and only for
    them, a float wire dtype for every reduction."""
    try:
        dtype = DType(value)
    except ValueError:
        raise InvalidArgumentError(f"{context}: unknown dtype {value}") from None
    if key is not None and key.kind is KeyKind.COLLECTIVE and key.collective_kind in BYTE_KINDS:
        if dtype is not DType.BYTES:
            raise InvalidArgumentError(
                f"{context}: {key.collective_kind.name} moves raw bytes: dtype must be BYTES, "
                f"got {dtype.name}"
            )
        return dtype
    if dtype is DType.BYTES:
        raise InvalidArgumentError(
            f"{context}: dtype BYTES is never reduced; only ALL_GATHER, BROADCAST and ALL_TO_ALL carry it"
        )
    if dtype not in ALLOWED_DTYPES:
        allowed = ", ".join(d.name for d in sorted(ALLOWED_DTYPES))
        state = "missing" if dtype is DType.UNSPECIFIED else f"{dtype.name} is reserved"
        raise InvalidArgumentError(f"{context}: dtype {state}; allowed: {allowed}")
    return dtype


# --- join -------------------------------------------------------------------------------------


def encode_join_request(request: JoinRequestIn) -> bytes:
    msg = pb.JoinRequest(
        node_id=request.node_id,
        gpu_count=request.gpu_count,
        device_type=request.device_type,
        protocol_version=request.protocol_version,
        shared_memory=request.shared_memory,
        link_bytes_per_s=request.link_bytes_per_s,
        job_chunk_bytes=request.job_chunk_bytes,
        wire_dtype=int(request.wire_dtype),  # type: ignore[arg-type]
        host_id=request.host_id,
        job_host_group=request.job_host_group,
        peer_host_id=request.peer_host_id,
    )
    if request.committed_step is not None:
        msg.committed_step = request.committed_step
    msg.job_fingerprint.update(request.fingerprint)
    if request.rank is not None:
        msg.rank = request.rank
    if request.partition_index is not None:
        msg.partition_index = request.partition_index
    return msg.SerializeToString()


def decode_join_request(raw: bytes) -> JoinRequestIn:
    msg = _parse(pb.JoinRequest, raw, "JoinRequest")
    if len(msg.node_id) > MAX_NAME_LENGTH or len(msg.device_type) > MAX_NAME_LENGTH:
        raise InvalidArgumentError(
            f"JoinRequest: node_id and device_type are limited to {MAX_NAME_LENGTH} characters"
        )
    committed = msg.committed_step if msg.HasField("committed_step") else None
    fingerprint = dict(msg.job_fingerprint)
    if len(fingerprint) > MAX_FINGERPRINT_FIELDS or any(
        len(k) > MAX_NAME_LENGTH or len(v) > MAX_NAME_LENGTH for k, v in fingerprint.items()
    ):
        raise InvalidArgumentError(
            f"JoinRequest from node {msg.node_id!r}: job_fingerprint is limited to "
            f"{MAX_FINGERPRINT_FIELDS} fields of at most {MAX_NAME_LENGTH} characters each"
        )
    rank = msg.rank if msg.HasField("rank") else None
    partition_index = msg.partition_index if msg.HasField("partition_index") else None
    if (
        len(msg.host_id) > MAX_NAME_LENGTH
        or len(msg.peer_host_id) > MAX_NAME_LENGTH
        or len(msg.job_host_group) > MAX_HOST_GROUP
    ):
        raise InvalidArgumentError(
            f"JoinRequest from node {msg.node_id!r}: host_id and peer_host_id are limited to "
            f"{MAX_NAME_LENGTH} characters and job_host_group to {MAX_HOST_GROUP} workers"
        )
    return JoinRequestIn(
        msg.node_id,
        msg.gpu_count,
        msg.device_type,
        msg.protocol_version,
        committed,
        fingerprint,
        rank,
        partition_index,
        msg.shared_memory,
        link_bytes_per_s=msg.link_bytes_per_s,
        job_chunk_bytes=msg.job_chunk_bytes,
        wire_dtype=_join_wire_dtype(msg),
        host_id=msg.host_id,
        job_host_group=tuple(msg.job_host_group),
        peer_host_id=msg.peer_host_id,
    )


def _join_wire_dtype(msg: pb.JoinRequest) -> DType:
    """The joiner's wire dtype: unset (older workers) is float32; else a reduction dtype, checked
    as a chunk's is."""
    if msg.wire_dtype == pb.DTYPE_UNSPECIFIED:
        return DType.FLOAT32
    return _dtype_from_pb(msg.wire_dtype, context=f"JoinRequest from node {msg.node_id!r}: wire_dtype")


def encode_link_probe(payload_bytes: int) -> bytes:
    """A link probe carrying `payload_bytes` bytes (zeros: only their size is timed)."""
    return pb.LinkProbe(payload=bytes(payload_bytes)).SerializeToString()


def decode_link_probe(raw: bytes) -> int:
    """The probe's payload size; refuses one above MAX_PROBE_BYTES (a probe needs far less)."""
    size = len(_parse(pb.LinkProbe, raw, "LinkProbe").payload)
    if size > MAX_PROBE_BYTES:
        raise InvalidArgumentError(f"LinkProbe: {size} payload bytes exceed the limit of {MAX_PROBE_BYTES}")
    return size


def encode_join_accepted(accepted: JoinAccepted) -> bytes:
    return pb.JoinResponse(
        worker_id=accepted.worker_id,
        total_workers=accepted.total_workers,
        session_id=accepted.session_id,
        member_token=accepted.member_token,
        protocol_version=accepted.protocol_version,
        chunk_bytes=accepted.chunk_bytes,
        max_message_bytes=accepted.max_message_bytes,
        max_tensor_elements=accepted.max_tensor_elements,
        heartbeat_interval_ms=round(accepted.heartbeat_interval_s * 1000),
        heartbeat_timeout_ms=round(accepted.heartbeat_timeout_s * 1000),
        step_timeout_ms=round(accepted.step_timeout_s * 1000),
        max_steps=accepted.max_steps,
        resume_step=accepted.resume_step,
        local_workers=accepted.local_workers,
        partition_map=accepted.partition_map,
        partition_index=accepted.partition_index,
        shm_socket=accepted.shm_socket,
        shm_nonce=accepted.shm_nonce,
        host_group=accepted.host_group,
        host_key=accepted.host_key,
        host_peers=accepted.host_peers,
        peer_key=accepted.peer_key,
        recovery=(
            None
            if accepted.recovery_step is None
            else pb.RecoveryPlan(step=accepted.recovery_step, donors=accepted.donors)
        ),
    ).SerializeToString()


def decode_join_accepted(raw: bytes) -> JoinAccepted:
    msg = _parse(pb.JoinResponse, raw, "JoinResponse")
    if msg.protocol_version != PROTOCOL_VERSION:
        raise InternalError(
            f"coordinator speaks protocol version {msg.protocol_version}, this worker {PROTOCOL_VERSION}"
        )
    group, peers = tuple(msg.host_group), tuple(msg.host_peers)
    plan = msg.recovery if msg.HasField("recovery") else None
    donors = tuple(plan.donors) if plan is not None else ()
    if (
        (plan is not None and (msg.worker_id in donors or any(d >= msg.total_workers for d in donors)))
        or msg.chunk_bytes < 4
        or msg.total_workers == 0
        or msg.worker_id >= msg.total_workers
        or (group and (msg.worker_id not in group or not _ascending(group, msg.total_workers)))
        or (peers and (msg.worker_id not in peers or not _ascending(peers, msg.total_workers)))
    ):
        raise InternalError(f"coordinator sent an inconsistent JoinResponse: {msg}")
    return JoinAccepted(
        worker_id=msg.worker_id,
        total_workers=msg.total_workers,
        session_id=msg.session_id,
        member_token=msg.member_token,
        protocol_version=msg.protocol_version,
        chunk_bytes=msg.chunk_bytes,
        max_message_bytes=msg.max_message_bytes,
        max_tensor_elements=msg.max_tensor_elements,
        heartbeat_interval_s=msg.heartbeat_interval_ms / 1000,
        heartbeat_timeout_s=msg.heartbeat_timeout_ms / 1000,
        step_timeout_s=msg.step_timeout_ms / 1000,
        max_steps=msg.max_steps,
        resume_step=msg.resume_step if msg.HasField("resume_step") else None,
        local_workers=max(1, msg.local_workers),
        partition_map=tuple(msg.partition_map),
        partition_index=msg.partition_index,
        shm_socket=msg.shm_socket,
        shm_nonce=msg.shm_nonce,
        host_group=group,
        host_key=msg.host_key,
        host_peers=peers,
        peer_key=msg.peer_key,
        recovery_step=plan.step if plan is not None else None,
        donors=donors,
    )


def _ascending(ids: tuple[int, ...], world: int) -> bool:
    """Whether `ids` are distinct worker ids below `world`, in increasing order."""
    return all(a < b for a, b in itertools.pairwise(ids)) and ids[-1] < world


# --- worker to coordinator ----------------------------------------------------------------------


def encode_worker_event(event: WorkerEvent) -> bytes:
    if isinstance(event, ChunkIn):
        chunk = pb.GradientChunk(
            worker_id=event.worker_id,
            key=_key_to_pb(event.key),
            dtype=int(event.header.dtype),  # type: ignore[arg-type]
            total_elements=event.header.total_elements,
            component_sizes=event.header.component_sizes,
            offset=event.offset,
            covers=event.covers,
        )
        if event.stats is not None:
            chunk.stats.CopyFrom(_stats_to_pb(event.stats))
        if event.shm is not None:
            chunk.shm.CopyFrom(_shm_to_pb(event.shm))
            return pb.WorkerMessage(chunk=chunk).SerializeToString()
        return with_payload(_WORKER_CHUNK_FIELD, chunk.SerializeToString(), _CHUNK_DATA_FIELD, event.data)
    if isinstance(event, PeerPiece):
        return with_payload(_WORKER_PEER_FIELD, _peer_header(event), _PEER_DATA_FIELD, event.data)
    if isinstance(event, BarrierIn):
        msg = pb.WorkerMessage(
            barrier=pb.Barrier(
                worker_id=event.worker_id, step=event.step, name=event.name, digest=event.digest
            )
        )
    elif isinstance(event, SampleRangeRequestIn):
        msg = pb.WorkerMessage(
            sample_range_request=pb.SampleRangeRequest(
                worker_id=event.worker_id,
                step=event.step,
                dataset_size=event.dataset_size,
                batch_size=event.batch_size,
            )
        )
    elif isinstance(event, HeartbeatIn):
        msg = pb.WorkerMessage(heartbeat=pb.Heartbeat(worker_id=event.worker_id, sequence=event.sequence))
    elif isinstance(event, StartAtIn):
        msg = pb.WorkerMessage(start_at=pb.StartAt(worker_id=event.worker_id, step=event.step))
    elif isinstance(event, StepFailureIn):
        failure = pb.Error(code=event.code, message=event.message, step=event.step, step_failed=True)
        if event.key is not None:
            failure.key.CopyFrom(_key_to_pb(event.key))
        if event.culprit is not None:
            failure.culprit_worker_id = event.culprit
        msg = pb.WorkerMessage(step_failure=failure)
    else:
        msg = pb.WorkerMessage(shutdown=pb.Shutdown(reason=event.reason))
    return msg.SerializeToString()


def decode_worker_message(raw: bytes, limits: WireLimits) -> WorkerEvent:
    """Parses and validates one message from a worker; raises naming what is wrong."""
    split = split_payload(raw, _WORKER_CHUNK_FIELD, _CHUNK_DATA_FIELD)
    if split is not None:
        header, data = split
        return _decode_chunk(_parse(pb.GradientChunk, header, "WorkerMessage"), limits, data)
    split = split_payload(raw, _WORKER_PEER_FIELD, _PEER_DATA_FIELD)
    if split is not None:
        header, data = split
        return _decode_peer_piece(_parse(pb.PeerMessage, header, "WorkerMessage"), limits, data)
    msg = _parse(pb.WorkerMessage, raw, "WorkerMessage")
    kind = msg.WhichOneof("kind")
    if kind == "chunk":
        return _decode_chunk(msg.chunk, limits, None)
    if kind == "barrier":
        b = msg.barrier
        if len(b.name) > MAX_NAME_LENGTH:
            raise InvalidArgumentError(
                f"worker {b.worker_id}, step {b.step}: barrier name longer than {MAX_NAME_LENGTH}",
                step=b.step,
                worker_id=b.worker_id,
            )
        return BarrierIn(b.worker_id, b.step, b.name, b.digest if b.HasField("digest") else None)
    if kind == "sample_range_request":
        s = msg.sample_range_request
        if s.dataset_size == 0 or s.batch_size == 0:
            raise InvalidArgumentError(
                f"worker {s.worker_id}, step {s.step}: sample-range request needs a positive dataset_size "
                f"and batch_size, got {s.dataset_size} and {s.batch_size}",
                step=s.step,
                worker_id=s.worker_id,
            )
        return SampleRangeRequestIn(s.worker_id, s.step, s.dataset_size, s.batch_size)
    if kind == "heartbeat":
        return HeartbeatIn(msg.heartbeat.worker_id, msg.heartbeat.sequence)
    if kind == "shutdown":
        return LeaveIn(msg.shutdown.reason[:MAX_NAME_LENGTH])
    if kind == "step_failure":
        return _decode_step_failure(msg.step_failure, limits)
    if kind == "peer_message":
        return _decode_peer_piece(msg.peer_message, limits, None)
    if kind == "start_at":
        return StartAtIn(msg.start_at.worker_id, msg.start_at.step)
    raise InvalidArgumentError("WorkerMessage carries no message kind")


def _peer_header(piece: PeerPiece) -> bytes:
    """A PeerMessage without its data."""
    return pb.PeerMessage(
        peer=piece.peer,
        tag=piece.tag,
        sequence=piece.sequence,
        total_bytes=piece.total_bytes,
        offset=piece.offset,
    ).SerializeToString()


def _decode_peer_piece(msg: pb.PeerMessage, limits: WireLimits, data: memoryview | None) -> PeerPiece:
    """A worker's point-to-point piece, its sizes checked against the job's limits (the receiver
    is checked by the relay, which knows who is live)."""
    payload = memoryview(msg.data) if data is None else data
    what = f"point-to-point message {msg.sequence} for worker {msg.peer} (tag {msg.tag})"
    largest = limits.max_tensor_elements * PEER_BYTES_PER_ELEMENT
    if msg.total_bytes > largest:
        problem = f"holds {msg.total_bytes} bytes, more than the largest message of {largest}"
    elif len(payload) > limits.chunk_elements * 4:
        problem = f"has a piece of {len(payload)} bytes, more than a chunk ({limits.chunk_elements * 4})"
    elif msg.offset + len(payload) > msg.total_bytes or (msg.total_bytes and not len(payload)):
        problem = f"has a piece of {len(payload)} bytes at offset {msg.offset} of {msg.total_bytes}"
    else:
        return PeerPiece(msg.peer, msg.tag, msg.sequence, msg.total_bytes, msg.offset, payload)
    raise InvalidArgumentError(f"{what} {problem}")


_MAX_FAILURE_MESSAGE = 4096


def _decode_step_failure(failure: pb.Error, limits: WireLimits) -> StepFailureIn:
    """A host group member's report of a failed step; its message is cut to a sane length. The
    sender is the stream's member (the message does not name it): `worker_id` is -1 until the
    coordinator sets it."""
    who = "host group member"
    key = _key_from_pb(failure.key, who=who, limits=limits) if failure.HasField("key") else None
    try:
        Status(failure.code)
    except ValueError:
        raise InvalidArgumentError(
            f"{who}, step {failure.step}: step failure with unknown status code {failure.code}",
            step=failure.step,
        ) from None
    return StepFailureIn(
        worker_id=-1,
        code=failure.code,
        message=failure.message[:_MAX_FAILURE_MESSAGE],
        step=failure.step,
        key=key,
        culprit=failure.culprit_worker_id if failure.HasField("culprit_worker_id") else None,
    )


def _decode_chunk(chunk: pb.GradientChunk, limits: WireLimits, data: memoryview | None) -> ChunkIn:
    who = f"worker {chunk.worker_id}"
    key = _key_from_pb(chunk.key, who=who, limits=limits)
    context = f"{who}, {key}"
    try:
        dtype = _dtype_from_pb(chunk.dtype, context=context, key=key)
    except InvalidArgumentError as exc:
        exc.step, exc.key, exc.worker_id = key.step, str(key), chunk.worker_id
        raise
    total = chunk.total_elements
    if total > limits.max_tensor_elements:
        raise ResourceExhaustedError(
            f"{context}: declared {total} elements, above the limit of {limits.max_tensor_elements}",
            step=key.step,
            key=str(key),
            worker_id=chunk.worker_id,
        )
    sizes = tuple(chunk.component_sizes)
    if key.kind is KeyKind.BLOCK:
        if len(sizes) != BLOCK_GRAD_COMPONENTS:
            raise InvalidArgumentError(
                f"{context}: {len(sizes)} component_sizes, a block has {BLOCK_GRAD_COMPONENTS}",
                step=key.step,
                key=str(key),
                worker_id=chunk.worker_id,
            )
        if sum(sizes) != total:
            raise InvalidArgumentError(
                f"{context}: data length {total} != sum(component_sizes) {sum(sizes)}",
                step=key.step,
                key=str(key),
                worker_id=chunk.worker_id,
            )
    elif sizes:
        raise InvalidArgumentError(
            f"{context}: component_sizes are only for block keys",
            step=key.step,
            key=str(key),
            worker_id=chunk.worker_id,
        )
    payload = chunk.WhichOneof("payload")
    shm: ShmRef | None = None
    if data is None and payload == "data":
        data = memoryview(chunk.data)
    elif data is None and payload == "shm":
        try:
            shm = _shm_from_pb(chunk.shm, context=context, allowed=("in", "inout"))
        except InvalidArgumentError as exc:
            exc.step, exc.key, exc.worker_id = key.step, str(key), chunk.worker_id
            raise
        data = memoryview(b"")
    if data is None:
        raise InvalidArgumentError(
            f"{context}: chunk carries no payload",
            step=key.step,
            key=str(key),
            worker_id=chunk.worker_id,
        )
    length = shm.length if shm is not None else len(data)
    _check_collective_chunk(key, chunk.worker_id, total, chunk.offset, length, context=context)
    item_size = ITEM_SIZE[dtype]
    if length % item_size:
        raise InvalidArgumentError(
            f"{context}: {length} payload bytes is not a whole number of {dtype.name.lower()} elements",
            step=key.step,
            key=str(key),
            worker_id=chunk.worker_id,
        )
    if not _header_only(key, chunk.worker_id):
        try:
            check_chunk_length(
                total, limits.chunk_elements, chunk.offset, length // item_size, context=context
            )
        except (InvalidArgumentError, ResourceExhaustedError) as exc:
            exc.step, exc.key, exc.worker_id = key.step, str(key), chunk.worker_id
            raise
    stats = None
    if chunk.HasField("stats"):
        if key.kind is not KeyKind.WHOLE_MODEL:
            raise InvalidArgumentError(
                f"{context}: sample stats (loss, correct, total) are only for whole-model keys",
                step=key.step,
                key=str(key),
                worker_id=chunk.worker_id,
            )
        stats = SampleStats(chunk.stats.loss, chunk.stats.correct, chunk.stats.total)
        if not math.isfinite(stats.loss) or stats.correct > stats.total:
            raise InvalidArgumentError(
                f"{context}: invalid sample stats loss={stats.loss} correct={stats.correct} "
                f"total={stats.total} (loss must be finite, correct <= total)",
                step=key.step,
                key=str(key),
                worker_id=chunk.worker_id,
            )
    elif key.kind is KeyKind.WHOLE_MODEL:
        raise InvalidArgumentError(
            f"{context}: whole-model chunks must carry sample stats",
            step=key.step,
            key=str(key),
            worker_id=chunk.worker_id,
        )
    return ChunkIn(
        worker_id=chunk.worker_id,
        key=key,
        header=ChunkHeader(dtype, total, sizes),
        offset=chunk.offset,
        data=data,
        stats=stats,
        shm=shm,
        covers=_covers(chunk, key, limits, context),
    )


def _covers(chunk: pb.GradientChunk, key: TensorKey, limits: WireLimits, context: str) -> tuple[int, ...]:
    """The workers a partial sum covers: distinct ids in increasing order, the sender among them,
    and only for keys that are summed (whether they are the sender's host group is the
    coordinator's to judge)."""
    covers = tuple(chunk.covers)
    if not covers:
        return covers
    problem = None
    if len(covers) > MAX_HOST_GROUP:
        problem = f"a partial sum covers {len(covers)} workers, above the limit of {MAX_HOST_GROUP}"
    elif not _ascending(covers, limits.world_size or 2**32) or chunk.worker_id not in covers:
        problem = (
            f"covers {list(covers)} must be distinct worker ids in increasing order, the sender among them"
        )
    elif not summed_on_hosts(key):
        problem = f"{key.describe()} is not summed on hosts: only block, non-block and REDUCE keys are"
    if problem is not None:
        raise InvalidArgumentError(
            f"{context}: {problem}", step=key.step, key=str(key), worker_id=chunk.worker_id
        )
    return covers


def handed_on_hosts(key: TensorKey) -> bool:
    """Whether a host group gets `key`'s result once, through one of its members, who hands it to
    the others on their host: what is the same for every rank (a REDUCE's or a gradient's
    average, an ALL_GATHER's or a BROADCAST's bytes), unlike a REDUCE_SCATTER's or an
    ALL_TO_ALL's parts."""
    if key.kind is KeyKind.WHOLE_MODEL:
        return False
    return key.kind is not KeyKind.COLLECTIVE or key.collective_kind in _HANDED_KINDS


_HANDED_KINDS = (CollectiveKind.REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.BROADCAST)


def summed_on_hosts(key: TensorKey) -> bool:
    """Whether a host group sums `key`'s contributions before they cross its link: every
    reduction but whole-model keys (whose sample stats are per worker): block and non-block
    gradients, REDUCE and REDUCE_SCATTER collectives."""
    if key.kind is KeyKind.WHOLE_MODEL:
        return False
    return key.kind is not KeyKind.COLLECTIVE or key.collective_kind not in BYTE_KINDS


def _header_only(key: TensorKey, worker_id: int) -> bool:
    """A BROADCAST's non-root ranks send one chunk with the root's size and no payload."""
    return (
        key.kind is KeyKind.COLLECTIVE
        and key.collective_kind is CollectiveKind.BROADCAST
        and worker_id != key.root
    )


def _check_collective_chunk(
    key: TensorKey, worker_id: int, total: int, offset: int, length: int, *, context: str
) -> None:
    """What one chunk of a byte-moving collective must satisfy on its own."""
    if key.kind is not KeyKind.COLLECTIVE:
        return
    problem = None
    if _header_only(key, worker_id) and (offset or length):
        problem = (
            f"worker {worker_id} is not the root ({key.root}) of a BROADCAST: it sends one "
            f"header-only chunk (offset 0, no payload), got {length} bytes at offset {offset}"
        )
    elif key.collective_kind is CollectiveKind.ALL_TO_ALL and sum(key.split_bytes) != total:
        problem = (
            f"ALL_TO_ALL split_bytes {list(key.split_bytes)} sum to {sum(key.split_bytes)}, "
            f"but the contribution declares {total} bytes"
        )
    if problem is not None:
        raise InvalidArgumentError(f"{context}: {problem}", step=key.step, key=str(key), worker_id=worker_id)


def _shm_to_pb(ref: ShmRef) -> pb.SharedMemoryRef:
    return pb.SharedMemoryRef(name=ref.name, offset=ref.offset, length=ref.length)


def _shm_from_pb(msg: pb.SharedMemoryRef, *, context: str, allowed: tuple[str, ...]) -> ShmRef:
    """A shared-memory reference; only the arenas `allowed` may be named (bounds are checked
    against the mapped arena by whoever resolves it)."""
    if msg.name not in allowed:
        raise InvalidArgumentError(
            f"{context}: shared-memory payload names arena {msg.name[:MAX_NAME_LENGTH]!r}; only "
            f"{' or '.join(repr(a) for a in allowed)} is allowed here"
        )
    return ShmRef(msg.name, msg.offset, msg.length)


def _stats_to_pb(stats: SampleStats) -> pb.SampleStats:
    return pb.SampleStats(loss=stats.loss, correct=stats.correct, total=stats.total)


# --- coordinator to worker ----------------------------------------------------------------------


def encode_server_event(event: ServerEvent) -> bytes:
    if isinstance(event, AveragedChunkOut):
        avg = pb.AveragedChunk(
            key=_key_to_pb(event.key),
            dtype=int(event.header.dtype),  # type: ignore[arg-type]
            total_elements=event.header.total_elements,
            component_sizes=event.header.component_sizes,
            offset=event.offset,
            num_contributors=event.num_contributors,
        )
        if event.stats is not None:
            avg.global_loss = event.stats.loss
            avg.correct = event.stats.correct
            avg.total = event.stats.total
        if event.shm is not None:
            avg.shm.CopyFrom(_shm_to_pb(event.shm))
            return pb.ServerMessage(averaged_chunk=avg).SerializeToString()
        return with_payload(_SERVER_AVERAGED_FIELD, avg.SerializeToString(), _AVERAGED_DATA_FIELD, event.data)
    if isinstance(event, PeerPiece):
        return with_payload(_SERVER_PEER_FIELD, _peer_header(event), _PEER_DATA_FIELD, event.data)
    if isinstance(event, PeerDeliveredOut):
        delivered = pb.PeerDelivered(peer=event.peer, sequence=event.sequence, bytes=event.upto)
        msg = pb.ServerMessage(peer_delivered=delivered)
    elif isinstance(event, MemberJoinedOut):
        msg = pb.ServerMessage(
            member_joined=pb.MemberJoined(worker_id=event.worker_id, first_step=event.first_step)
        )
    elif isinstance(event, BarrierReleaseOut):
        msg = pb.ServerMessage(barrier_release=pb.BarrierRelease(step=event.step, name=event.name))
    elif isinstance(event, SampleRangeAssignmentOut):
        msg = pb.ServerMessage(
            sample_range_assignment=pb.SampleRangeAssignment(
                step=event.step,
                worker_id=event.worker_id,
                ranges=[pb.SampleRange(start=r.start, stop=r.stop, stride=r.stride) for r in event.ranges],
            )
        )
    elif isinstance(event, HeartbeatAckOut):
        msg = pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(sequence=event.sequence))
    elif isinstance(event, ShutdownOut):
        msg = pb.ServerMessage(shutdown=pb.Shutdown(reason=event.reason))
    elif isinstance(event, MemberLeftOut):
        msg = pb.ServerMessage(
            member_left=pb.MemberLeft(worker_id=event.worker_id, reason=event.reason, aborts=event.aborts)
        )
    else:
        err = pb.Error(code=event.code, message=event.message, step=event.step, step_failed=event.step_failed)
        if event.key is not None:
            err.key.CopyFrom(_key_to_pb(event.key))
        if event.culprit_worker_id is not None:
            err.culprit_worker_id = event.culprit_worker_id
        if event.barrier_name is not None:
            err.barrier.CopyFrom(pb.Barrier(step=event.step, name=event.barrier_name))
        if event.sample_range_step is not None:
            err.sample_range_request.CopyFrom(pb.SampleRangeRequest(step=event.sample_range_step))
        if event.peer_message is not None:
            err.peer_message.ParseFromString(_peer_header(event.peer_message))
        if event.start_at is not None:
            err.start_at.CopyFrom(pb.StartAt(worker_id=event.start_at.worker_id, step=event.start_at.step))
        msg = pb.ServerMessage(error=err)
    return msg.SerializeToString()


def decode_server_message(raw: bytes) -> ServerEvent:
    """Parses one message from the coordinator; a malformed one is an InternalError."""
    data: memoryview | None = None
    try:
        split = split_payload(raw, _SERVER_AVERAGED_FIELD, _AVERAGED_DATA_FIELD)
        peer_split = None if split is not None else split_payload(raw, _SERVER_PEER_FIELD, _PEER_DATA_FIELD)
        if split is not None:
            header, data = split
            msg = pb.ServerMessage(averaged_chunk=pb.AveragedChunk.FromString(header))
        elif peer_split is not None:
            header, data = peer_split
            msg = pb.ServerMessage(peer_message=pb.PeerMessage.FromString(header))
        else:
            msg = pb.ServerMessage.FromString(raw)
    except DecodeError as exc:
        raise InternalError(f"malformed message from the coordinator: {exc}") from exc
    kind = msg.WhichOneof("kind")
    try:
        if kind == "averaged_chunk":
            a = msg.averaged_chunk
            key = _key_from_pb(a.key, who="coordinator", limits=None)
            shm = None
            if a.WhichOneof("payload") == "shm":
                shm = _shm_from_pb(a.shm, context=f"coordinator, {key}", allowed=("out", "in"))
                data = memoryview(b"")
            elif data is None:
                data = memoryview(a.data)
            stats = (
                SampleStats(a.global_loss, a.correct, a.total) if key.kind is KeyKind.WHOLE_MODEL else None
            )
            return AveragedChunkOut(
                key=key,
                header=ChunkHeader(DType(a.dtype), a.total_elements, tuple(a.component_sizes)),
                offset=a.offset,
                data=data,
                num_contributors=a.num_contributors,
                stats=stats,
                shm=shm,
            )
        if kind == "barrier_release":
            return BarrierReleaseOut(msg.barrier_release.step, msg.barrier_release.name)
        if kind == "sample_range_assignment":
            s = msg.sample_range_assignment
            ranges = tuple(SampleRange(r.start, r.stop, r.stride) for r in s.ranges)
            return SampleRangeAssignmentOut(s.step, s.worker_id, ranges)
        if kind == "heartbeat_ack":
            return HeartbeatAckOut(msg.heartbeat_ack.sequence)
        if kind == "shutdown":
            return ShutdownOut(msg.shutdown.reason)
        if kind == "member_left":
            left = msg.member_left
            return MemberLeftOut(left.worker_id, left.reason, left.aborts)
        if kind == "peer_message":
            p = msg.peer_message
            payload = memoryview(p.data) if data is None else data
            if p.offset + len(payload) > p.total_bytes:
                raise InternalError(f"coordinator sent a point-to-point piece beyond its message: {p}")
            return PeerPiece(p.peer, p.tag, p.sequence, p.total_bytes, p.offset, payload)
        if kind == "member_joined":
            return MemberJoinedOut(msg.member_joined.worker_id, msg.member_joined.first_step)
        if kind == "peer_delivered":
            d = msg.peer_delivered
            return PeerDeliveredOut(d.peer, d.sequence, d.bytes)
        if kind == "error":
            e = msg.error
            subject = e.WhichOneof("subject")
            return ErrorOut(
                code=e.code,
                message=e.message,
                step=e.step,
                key=_key_from_pb(e.key, who="coordinator", limits=None) if e.HasField("key") else None,
                culprit_worker_id=e.culprit_worker_id if e.HasField("culprit_worker_id") else None,
                barrier_name=e.barrier.name if subject == "barrier" else None,
                sample_range_step=e.sample_range_request.step if subject == "sample_range_request" else None,
                step_failed=e.step_failed,
                peer_message=_refused_peer(e.peer_message) if subject == "peer_message" else None,
                start_at=StartAtIn(e.start_at.worker_id, e.start_at.step) if subject == "start_at" else None,
            )
    except (InvalidArgumentError, ValueError) as exc:
        raise InternalError(f"invalid message from the coordinator: {exc}") from exc
    raise InternalError("message from the coordinator carries no message kind")


def _refused_peer(p: pb.PeerMessage) -> PeerPiece:
    return PeerPiece(p.peer, p.tag, p.sequence, p.total_bytes, p.offset)


_M = TypeVar(
    "_M", pb.WorkerMessage, pb.GradientChunk, pb.PeerMessage, pb.JoinRequest, pb.JoinResponse, pb.LinkProbe
)


def _parse(cls: type[_M], raw: bytes, what: str) -> _M:
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(f"malformed {what}: {exc}") from exc
