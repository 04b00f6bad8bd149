"""The worker's transports: one `Link` class per way of reaching the coordinator, and `open_link`,
which picks one for a joined worker.

- `grpc_link.GrpcLink`: every payload inline in the Exchange stream's gRPC messages.
- `shm_payloads.ShmPayloads`: a `GrpcLink` whose payloads go through shared memory (same host);
  a link's payloads are a strategy (`payloads.Payloads`), its awaited results a
  `result_ledger.ResultLedger`, its pacing a `pacing.Pacer`.
- `partitioned_link.PartitionedLink`: one `GrpcLink` per coordinator partition (partitioned coordinators).
- `host_link.HostLink`: a host group member's (the workers of one host other than the
  coordinator's, summing there): wraps a `GrpcLink` or `PartitionedLink`, with the group's
  shared memory (`host_arena`).

Only this package names the concrete classes; the rest of the worker sees a `Link`. A new
transport is one module here implementing `base.Link`, one branch in `open_link`, and one outbox
on the coordinator's side.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import grpc

from gradserver.common import shm
from gradserver.common.config import env_name, environment_value
from gradserver.common.errors import FailedPreconditionError, GradServerError, InvalidArgumentError
from gradserver.common.lane import supported as futexes_supported
from gradserver.common.messages import DType, JoinAccepted
from gradserver.common.timeouts import Timeouts

from . import peer_rings
from .base import ErrorRecord, Link, PendingResult
from .grpc_link import GrpcLink
from .host_arena import form
from .host_link import HostLink
from .lane import LaneClient
from .mailbox import Mailbox, PeerReceive, PeerSend
from .partitioned_link import JoinPartition, PartitionedLink, join_other_partitions
from .shm_channel import ShmChannel
from .shm_payloads import ShmPayloads

__all__ = [
    "DEFAULT_SHM_ARENA_MIB",
    "TRANSPORTS",
    "TRANSPORT_ENV",
    "ErrorRecord",
    "HostLink",
    "JoinPartition",
    "LaneClient",
    "Link",
    "Mailbox",
    "PeerReceive",
    "PeerSend",
    "PendingResult",
    "host_identity",
    "open_link",
    "open_mailbox",
    "peer_host_identity",
    "shm_intended",
    "transport_choice",
]

log = logging.getLogger("gradserver.worker")

TRANSPORTS = ("auto", "grpc", "shm")
TRANSPORT_ENV = env_name("transport")
# A worker's input arena: staging slots, gradient_buffers and the results averaged there, so a
# step's gradients of a ~250M-parameter model fit whole. Only the pages used are ever allocated.
DEFAULT_SHM_ARENA_MIB = 1024.0


def transport_choice(transport: str | None) -> str:
    """The argument, else $GRADSERVER_TRANSPORT, else auto; anything else is refused by name."""
    choice = transport if transport is not None else environment_value("transport") or "auto"
    if choice not in TRANSPORTS:
        source = "transport" if transport is not None else TRANSPORT_ENV
        raise InvalidArgumentError(f"{source}={choice!r}: choose one of {', '.join(TRANSPORTS)}")
    return choice


_ON, _OFF = ("", "1", "on", "true", "yes"), ("0", "off", "false", "no")


def host_identity(host_groups: bool | None, host_id: str | None) -> str:
    """What this worker tells the coordinator it shares a host with (JoinRequest.host_id): `host_id`
    when given (tests emulate hosts so), else this machine's (`gradserver.common.shm.host_id`);
    "" when host groups are off (`host_groups` False, or $GRADSERVER_HOST_GROUPS off) or this
    platform cannot share memory and futexes between processes."""
    if host_groups is None:
        value = environment_value("host_groups").strip().lower()
        if value not in _ON + _OFF:
            raise InvalidArgumentError(f"{env_name('host_groups')}={value!r}: use on or off")
        host_groups = value in _ON
    if not host_groups or not futexes_supported() or not shm.supported():
        return ""
    return shm.host_id() if host_id is None else host_id


def peer_host_identity(share_memory: bool) -> str:
    """What this worker tells the coordinator it shares memory with for point-to-point messages
    (JoinRequest.peer_host_id): this machine's host id, or "" when not asked or not possible."""
    if not share_memory or not futexes_supported() or not shm.supported():
        return ""
    return shm.host_id()


def open_mailbox(link: Link, accepted: JoinAccepted, timeouts: Timeouts) -> Mailbox:
    """The worker's point-to-point mailbox: through its host's shared rings to the workers the
    coordinator says share its memory (formed here, with them), through `link` to the others."""
    rings = None
    if accepted.host_peers:
        rings = peer_rings.form(accepted.host_peers, accepted.worker_id, accepted.peer_key, timeouts.connect)
    return Mailbox(link.control, accepted, timeouts.receive, rings)


def shm_intended(choice: str, wire_dtype: DType) -> bool:
    """Whether a worker with this transport `choice` and `wire_dtype` will send through shared
    memory if its coordinator offers it (JoinRequest.shared_memory: the coordinator sizes the
    job's chunks for it). Partitioned coordinators rule it out too, but they are not known before
    the Join and fix their chunk size regardless."""
    return choice != "grpc" and _why_not_shm(wire_dtype, partitioned=False) is None and shm.supported()


def open_link(
    channel: grpc.Channel,
    accepted: JoinAccepted,
    timeouts: Timeouts,
    metadata: tuple[tuple[str, str], ...],
    join_partition: JoinPartition,
    *,
    choice: str,
    wire_dtype: DType,
    shm_arena_mib: float,
) -> Link:
    """The link for a worker that joined through `channel` (now owned by the link, and closed
    with everything else opened here when this raises). Partitioned coordinators are joined through
    `join_partition`; `choice` (see `transport_choice`) decides between gRPC and shared memory."""
    others = None
    try:
        if len(accepted.partition_map) > 1:
            others = join_other_partitions(accepted, join_partition)
        why_not = _why_not_shm(wire_dtype, partitioned=others is not None, grouped=bool(accepted.host_group))
        arenas = _open_shm(accepted, choice, shm_arena_mib, timeouts.connect, why_not)
    except BaseException:
        channel.close()
        raise
    if accepted.host_group:
        inner: PartitionedLink | GrpcLink
        if others is not None:
            inner = PartitionedLink((channel, accepted), others, timeouts, metadata)
        else:
            inner = _constructed(lambda: GrpcLink(channel, accepted, timeouts, metadata), channel)
        return _in_host_group(inner, accepted, timeouts)
    if others is not None:
        return PartitionedLink((channel, accepted), others, timeouts, metadata)
    if arenas is None:
        return _constructed(lambda: GrpcLink(channel, accepted, timeouts, metadata), channel)
    log.info("worker %d sends its gradients through shared memory", accepted.worker_id)
    try:
        payloads = ShmPayloads(arenas)  # owned by the link once it exists
        return _constructed(
            lambda: GrpcLink(channel, accepted, timeouts, metadata, payloads=payloads), channel
        )
    except BaseException:
        arenas.close()
        raise


_L = TypeVar("_L", bound=Link)


def _constructed(make: Callable[[], _L], channel: grpc.Channel) -> _L:
    """`make()`, closing `channel` when it raises (a link owns its channel once it exists)."""
    try:
        return make()
    except BaseException:
        channel.close()
        raise


def _in_host_group(inner: PartitionedLink | GrpcLink, accepted: JoinAccepted, timeouts: Timeouts) -> Link:
    """The link of a host group member: `inner` with the group's shared memory, or `inner` alone
    when the group could not form it (every member then sends its own contributions)."""
    try:
        arena = form(
            accepted.host_group, accepted.worker_id, accepted.host_key, accepted.chunk_bytes, timeouts.connect
        )
    except BaseException:
        inner.close()
        raise
    if arena is None:
        return inner
    log.info(
        "worker %d sums with host group %s before sending", accepted.worker_id, list(accepted.host_group)
    )
    return HostLink(inner, arena, timeouts)


def _why_not_shm(wire_dtype: DType, *, partitioned: bool, grouped: bool = False) -> str | None:
    """Why this worker's settings rule shared memory out, or None."""
    if grouped:
        return "this worker sums in a host group (the coordinator is on another host)"
    if wire_dtype is not DType.FLOAT32:
        return f"the wire dtype is {wire_dtype.name.lower()} (shared memory carries float32)"
    if partitioned:
        return "the coordinators are partitioned (shared memory is for one coordinator on this host)"
    return None


def _open_shm(
    accepted: JoinAccepted, choice: str, arena_mib: float, timeout: float, why_not: str | None
) -> ShmChannel | None:
    """The shared-memory channel for `auto` or `shm`; auto falls back to gRPC with one INFO line
    saying why, shm raises the reason."""
    if choice == "grpc":
        return None
    try:
        if why_not is not None:
            raise FailedPreconditionError(why_not)
        if not accepted.shm_socket:
            raise FailedPreconditionError(
                "the coordinator offers no shared memory (it runs with --no-shm or without Linux memfd)"
            )
        return ShmChannel.open(accepted, int(arena_mib * 1024 * 1024), timeout)
    except GradServerError as exc:
        if choice == "shm":
            raise type(exc)(f"transport 'shm' is not available: {exc.message}") from None
        log.info("gradients go over gRPC: %s", exc.message)
        return None
