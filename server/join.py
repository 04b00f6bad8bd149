"""The Join call's two ends: the checks a request must pass before it waits for the world, and
the JoinAccepted a member gets (the job's limits and timeouts, and each transport's offer)."""

from __future__ import annotations

from typing import Any

from gradserver.common import codec
from gradserver.common.errors import FailedPreconditionError
from gradserver.common.messages import JoinAccepted, JoinRequestIn

from .config import CoordinatorConfig
from .job import Job
from .membership import Member, Membership


def check_request(request: JoinRequestIn, job: Job) -> None:
    """Raises naming the node when it speaks another protocol version or the job no longer takes
    members (the coordinator stops); the features' checks follow (`Lifecycle.check_join`: the
    partition asked for, server/peers.py)."""
    if request.protocol_version != codec.PROTOCOL_VERSION:
        raise FailedPreconditionError(
            f"node {request.node_id!r} speaks protocol version {request.protocol_version}, "
            f"this coordinator {codec.PROTOCOL_VERSION}"
        )
    refusal = job.join_refusal()
    if refusal is not None:
        raise refusal


def accepted(
    member: Member,
    membership: Membership,
    config: CoordinatorConfig,
    session_id: int,
    chunk_bytes: int,
    offers: dict[str, Any],
) -> bytes:
    """The encoded JoinAccepted for `member`: `chunk_bytes` is the job's chunk size (chosen as
    its world completed, or --chunk-mib), `offers` are the transports' fields and the member's
    host group."""
    return codec.encode_join_accepted(
        JoinAccepted(
            worker_id=member.worker_id,
            total_workers=config.world_size,
            session_id=session_id,
            member_token=member.token,
            protocol_version=codec.PROTOCOL_VERSION,
            chunk_bytes=chunk_bytes,
            max_message_bytes=config.max_message_bytes,
            max_tensor_elements=config.max_tensor_elements,
            heartbeat_interval_s=config.heartbeat_interval,
            heartbeat_timeout_s=config.heartbeat_timeout,
            step_timeout_s=config.step_timeout,
            max_steps=config.max_steps,
            resume_step=membership.resume_step(),
            local_workers=membership.local_workers(member),
            **offers,
        )
    )
