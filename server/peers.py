"""Partitioned coordinators: how one partition tells the others that a step failed or a worker was
lost.

A step completes on all partitions or on none. Each partition averages only its chunks, so when
a step fails on one partition (a timeout, a bad contribution, a lost worker) the others would
otherwise complete their part or wait out the step timeout. `PartitionPeers` sends a
`PartitionNotice` to every other partition (the NotifyPartition RPC, with the partition's own
auth token and TLS, a deadline of one heartbeat timeout); the receiving coordinator fails the
same step for every worker, naming the sending partition. Delivery is best effort: a partition
that cannot be reached is also unreachable for the workers, whose streams to it break and fail
the step on the partitions they still reach.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from gradserver.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    Status,
    status_code_from_value,
)
from gradserver.common.messages import ErrorOut, JoinRequestIn
from gradserver.common.partition_map import (
    NOTIFY_METHOD,
    PartitionMap,
    PartitionNotice,
    decode_notice,
    encode_notice,
)
from gradserver.common.rpc import worker_channel_options
from gradserver.common.security import bearer_metadata

from .config import CoordinatorConfig
from .lifecycle import Departure, Lifecycle, Shell, TableAccess
from .outgoing import Outgoing

log = logging.getLogger("gradserver.server.peers")

_TOLD_KEPT = 64
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


class PartitionPeers:
    """Channels from this partition to every other partition of the map, opened on first use."""

    def __init__(self, partition_map: PartitionMap, own_index: int, config: CoordinatorConfig) -> None:
        self.partition_map = partition_map
        self.own_index = own_index
        self._config = config
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchers: list[asyncio.Task[None]] = []
        self._metadata = bearer_metadata(config.auth_token)

    def watch(self, on_unreachable: Callable[[int, str], None]) -> None:
        """Checks every other partition's health four times per heartbeat timeout; calls
        `on_unreachable(index, why)` once a partition has not answered for a heartbeat timeout (again
        only after it answered once more). A partition that is stopped keeps its connections open and
        tells no one, so without this its part of a step would wait for the step timeout."""
        for index in range(self.partition_map.count):
            if index != self.own_index:
                task = asyncio.create_task(
                    self._watch(index, on_unreachable), name=f"gradserver-watch-partition-{index}"
                )
                self._watchers.append(task)

    async def _watch(self, index: int, on_unreachable: Callable[[int, str], None]) -> None:
        loop = asyncio.get_running_loop()
        interval = self._config.heartbeat_interval
        limit = self._config.heartbeat_timeout
        check = self._channel(index).unary_unary(
            _HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        last_answer = loop.time()
        reported = False
        while True:
            await asyncio.sleep(interval)
            try:
                await check(
                    health_pb2.HealthCheckRequest(), timeout=max(interval, limit / 2), metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                silent = loop.time() - last_answer
                if not reported and silent > limit:
                    reported = True
                    why = f"no answer for {silent:.1f} s (heartbeat timeout {limit:g} s): {exc.code().name}"
                    log.warning("%s is unreachable: %s", self.partition_map.describe(index), why)
                    on_unreachable(index, why)
                continue
            if reported:
                log.info("%s answers again", self.partition_map.describe(index))
            last_answer = loop.time()
            reported = False

    def notify(self, notice: PartitionNotice) -> None:
        """Sends `notice` to every other partition in the background (never blocks the caller)."""
        for index in range(self.partition_map.count):
            if index == self.own_index:
                continue
            task = asyncio.create_task(self._send(index, notice), name=f"gradserver-notify-partition-{index}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, index: int, notice: PartitionNotice) -> None:
        call = self._channel(index).unary_unary(NOTIFY_METHOD)
        try:
            await call(encode_notice(notice), timeout=self._config.heartbeat_timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "could not tell %s that step %d failed: %s: %s",
                self.partition_map.describe(index),
                notice.step,
                exc.code().name,
                exc.details(),
            )

    def _channel(self, index: int) -> grpc.aio.Channel:
        channel = self._channels.get(index)
        if channel is None:
            address = self.partition_map.addresses[index]
            options = worker_channel_options()
            if self._config.tls_cert:
                channel = grpc.aio.secure_channel(address, self._credentials(), options=options)
            else:
                channel = grpc.aio.insecure_channel(address, options=options)
            self._channels[index] = channel
        return channel

    def _credentials(self) -> grpc.ChannelCredentials:
        """TLS to the other partitions: their certificates checked against --partition-tls-ca (or
        --tls-client-ca); this partition's own certificate is the client certificate under mutual TLS."""
        cfg = self._config
        ca = Path(cfg.partition_tls_ca or cfg.tls_client_ca).read_bytes()
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=Path(cfg.tls_key).read_bytes(),
            certificate_chain=Path(cfg.tls_cert).read_bytes(),
        )

    async def close(self) -> None:
        """Waits (bounded by each call's deadline) for notices under way, then closes channels."""
        for watcher in self._watchers:
            watcher.cancel()
        if self._watchers:
            await asyncio.wait(self._watchers)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self._config.heartbeat_timeout)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class PartitionRole:
    """What makes a coordinator one partition of several: the Join checks, the map in JoinAccepted,
    and the step failures it tells the other partitions about or hears from them (each step once, so
    two partitions never echo one failure back and forth). It subscribes to the coordinator's
    lifecycle (`subscribe`): it sees every step failure and every lost worker on their way out."""

    def __init__(self, partition_map: PartitionMap, own_index: int, config: CoordinatorConfig) -> None:
        self.partition_map = partition_map
        self.own_index = own_index
        self.largest_chunk_bytes = config.chunk_bytes
        self.peers = PartitionPeers(partition_map, own_index, config)
        # Steps whose failure the other partitions know of (the newest _TOLD_KEPT).
        self._told: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def me(self) -> str:
        return self.partition_map.describe(self.own_index)

    def check_join(self, request: JoinRequestIn) -> None:
        """Partition 0 takes new workers; partitions 1..K-1 take only workers that joined partition 0 (they
        ask for their index and their worker id)."""
        asked = request.partition_index
        if asked is None and self.own_index != 0:
            raise FailedPreconditionError(
                f"node {request.node_id!r} joined {self.me}, but workers join partition 0 at "
                f"{self.partition_map.addresses[0]} and learn the other partitions from it"
            )
        if asked is not None and asked != self.own_index:
            raise FailedPreconditionError(
                f"node {request.node_id!r} asked for partition {asked}, but this is {self.me}: the "
                "partition maps of the coordinators differ"
            )
        if asked is not None and request.rank is None:
            raise InvalidArgumentError(
                f"node {request.node_id!r} joined {self.me} without the worker id partition 0 gave it"
            )
        brought = request.job_chunk_bytes
        if brought and (brought % 4 or brought > self.largest_chunk_bytes):
            raise InvalidArgumentError(
                f"node {request.node_id!r} (worker {request.rank}) brought a chunk size of {brought} "
                f"bytes from partition 0 to {self.me}, which takes whole float32 elements up to "
                f"{self.largest_chunk_bytes} bytes"
            )

    def offer(self) -> dict[str, Any]:
        """The JoinAccepted fields: the map, and which partition this is."""
        return {"partition_map": self.partition_map.addresses, "partition_index": self.own_index}

    def failed_steps(self, outgoing: Sequence[Outgoing]) -> None:
        """Tells the other partitions of every step that `outgoing` fails for the first time."""
        for item in outgoing:
            event = item.event
            if isinstance(event, ErrorOut) and event.step_failed and event.step not in self._told:
                self._mark_told(event.step)
                self.peers.notify(
                    PartitionNotice(
                        self.own_index,
                        self.partition_map.count,
                        event.step,
                        event.code,
                        event.message,
                        event.culprit_worker_id,
                    )
                )

    def worker_lost(self, worker_id: int, reason: str, pending: set[int]) -> None:
        """Tells the other partitions that a worker was lost here: its steps in flight fail there too."""
        for step in pending:
            self._mark_told(step)
        self.peers.notify(
            PartitionNotice(
                self.own_index,
                self.partition_map.count,
                min(pending, default=0),
                int(Status.ABORTED),
                f"worker {worker_id} {reason}",
                worker_id,
                worker_lost=True,
            )
        )

    def unreachable(self, index: int, why: str, table: TableAccess) -> list[Outgoing]:
        """Another partition stopped answering: every step still unsettled here fails for every
        worker, naming it (the workers cannot get that partition's part of those steps)."""
        where = self.partition_map.describe(index)
        out: list[Outgoing] = []
        for step in sorted(table.unsettled_steps()):
            self._mark_told(step)
            message = f"step {step} aborted: {where} is unreachable: {why}"
            out += table.fail_step(step, message, Status.UNAVAILABLE)
        return out

    @staticmethod
    def hear(role: PartitionRole | None, raw: bytes, table: TableAccess) -> list[Outgoing]:
        """`role.heard`, refused (naming why) on a coordinator without --partition-map."""
        if role is None:
            raise FailedPreconditionError("NotifyPartition: this coordinator runs without --partition-map")
        return role.heard(raw, table)

    def heard(self, raw: bytes, table: TableAccess) -> list[Outgoing]:
        """Applies a notice from another partition to `table`: the step (or, for a lost worker, every
        step in flight) fails for every worker, naming the partition that failed it first."""
        notice = decode_notice(raw)
        if (
            notice.partition_count != self.partition_map.count
            or notice.from_partition >= self.partition_map.count
        ):
            raise InvalidArgumentError(
                f"a notice from partition {notice.from_partition} of {notice.partition_count} "
                f"reached {self.me} of {self.partition_map.count}: the partition maps of the coordinators "
                "differ"
            )
        origin = self.partition_map.describe(notice.from_partition)
        log.warning("%s reports: %s", origin, notice.message)
        code = status_code_from_value(notice.code)
        if notice.worker_lost:
            # Only steps in flight here (including ones whose chunks here are all averaged, but
            # not yet counted complete): a step counted complete stays complete, and the lost
            # worker's later contributions are refused by the partition that lost it.
            steps = table.unsettled_steps()
            for step in steps:
                self._mark_told(step)
            message = f"on {origin}: {notice.message}"
            out: list[Outgoing] = []
            for step in sorted(steps):
                out += table.fail_step(
                    step, f"step {step} aborted: {message}", code, notice.culprit_worker_id
                )
            return out
        self._mark_told(notice.step)
        message = f"step {notice.step} failed on {origin}: {notice.message}"
        return table.fail_step(notice.step, message, code, notice.culprit_worker_id)

    def _mark_told(self, step: int) -> None:
        self._told[step] = None
        while len(self._told) > _TOLD_KEPT:
            self._told.popitem(last=False)

    def reset(self) -> None:
        """A new job starts (every worker left): its steps count from 0 again."""
        self._told.clear()

    async def close(self) -> None:
        await self.peers.close()


NOTIFY_PARTITION = "NotifyPartition"  # the RPC another partition tells this one through


def check_join(role: PartitionRole | None, request: JoinRequestIn) -> None:
    """`role.check_join`; without --partition-map, a request for a partition is refused."""
    if role is not None:
        role.check_join(request)
    elif request.partition_index is not None:
        raise FailedPreconditionError(
            f"node {request.node_id!r} asked for partition {request.partition_index}, but this "
            "coordinator runs without --partition-map"
        )


def subscribe(lifecycle: Lifecycle, shell: Shell) -> PartitionRole | None:
    """This coordinator's partition role (None without --partition-map), subscribed to its
    lifecycle; NotifyPartition is served either way (refused without a map)."""
    config = shell.config
    role = PartitionRole(config.partitions, config.partition_index, config) if config.partitions else None
    lifecycle.on_join_request(lambda request: check_join(role, request))
    lifecycle.handle_call(NOTIFY_PARTITION, lambda raw: PartitionRole.hear(role, raw, shell.table()))
    if role is None:
        return None

    def departed(departure: Departure) -> None:
        if departure.lost:
            role.worker_lost(departure.worker_id, departure.reason, shell.table().unsettled_steps())

    async def start() -> None:
        role.peers.watch(lambda index, why: shell.deliver(role.unreachable(index, why, shell.table())))

    lifecycle.on_table(lambda: {"partition": (role.partition_map, role.own_index)})
    lifecycle.on_joined(lambda member, members: role.offer())
    lifecycle.on_start(start)
    lifecycle.on_sent(role.failed_steps)
    lifecycle.on_departed(departed)
    lifecycle.on_reset(role.reset)
    lifecycle.on_close(role.close)
    return role
