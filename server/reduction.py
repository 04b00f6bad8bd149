"""The coordinator's reduction table: which contributions are pending, and what to send when.

Pure bookkeeping with no I/O: every call returns the messages to send (`Outgoing`) and the
coordinator delivers them. One pending slot exists per key identity (a block index, a non-block
component, the whole model) and holds only the chunks that not every worker has sent yet; a chunk
is averaged as soon as the last worker's copy arrives and its buffers are freed.

Beside the table: `participation` (which workers a step waits for: lost, rejoined, live),
`sample_ranges` (the answers to sample-range requests), `step_stats` (per-step counts, logged at
DEBUG), `outgoing` (what the table returns), `averaging` (the float64 mean of one chunk) and
`collectives` (where the result pieces of the native collective kinds go: ALL_GATHER, BROADCAST,
ALL_TO_ALL are routed there without float work; a REDUCE_SCATTER is reduced here like any key and
its reduced chunks are cut into the ranks' parts there).

Rules (docs/PROTOCOL.md lists them with their status codes):
- A step either completes for every key or fails for all workers at once; the failure is
  broadcast as one step-wide error and late contributions to it are answered, never counted.
- A message that is wrong on its own (stale or future step, duplicate) is rejected to its sender
  without changing any state, so what was already accepted stays counted exactly once.
- A message that disagrees with what other workers sent for the same key (sizes, num_blocks),
  a non-finite value, a lost worker, a worker that moved to a later step without sending a key
  (also a key first opened after one of its workers moved on), or a timeout fails the step: the
  culprit gets its own code, everyone else ABORTED.
- A step counts as completed only when it did not fail, none of its keys or barriers is pending,
  and every worker expected at it has moved to a later step or left: the table cannot know a
  step's last key before its workers move on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from gradserver.common.averaging import Averager, NonFiniteContribution, SumOverflow
from gradserver.common.chunking import chunk_count, payload_nbytes
from gradserver.common.codec import handed_on_hosts, summed_on_hosts
from gradserver.common.errors import Status, status_code_from_value
from gradserver.common.messages import (
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
    KeyKind,
    MemberJoinedOut,
    MemberLeftOut,
    ReduceOp,
    SampleRangeRequestIn,
    SampleStats,
    StartAtIn,
    StepFailureIn,
    TensorKey,
)
from gradserver.common.partition_map import PartitionMap, key_hash

from .collectives import ByteCollective, Piece, ScatterParts
from .digests import vote
from .host_groups import HostGroups
from .message_rules import StepView, closed_step_refusal, covers_refusal, reporter_refusal, start_at_refusal
from .outgoing import Outgoing, error_to
from .participation import Participation
from .sample_ranges import SampleRangeAssigner
from .step_stats import StepStatistics

log = logging.getLogger("gradserver.server.reduction")

_FAILED_STEPS_KEPT = 64
_ABORTED = Status.ABORTED
_INVALID = Status.INVALID_ARGUMENT
_PRECONDITION = Status.FAILED_PRECONDITION
_DEADLINE = Status.DEADLINE_EXCEEDED


@dataclasses.dataclass
class _Slot:
    key: TensorKey
    header: ChunkHeader
    num_chunks: int
    deadline: float
    world_size: int
    opened: float = 0.0
    expected: frozenset[int] = frozenset()
    chunks: dict[int, list[bytes | memoryview | None]] = dataclasses.field(default_factory=dict)
    received: list[set[int]] = dataclasses.field(default_factory=list)
    stats: list[SampleStats | None] = dataclasses.field(default_factory=list)
    reduced: int = 0
    # Chunks handed out to be averaged (`Reduce`), their parts kept until the result is back.
    inflight: dict[int, list[bytes | memoryview | None]] = dataclasses.field(default_factory=dict)
    # What each part counts toward its sender's in-flight budget, per chunk index (held or in
    # flight): its bytes, or 0 when it lies in the sender's own memory (`contribute(borrowed=)`).
    charged: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    # ALL_GATHER, BROADCAST, ALL_TO_ALL: the chunks are routed there instead of averaged.
    collective: ByteCollective | None = None
    # REDUCE_SCATTER: cuts the reduced chunks into the ranks' parts.
    scattered: ScatterParts | None = None
    # Host groups' partial sums, per chunk index: the workers each covers (its place is the
    # first's) and the member that sent it.
    partials: dict[int, list[tuple[tuple[int, ...], int]]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.received = [set() for _ in range(self.world_size)]
        self.stats = [None] * self.world_size

    def chunks_of(self, w: int) -> int | None:
        """How many chunks worker `w` sends for this key (None: not known yet)."""
        return self.num_chunks if self.collective is None else self.collective.expected_chunks(w)

    def missing_workers(self) -> list[int]:
        return [w for w in sorted(self.expected) if len(self.received[w]) != self.chunks_of(w)]

    def chunk_complete(self, index: int) -> bool:
        parts = self.chunks.get(index)
        covered = {w for covers, _ in self.partials.get(index, ()) for w in covers}
        return parts is not None and all(parts[w] is not None or w in covered for w in self.expected)


@dataclasses.dataclass(eq=False)
class Reduce:
    """One complete chunk to average, in worker-id order: computing it reads nothing of the
    table, so it may run off the event loop; `ReductionTable.reduced` takes its result."""

    key: TensorKey
    index: int
    contributors: tuple[int, ...]
    data: list[bytes | memoryview]
    dtype: DType
    divide: bool
    finite_only: bool
    to: tuple[int, ...]  # the live workers when it completed (less those a partial sum covers)
    # Who sent each of `data` (a host group's partial sum covers several contributors).
    senders: tuple[int, ...] = ()

    @property
    def scattered(self) -> bool:
        """A REDUCE_SCATTER chunk: its result is copied into the rank parts, not sent as is."""
        return self.key.collective_kind is CollectiveKind.REDUCE_SCATTER

    @property
    def nbytes(self) -> int:
        return sum(payload_nbytes(d) for d in self.data)

    @property
    def count(self) -> int:
        """How many workers' contributions the average stands for (a partial sum stands for its
        host group)."""
        return len(self.contributors)


@dataclasses.dataclass
class _Barrier:
    step: int
    name: str
    deadline: float
    opened: float = 0.0
    expected: frozenset[int] = frozenset()
    arrived: set[int] = dataclasses.field(default_factory=set)
    # Arrivals carry state digests (`digests.vote` decides whom the barrier releases) or none.
    with_digests: bool = False
    digests: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Failure:
    code: Status
    message: str
    culprit: int | None
    culprit_code: Status
    answered: set[tuple[int, TensorKey | str]] = dataclasses.field(default_factory=set)

    def code_for(self, worker_id: int) -> Status:
        return self.culprit_code if worker_id == self.culprit else self.code


class ReductionTable:
    """All reductions of one job. Not thread-safe: the coordinator calls it from its event loop."""

    def __init__(
        self,
        world_size: int,
        chunk_elements: int,
        step_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        on_key_reduced: Callable[[float], None] | None = None,
        on_barrier_released: Callable[[float], None] | None = None,
        on_worker_loss: str = "abort",
        partition: tuple[PartitionMap, int] | None = None,
        averager: Averager | None = None,
        defer_reductions: bool = False,
        host_groups: HostGroups | None = None,
    ) -> None:
        """`on_key_reduced` and `on_barrier_released` receive the seconds from the first
        contribution or arrival to completion (for metrics). `partition` (map, own index): this
        table expects and averages only the chunks the map assigns to that partition. `averager`
        (one thread by default) computes the averages; the coordinator shares one across jobs.
        With `defer_reductions`, complete chunks are not averaged here but queued as `Reduce`
        requests (`take_reductions`) whose results come back through `reduced`. `host_groups`:
        the job's host groups (formed later, when its world completes), whose members' partial
        sums this table takes."""
        if on_worker_loss not in ("abort", "continue"):
            raise ValueError(f"on_worker_loss must be abort or continue, got {on_worker_loss!r}")
        self.world_size = world_size
        self.on_worker_loss = on_worker_loss
        self._roster = Participation(world_size, rejoin_next_step=on_worker_loss == "continue")
        self._on_key_reduced = on_key_reduced
        self._on_barrier_released = on_barrier_released
        self.chunk_elements = chunk_elements
        self.step_timeout = step_timeout
        self._clock = clock
        self._averager = averager if averager is not None else Averager()
        self._defer = defer_reductions
        self._reductions: list[Reduce] = []
        self._pending: dict[tuple[KeyKind, int], _Slot] = {}
        self._barriers: dict[tuple[int, str], _Barrier] = {}
        self._last_step: dict[tuple[KeyKind, int], int] = {}
        self._last_barrier: dict[str, int] = {}
        self._diverged: list[tuple[int, str]] = []
        self._worker_step: list[int | None] = [None] * world_size
        self._failed: collections.OrderedDict[int, _Failure] = collections.OrderedDict()
        self._buffered = [0] * world_size
        self._sample_ranges = SampleRangeAssigner(world_size)
        self._step_stats = StepStatistics(clock)
        self._open_steps: set[int] = set()  # steps seen, neither failed nor counted yet
        self.steps_completed = 0
        self.keys_reduced = 0
        self.contributions_counted = 0
        self._last_completed_step: int | None = None
        self._partition = partition
        self.host_groups = host_groups if host_groups is not None else HostGroups("", enabled=False)

    # --- queries ------------------------------------------------------------------------------

    def buffered_bytes(self, worker_id: int) -> int:
        """Bytes of `worker_id`'s contributions held while waiting for other workers."""
        return self._buffered[worker_id]

    def has_pending(self) -> bool:
        return bool(self._pending or self._barriers)

    def pending_steps(self) -> set[int]:
        steps = {slot.key.step for slot in self._pending.values()}
        steps.update(b.step for b in self._barriers.values())
        return steps

    def unsettled_steps(self) -> set[int]:
        """Steps still pending, or done here but not yet counted complete (a worker expected at
        them has not moved on): partitioned coordinators fail these when another partition lost a worker."""
        return self.pending_steps() | self._open_steps

    @property
    def last_completed_step(self) -> int | None:
        return self._last_completed_step

    def live_workers(self) -> tuple[int, ...]:
        return self._roster.live_workers()

    def take_diverged(self) -> list[tuple[int, str]]:
        """Workers whose state digest differed from the majority's at a barrier since the last
        call, and why: the coordinator evicts them."""
        diverged, self._diverged = self._diverged, []
        return diverged

    def first_step(self, worker_id: int) -> int:
        """The first step `worker_id` takes part in (0 unless it joined a running job)."""
        return self._roster.first_step(worker_id)

    def take_reductions(self) -> list[Reduce]:
        """The chunks that became complete since the last call (with `defer_reductions`)."""
        taken, self._reductions = self._reductions, []
        return taken

    def reduced(
        self,
        request: Reduce,
        result: bytes | memoryview | None,
        error: SumOverflow | NonFiniteContribution | None = None,
    ) -> list[Outgoing]:
        """Takes the average of `request` (or why it has none): sends it, or fails its step. A
        result whose step failed meanwhile is dropped (nothing is returned for it)."""
        out = self._reduced(request, result, error)
        self._settle_steps()
        return out

    # --- membership ---------------------------------------------------------------------------

    def worker_lost(self, worker_id: int, reason: str) -> list[Outgoing]:
        """abort: fails every step in flight and refuses new keys until a replacement joins.
        continue: keys go on with the survivors (see `_continue_without`)."""
        self._roster.lost(worker_id, reason)
        self._worker_step[worker_id] = None
        out = self._tell_departure(worker_id, reason)
        if self.on_worker_loss == "continue":
            out += self._continue_without(worker_id, reason)
        else:
            for step in sorted(self.pending_steps()):
                out += self._fail_step(
                    step, f"step {step} aborted: worker {worker_id} {reason}", culprit=worker_id
                )
        self._settle_steps()
        return out

    def _tell_departure(self, worker_id: int, reason: str) -> list[Outgoing]:
        """`worker_id` left: its host group (if any) ends, and every other live worker is told
        first (its group's members stop summing with it; point-to-point messages with it fail)."""
        self.host_groups.dissolve(worker_id)
        others = tuple(w for w in sorted(self.live_workers()) if w != worker_id)
        notice = MemberLeftOut(worker_id, reason, aborts=self.on_worker_loss == "abort")
        return [Outgoing(others, notice)] if others else []

    def copy_held_data(self, worker_id: int) -> None:
        """Replaces the views of `worker_id`'s contributions still held by private copies, so
        that memory its sender can still write is never read again (its transport decides)."""
        for slot in self._pending.values():
            for parts in slot.chunks.values():
                part = parts[worker_id]
                if isinstance(part, memoryview):
                    parts[worker_id] = bytes(part)
            if slot.collective is not None:
                slot.collective.copy_held(worker_id)

    def worker_joined(self, worker_id: int) -> None:
        """A (re)joined worker takes part from the next step that has not started yet."""
        self._roster.joined(worker_id)
        self._worker_step[worker_id] = None

    def _continue_without(self, lost: int, reason: str) -> list[Outgoing]:
        """A lost worker's complete contributions stay counted; its partial ones are dropped,
        and keys then complete with the others, each average reporting its contributors. If a
        chunk already averaged with the lost worker's data would be mixed with chunks averaged
        without it, that step fails instead: no average is ever a mixture."""
        out: list[Outgoing] = []
        for slot in list(self._pending.values()):
            if lost not in slot.expected or len(slot.received[lost]) == slot.chunks_of(lost):
                continue
            out += self._stop_expecting(slot, lost, f"worker {lost} {reason}")
        for bar in list(self._barriers.values()):
            if lost in bar.expected and lost not in bar.arrived:
                bar.expected = bar.expected - {lost}
                out += self._maybe_release(bar)
        return out

    def _stop_expecting(self, slot: _Slot, worker: int, why: str) -> list[Outgoing]:
        """`slot` completes without `worker` (its partial contribution dropped), or its step fails
        when that would mix averages with and without it, or leave no contributor."""
        step = slot.key.step
        if slot.key.kind is KeyKind.COLLECTIVE and slot.key.collective_kind is not CollectiveKind.REDUCE:
            return self._fail_step(
                step, f"step {step} aborted: {why}; {slot.key} needs every rank", culprit=worker
            )
        if slot.reduced or slot.inflight:
            return self._fail_step(
                step,
                f"step {step} aborted: {why} after part of {slot.key} was averaged with its data",
                culprit=worker,
            )
        slot.expected = slot.expected - {worker}
        for index, parts in slot.chunks.items():
            self._buffered[worker] -= slot.charged[index][worker]
            slot.charged[index][worker] = 0
            parts[worker] = None
        slot.received[worker].clear()
        if not slot.expected:
            return self._fail_step(step, f"step {step} aborted: every contributor of {slot.key} is lost")
        out: list[Outgoing] = []
        for index in sorted(slot.chunks):
            if slot.key.slot in self._pending and slot.chunk_complete(index):
                out += self._reduce(slot, index)
        return out

    def start_at(self, request: StartAtIn) -> list[Outgoing]:
        """A worker that joined a running job takes part from a later step (before it sent
        anything): what waits for it in earlier steps completes without it, and every other member
        hears its new first step."""
        w, step = request.worker_id, request.step
        refusal = start_at_refusal(
            request,
            plan=self._roster.plan(w),
            first=self._roster.first_step(w),
            sent=self._worker_step[w],
            partitioned=self._partition is not None,
        )
        if refusal is not None:
            log.info("rejected: %s", refusal.message, extra={"step": step, "worker_id": w})
            return [Outgoing((w,), ErrorOut(int(refusal.code), refusal.message, step, start_at=request))]
        self._roster.start_at(w, step)
        out: list[Outgoing] = []
        why = f"worker {w} takes part from step {step}"
        for slot in list(self._pending.values()):
            if slot.key.step < step and w in slot.expected:
                out += self._stop_expecting(slot, w, why)
        for bar in list(self._barriers.values()):
            if bar.step < step and w in bar.expected:
                bar.expected = bar.expected - {w}
                out += self._maybe_release(bar)
        others = tuple(v for v in sorted(self.live_workers()) if v != w)
        if others:
            out.append(Outgoing(others, MemberJoinedOut(w, step)))
        self._settle_steps()
        return out

    # --- contributions ------------------------------------------------------------------------

    def contribute(self, chunk: ChunkIn, *, borrowed: bool = False) -> list[Outgoing]:
        """Accepts, rejects or reduces one chunk of one worker's contribution. `borrowed`: its
        data lies in memory its sender lent (shared memory), so holding it costs this process
        nothing and it does not count toward the sender's in-flight budget (which, counted,
        would hold back a worker whose keys come in another order than the others' for good)."""
        out = self._contribute(chunk, borrowed)
        self._settle_steps()
        return out

    def _contribute(self, chunk: ChunkIn, borrowed: bool = False) -> list[Outgoing]:
        w, key = chunk.worker_id, chunk.key
        # A partial sum is sent when its host summed it, not in the order of the sender's own
        # steps: "steps only move forward" holds for what a worker sends of its own.
        rejected = self._admit(w, key.step, key, what=str(key), in_order=not chunk.covers)
        if rejected is not None:
            return rejected
        if chunk.covers and (bad := covers_refusal(w, chunk.covers, self.world_size, self.host_groups)):
            return self._reject(w, key.step, bad.code, key, bad.message)
        if (
            self._partition is not None
            and key.kind is KeyKind.COLLECTIVE
            and key.collective_kind is not CollectiveKind.REDUCE
        ):
            return self._reject(
                w,
                key.step,
                _PRECONDITION,
                key,
                f"worker {w} sent {key}: partitioned coordinators average only REDUCE collectives, "
                f"not {key.collective_kind.name}",
            )
        if (foreign := self._foreign_chunk(key, chunk.offset // self.chunk_elements)) is not None:
            return self._reject(w, key.step, _INVALID, key, f"worker {w} sent {foreign}")
        slot = self._pending.get(key.slot)
        if slot is not None and slot.key.step != key.step:
            return self._reject(
                w,
                key.step,
                _PRECONDITION,
                key,
                f"worker {w} sent {key}, but {key.describe()} is being reduced at step {slot.key.step}",
            )
        if slot is None:
            last = self._last_step.get(key.slot)
            if last is not None and key.step <= last:
                if key.step == last:
                    return self._reject(
                        w,
                        key.step,
                        _INVALID,
                        key,
                        f"worker {w} sent {key} again after it was reduced; the first copy counts",
                    )
                return self._reject(
                    w,
                    key.step,
                    _PRECONDITION,
                    key,
                    f"worker {w} sent {key}, which is stale: {key.describe()} was reduced at step {last}",
                )
        covers = chunk.covers or (w,)
        out: list[Outgoing] = []
        for v in covers:
            out += self._advance_worker(v, key.step)
        if (native := self._native_problem(chunk, slot)) is not None:
            code, problem = native
            return out + self._fail_step(key.step, problem, culprit=w, culprit_code=code, key=key)
        if slot is None:
            slot = self._open(key, chunk.header)
            behind = self._left_behind(key.step, slot.expected, str(key), key)
            if behind:
                return out + behind
        elif (mismatch := self._header_mismatch(slot, chunk)) is not None:
            return out + self._fail_step(key.step, mismatch, culprit=w, culprit_code=_INVALID, key=key)
        for v in covers:
            if v not in slot.expected:
                return out + self._reject(
                    w,
                    key.step,
                    _PRECONDITION,
                    key,
                    f"worker {v} is not a contributor of {key}; it (re)joined later",
                )
        index = chunk.offset // self.chunk_elements
        for v in covers:
            if index in slot.received[v]:
                by = "" if v == w else f" (in a partial sum from worker {w})"
                return out + self._reject(
                    w,
                    key.step,
                    _INVALID,
                    key,
                    f"worker {v} sent the chunk at offset {chunk.offset} of {key} twice{by}; the first "
                    "copy counts",
                )
        if key.kind is KeyKind.WHOLE_MODEL:
            known = slot.stats[w]
            if known is not None and known != chunk.stats:
                return out + self._reject(
                    w,
                    key.step,
                    _INVALID,
                    key,
                    f"worker {w} sent sample stats {chunk.stats} in one chunk of {key} and "
                    f"{known} in another",
                )
            slot.stats[w] = chunk.stats
        for v in covers:
            slot.received[v].add(index)
        if slot.collective is not None:
            return out + self._route(slot, chunk, index)
        parts = slot.chunks.setdefault(index, [None] * self.world_size)
        # A partial sum takes its group's first place, whoever of the group sent it, so the sum
        # runs in the same order whichever member summed this chunk.
        parts[covers[0]] = chunk.data
        if chunk.covers:
            slot.partials.setdefault(index, []).append((covers, w))
        charged = 0 if borrowed else payload_nbytes(chunk.data)
        slot.charged.setdefault(index, [0] * self.world_size)[w] = charged
        self._buffered[w] += charged
        self._step_stats.bytes_received(key.step, payload_nbytes(chunk.data))
        if slot.chunk_complete(index):
            out += self._reduce(slot, index)
        return out

    def barrier(self, arrival: BarrierIn) -> list[Outgoing]:
        """Records one worker's arrival at a barrier; releases it when every worker arrived."""
        out = self._barrier(arrival)
        self._settle_steps()
        return out

    def _barrier(self, arrival: BarrierIn) -> list[Outgoing]:
        w, step, name = arrival.worker_id, arrival.step, arrival.name
        what = f"step {step} barrier {name!r}"
        rejected = self._admit(w, step, name, what=what)
        if rejected is not None:
            return rejected
        last = self._last_barrier.get(name)
        if last is not None and step <= last:
            return self._reject(
                w,
                step,
                _PRECONDITION,
                name,
                f"worker {w} arrived at {what}, but barrier {name!r} was already released at step {last}",
            )
        out = self._advance_worker(w, step)
        bar = self._barriers.get((step, name))
        if bar is None:
            now = self._clock()
            self._roster.saw_step(step)
            bar = self._barriers[(step, name)] = _Barrier(
                step,
                name,
                now + self.step_timeout,
                now,
                expected=self._roster.expected(step),
                with_digests=arrival.digest is not None,
            )
            self._open_steps.add(step)
            behind = self._left_behind(step, bar.expected, what)
            if behind:
                return out + behind
        if w in bar.arrived:
            return out + self._reject(w, step, _INVALID, name, f"worker {w} arrived at {what} twice")
        if bar.with_digests != (arrival.digest is not None):
            said = "with a state digest" if arrival.digest is not None else "without a state digest"
            return out + self._reject(
                w,
                step,
                _INVALID,
                name,
                f"worker {w} arrived at {what} {said}, the others the other way: every arrival at "
                "one barrier carries a digest or none does",
            )
        bar.arrived.add(w)
        if arrival.digest is not None:
            bar.digests[w] = arrival.digest
        return out + self._maybe_release(bar)

    def _maybe_release(self, bar: _Barrier) -> list[Outgoing]:
        if not bar.expected <= bar.arrived:
            return []
        released = self.live_workers()
        if bar.with_digests:
            # Only the digests of workers still expected count (a lost one's is void).
            verdict = vote(bar.step, bar.name, {w: d for w, d in bar.digests.items() if w in bar.expected})
            if verdict.undecided is not None:
                return self._fail_step(bar.step, verdict.undecided, code=_PRECONDITION)
            self._diverged += verdict.diverged.items()
            released = tuple(w for w in released if w not in verdict.diverged)
        del self._barriers[(bar.step, bar.name)]
        self._last_barrier[bar.name] = bar.step
        if self._on_barrier_released is not None:
            self._on_barrier_released(self._clock() - bar.opened)
        return [Outgoing(released, BarrierReleaseOut(bar.step, bar.name))] if released else []

    def sample_ranges(self, request: SampleRangeRequestIn) -> list[Outgoing]:
        """Answers a sample-range request (see `SampleRangeAssigner`)."""
        return self._sample_ranges.answer(request)

    def expire(self) -> list[Outgoing]:
        """Fails every step that has a key or barrier past its deadline."""
        now = self._clock()
        out: list[Outgoing] = []
        for slot in list(self._pending.values()):
            # A slot with every chunk received is only being averaged: that is no one's delay.
            if slot.deadline <= now and slot.key.slot in self._pending and slot.missing_workers():
                missing = ", ".join(map(str, slot.missing_workers()))
                out += self._fail_step(
                    slot.key.step,
                    f"{slot.key}: no complete contribution from worker(s) {missing} within the "
                    f"step timeout of {self.step_timeout:g} s",
                    code=_DEADLINE,
                )
        for bar in list(self._barriers.values()):
            if bar.deadline <= now and (bar.step, bar.name) in self._barriers:
                missing = ", ".join(str(w) for w in sorted(bar.expected - bar.arrived))
                out += self._fail_step(
                    bar.step,
                    f"step {bar.step} barrier {bar.name!r}: worker(s) {missing} did not arrive "
                    f"within the step timeout of {self.step_timeout:g} s",
                    code=_DEADLINE,
                )
        return out

    def step_failure_reported(self, report: StepFailureIn) -> list[Outgoing]:
        """A host group member found what fails a step on its host (a member's non-finite value,
        a host sum beyond its dtype): the step fails for everyone, naming the culprit, when the
        sender takes part in it and it is open (server/message_rules.py); else the sender alone
        is answered."""
        w, step = report.worker_id, report.step
        subject: TensorKey | str = report.key if report.key is not None else "step failure"
        refusal = reporter_refusal(report, self.host_groups.group_of(w))
        if refusal is None:
            # The rules of every message of a step: a failed step answers with its failure, and
            # a step the sender takes no part in is refused.
            answered = self._admit(w, step, subject, what=f"a failure report of step {step}", in_order=False)
            if answered is not None:
                return answered
            refusal = closed_step_refusal(report, self._step_view(step, report.key))
        if refusal is not None:
            return self._reject(w, step, refusal.code, subject, refusal.message)
        culprit_code = status_code_from_value(report.code)
        out = self._fail_step(
            step, report.message, culprit=report.culprit, culprit_code=culprit_code, key=report.key
        )
        self._settle_steps()
        return out

    def _step_view(self, step: int, key: TensorKey | None) -> StepView:
        """What decides whether `step` (of `key`, if named) is open to a report."""
        slot = self._pending.get(key.slot) if key is not None else None
        return StepView(
            newest=self._roster.newest_step,
            pending=step in self.pending_steps(),
            key_pending_at=slot.key.step if slot is not None else None,
            key_last=self._last_step.get(key.slot) if key is not None else None,
        )

    def fail_all(self, code: Status, reason: str) -> list[Outgoing]:
        """Fails every step in flight (used by a shutdown that cannot wait any longer)."""
        out: list[Outgoing] = []
        for step in sorted(self.pending_steps()):
            out += self._fail_step(step, f"step {step} aborted: {reason}", code=code)
        return out

    def fail_step(self, step: int, message: str, code: Status, culprit: int | None = None) -> list[Outgoing]:
        """Fails `step` for every worker (partitioned coordinators: another partition failed it)."""
        culprit_code = code if culprit is None else _ABORTED
        out = self._fail_step(step, message, culprit=culprit, code=code, culprit_code=culprit_code)
        self._settle_steps()
        return out

    # --- internals ----------------------------------------------------------------------------

    def _admit(
        self, w: int, step: int, subject: TensorKey | str, *, what: str, in_order: bool = True
    ) -> list[Outgoing] | None:
        """Checks that apply to every message of a step; returns the answer when it is refused.
        `in_order`: the message must not be older than the worker's newest step."""
        failure = self._failed.get(step)
        if failure is not None:
            if (w, subject) in failure.answered:
                return []
            failure.answered.add((w, subject))
            return [error_to(w, step, failure.code_for(w), failure.message, subject, step_failed=True)]
        joined_at = self._roster.first_step(w)
        if step < joined_at:
            return [
                error_to(
                    w,
                    step,
                    _PRECONDITION,
                    f"worker {w} sent {what}, but it rejoined during step {joined_at - 1} and takes "
                    f"part from step {joined_at}",
                    subject,
                )
            ]
        vacant = self._roster.vacant
        if vacant and self.on_worker_loss == "abort":
            lost = ", ".join(f"worker {v} {why}" for v, why in sorted(vacant.items()))
            return [
                error_to(
                    w,
                    step,
                    _ABORTED,
                    f"{what} refused: the world is incomplete ({lost}); waiting for a replacement to join",
                    subject,
                    culprit=min(vacant),
                )
            ]
        known = self._worker_step[w]
        if in_order and known is not None and step < known:
            return [
                error_to(
                    w,
                    step,
                    _PRECONDITION,
                    f"worker {w} sent {what}, but it already sent step {known}; steps only move forward",
                    subject,
                )
            ]
        return None

    def _advance_worker(self, w: int, step: int) -> list[Outgoing]:
        """Records that `w` reached `step`; fails older steps it left without contributing."""
        known = self._worker_step[w]
        self._worker_step[w] = step if known is None else max(known, step)
        if known is not None and step <= known:
            return []
        out: list[Outgoing] = []
        abandoned = [
            (slot.key.step, str(slot.key))
            for slot in self._pending.values()
            if slot.key.step < step and w in slot.missing_workers() and not self._summed_on_host(w, slot.key)
        ]
        abandoned += [
            (bar.step, f"step {bar.step} barrier {bar.name!r}")
            for bar in self._barriers.values()
            if bar.step < step and w not in bar.arrived
        ]
        for old_step, what in sorted(abandoned):
            if old_step in self._failed:
                continue
            out += self._fail_step(
                old_step,
                f"worker {w} moved on to step {step} without completing {what}",
                culprit=w,
                culprit_code=_PRECONDITION,
            )
        return out

    def _open(self, key: TensorKey, header: ChunkHeader) -> _Slot:
        self._step_stats.key_opened(key.step, self._failed)
        slot = _Slot(
            key=key,
            header=header,
            num_chunks=self._owned_chunks(key, chunk_count(header.total_elements, self.chunk_elements)),
            deadline=self._clock() + self.step_timeout,
            world_size=self.world_size,
            opened=self._clock(),
            expected=self._roster.expected(key.step),
        )
        if key.kind is KeyKind.COLLECTIVE and key.collective_kind in BYTE_KINDS:
            slot.collective = ByteCollective(key, self.world_size, self.chunk_elements, header.total_elements)
        elif key.kind is KeyKind.COLLECTIVE and key.collective_kind is CollectiveKind.REDUCE_SCATTER:
            item = ITEM_SIZE[header.dtype]
            parts = tuple(b // 4 for b in key.split_bytes)  # float32 bytes: elements
            total = header.total_elements
            slot.scattered = ScatterParts(self.world_size, total, item, slot.num_chunks, parts)
        self._roster.saw_step(key.step)
        self._pending[key.slot] = slot
        self._open_steps.add(key.step)
        return slot

    def _owned_chunks(self, key: TensorKey, num_chunks: int) -> int:
        if self._partition is None:
            return num_chunks
        partition_map, own = self._partition
        return partition_map.owned_chunks(key, num_chunks, own)

    def _foreign_chunk(self, key: TensorKey, index: int) -> str | None:
        """What is wrong when chunk `index` of `key` belongs to another partition; None when ours."""
        if self._partition is None:
            return None
        partition_map, own = self._partition
        owner = partition_map.owner(key, index)
        if owner == own:
            return None
        return (
            f"chunk {index} of {key} to {partition_map.describe(own)}, but the partition map assigns it "
            f"to {partition_map.describe(owner)}"
        )

    def _left_behind(
        self, step: int, expected: frozenset[int], what: str, key: TensorKey | None = None
    ) -> list[Outgoing]:
        """Fails `step` at once when a worker expected at a key or barrier that just opened has
        already moved to a later step: steps only move forward, so it will never send it."""
        for w in sorted(expected):
            if key is not None and self._summed_on_host(w, key):
                continue
            if self._moved_past(w, step):
                return self._fail_step(
                    step,
                    f"worker {w} moved on to step {self._worker_step[w]} without completing {what}",
                    culprit=w,
                    culprit_code=_PRECONDITION,
                    key=key,
                )
        return []

    def _summed_on_host(self, w: int, key: TensorKey) -> bool:
        """Whether `w`'s part of `key` comes in its host group's partial sum, sent whenever its
        host summed it: then `w` moving on to a later step says nothing of it."""
        return self.host_groups.group_of(w) is not None and summed_on_hosts(key)

    def _moved_past(self, w: int, step: int) -> bool:
        known = self._worker_step[w]
        return known is not None and known > step

    def _settle_steps(self) -> None:
        """Counts every open step that can no longer change: nothing of it pending, and every
        worker expected at it moved to a later step or left."""
        if not self._open_steps:
            return
        pending = self.pending_steps()
        for step in sorted(self._open_steps - pending):
            if not all(self._moved_past(w, step) for w in self._roster.expected(step)):
                continue
            self._open_steps.discard(step)
            self.steps_completed += 1
            if self._last_completed_step is None or step > self._last_completed_step:
                self._last_completed_step = step

    def _header_mismatch(self, slot: _Slot, chunk: ChunkIn) -> str | None:
        ref, got, w = slot.header, chunk.header, chunk.worker_id
        first = min((v for v, r in enumerate(slot.received) if r), default=None)
        other = f"worker {first}'s" if first is not None else "the first contributor's"
        if chunk.key.num_blocks != slot.key.num_blocks:
            return (
                f"worker {w} sent {chunk.key} with num_blocks {chunk.key.num_blocks}, but "
                f"{other} says {slot.key.num_blocks}"
            )
        if chunk.key.collective_kind != slot.key.collective_kind or chunk.key.root != slot.key.root:
            return f"worker {w} sent {chunk.key}, but {other} is {slot.key}"
        if chunk.key.op != slot.key.op:
            return f"worker {w} sent {chunk.key}, but {other} is {slot.key.op.name}"
        if chunk.key.propagate_non_finite != slot.key.propagate_non_finite:
            return (
                f"worker {w} sent {chunk.key} with propagate_non_finite {chunk.key.propagate_non_finite}, "
                f"but {other} has {slot.key.propagate_non_finite}"
            )
        if got.component_sizes != ref.component_sizes:
            return (
                f"worker {w} sent {chunk.key} with component_sizes {list(got.component_sizes)}, "
                f"which differ from {other} {list(ref.component_sizes)}"
            )
        if chunk.key.collective_kind is CollectiveKind.ALL_TO_ALL and slot.collective is not None:
            return _split_mismatch(slot.collective, chunk)
        if got.total_elements != ref.total_elements or got.dtype != ref.dtype:
            return (
                f"worker {w} sent {chunk.key} as {got.total_elements} {got.dtype.name} elements, "
                f"but {other} has {ref.total_elements} {ref.dtype.name} elements"
            )
        return None

    def _native_problem(self, chunk: ChunkIn, slot: _Slot | None) -> tuple[Status, str] | None:
        """What makes `chunk` of a native collective impossible in this world (code, message)."""
        key, w = chunk.key, chunk.worker_id
        if key.kind is not KeyKind.COLLECTIVE or key.collective_kind is CollectiveKind.REDUCE:
            return None
        n = self.world_size
        if key.collective_kind is CollectiveKind.BROADCAST and key.root >= n:
            return _INVALID, f"worker {w} sent {key}, but the root {key.root} is not a rank of {n} workers"
        if key.collective_kind is CollectiveKind.ALL_TO_ALL and len(key.split_bytes) != n:
            return _INVALID, (
                f"worker {w} sent {key} with {len(key.split_bytes)} split_bytes, one per rank of {n} "
                "workers is needed"
            )
        total = chunk.header.total_elements
        if key.collective_kind is CollectiveKind.REDUCE_SCATTER and key.split_bytes:
            if len(key.split_bytes) != n or sum(key.split_bytes) != 4 * total:
                return _INVALID, (
                    f"worker {w} sent {key} of {total} elements with split_bytes "
                    f"{list(key.split_bytes)}: one per rank of {n} workers, summing to {4 * total}, needed"
                )
        elif key.collective_kind is CollectiveKind.REDUCE_SCATTER and total % n:
            return _INVALID, (
                f"worker {w} sent {key} of {total} elements, which is not divisible by the {n} ranks"
            )
        expected = slot.expected if slot is not None else self._roster.expected(key.step)
        if expected != frozenset(range(n)):
            absent = ", ".join(str(v) for v in range(n) if v not in expected)
            return _ABORTED, f"{key} needs every rank, but worker(s) {absent} take no part in step {key.step}"
        return None

    def _route(self, slot: _Slot, chunk: ChunkIn, index: int) -> list[Outgoing]:
        """Hands one chunk of a byte-moving collective to its router; sends what became ready."""
        collective = slot.collective
        assert collective is not None
        size = payload_nbytes(chunk.data)
        self._step_stats.bytes_received(slot.key.step, size)
        before = [collective.held_bytes(v) for v in range(self.world_size)]
        pieces = collective.add(
            chunk.worker_id, index, chunk.data, chunk.header.total_elements, chunk.key.split_bytes
        )
        for v in range(self.world_size):
            self._buffered[v] += collective.held_bytes(v) - before[v]
        live = self.live_workers()
        out = [self._piece_out(slot, piece, live) for piece in pieces]
        if collective.complete():
            self._finish(slot, len(slot.expected))
        return [o for o in out if o.to]

    def _piece_out(self, slot: _Slot, piece: Piece, live: tuple[int, ...]) -> Outgoing:
        to = tuple(w for w in piece.to if w in live)
        if handed_on_hosts(slot.key):
            # Every rank gets the same bytes: a host group's member gets them for its group.
            to = self.host_groups.one_per_group(to, piece.offset // self.chunk_elements + key_hash(slot.key))
        return Outgoing(
            to,
            AveragedChunkOut(
                key=slot.key,
                header=ChunkHeader(slot.header.dtype, piece.total),
                offset=piece.offset,
                data=piece.data,
                num_contributors=len(slot.expected),
            ),
        )

    def _scatter(
        self, slot: _Slot, index: int, averaged: bytes | memoryview, to: tuple[int, ...]
    ) -> list[Outgoing]:
        """REDUCE_SCATTER: the pieces of the ranks' parts that chunk `index` completes."""
        assert slot.scattered is not None
        pieces = slot.scattered.reduced(index * self.chunk_elements, averaged)
        return [o for o in (self._piece_out(slot, piece, to) for piece in pieces) if o.to]

    def _finish(self, slot: _Slot, contributors: int) -> None:
        """`slot` is done: every result went out."""
        del self._pending[slot.key.slot]
        self._last_step[slot.key.slot] = slot.key.step
        self.contributions_counted += contributors
        self.keys_reduced += 1
        if self._on_key_reduced is not None:
            self._on_key_reduced(self._clock() - slot.opened)

    def _reduce(self, slot: _Slot, index: int) -> list[Outgoing]:
        parts = slot.inflight[index] = slot.chunks.pop(index)
        contributors = tuple(sorted(slot.expected))
        placed = [(w, d) for w in contributors if (d := parts[w]) is not None]
        partials = slot.partials.pop(index, [])
        senders = {covers[0]: sender for covers, sender in partials}
        forwarded = {v for covers, sender in partials for v in covers if v != sender}
        live = self.live_workers()
        # An average a partial sum went into goes to the member that sent it, which hands it to
        # the rest of its group on their host; a reduce-scatter's parts go to every rank.
        to = live if slot.scattered is not None else tuple(v for v in live if v not in forwarded)
        request = Reduce(
            key=slot.key,
            index=index,
            contributors=contributors,
            data=[d for _, d in placed],
            dtype=slot.header.dtype,
            divide=slot.key.op is not ReduceOp.SUM,
            finite_only=not slot.key.propagate_non_finite,
            to=to,
            senders=tuple(senders.get(w, w) for w, _ in placed),
        )
        if self._defer:
            self._reductions.append(request)
            return []
        try:
            # A reduce-scatter's chunks are copied into its result, never sent as they are: no
            # output buffer (the shared-memory arena) is worth taking for them.
            average = self._averager.average if request.scattered else self._averager.reduce
            averaged = average(
                request.data,
                divide=request.divide,
                dtype=request.dtype,
                finite_only=request.finite_only,
                count=request.count,
            )
        except (SumOverflow, NonFiniteContribution) as exc:
            return self._reduced(request, None, exc)
        return self._reduced(request, averaged)

    def _reduced(
        self,
        request: Reduce,
        averaged: bytes | memoryview | None,
        error: SumOverflow | NonFiniteContribution | None = None,
    ) -> list[Outgoing]:
        slot = self._pending.get(request.key.slot)
        index = request.index
        if slot is None or slot.key != request.key or index not in slot.inflight:
            return []  # its step failed (or its job was reset) while it was averaged
        contributors = request.contributors
        if isinstance(error, SumOverflow):
            exc = error
            element = index * self.chunk_elements + exc.element
            what = "sum" if slot.key.op is ReduceOp.SUM else "average"
            return self._fail_step(
                slot.key.step,
                f"the {what} of {slot.key} overflows {exc.dtype.name.lower()} at element {element}; "
                "the step is halted",
                key=slot.key,
            )
        if isinstance(error, NonFiniteContribution):
            culprit = (request.senders or contributors)[error.position]
            element = index * self.chunk_elements + error.element
            return self._fail_step(
                slot.key.step,
                f"worker {culprit} sent a non-finite value (NaN or Inf) in {slot.key} at element "
                f"{element}; the step is halted",
                culprit=culprit,
                culprit_code=_INVALID,
                key=slot.key,
            )
        assert averaged is not None
        del slot.inflight[index]
        for w, charged in enumerate(slot.charged.pop(index)):
            self._buffered[w] -= charged
        if slot.scattered is not None:
            outgoing = self._scatter(slot, index, averaged, request.to)
            slot.reduced += 1
            if slot.reduced == slot.num_chunks:
                self._finish(slot, len(contributors))
            return outgoing
        slot.reduced += 1
        stats = self._global_stats(slot) if slot.key.kind is KeyKind.WHOLE_MODEL else None
        outgoing = [
            Outgoing(
                request.to,
                AveragedChunkOut(
                    key=slot.key,
                    header=slot.header,
                    offset=index * self.chunk_elements,
                    data=averaged,
                    num_contributors=len(contributors),
                    stats=stats,
                ),
            )
        ]
        if slot.reduced == slot.num_chunks:
            self._finish(slot, len(contributors))
        return outgoing

    @staticmethod
    def _global_stats(slot: _Slot) -> SampleStats:
        stats = [s for w, s in enumerate(slot.stats) if s is not None and w in slot.expected]
        total = sum(s.total for s in stats)
        if total:
            loss = sum(s.loss * s.total for s in stats) / total
        else:
            loss = sum(s.loss for s in stats) / len(stats)
        return SampleStats(loss, sum(s.correct for s in stats), total)

    def _fail_step(
        self,
        step: int,
        message: str,
        *,
        culprit: int | None = None,
        culprit_code: Status = _ABORTED,
        code: Status = _ABORTED,
        key: TensorKey | None = None,
    ) -> list[Outgoing]:
        """Drops everything of `step` and tells every live worker once."""
        if step in self._failed:
            return []
        failure = _Failure(code, message, culprit, culprit_code)
        self._failed[step] = failure
        self._open_steps.discard(step)
        while len(self._failed) > _FAILED_STEPS_KEPT:
            self._failed.popitem(last=False)
        for ident, slot in list(self._pending.items()):
            if slot.key.step == step:
                for charged in slot.charged.values():
                    for w, n in enumerate(charged):
                        self._buffered[w] -= n
                if slot.collective is not None:
                    for w in range(self.world_size):
                        self._buffered[w] -= slot.collective.held_bytes(w)
                del self._pending[ident]
                self._last_step[ident] = step
        for ident2 in [k for k, b in self._barriers.items() if b.step == step]:
            del self._barriers[ident2]
        log.warning("step %d failed: %s", step, message, extra={"step": step, "worker_id": culprit})
        out: list[Outgoing] = []
        live = self.live_workers()
        others = tuple(w for w in live if w != culprit)
        for code_, to in ((code, others), (culprit_code, (culprit,) if culprit in live else ())):
            if to:
                event = ErrorOut(int(code_), message, step, key, culprit, step_failed=True)
                out.append(Outgoing(to, event))
        return out

    def _reject(
        self, w: int, step: int, code: Status, subject: TensorKey | str, message: str
    ) -> list[Outgoing]:
        """Refuses one message (about a key, or a barrier name) to its sender only."""
        log.info("rejected: %s", message, extra={"step": step, "worker_id": w})
        return [error_to(w, step, code, message, subject)]


def _split_mismatch(collective: ByteCollective, chunk: ChunkIn) -> str | None:
    """ALL_TO_ALL: each rank sends its own total and splits, the same in every one of its chunks."""
    w, key = chunk.worker_id, chunk.key
    total, splits = collective.totals[w], collective.splits[w]
    if total is None or (total == chunk.header.total_elements and splits == key.split_bytes):
        return None
    return (
        f"worker {w} sent a chunk of {key} declaring {chunk.header.total_elements} bytes split "
        f"{list(key.split_bytes)}, but its first chunk declared {total} bytes split {list(splits)}"
    )
