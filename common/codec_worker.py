"""Worker to coordinator on the wire: encoding a worker's events and decoding (and validating)
the WorkerMessage the coordinator receives, gradient chunks first among them.

Part of the wire codec (`gradserver.common.codec` lists its modules). A chunk's payload is
written and split by the hand-written `_wire` functions, so multi-MiB payloads never pass
through a message object. Decoding validates everything one message can be judged by and raises
an error naming the worker, step and key; checks that need other workers' messages live in the
coordinator's reduction table.
"""

from __future__ import annotations

import math

from google.protobuf.message import DecodeError

from ._pb import gradient_server_pb2 as pb
from ._wire import split_payload, with_payload
from .chunking import check_chunk_length
from .codec_fields import (
    MAX_NAME_LENGTH,
    PEER_DATA_FIELD,
    WireLimits,
    dtype_from_pb,
    key_from_pb,
    key_to_pb,
    parse,
    peer_header,
    shm_from_pb,
    shm_to_pb,
    stats_to_pb,
)
from .collective_rules import chunk_problem, header_only, partial_sum_problem
from .components import BLOCK_GRAD_COMPONENTS
from .errors import GradServerError, InvalidArgumentError, ResourceExhaustedError, Status
from .messages import (
    ITEM_SIZE,
    QUANTIZED_DTYPES,
    BarrierIn,
    ChunkHeader,
    ChunkIn,
    DType,
    HeartbeatIn,
    KeyKind,
    LeaveIn,
    PeerPiece,
    SampleRangeRequestIn,
    SampleStats,
    ShmRef,
    StartAtIn,
    StepFailureIn,
    TensorKey,
    WorkerEvent,
)
from .quantized_wire import words_for

# Field numbers of the payload-carrying fields, read from the descriptors so they cannot drift.
_WORKER_CHUNK_FIELD = pb.WorkerMessage.DESCRIPTOR.fields_by_name["chunk"].number
_CHUNK_DATA_FIELD = pb.GradientChunk.DESCRIPTOR.fields_by_name["data"].number
_WORKER_PEER_FIELD = pb.WorkerMessage.DESCRIPTOR.fields_by_name["peer_message"].number
# The largest point-to-point message, in bytes per element of the largest tensor a job allows.
PEER_BYTES_PER_ELEMENT = 8


def encode_worker_event(event: WorkerEvent) -> bytes:
    if isinstance(event, ChunkIn):
        chunk = pb.GradientChunk(
            worker_id=event.worker_id,
            key=key_to_pb(event.key),
            dtype=int(event.header.dtype),  # type: ignore[arg-type]
            total_elements=event.header.total_elements,
            component_sizes=event.header.component_sizes,
            offset=event.offset,
            covers=event.covers,
        )
        if event.stats is not None:
            chunk.stats.CopyFrom(stats_to_pb(event.stats))
        if event.shm is not None:
            chunk.shm.CopyFrom(shm_to_pb(event.shm))
            return pb.WorkerMessage(chunk=chunk).SerializeToString()
        return with_payload(_WORKER_CHUNK_FIELD, chunk.SerializeToString(), _CHUNK_DATA_FIELD, event.data)
    if isinstance(event, PeerPiece):
        return with_payload(_WORKER_PEER_FIELD, peer_header(event), PEER_DATA_FIELD, event.data)
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
            failure.key.CopyFrom(key_to_pb(event.key))
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
        return _decode_chunk(parse(pb.GradientChunk, header, "WorkerMessage"), limits, data)
    split = split_payload(raw, _WORKER_PEER_FIELD, PEER_DATA_FIELD)
    if split is not None:
        header, data = split
        return _decode_peer_piece(parse(pb.PeerMessage, header, "WorkerMessage"), limits, data)
    msg = parse(pb.WorkerMessage, raw, "WorkerMessage")
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


def chunk_key(raw: bytes) -> TensorKey | None:
    """The key of the chunk in a serialised WorkerMessage, or None when `raw` holds no chunk or no
    readable key: for naming a chunk that `decode_worker_message` refused after its key was read."""
    try:
        msg = pb.WorkerMessage.FromString(raw)
        if msg.WhichOneof("kind") != "chunk":
            return None
        return key_from_pb(msg.chunk.key, who="refused chunk", limits=None)
    except (DecodeError, GradServerError, ValueError):
        return None


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
    key = key_from_pb(failure.key, who=who, limits=limits) if failure.HasField("key") else None
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
    key = key_from_pb(chunk.key, who=who, limits=limits)
    context = f"{who}, {key}"
    try:
        dtype = dtype_from_pb(chunk.dtype, context=context, key=key)
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
        if _block_elements(sum(sizes), dtype, limits.chunk_elements) != total:
            raise InvalidArgumentError(
                f"{context}: data length {total} != sum(component_sizes) {sum(sizes)}"
                f"{' as ' + dtype.name + ' words' if dtype in QUANTIZED_DTYPES else ''}",
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
            shm = shm_from_pb(chunk.shm, context=context, allowed=("in", "inout"))
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
    problem = chunk_problem(key, chunk.worker_id, total, chunk.offset, length)
    if problem is not None:
        raise InvalidArgumentError(
            f"{context}: {problem}", step=key.step, key=str(key), worker_id=chunk.worker_id
        )
    item_size = ITEM_SIZE[dtype]
    if length % item_size:
        raise InvalidArgumentError(
            f"{context}: {length} payload bytes is not a whole number of {dtype.name.lower()} elements",
            step=key.step,
            key=str(key),
            worker_id=chunk.worker_id,
        )
    if not header_only(key, chunk.worker_id):
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
        covers=_covers(chunk, key, dtype, limits, context),
    )


def _block_elements(values: int, dtype: DType, chunk_elements: int) -> int | None:
    """The payload elements of a block of `values` values in `dtype`: as many, except quantized
    words laid out in chunks (None when a chunk cannot hold a record)."""
    if dtype not in QUANTIZED_DTYPES:
        return values
    try:
        return words_for(values, dtype, chunk_elements)
    except ValueError:
        return None


def _covers(
    chunk: pb.GradientChunk, key: TensorKey, dtype: DType, limits: WireLimits, context: str
) -> tuple[int, ...]:
    """The workers a partial sum covers: distinct ids in increasing order, the sender among them,
    and only for keys that are summed (whether they are the sender's host group is the
    coordinator's to judge)."""
    covers = tuple(chunk.covers)
    if not covers:
        return covers
    problem = partial_sum_problem(key, chunk.worker_id, covers, limits.world_size, dtype)
    if problem is not None:
        raise InvalidArgumentError(
            f"{context}: {problem}", step=key.step, key=str(key), worker_id=chunk.worker_id
        )
    return covers
