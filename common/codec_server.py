"""Coordinator to worker on the wire: encoding the coordinator's events and decoding the
ServerMessage a worker receives, averaged chunks and collective pieces first among them.

Part of the wire codec (`gradserver.common.codec` lists its modules). An averaged chunk's or a
relayed piece's payload is written and split by the hand-written `_wire` functions (a worker
decodes it as a zero-copy view). A message from the coordinator that a worker cannot read or
trust is the coordinator's fault: an InternalError.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from ._pb import gradient_server_pb2 as pb
from ._wire import split_payload, with_payload
from .codec_fields import PEER_DATA_FIELD, key_from_pb, key_to_pb, peer_header, shm_from_pb, shm_to_pb
from .errors import InternalError, InvalidArgumentError
from .messages import (
    AveragedChunkOut,
    BarrierReleaseOut,
    ChunkHeader,
    DType,
    ErrorOut,
    HeartbeatAckOut,
    KeyKind,
    MemberJoinedOut,
    MemberLeftOut,
    PeerDeliveredOut,
    PeerPiece,
    SampleRange,
    SampleRangeAssignmentOut,
    SampleStats,
    ServerEvent,
    ShutdownOut,
    StartAtIn,
)

# Field numbers of the payload-carrying fields, read from the descriptors so they cannot drift.
_SERVER_AVERAGED_FIELD = pb.ServerMessage.DESCRIPTOR.fields_by_name["averaged_chunk"].number
_AVERAGED_DATA_FIELD = pb.AveragedChunk.DESCRIPTOR.fields_by_name["data"].number
_SERVER_PEER_FIELD = pb.ServerMessage.DESCRIPTOR.fields_by_name["peer_message"].number


def encode_server_event(event: ServerEvent) -> bytes:
    if isinstance(event, AveragedChunkOut):
        avg = pb.AveragedChunk(
            key=key_to_pb(event.key),
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
            avg.shm.CopyFrom(shm_to_pb(event.shm))
            return pb.ServerMessage(averaged_chunk=avg).SerializeToString()
        return with_payload(_SERVER_AVERAGED_FIELD, avg.SerializeToString(), _AVERAGED_DATA_FIELD, event.data)
    if isinstance(event, PeerPiece):
        return with_payload(_SERVER_PEER_FIELD, peer_header(event), PEER_DATA_FIELD, event.data)
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
            err.key.CopyFrom(key_to_pb(event.key))
        if event.culprit_worker_id is not None:
            err.culprit_worker_id = event.culprit_worker_id
        if event.barrier_name is not None:
            err.barrier.CopyFrom(pb.Barrier(step=event.step, name=event.barrier_name))
        if event.sample_range_step is not None:
            err.sample_range_request.CopyFrom(pb.SampleRangeRequest(step=event.sample_range_step))
        if event.peer_message is not None:
            err.peer_message.ParseFromString(peer_header(event.peer_message))
        if event.start_at is not None:
            err.start_at.CopyFrom(pb.StartAt(worker_id=event.start_at.worker_id, step=event.start_at.step))
        msg = pb.ServerMessage(error=err)
    return msg.SerializeToString()


def decode_server_message(raw: bytes) -> ServerEvent:
    """Parses one message from the coordinator; a malformed one is an InternalError."""
    data: memoryview | None = None
    try:
        split = split_payload(raw, _SERVER_AVERAGED_FIELD, _AVERAGED_DATA_FIELD)
        peer_split = None if split is not None else split_payload(raw, _SERVER_PEER_FIELD, PEER_DATA_FIELD)
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
            key = key_from_pb(a.key, who="coordinator", limits=None)
            shm = None
            if a.WhichOneof("payload") == "shm":
                shm = shm_from_pb(a.shm, context=f"coordinator, {key}", allowed=("out", "in"))
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
                key=key_from_pb(e.key, who="coordinator", limits=None) if e.HasField("key") else None,
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
