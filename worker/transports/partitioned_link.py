"""`PartitionedLink`: the worker's side of partitioned coordinators, one `GrpcLink` per partition.

The job's coordinators split every key's chunks between them (the partition map; each
coordinator is one partition, "partition N" in messages). Partition 0's JoinResponse carries the
map; the worker joins every other partition as the worker id partition 0 gave it
(`join_other_partitions`) and opens one link per partition. `PartitionedLink` is a `Link`
composed of those: each chunk goes to the partition that owns it
(gradserver.common.partition_map), barriers and sample-range requests go to partition 0, and
every partition's link fills its chunks of the same result array. An average is returned only
once every partition that owns a chunk of it delivered, and never when any partition failed its
step: a worker never applies part of a step. The links share one condition, so a waiter wakes on
news from any partition; a link that breaks (a coordinator killed or cut off) breaks the others
at once, so every wait fails naming that partition instead of running into its deadline, and
every partition counts this worker as lost.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from gradserver.common.chunking import chunk_count
from gradserver.common.collective_rules import served_by_partitions
from gradserver.common.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    GradServerError,
    UnavailableError,
)
from gradserver.common.messages import (
    ChunkHeader,
    DType,
    JoinAccepted,
    SampleRangeAssignmentOut,
    SampleStats,
    ServerEvent,
    TensorKey,
    WorkerEvent,
)
from gradserver.common.partition_map import PartitionMap
from gradserver.common.timeouts import Timeouts

from .base import ErrorRecord, PeerSink, PendingResult
from .grpc_link import GrpcLink
from .lane import LaneClient

# Joins partition `index` at `address` as the given worker id; returns its channel and answer.
JoinPartition = Callable[[int, str], tuple[grpc.Channel, JoinAccepted]]


@dataclasses.dataclass(frozen=True)
class JoinedPartition:
    """One joined coordinator partition: its index, its channel and its JoinResponse."""

    index: int
    channel: grpc.Channel
    accepted: JoinAccepted


def join_other_partitions(first: JoinAccepted, join: JoinPartition) -> list[JoinedPartition]:
    """Joins partitions 1..K-1 of `first.partition_map` in order (every worker joins them in the same
    order, so each partition's Join completes once the whole world reached it). Refuses partitions whose
    map, worker id or chunk size differ from partition 0's: the chunk rule needs all three equal."""
    partition_map = PartitionMap(first.partition_map)
    links: list[JoinedPartition] = []
    try:
        for index in range(1, partition_map.count):
            try:
                channel, accepted = join(index, partition_map.addresses[index])
            except GradServerError as exc:
                where = partition_map.describe(index)
                raise type(exc)(f"{where}: {exc.message}", worker_id=exc.worker_id) from exc
            links.append(JoinedPartition(index, channel, accepted))
            _check_alike(partition_map, index, first, accepted)
    except BaseException:
        for link in links:
            link.channel.close()
        raise
    return links


def _check_alike(partition_map: PartitionMap, index: int, first: JoinAccepted, other: JoinAccepted) -> None:
    where = partition_map.describe(index)
    if other.partition_map != first.partition_map or other.partition_index != index:
        raise FailedPreconditionError(
            f"{where} runs with partition map {','.join(other.partition_map)} as partition "
            f"{other.partition_index}, but partition 0 has {','.join(first.partition_map)}: start every "
            "partition with the same --partition-map"
        )
    if other.worker_id != first.worker_id or other.chunk_bytes != first.chunk_bytes:
        raise FailedPreconditionError(
            f"{where} made this worker {other.worker_id} with {other.chunk_bytes}-byte chunks, but "
            f"partition 0 made it {first.worker_id} with {first.chunk_bytes}-byte chunks: start every "
            "partition with the same --chunk-mib"
        )


class PartitionedLink:
    """A `Link` over one `GrpcLink` per coordinator partition."""

    transport = "grpc"
    host_group: tuple[int, ...] = ()

    def __init__(
        self,
        first: tuple[grpc.Channel, JoinAccepted],
        others: list[JoinedPartition],
        timeouts: Timeouts,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.accepted = first[1]
        self.partition_map = PartitionMap(self.accepted.partition_map)
        self.timeouts = timeouts
        self._chunk_elements = self.accepted.chunk_bytes // 4
        self._cond = threading.Condition()
        self._closing = False
        self._broken_by: int | None = None
        self._delivered: dict[TensorKey, set[int]] = {}  # partitions whose part of a key arrived
        self._links: list[GrpcLink] = []
        links = [(first[0], first[1])] + [(link.channel, link.accepted) for link in others]
        try:
            for index, (channel, accepted) in enumerate(links):
                self._links.append(
                    GrpcLink(
                        channel,
                        accepted,
                        timeouts,
                        metadata,
                        cond=self._cond,
                        on_break=functools.partial(self._partition_broke, index),
                    )
                )
        except BaseException:
            self.close()
            for channel, _ in links[len(self._links) :]:
                channel.close()  # each link owns its channel from its construction on
            raise
        for index, link in enumerate(self._links):
            broken = link.trouble(-1)
            if broken is not None:
                self._partition_broke(index, broken)

    # --- errors naming the partition --------------------------------------------------------------

    def _named(self, index: int, error: GradServerError | ErrorRecord) -> GradServerError:
        record = error if isinstance(error, ErrorRecord) else ErrorRecord.of(error)
        where = self.partition_map.describe(index)
        if record.message.startswith(where):
            return record.exception()
        return dataclasses.replace(record, message=f"{where}: {record.message}").exception()

    def _partition_broke(self, index: int, error: ErrorRecord) -> None:
        """One partition's stream broke: every other one breaks too, naming that partition."""
        with self._cond:
            if self._closing or self._broken_by is not None:
                return
            self._broken_by = index
        lost = UnavailableError(f"{self.partition_map.describe(index)} is lost: {error.message}")
        for other, link in enumerate(self._links):
            if other != index:
                link.abort_with(lost)

    # --- the Link calls -----------------------------------------------------------------------

    @property
    def control(self) -> PartitionedLink:
        """Partition 0 carries the control plane; this link names it in errors (`send`,
        `barrier`, `wait_samples`; `confirm_open` asks every partition)."""
        return self

    def lane(self) -> LaneClient | None:
        """None: the lane is one coordinator's, and partitioned coordinators are for networks."""
        return None

    def allocate(self, num_elements: int) -> np.ndarray | None:
        return None

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        return None

    def raise_if_broken(self) -> None:
        for index, link in enumerate(self._links):
            try:
                link.raise_if_broken()
            except GradServerError as exc:
                raise self._named(index, exc) from None

    def send_chunk(
        self,
        key: TensorKey,
        header: ChunkHeader,
        offset: int,
        piece: np.ndarray,
        stats: SampleStats | None,
        *,
        covers: tuple[int, ...] = (),
    ) -> None:
        """To the partition that owns the chunk."""
        index = self.partition_map.owner(key, offset // self._chunk_elements)
        try:
            self._links[index].send_chunk(key, header, offset, piece, stats, covers=covers)
        except GradServerError as exc:
            raise self._named(index, exc) from None

    def on_peer_messages(self, sink: PeerSink) -> None:
        """Partition 0 relays point-to-point messages (they go out with `send`)."""
        self._links[0].on_peer_messages(sink)

    def send(self, event: WorkerEvent) -> None:
        """Control messages (and point-to-point pieces) go to partition 0."""
        try:
            self._links[0].send(event)
        except GradServerError as exc:
            raise self._named(0, exc) from None

    def _owners(self, key: TensorKey, total: int) -> dict[int, int]:
        """Partition index -> how many chunks of `key` it owns, for the partitions owning any."""
        num_chunks = chunk_count(total, self._chunk_elements)
        counts = {
            i: self.partition_map.owned_chunks(key, num_chunks, i) for i in range(self.partition_map.count)
        }
        return {i: n for i, n in counts.items() if n}

    def expect(
        self,
        key: TensorKey,
        component_sizes: tuple[int, ...],
        total: int | None,
        dtype: DType = DType.FLOAT32,
        *,
        array: np.ndarray | None = None,
    ) -> None:
        if total is None or not served_by_partitions(key):
            # Each partition sees only its chunks, so it cannot gather, relay or route whole
            # contributions (the coordinators refuse these kinds too; this says so before sending).
            raise FailedPreconditionError(
                f"{key}: partitioned coordinators only reduce; "
                f"{key.collective_kind.name} needs one coordinator",
                step=key.step,
                key=str(key),
            )
        array = np.empty(total, dtype=np.float32) if array is None else array
        try:
            for index, owned in self._owners(key, total).items():
                self._links[index].expect(key, component_sizes, total, dtype, array=array, num_chunks=owned)
        except BaseException:
            self.forget(key)
            raise
        with self._cond:
            self._delivered[key] = set()

    def forget(self, key: TensorKey) -> None:
        with self._cond:
            self._delivered.pop(key, None)
            for link in self._links:
                link.forget(key)

    def awaiting(self, key: TensorKey) -> bool:
        return any(link.awaiting(key) for link in self._links)

    def step_failed(self, step: int) -> bool:
        return any(link.step_failed(step) for link in self._links)

    def pace_as_one_of(self, members: int) -> None:
        """Every partition's stream shares its window with the host's other members (see
        `GrpcLink.pace_as_one_of`)."""
        for link in self._links:
            link.pace_as_one_of(members)

    def observe(self, news: Callable[[ServerEvent], bool]) -> None:
        """Every partition's news (see `GrpcLink.observe`)."""
        for link in self._links:
            link.observe(news)

    def trouble(self, step: int) -> ErrorRecord | None:
        """Why nothing of `step` can complete on any partition, naming that partition."""
        found = self._trouble(step)
        if found is None:
            return None
        index, record = found
        return ErrorRecord.of(self._named(index, record))

    def _trouble(self, step: int) -> tuple[int, ErrorRecord] | None:
        """The first partition that broke or failed `step`, and why."""
        for index, link in enumerate(self._links):
            record = link.trouble(step)
            if record is not None:
                return index, record
        return None

    def wait_result(self, key: TensorKey, timeout: float | None = None) -> PendingResult:
        """The average of `key` once every owning partition delivered its chunks. Any partition that broke
        or failed the key's step fails it (naming that partition); after a local timeout the key stays
        registered and a later call waits for the partitions still missing."""
        limit = self.timeouts.receive if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            delivered = self._delivered.setdefault(key, set())
            owners = [i for i, s in enumerate(self._links) if i not in delivered and s.awaiting(key)]
            result: PendingResult | None = None
            while True:
                trouble = self._trouble(key.step)
                if trouble is not None:
                    self.forget(key)
                    raise self._named(*trouble)
                for index in [i for i in owners if self._links[i].result_ready(key)]:
                    try:
                        result = self._links[index].wait_result(key, 0)
                    except GradServerError as exc:
                        self.forget(key)
                        raise self._named(index, exc) from None
                    delivered.add(index)
                    owners.remove(index)
                if not owners:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = ", ".join(self.partition_map.describe(i) for i in owners)
                    raise DeadlineExceededError(
                        f"no average for {key} within {limit:g} s from {missing}", step=key.step
                    )
                self._cond.wait(remaining)
            del self._delivered[key]
        if result is None:
            raise UnavailableError(f"{key} is not awaited on any partition", step=key.step, key=str(key))
        return result

    def confirm_open(self, timeout: float) -> None:
        """Returns once every partition answered on its new stream (see GrpcLink.confirm_open)."""
        for index, link in enumerate(self._links):
            try:
                link.confirm_open(timeout)
            except GradServerError as exc:
                raise self._named(index, exc) from None

    def barrier(self, step: int, name: str, timeout: float | None, digest: int | None = None) -> None:
        try:
            self._links[0].barrier(step, name, timeout, digest)
        except GradServerError as exc:
            raise self._named(0, exc) from None

    def wait_samples(self, timeout: float | None) -> SampleRangeAssignmentOut:
        try:
            return self._links[0].wait_samples(timeout)
        except GradServerError as exc:
            raise self._named(0, exc) from None

    def close(self) -> None:
        """Leaves every partition (each link says goodbye), stops every helper thread and closes
        every channel."""
        with self._cond:
            self._closing = True
        for link in self._links:
            link.close()
