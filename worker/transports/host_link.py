"""`HostLink`: a host group member's link (docs/PROTOCOL.md "Host groups"). The workers of one
host other than the coordinator's sum their contributions there and share what they all get, so
that each chunk crosses the host's link once each way instead of once per worker.

It wraps the member's own link to the coordinator (a `GrpcLink`, or a `PartitionedLink`), which
keeps carrying everything of its own: barriers, sample ranges, heartbeats, the collectives that
move bytes, whole-model keys. A key that is summed (block and non-block gradients, REDUCE and
REDUCE_SCATTER collectives) goes through the group's arena (`host_arena`) instead:

- every member posts each chunk into its input slots;
- chunk c of a key is summed by the member at position (c + hash(key)) mod P of the group, as
  chunks are spread over coordinator partitions: its reducer thread waits for every member's
  copy, sums them in worker-id order in float64 and rounds once to the wire dtype (the
  coordinator's own averaging, `Averager` with `divide` off), and sends that partial sum on its
  own stream naming the workers it covers (`ChunkIn.covers`); a non-finite value (unless the key
  propagates them) or a sum beyond the dtype is reported instead (`StepFailureIn`), naming the
  member, and the coordinator fails the step for everyone;
- the coordinator sends what every rank gets alike (the average of a REDUCE chunk, a piece of an
  ALL_GATHER's or a BROADCAST's bytes) to one member of the group only: for an average, the
  member whose partial sum went into it; for bytes, the members in turn. That member fills its
  own result and publishes the piece in its output slots, where the others' reader threads copy
  it into theirs (a REDUCE_SCATTER's and an ALL_TO_ALL's parts differ per rank: they come to
  every rank on its own stream, as always).

A failed step (every member hears it on its own stream) drops what the group holds of it; a member
that leaves or is lost dissolves the group (the coordinator says so, `MemberLeftOut`): what is
still waiting in the arena fails naming that member, and every key begun afterwards goes over the
member's own link. Each wait is bounded and also ends when the step fails, the link breaks or
the group dissolves.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable
from typing import Protocol

import numpy as np

from gradserver.common.averaging import Averager, NonFiniteContribution, SumOverflow
from gradserver.common.chunking import chunk_count
from gradserver.common.collective_rules import handed_on_hosts, summed_on_hosts
from gradserver.common.errors import (
    DeadlineExceededError,
    GradServerError,
    InvalidArgumentError,
    Status,
    UnavailableError,
)
from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    DType,
    ErrorOut,
    JoinAccepted,
    MemberLeftOut,
    SampleStats,
    ServerEvent,
    StepFailureIn,
    TensorKey,
)
from gradserver.common.partition_map import key_hash
from gradserver.common.timeouts import Timeouts

from .base import ControlPlane, ErrorRecord, Link, PendingResult, error_of, payload_values
from .host_arena import HostArena, Post, Published, identity, key_of
from .lane import LaneClient

log = logging.getLogger("gradserver.worker")

# How long a thread sleeps on its bell before it looks again anyway (a failed step, a closed link).
_LOOK_S = 0.05
# How often the reducer looks for chunks of failed steps it must let go.
_SWEEP_S = 0.2
# After this member's stream ended, how long a result the group already got may take to come
# through the arena (it is there within milliseconds: the member that got it publishes at once).
_BROKEN_GRACE_S = 2.0
_F32 = np.dtype("<f4")


class InnerLink(Link, Protocol):
    """What `HostLink` needs of the link it wraps beyond `Link` (`GrpcLink`, `PartitionedLink`):
    partial sums sent naming what they cover, its news seen first, and why a step cannot end."""

    def send_chunk(
        self,
        key: TensorKey,
        header: ChunkHeader,
        offset: int,
        piece: np.ndarray,
        stats: SampleStats | None,
        *,
        covers: tuple[int, ...] = (),
    ) -> None: ...

    def observe(self, news: Callable[[ServerEvent], bool]) -> None: ...

    def pace_as_one_of(self, members: int) -> None: ...

    def trouble(self, step: int) -> ErrorRecord | None: ...


@dataclasses.dataclass
class _Result:
    """A result the group gets once (an average, an ALL_GATHER's or BROADCAST's bytes), filled
    from this member's own stream (the pieces that came to it) and from the group's arena (the
    pieces that came to the others), whole once every element is there (and, for an empty one,
    its empty piece)."""

    key: TensorKey
    component_sizes: tuple[int, ...]
    array: np.ndarray
    dtype: DType
    num_chunks: int
    offsets: set[int] = dataclasses.field(default_factory=set)
    elements: int = 0
    num_contributors: int = 0
    error: ErrorRecord | None = None

    @property
    def done(self) -> bool:
        # At least one piece: an empty result (a barrier's) still waits for the coordinator's.
        return bool(self.offsets) and self.elements == self.array.size


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A chunk this member sums: its key, its header (this member's own) and offset."""

    key: TensorKey
    header: ChunkHeader
    offset: int


def header_check(key: TensorKey, header: ChunkHeader) -> int:
    """A checksum of what every member's copy of a chunk must agree on besides its length."""
    fields = struct.pack(
        f"<QIBBII{len(header.component_sizes)}Q",
        header.total_elements,
        int(header.dtype),
        int(key.collective_kind),
        int(key.op),
        int(key.propagate_non_finite),
        key.root,
        *header.component_sizes,
    )
    return zlib.crc32(fields)


class HostLink:
    """A `Link` for one member of a host group, over its own link and the group's arena."""

    def __init__(self, inner: InnerLink, arena: HostArena, timeouts: Timeouts) -> None:
        self._inner = inner
        self._arena = arena
        self.accepted: JoinAccepted = inner.accepted
        self.timeouts = timeouts
        self._group = self.accepted.host_group
        self._position = arena.position
        self._chunk_elements = self.accepted.chunk_bytes // 4
        self._cond = threading.Condition()
        self._posting = threading.Lock()
        self._summed: set[TensorKey] = set()  # keys this member's copy of goes through the arena
        self._results: dict[TensorKey, _Result] = {}
        self._by_ident: dict[tuple[int, int, int], TensorKey] = {}
        self._work: collections.deque[_Chunk] = collections.deque()
        self._outbox: collections.deque[tuple[AveragedChunkOut, tuple[int, int, int]]] = collections.deque()
        self._dissolved: ErrorRecord | None = None
        self._failed: ErrorRecord | None = None  # a helper thread's own failure
        self._closing = False
        self._averager = Averager()
        inner.observe(self._news)
        # The group's members send its sums over one link: one stream's worth of chunks in flight.
        inner.pace_as_one_of(len(self._group))
        self._summer = threading.Thread(
            target=self._guarded(self._reduce_loop), name="gradserver-host-sum", daemon=True
        )
        self._exchanger = threading.Thread(
            target=self._guarded(self._exchange_loop), name="gradserver-host-io", daemon=True
        )
        self._threads = [self._summer, self._exchanger]
        for thread in self._threads:
            thread.start()

    transport = "grpc"

    @property
    def host_group(self) -> tuple[int, ...]:
        return self._group

    # --- what goes where ---------------------------------------------------------------------

    def _owner(self, key: TensorKey, offset: int) -> int:
        """The position in the group of the member that sums the chunk at `offset` of `key`."""
        return (offset // self._chunk_elements + key_hash(key)) % len(self._group)

    def expect(
        self,
        key: TensorKey,
        component_sizes: tuple[int, ...],
        total: int | None,
        dtype: DType,
        *,
        array: np.ndarray | None = None,
    ) -> None:
        with self._cond:
            grouped = self._dissolved is None and total is not None
            summed, handed = grouped and summed_on_hosts(key), grouped and handed_on_hosts(key)
            if key in self._summed or key in self._results:
                raise InvalidArgumentError(
                    f"{key} was already sent by this worker and is still awaiting its average",
                    step=key.step,
                    key=str(key),
                )
        if not handed:
            self._inner.expect(key, component_sizes, total, dtype, array=array)
            if summed:
                with self._cond:
                    self._summed.add(key)
            return
        assert total is not None
        if array is None:
            array = np.empty(total, dtype=np.uint8 if dtype is DType.BYTES else np.float32)
        result = _Result(key, component_sizes, array, dtype, chunk_count(total, self._chunk_elements))
        failed = self._inner.trouble(key.step)
        with self._cond:
            result.error = failed
            self._results[key] = result
            self._by_ident[identity(key)] = key
            if summed:
                self._summed.add(key)

    def send_chunk(
        self,
        key: TensorKey,
        header: ChunkHeader,
        offset: int,
        piece: np.ndarray,
        stats: SampleStats | None,
    ) -> None:
        with self._cond:
            summed = key in self._summed
        if not summed:
            self._inner.send_chunk(key, header, offset, piece, stats)
            return
        check = header_check(key, header)
        with self._posting:  # a slot found free is this thread's until it is posted
            slot = self._free_input(key)
            self._arena.post(slot, identity(key), offset, piece, header.dtype, check)
        owner = self._owner(key, offset)
        if owner == self._position:
            with self._cond:
                self._work.append(_Chunk(key, header, offset))
        self._arena.ring(owner)

    def _free_input(self, key: TensorKey) -> int:
        """One of this member's input slots, waiting (bounded by the send timeout) for one to be
        summed; raises the key's step failure, the group's end or the link's."""
        deadline = time.monotonic() + self.timeouts.send
        while True:
            self._raise_trouble(key)
            seen = self._arena.bell()
            slot = self._arena.free_input()
            if slot is not None:
                return slot
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    f"{key}: the host group's shared memory stayed full for {self.timeouts.send:g} s "
                    f"(workers {list(self._group)} must send their keys in the same order)",
                    step=key.step,
                    key=str(key),
                )
            self._arena.sleep(seen, min(remaining, _LOOK_S))

    def _raise_trouble(self, key: TensorKey) -> None:
        with self._cond:
            trouble = self._trouble(key)
            if trouble is None and self._closing:
                raise UnavailableError("the client was closed")
        if trouble is not None:
            raise trouble.exception()

    # --- summing (the reducer thread) ----------------------------------------------------------

    def _reduce_loop(self) -> None:
        swept = 0.0
        while not self._stopped():
            seen = self._arena.bell()
            with self._cond:
                chunk = self._work[0] if self._work else None
            if chunk is not None and self._try_sum(chunk):
                with self._cond:
                    self._work.popleft()
                continue
            now = time.monotonic()
            if now - swept >= _SWEEP_S:
                swept = now
                self._sweep()
            self._arena.sleep(seen, _LOOK_S)

    def _try_sum(self, chunk: _Chunk) -> bool:
        """Sums `chunk` if every member's copy is there (True: done with it, summed or dropped)."""
        key, ident = chunk.key, identity(chunk.key)
        if self._inner.trouble(key.step) is not None or self._stopped():
            self._sweep()  # its step failed: the copies there are let go (or the link is gone)
            return True
        posts: list[Post] = []
        for member in range(len(self._group)):
            post = self._arena.find_post(member, ident, chunk.offset)
            if post is None:
                return False
            posts.append(post)
        mine = posts[self._position]
        for member, post in enumerate(posts):
            if (post.nbytes, post.dtype, post.check) != (mine.nbytes, mine.dtype, mine.check):
                self._report(
                    chunk,
                    Status.INVALID_ARGUMENT,
                    f"worker {self._group[member]} sent {key} as {post.nbytes} bytes of "
                    f"{post.dtype.name}, but worker {self.accepted.worker_id} as {mine.nbytes} bytes of "
                    f"{mine.dtype.name}"
                    + ("" if post.nbytes != mine.nbytes else " with another shape or operation"),
                    culprit=self._group[member],
                    posts=posts,
                )
                return True
        try:
            summed = self._averager.average(
                [self._arena.payload(post) for post in posts],
                divide=False,
                dtype=mine.dtype,
                finite_only=not key.propagate_non_finite,
            )
        except NonFiniteContribution as exc:
            element = chunk.offset + exc.element
            culprit = self._group[exc.position]
            self._report(
                chunk,
                Status.INVALID_ARGUMENT,
                f"worker {culprit} sent a non-finite value (NaN or Inf) in {key} at element {element}; "
                "the step is halted",
                culprit=culprit,
                posts=posts,
            )
            return True
        except SumOverflow as exc:
            element = chunk.offset + exc.element
            self._report(
                chunk,
                Status.ABORTED,
                f"the sum of {key} over host group {list(self._group)} overflows "
                f"{exc.dtype.name.lower()} at element {element}; the step is halted",
                culprit=None,
                posts=posts,
            )
            return True
        for post in posts:
            self._arena.consume(post)
        piece = np.frombuffer(summed, dtype=_F32 if mine.dtype is DType.FLOAT32 else np.uint16)
        try:
            self._inner.send_chunk(key, chunk.header, chunk.offset, piece, None, covers=self._group)
        except GradServerError as exc:
            # The link broke (every wait learns it from the link itself) or the step failed.
            log.info("host group: could not send the sum of %s: %s", key, exc.message)
        return True

    def _report(
        self, chunk: _Chunk, code: Status, message: str, *, culprit: int | None, posts: list[Post]
    ) -> None:
        """The step fails: the coordinator is told why (and fails it for everyone)."""
        for post in posts:
            self._arena.consume(post)
        failure = StepFailureIn(
            self.accepted.worker_id, int(code), message, chunk.key.step, chunk.key, culprit
        )
        try:
            self._inner.control.send(failure)
        except GradServerError as exc:
            log.info("host group: could not report %r: %s", message, exc.message)

    def _sweep(self) -> None:
        """Lets go of the copies of chunks this member sums whose step failed, whenever they
        were posted (a member may post one after the step failed, before it heard so)."""
        for member in range(len(self._group)):
            for post, ident, offset in self._arena.posts(member):
                if self._owner(key_of(ident), offset) == self._position and self._inner.step_failed(ident[0]):
                    self._arena.consume(post)

    # --- averages: published by the member that summed them, read by the others --------------

    def _news(self, event: ServerEvent) -> bool:
        """What this member's own stream brought that concerns the group (the receiver thread;
        never blocks). True: an average of a summed key, taken here."""
        if isinstance(event, AveragedChunkOut):
            return self._averaged(event)
        if isinstance(event, MemberLeftOut):
            if event.worker_id in self._group:
                self._dissolve(event.worker_id, event.reason)
        elif isinstance(event, ErrorOut):
            with self._cond:
                target = self._results.get(event.key) if event.key is not None else None
                if target is not None and not event.step_failed and not target.done:
                    target.error = ErrorRecord.of(error_of(event))
                self._cond.notify_all()
            self._arena.ring(self._position)
        return False

    def _averaged(self, event: AveragedChunkOut) -> bool:
        key = event.key
        if not handed_on_hosts(key) or self._inner.awaiting(key):
            return False  # not the group's (or sent over this member's own link)
        with self._cond:
            result = self._results.get(key)
            if result is not None:
                self._fill(result, event.offset, event.data, event.header.dtype, event.num_contributors)
            # Published even when this member gave up on the key: the others still wait for it.
            if self._dissolved is None:
                self._outbox.append((event, identity(key)))
        self._arena.ring(self._position)
        return True

    def _fill(
        self, result: _Result, offset: int, data: bytes | memoryview, dtype: DType, contributors: int
    ) -> None:
        """One chunk's average into `result` (lock held)."""
        if offset in result.offsets or result.error is not None:
            return
        values = payload_values(data, dtype)
        end = offset + values.size
        if dtype is not result.dtype or end > result.array.size:
            result.error = ErrorRecord(
                UnavailableError,
                f"host group: an average of {result.key} ({values.size} {dtype.name} elements at offset "
                f"{offset}) does not fit what this worker sent",
                step=result.key.step,
                key=str(result.key),
            )
        else:
            result.array[offset:end] = values
            result.offsets.add(offset)
            result.elements += values.size
            result.num_contributors = contributors
        self._cond.notify_all()

    def _exchange_loop(self) -> None:
        """Publishes the averages this member got for the group and reads the others': never
        blocks on anything but its bell, so no member waits on another in a circle."""
        while not self._stopped(dissolved_too=False):
            seen = self._arena.bell()
            busy = self._publish() | self._read()
            if not busy:
                self._arena.sleep(seen, _LOOK_S)

    def _publish(self) -> bool:
        published = False
        while True:
            with self._cond:
                if not self._outbox:
                    return published
                event, ident = self._outbox[0]
            slot = self._arena.free_output()
            if slot is None:
                return published
            self._arena.publish(
                slot, ident, event.offset, event.data, event.header.dtype, event.num_contributors
            )
            with self._cond:
                self._outbox.popleft()
                self._cond.notify_all()  # `close` waits for the outbox to empty
            published = True

    def _read(self) -> bool:
        read = False
        for item in self._arena.published():
            self._take(item)
            read = True
        return read

    def _take(self, item: Published) -> None:
        with self._cond:
            key = self._by_ident.get(item.ident)
            result = self._results.get(key) if key is not None else None
            if result is not None:
                self._fill(result, item.offset, self._arena.average(item), item.dtype, item.contributors)
        # Taken whether or not it is awaited: a key this member gave up on holds no slot.
        self._arena.take(item)

    # --- waiting -------------------------------------------------------------------------------

    def wait_result(self, key: TensorKey, timeout: float | None = None) -> PendingResult:
        with self._cond:
            result = self._results.get(key)
        if result is None:
            return self._inner.wait_result(key, timeout)
        limit = self.timeouts.receive if timeout is None else timeout
        deadline = time.monotonic() + limit
        broken_at: float | None = None
        with self._cond:
            while not result.done and result.error is None:
                trouble = self._trouble(key)
                if trouble is not None and not self._inner.step_failed(key.step) and self._failed is None:
                    # This member's stream ended, or its group did (the coordinator stopped after
                    # the last result, say): what the group already got still comes through the
                    # arena, a moment after the end, where this member's own result would have
                    # come before it. A step that failed, a helper that failed: at once.
                    now = time.monotonic()
                    broken_at = now if broken_at is None else broken_at
                    trouble = trouble if now - broken_at >= _BROKEN_GRACE_S else None
                if trouble is not None:
                    result.error = trouble
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError(f"no average for {key} within {limit:g} s", step=key.step)
                self._cond.wait(min(remaining, _LOOK_S))
            self._forget(key)
            # An average that arrived before its step failed is void too (as on any link); one
            # that arrived whole before the stream ended is not.
            failed = self._inner.trouble(key.step) if self._inner.step_failed(key.step) else None
            error = failed or result.error
        if error is not None:
            raise error.exception()
        return PendingResult(
            key=key,
            component_sizes=result.component_sizes,
            array=result.array,
            num_chunks=result.num_chunks,
            offsets=result.offsets,
            dtype=result.dtype,
            num_contributors=result.num_contributors,
        )

    def _trouble(self, key: TensorKey) -> ErrorRecord | None:
        """Why `key` can no longer complete (lock held)."""
        trouble = self._inner.trouble(key.step)
        if trouble is not None:
            return trouble
        for record in (self._dissolved, self._failed):
            if record is not None:
                return dataclasses.replace(record, step=key.step, key=str(key))
        return None

    def forget(self, key: TensorKey) -> None:
        with self._cond:
            known = self._results.get(key)
            self._forget(key)
            self._summed.discard(key)
        if known is None:
            self._inner.forget(key)

    def _forget(self, key: TensorKey) -> None:
        """Lock held."""
        if self._results.pop(key, None) is not None:
            self._summed.discard(key)
            if self._by_ident.get(identity(key)) == key:
                del self._by_ident[identity(key)]

    def awaiting(self, key: TensorKey) -> bool:
        with self._cond:
            if key in self._results:
                return True
        return self._inner.awaiting(key)

    # --- the group's end -----------------------------------------------------------------------

    def _dissolve(self, worker: int, reason: str) -> None:
        with self._cond:
            if self._dissolved is not None:
                return
            self._dissolved = ErrorRecord(
                UnavailableError,
                f"worker {worker} of this worker's host group {list(self._group)} left ({reason}); "
                "the group's keys in flight are lost, later ones go over this worker's own link",
                worker_id=worker,
            )
            # What waits fails only if the group's copy does not come through the arena soon
            # (`wait_result`): a member that left after publishing what it got (the coordinator
            # stopping after the last result) leaves nothing missing.
            self._cond.notify_all()
        log.info("host group %s dissolved: worker %d left (%s)", list(self._group), worker, reason)
        self._arena.ring(self._position)

    def _stopped(self, *, dissolved_too: bool = True) -> bool:
        """Whether a helper thread should end: the link closed or a helper failed, or (unless
        `dissolved_too` is False: what the group already got is still handed on) the group ended."""
        with self._cond:
            dissolved = dissolved_too and self._dissolved is not None
            return self._closing or dissolved or self._failed is not None

    def _guarded(self, loop: Callable[[], None]) -> Callable[[], None]:
        """A helper thread's loop; a failure of its own is kept, fails what waits, and is logged."""

        def run() -> None:
            try:
                loop()
            except Exception as exc:
                log.exception("host group helper thread failed")
                with self._cond:
                    self._failed = ErrorRecord(UnavailableError, f"host group helper failed: {exc!r}")
                    for result in self._results.values():
                        if not result.done and result.error is None:
                            result.error = self._failed
                    self._cond.notify_all()

        return run

    # --- the rest of Link: the member's own link's -----------------------------------------------

    @property
    def control(self) -> ControlPlane:
        """The member's own link's: barriers, sample ranges and control messages do not go
        through the group."""
        return self._inner.control

    def lane(self) -> LaneClient | None:
        return None

    def allocate(self, num_elements: int) -> np.ndarray | None:
        return None

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        return None

    def raise_if_broken(self) -> None:
        self._inner.raise_if_broken()
        with self._cond:
            if self._failed is not None:
                raise self._failed.exception()

    def step_failed(self, step: int) -> bool:
        return self._inner.step_failed(step)

    def trouble(self, step: int) -> ErrorRecord | None:
        return self._inner.trouble(step)

    def close(self) -> None:
        """Hands on what it still owes the group (what came to it for the others: a member that
        got the last result of a job closes right after), then leaves the group's arena (the
        others stop waiting for this member's reads) and the job; stops the helper threads."""
        deadline = time.monotonic() + self.timeouts.close
        with self._cond:
            if self._closing:
                return
            while self._outbox and self._failed is None and self._exchanger.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.info("host group: closing with %d piece(s) not handed on", len(self._outbox))
                    break
                self._cond.wait(min(remaining, _LOOK_S))
            self._closing = True
            self._cond.notify_all()
        self._arena.mark_closed()
        for thread in self._threads:
            thread.join(self.timeouts.close)
        try:
            self._inner.close()
        finally:
            self._arena.close()
