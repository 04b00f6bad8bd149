"""The coordinator's reduction table: which contributions are pending, and what to send when.

Pure bookkeeping with no I/O: every call returns the messages to send (`Outgoing`) and the
coordinator delivers them. One pending slot exists per key identity (a block index, a non-block
component, the whole model) and holds only the chunks that not every worker has sent yet; a chunk
is averaged as soon as the last worker's copy arrives and its buffers are freed.

The table decides, per message, which rules apply and in what order; it composes parts with one
job each, and `step_actions` keeps them consistent (a step failed everywhere at once, an average
sent, a barrier released, a worker moving on failing what it left behind):
- `step_ledger` (the steps: admit, advance, fail, settle) over `participation` (which workers a
  step waits for: lost, rejoined, live);
- `pending_keys` (a slot per key identity) holding `slots` of each kind (averaged, scattered,
  routed: what a key's chunks become), which check `chunk_rules` (shapes, agreement across ranks);
- `barriers` (arrivals and the digest vote); `chunk_averages` (a complete chunk averaged at
  once or queued as a `Reduce` for the coordinator's `Reducer`, and the failure an averaging
  error is);
- `placement` (a worker's own chunk or a host group's partial sum: whose contribution a chunk is
  and who gets what it went into), `chunk_ownership` (which chunks are this coordinator's: all,
  or a partition's) and `inflight` (the bytes held per worker);
- beside them: `sample_ranges`, `step_stats` (per-step counts, logged at DEBUG), `outgoing`,
  `message_rules` (whether a report, a `StartAt` or a partial sum's cover is believed).

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

import logging
import time
from collections.abc import Callable

from gradserver.common.averaging import Averager
from gradserver.common.chunking import payload_nbytes
from gradserver.common.errors import Status, status_code_from_value
from gradserver.common.messages import (
    BarrierIn,
    ChunkIn,
    ErrorOut,
    KeyKind,
    MemberJoinedOut,
    MemberLeftOut,
    SampleRangeRequestIn,
    StartAtIn,
    StepFailureIn,
    TensorKey,
)
from gradserver.common.partition_map import PartitionMap

from .barriers import Barrier, Barriers
from .chunk_averages import AveragingError, ChunkAverages
from .chunk_ownership import ChunkOwnership, chunk_ownership
from .chunk_rules import native_problem
from .host_groups import HostGroups
from .inflight import InFlightBytes
from .message_rules import StepView, closed_step_refusal, reporter_refusal, start_at_refusal
from .outgoing import Outgoing, error_to
from .participation import Participation
from .pending_keys import PendingKeys
from .placement import Placements
from .sample_ranges import SampleRangeAssigner
from .slots import Data, Reduce, Slot, SlotSetting
from .step_actions import StepActions
from .step_ledger import StepLedger
from .step_stats import StepStatistics

__all__ = ["Reduce", "ReductionTable"]

log = logging.getLogger("gradserver.server.reduction")

_ABORTED = Status.ABORTED
_INVALID = Status.INVALID_ARGUMENT
_PRECONDITION = Status.FAILED_PRECONDITION
_DEADLINE = Status.DEADLINE_EXCEEDED


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
        partition: ChunkOwnership | tuple[PartitionMap, int] | None = None,
        averager: Averager | None = None,
        defer_reductions: bool = False,
        host_groups: HostGroups | None = None,
    ) -> None:
        """`on_key_reduced` and `on_barrier_released` receive the seconds from the first
        contribution or arrival to completion (for metrics). `partition` (a `ChunkOwnership`,
        or (map, own index) for a partition's): this table expects and averages only the chunks
        it owns. `averager` (one thread by default) computes the averages; the coordinator
        shares one across jobs. With `defer_reductions`, complete chunks are not averaged here
        but queued as `Reduce` requests (`take_reductions`) whose results come back through
        `reduced`. `host_groups`: the job's host groups (formed later, when its world
        completes), whose members' partial sums this table takes."""
        if on_worker_loss not in ("abort", "continue"):
            raise ValueError(f"on_worker_loss must be abort or continue, got {on_worker_loss!r}")
        self.world_size = world_size
        self.on_worker_loss = on_worker_loss
        self.chunk_elements = chunk_elements
        self.step_timeout = step_timeout
        self._clock = clock
        self._averages = ChunkAverages(
            averager if averager is not None else Averager(), defer=defer_reductions
        )
        self._roster = Participation(world_size, rejoin_next_step=on_worker_loss == "continue")
        self._ledger = StepLedger(self._roster, abort_on_loss=on_worker_loss == "abort")
        self.host_groups = host_groups if host_groups is not None else HostGroups("", enabled=False)
        self._placements = Placements(self.host_groups)
        self._ownership = chunk_ownership(partition)
        self._inflight = InFlightBytes(world_size)
        self._step_stats = StepStatistics(clock)
        self._keys = PendingKeys(
            SlotSetting(world_size, chunk_elements, self._placements, self._roster.live_workers),
            step_timeout=step_timeout,
            clock=clock,
            ownership=self._ownership,
            inflight=self._inflight,
            on_key_reduced=on_key_reduced,
        )
        self._bars = Barriers(clock, on_barrier_released)
        self._sample_ranges = SampleRangeAssigner(world_size)
        self._act = StepActions(
            roster=self._roster,
            ledger=self._ledger,
            keys=self._keys,
            barriers=self._bars,
            placements=self._placements,
            averages=self._averages,
            step_stats=self._step_stats,
            chunk_elements=chunk_elements,
        )

    # --- queries ------------------------------------------------------------------------------

    def buffered_bytes(self, worker_id: int) -> int:
        """Bytes of `worker_id`'s contributions held while waiting for other workers."""
        return self._inflight.of(worker_id)

    def has_pending(self) -> bool:
        return bool(self._keys or self._bars)

    def pending_steps(self) -> set[int]:
        return self._keys.steps() | self._bars.steps()

    def unsettled_steps(self) -> set[int]:
        """Steps still pending, or done here but not yet counted complete (a worker expected at
        them has not moved on): partitioned coordinators fail these when another partition lost a worker."""
        return self.pending_steps() | self._ledger.open_steps

    @property
    def steps_completed(self) -> int:
        return self._ledger.steps_completed

    @property
    def last_completed_step(self) -> int | None:
        return self._ledger.last_completed_step

    @property
    def keys_reduced(self) -> int:
        return self._keys.keys_reduced

    @property
    def contributions_counted(self) -> int:
        return self._keys.contributions_counted

    def live_workers(self) -> tuple[int, ...]:
        return self._roster.live_workers()

    def take_diverged(self) -> list[tuple[int, str]]:
        """Workers whose state digest differed from the majority's at a barrier since the last
        call, and why: the coordinator evicts them."""
        return self._bars.take_diverged()

    def first_step(self, worker_id: int) -> int:
        """The first step `worker_id` takes part in (0 unless it joined a running job)."""
        return self._roster.first_step(worker_id)

    def resumes_at(self, step: int) -> None:
        """The job resumes at `step` (its workers rejoined a restarted coordinator): the steps
        before it are behind the job, so `step` is the next one, which a failure report may
        fail before any key of it opened, and a replacement is planned from it."""
        self._roster.saw_step(step - 1)

    def take_reductions(self) -> list[Reduce]:
        """The chunks that became complete since the last call (with `defer_reductions`)."""
        return self._averages.take()

    # The parts' state as tests/test_fuzz.py checks its invariants (read only).
    @property
    def _worker_step(self) -> list[int | None]:
        return self._ledger.worker_steps

    @property
    def _pending(self) -> dict[tuple[KeyKind, int], Slot]:
        return self._keys.by_identity

    @property
    def _barriers(self) -> dict[tuple[int, str], Barrier]:
        return self._bars.pending

    # --- membership ---------------------------------------------------------------------------

    def worker_lost(self, worker_id: int, reason: str) -> list[Outgoing]:
        """abort: fails every step in flight and refuses new keys until a replacement joins.
        continue: keys go on with the survivors (see `_continue_without`)."""
        self._roster.lost(worker_id, reason)
        self._ledger.forget(worker_id)
        out = self._tell_departure(worker_id, reason)
        if self.on_worker_loss == "continue":
            out += self._continue_without(worker_id, reason)
        else:
            for step in sorted(self.pending_steps()):
                out += self._act.fail_step(
                    step, f"step {step} aborted: worker {worker_id} {reason}", culprit=worker_id
                )
        self._act.settle()
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
        self._keys.copy_held(worker_id)

    def worker_joined(self, worker_id: int) -> None:
        """A (re)joined worker takes part from the next step that has not started yet."""
        self._roster.joined(worker_id)
        self._ledger.forget(worker_id)

    def _continue_without(self, lost: int, reason: str) -> list[Outgoing]:
        """A lost worker's complete contributions stay counted; its partial ones are dropped,
        and keys then complete with the others, each average reporting its contributors. If a
        chunk already averaged with the lost worker's data would be mixed with chunks averaged
        without it, that step fails instead: no average is ever a mixture."""
        out: list[Outgoing] = []
        for slot in self._keys.slots():
            if lost in slot.expected and len(slot.received[lost]) != slot.chunks_of(lost):
                out += self._act.stop_expecting(slot, lost, f"worker {lost} {reason}")
        return out + self._act.release_all(self._bars.excuse_lost(lost))

    def start_at(self, request: StartAtIn) -> list[Outgoing]:
        """A worker that joined a running job takes part from a later step (before it sent
        anything): what waits for it in earlier steps completes without it, and every other member
        hears its new first step."""
        w, step = request.worker_id, request.step
        refusal = start_at_refusal(
            request,
            plan=self._roster.plan(w),
            first=self._roster.first_step(w),
            sent=self._ledger.worker_steps[w],
            partitioned=self._ownership.partitioned,
        )
        if refusal is not None:
            log.info("rejected: %s", refusal.message, extra={"step": step, "worker_id": w})
            return [Outgoing((w,), ErrorOut(int(refusal.code), refusal.message, step, start_at=request))]
        self._roster.start_at(w, step)
        out: list[Outgoing] = []
        why = f"worker {w} takes part from step {step}"
        for slot in self._keys.slots():
            if slot.key.step < step and w in slot.expected:
                out += self._act.stop_expecting(slot, w, why)
        out += self._act.release_all(self._bars.excuse_before(w, step))
        others = tuple(v for v in sorted(self.live_workers()) if v != w)
        if others:
            out.append(Outgoing(others, MemberJoinedOut(w, step)))
        self._act.settle()
        return out

    # --- contributions ------------------------------------------------------------------------

    def contribute(self, chunk: ChunkIn, *, borrowed: bool = False) -> list[Outgoing]:
        """Accepts, rejects or reduces one chunk of one worker's contribution. `borrowed`: its
        data lies in memory its sender lent (shared memory), so holding it costs this process
        nothing and it does not count toward the sender's in-flight budget (which, counted,
        would hold back a worker whose keys come in another order than the others' for good)."""
        out = self._contribute(chunk, borrowed)
        self._act.settle()
        return out

    def _contribute(self, chunk: ChunkIn, borrowed: bool = False) -> list[Outgoing]:
        w, key = chunk.worker_id, chunk.key
        placement = self._placements.of(chunk)
        rejected = self._ledger.admit(w, key.step, key, what=str(key), in_order=placement.in_order)
        if rejected is not None:
            return rejected
        index = chunk.offset // self.chunk_elements
        # Pending at this step if at all (else refused below): what a worker moving on fails is
        # of earlier steps only, so it stays pending.
        slot = self._keys.get(key)
        refusal = (
            placement.refusal(self.world_size, self.host_groups)
            or self._ownership.refusal(w, key, index)
            or self._keys.refusal(w, key, slot)
        )
        if refusal is not None:
            return self._reject(w, key.step, refusal.code, key, refusal.message)
        out: list[Outgoing] = []
        for v in placement.covers:
            out += self._act.advance(v, key.step)
        expected = slot.expected if slot is not None else self._roster.expected(key.step)
        if (native := native_problem(chunk, expected, self.world_size)) is not None:
            code, problem = native
            return out + self._act.fail_step(key.step, problem, culprit=w, culprit_code=code, key=key)
        if slot is None:
            slot = self._act.open(chunk)
            behind = self._act.left_behind(key.step, slot.expected, str(key), key)
            if behind:
                return out + behind
        elif (mismatch := slot.mismatch(chunk)) is not None:
            return out + self._act.fail_step(key.step, mismatch, culprit=w, culprit_code=_INVALID, key=key)
        if (refusal := slot.refusal(placement, index, chunk)) is not None:
            return out + self._reject(w, key.step, refusal.code, key, refusal.message)
        size = payload_nbytes(chunk.data)
        self._step_stats.bytes_received(key.step, size)
        accepted = slot.accept(placement, index, chunk, 0 if borrowed else size)
        out += accepted.out
        if accepted.done:
            self._keys.finish(slot, len(slot.expected))
        if accepted.request is not None:
            out += self._act.reduce(accepted.request)
        return out

    def barrier(self, arrival: BarrierIn) -> list[Outgoing]:
        """Records one worker's arrival at a barrier; releases it when every worker arrived."""
        out = self._barrier(arrival)
        self._act.settle()
        return out

    def _barrier(self, arrival: BarrierIn) -> list[Outgoing]:
        w, step, name = arrival.worker_id, arrival.step, arrival.name
        what = f"step {step} barrier {name!r}"
        rejected = self._ledger.admit(w, step, name, what=what)
        if rejected is not None:
            return rejected
        if (replay := self._bars.replay(arrival)) is not None:
            return self._reject(w, step, _PRECONDITION, name, replay)
        out = self._act.advance(w, step)
        bar = self._bars.get(step, name)
        if bar is None:
            self._roster.saw_step(step)
            bar = self._bars.open(arrival, self._roster.expected(step), self.step_timeout)
            self._ledger.opened(step)
            behind = self._act.left_behind(step, bar.expected, what)
            if behind:
                return out + behind
        if (problem := self._bars.arrival_refusal(bar, arrival)) is not None:
            return out + self._reject(w, step, _INVALID, name, problem)
        self._bars.arrive(bar, arrival)
        return out + self._act.release(bar)

    def sample_ranges(self, request: SampleRangeRequestIn) -> list[Outgoing]:
        """Answers a sample-range request (see `SampleRangeAssigner`)."""
        return self._sample_ranges.answer(request)

    def expire(self) -> list[Outgoing]:
        """Fails every step that has a key or barrier past its deadline."""
        now = self._clock()
        out: list[Outgoing] = []
        for slot in self._keys.expired(now):
            if self._keys.is_pending(slot):
                out += self._act.fail_step(slot.key.step, slot.overdue(self.step_timeout), code=_DEADLINE)
        for bar in self._bars.expired(now):
            if self._bars.is_pending(bar):
                out += self._act.fail_step(bar.step, bar.overdue(self.step_timeout), code=_DEADLINE)
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
            what = f"a failure report of step {step}"
            answered = self._ledger.admit(w, step, subject, what=what, in_order=False)
            if answered is not None:
                return answered
            refusal = closed_step_refusal(report, self._step_view(step, report.key))
        if refusal is not None:
            return self._reject(w, step, refusal.code, subject, refusal.message)
        culprit_code = status_code_from_value(report.code)
        out = self._act.fail_step(
            step, report.message, culprit=report.culprit, culprit_code=culprit_code, key=report.key
        )
        self._act.settle()
        return out

    def _step_view(self, step: int, key: TensorKey | None) -> StepView:
        """What decides whether `step` (of `key`, if named) is open to a report."""
        slot = self._keys.get(key) if key is not None else None
        return StepView(
            newest=self._roster.newest_step,
            pending=step in self.pending_steps(),
            key_pending_at=slot.key.step if slot is not None else None,
            key_last=self._keys.last_step(key) if key is not None else None,
        )

    def fail_all(self, code: Status, reason: str) -> list[Outgoing]:
        """Fails every step in flight (used by a shutdown that cannot wait any longer)."""
        out: list[Outgoing] = []
        for step in sorted(self.pending_steps()):
            out += self._act.fail_step(step, f"step {step} aborted: {reason}", code=code)
        return out

    def fail_step(self, step: int, message: str, code: Status, culprit: int | None = None) -> list[Outgoing]:
        """Fails `step` for every worker (partitioned coordinators: another partition failed it)."""
        culprit_code = code if culprit is None else _ABORTED
        out = self._act.fail_step(step, message, culprit=culprit, code=code, culprit_code=culprit_code)
        self._act.settle()
        return out

    def reduced(
        self, request: Reduce, result: Data | None, error: AveragingError | None = None
    ) -> list[Outgoing]:
        """Takes the average of `request` (or why it has none): sends it, or fails its step. A
        result whose step failed meanwhile is dropped (nothing is returned for it)."""
        out = self._act.reduced(request, result, error)
        self._act.settle()
        return out

    # --- internals ----------------------------------------------------------------------------

    def _reject(
        self, w: int, step: int, code: Status, subject: TensorKey | str, message: str
    ) -> list[Outgoing]:
        """Refuses one message (about a key, or a barrier name) to its sender only."""
        log.info("rejected: %s", message, extra={"step": step, "worker_id": w})
        return [error_to(w, step, code, message, subject)]
