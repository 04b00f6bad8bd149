"""The reduction table's actions that span its parts, keeping them consistent: a step fails
everywhere at once (ledger, keys, barriers), a complete chunk is averaged and its results sent, a
barrier is released (or fails its step when the digest vote has no majority), a worker moving on
fails what it left behind, and a key goes on without a worker.

`ReductionTable` (server/reduction.py) decides, per message, which rules apply in which order and
calls these; the parts (server/step_ledger.py, pending_keys.py, slots.py, barriers.py) each keep
their own state and never call one another.
"""

from __future__ import annotations

import logging

from gradserver.common.errors import Status
from gradserver.common.messages import ChunkIn, TensorKey

from .barriers import Barrier, Barriers, Undecided
from .chunk_averages import AveragingError, ChunkAverages, averaging_failure
from .outgoing import Outgoing
from .participation import Participation
from .pending_keys import PendingKeys
from .placement import Placements
from .slots import Data, Reduce, Slot
from .step_ledger import StepFailure, StepLedger
from .step_stats import StepStatistics

# The table's logger: these lines are part of its story.
log = logging.getLogger("gradserver.server.reduction")


class StepActions:
    """What happens across the parts of one table when a step fails, a chunk completes, a barrier
    completes or a worker moves on."""

    def __init__(
        self,
        *,
        roster: Participation,
        ledger: StepLedger,
        keys: PendingKeys,
        barriers: Barriers,
        placements: Placements,
        averages: ChunkAverages,
        step_stats: StepStatistics,
        chunk_elements: int,
    ) -> None:
        self._roster = roster
        self._ledger = ledger
        self._keys = keys
        self._bars = barriers
        self._placements = placements
        self._averages = averages
        self._step_stats = step_stats
        self._chunk_elements = chunk_elements

    # --- steps --------------------------------------------------------------------------------

    def fail_step(
        self,
        step: int,
        message: str,
        *,
        culprit: int | None = None,
        culprit_code: Status = Status.ABORTED,
        code: Status = Status.ABORTED,
        key: TensorKey | None = None,
    ) -> list[Outgoing]:
        """Drops everything of `step` and tells every live worker once."""
        return self.fail(step, StepFailure(code, message, culprit, culprit_code), key)

    def fail(self, step: int, failure: StepFailure, key: TensorKey | None) -> list[Outgoing]:
        if self._ledger.fail(step, failure) is None:
            return []
        self._keys.drop_step(step)
        self._bars.drop_step(step)
        log.warning(
            "step %d failed: %s", step, failure.message, extra={"step": step, "worker_id": failure.culprit}
        )
        return failure.notice(step, key, self._roster.live_workers())

    def settle(self) -> None:
        """Counts every open step that can no longer change (see `StepLedger.settle`)."""
        if self._ledger.open_steps:
            self._ledger.settle(self._keys.steps() | self._bars.steps())

    def advance(self, w: int, step: int) -> list[Outgoing]:
        """Records that `w` reached `step`; fails older steps it left without contributing."""
        if not self._ledger.advance(w, step):
            return []
        abandoned = self._keys.owed_by(w, step, self._placements.owes_in_step_order)
        abandoned += self._bars.owed_by(w, step)
        out: list[Outgoing] = []
        for old_step, what in sorted(abandoned):
            if old_step in self._ledger.failed_steps:
                continue
            out += self.fail_step(
                old_step,
                f"worker {w} moved on to step {step} without completing {what}",
                culprit=w,
                culprit_code=Status.FAILED_PRECONDITION,
            )
        return out

    def left_behind(
        self, step: int, expected: frozenset[int], what: str, key: TensorKey | None = None
    ) -> list[Outgoing]:
        """Fails `step` at once when a worker expected at a key or barrier that just opened has
        already moved to a later step: steps only move forward, so it will never send it."""
        for w in sorted(expected):
            if key is not None and not self._placements.owes_in_step_order(w, key):
                continue
            if self._ledger.moved_past(w, step):
                return self.fail_step(
                    step,
                    f"worker {w} moved on to step {self._ledger.worker_steps[w]} without completing {what}",
                    culprit=w,
                    culprit_code=Status.FAILED_PRECONDITION,
                    key=key,
                )
        return []

    # --- keys ---------------------------------------------------------------------------------

    def open(self, chunk: ChunkIn) -> Slot:
        """Opens the slot of `chunk`'s key, waiting for the workers its step expects."""
        key = chunk.key
        self._step_stats.key_opened(key.step, self._ledger.failed_steps)
        slot = self._keys.open(key, chunk.header, self._roster.expected(key.step))
        self._roster.saw_step(key.step)
        self._ledger.opened(key.step)
        return slot

    def reduce(self, request: Reduce) -> list[Outgoing]:
        """Averages a complete chunk here, or queues it (`defer_reductions`)."""
        result = self._averages.submit(request)
        return [] if result is None else self.reduced(request, *result)

    def reduced(self, request: Reduce, averaged: Data | None, error: AveragingError | None) -> list[Outgoing]:
        """Sends the average of `request`'s chunk, or fails its step with `error`."""
        slot = self._keys.awaiting(request)
        if slot is None:
            return []  # its step failed (or its job was reset) while it was averaged
        if error is not None:
            return self.fail(slot.key.step, averaging_failure(request, error, self._chunk_elements), slot.key)
        assert averaged is not None
        accepted = slot.reduced(request, averaged)
        if accepted.done:
            self._keys.finish(slot, len(request.contributors))
        return accepted.out

    def stop_expecting(self, slot: Slot, worker: int, why: str) -> list[Outgoing]:
        """`slot` completes without `worker` (its partial contribution dropped), or its step fails
        when that would mix averages with and without it, or leave no contributor."""
        step = slot.key.step
        if not self._keys.is_pending(slot):
            return []  # its step failed while another key went on without `worker`
        problem = slot.without(worker, why)
        if problem is not None:
            return self.fail_step(step, problem, culprit=worker)
        if not slot.expected:
            return self.fail_step(step, f"step {step} aborted: every contributor of {slot.key} is lost")
        out: list[Outgoing] = []
        for request in slot.take_complete():
            out += self.reduce(request)
            if not self._keys.is_pending(slot):
                break  # averaging it failed the step
        return out

    # --- barriers -----------------------------------------------------------------------------

    def release(self, bar: Barrier) -> list[Outgoing]:
        """Releases `bar` if no one it waits for is missing, or fails its step (no majority)."""
        released = self._bars.release(bar, self._roster.live_workers())
        if isinstance(released, Undecided):
            return self.fail_step(bar.step, released.message, code=Status.FAILED_PRECONDITION)
        return released

    def release_all(self, bars: list[Barrier]) -> list[Outgoing]:
        """Releases each of `bars` still pending that no longer waits for anyone."""
        out: list[Outgoing] = []
        for bar in bars:
            if self._bars.is_pending(bar):
                out += self.release(bar)
        return out
