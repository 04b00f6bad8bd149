"""The step ledger of the reduction table: which step each worker reached, which steps failed (and
how each is answered), and which steps still count toward `steps_completed`.

Four verbs, the rules every message of a step goes through:
- `admit`: a message of a failed step is answered with its failure (once per worker and subject);
  one older than its sender's first step, one that arrives while a lost worker's place is vacant
  (--on-worker-loss abort), or one older than its sender's newest step (steps only move forward,
  for what a worker sends of its own) is refused to its sender alone.
- `advance`: a worker reached a step; the table then fails what it left behind unfinished.
- `fail`: a step fails once, for everyone; the last `FAILED_STEPS_KEPT` failures are kept to answer
  late messages.
- `settle`: a step counts as completed once it did not fail, nothing of it is pending, and every
  worker expected at it moved to a later step or left (the table cannot know a step's last key
  before its workers move on).

Pure bookkeeping: what a step holds (keys, barriers) lives beside it, in server/pending_keys.py
and server/barriers.py; the table drops those when the ledger records a failure.
"""

from __future__ import annotations

import collections
import dataclasses

from gradserver.common.errors import Status
from gradserver.common.messages import ErrorOut, TensorKey

from .outgoing import Outgoing, error_to
from .participation import Participation

FAILED_STEPS_KEPT = 64


@dataclasses.dataclass
class StepFailure:
    """Why a step failed: `code` for everyone but the culprit, who gets `culprit_code`."""

    code: Status
    message: str
    culprit: int | None
    culprit_code: Status
    # (worker, key or barrier name) already answered with this failure after it was broadcast.
    answered: set[tuple[int, TensorKey | str]] = dataclasses.field(default_factory=set)

    def code_for(self, worker_id: int) -> Status:
        return self.culprit_code if worker_id == self.culprit else self.code

    def notice(self, step: int, key: TensorKey | None, live: tuple[int, ...]) -> list[Outgoing]:
        """The step-wide error: the culprit (if live) with its own code, every other live worker
        with the step's."""
        out: list[Outgoing] = []
        others = tuple(w for w in live if w != self.culprit)
        culprit = (self.culprit,) if self.culprit in live else ()
        for code, to in ((self.code, others), (self.culprit_code, culprit)):
            if to:
                event = ErrorOut(int(code), self.message, step, key, self.culprit, step_failed=True)
                out.append(Outgoing(to, event))
        return out


class StepLedger:
    """The steps of one job's table and their failures."""

    def __init__(self, roster: Participation, *, abort_on_loss: bool) -> None:
        self._roster = roster
        self._abort_on_loss = abort_on_loss
        # Per worker, the newest step it sent anything of (None: nothing since it (re)joined).
        self.worker_steps: list[int | None] = [None] * roster.world_size
        self._failed: collections.OrderedDict[int, StepFailure] = collections.OrderedDict()
        self._open: set[int] = set()  # steps seen, neither failed nor counted yet
        self.steps_completed = 0
        self.last_completed_step: int | None = None

    # --- queries ------------------------------------------------------------------------------

    @property
    def failed_steps(self) -> collections.OrderedDict[int, StepFailure]:
        """The failures kept, oldest first."""
        return self._failed

    @property
    def open_steps(self) -> set[int]:
        """Steps seen that neither failed nor were counted completed yet."""
        return self._open

    def moved_past(self, worker: int, step: int) -> bool:
        """Whether `worker` already sent something of a later step than `step`."""
        known = self.worker_steps[worker]
        return known is not None and known > step

    # --- the verbs ----------------------------------------------------------------------------

    def admit(
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
            message = (
                f"worker {w} sent {what}, but it rejoined during step {joined_at - 1} and takes part "
                f"from step {joined_at}"
            )
            return [error_to(w, step, Status.FAILED_PRECONDITION, message, subject)]
        vacant = self._roster.vacant
        if vacant and self._abort_on_loss:
            lost = ", ".join(f"worker {v} {why}" for v, why in sorted(vacant.items()))
            message = f"{what} refused: the world is incomplete ({lost}); waiting for a replacement to join"
            return [error_to(w, step, Status.ABORTED, message, subject, culprit=min(vacant))]
        known = self.worker_steps[w]
        if in_order and known is not None and step < known:
            message = f"worker {w} sent {what}, but it already sent step {known}; steps only move forward"
            return [error_to(w, step, Status.FAILED_PRECONDITION, message, subject)]
        return None

    def advance(self, w: int, step: int) -> bool:
        """Records that `w` reached `step`; True when that is later than anything it sent before
        (what it left unfinished in earlier steps is then abandoned)."""
        known = self.worker_steps[w]
        self.worker_steps[w] = step if known is None else max(known, step)
        return known is None or step > known

    def forget(self, w: int) -> None:
        """`w` left or (re)joined: nothing it sent before says where its successor is."""
        self.worker_steps[w] = None

    def opened(self, step: int) -> None:
        """A key or barrier of `step` opened: the step is open until it settles or fails."""
        self._open.add(step)

    def fail(self, step: int, failure: StepFailure) -> StepFailure | None:
        """Records `failure` of `step`; None when the step had already failed (it fails once)."""
        if step in self._failed:
            return None
        self._failed[step] = failure
        self._open.discard(step)
        while len(self._failed) > FAILED_STEPS_KEPT:
            self._failed.popitem(last=False)
        return failure

    def settle(self, pending: set[int]) -> None:
        """Counts every open step that can no longer change: nothing of it `pending`, and every
        worker expected at it moved to a later step or left."""
        for step in sorted(self._open - pending):
            if not all(self.moved_past(w, step) for w in self._roster.expected(step)):
                continue
            self._open.discard(step)
            self.steps_completed += 1
            if self.last_completed_step is None or step > self.last_completed_step:
                self.last_completed_step = step
