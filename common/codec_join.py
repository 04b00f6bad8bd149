"""Joining a job on the wire: the JoinRequest a worker sends, the JoinResponse it is accepted
with, and the link probe it times its link with before joining.

Part of the wire codec (`gradserver.common.codec` lists its modules). A request is checked for
what one message can be judged by (sizes of names and fingerprints, the host group it adopts);
an answer the worker cannot trust (a group without it, ids out of order or of range) is the
coordinator's fault, an InternalError.
"""

from __future__ import annotations

from ._pb import gradient_server_pb2 as pb
from .codec_fields import MAX_NAME_LENGTH, dtype_from_pb, parse
from .collective_rules import MAX_HOST_GROUP, ascending_ids
from .errors import InternalError, InvalidArgumentError
from .messages import DType, JoinAccepted, JoinRequestIn

PROTOCOL_VERSION = 1
MAX_FINGERPRINT_FIELDS = 64
# The largest link probe a coordinator answers (workers send 1 MiB).
MAX_PROBE_BYTES = 4 * 2**20


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
    msg = parse(pb.JoinRequest, raw, "JoinRequest")
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
    return dtype_from_pb(msg.wire_dtype, context=f"JoinRequest from node {msg.node_id!r}: wire_dtype")


def encode_link_probe(payload_bytes: int) -> bytes:
    """A link probe carrying `payload_bytes` bytes (zeros: only their size is timed)."""
    return pb.LinkProbe(payload=bytes(payload_bytes)).SerializeToString()


def decode_link_probe(raw: bytes) -> int:
    """The probe's payload size; refuses one above MAX_PROBE_BYTES (a probe needs far less)."""
    size = len(parse(pb.LinkProbe, raw, "LinkProbe").payload)
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
    msg = parse(pb.JoinResponse, raw, "JoinResponse")
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
        or (group and (msg.worker_id not in group or not ascending_ids(group, msg.total_workers)))
        or (peers and (msg.worker_id not in peers or not ascending_ids(peers, msg.total_workers)))
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
