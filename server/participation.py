"""Which workers take part in which step: the reduction table's membership policy.

A lost worker's place is vacant (with the reason) until a replacement joins. With
`rejoin_next_step` (the job continues without lost workers), a worker that (re)joins takes part
from the step after the highest one seen so far, since the steps already open were opened
without it; otherwise a worker takes part in every step. That first step is the worker's
recovery plan (`plan`, the step its JoinAccepted names), which a `StartAt` may move later.
"""

from __future__ import annotations


class Participation:
    def __init__(self, world_size: int, *, rejoin_next_step: bool) -> None:
        self.world_size = world_size
        self._rejoin_next_step = rejoin_next_step
        self._vacant: dict[int, str] = {}
        self._first_step: dict[int, int] = {}
        # The first step each worker that joined a running job was given (its recovery plan).
        self._plans: dict[int, int] = {}
        self._high_step = -1

    @property
    def vacant(self) -> dict[int, str]:
        """Lost workers and why, until a replacement joins."""
        return self._vacant

    def lost(self, worker_id: int, reason: str) -> None:
        self._vacant[worker_id] = reason

    def joined(self, worker_id: int) -> None:
        self._vacant.pop(worker_id, None)
        if self._rejoin_next_step and self._high_step >= 0:
            self._first_step[worker_id] = self._plans[worker_id] = self._high_step + 1
        else:
            self._plans.pop(worker_id, None)

    def start_at(self, worker_id: int, step: int) -> None:
        """`worker_id` (which joined a running job) takes part from `step` instead."""
        self._first_step[worker_id] = step

    def plan(self, worker_id: int) -> int | None:
        """The first step `worker_id` was given when it joined a running job (None: it joined as
        the job began, or the job stops at a lost worker, so every step waits for it)."""
        return self._plans.get(worker_id)

    def saw_step(self, step: int) -> None:
        """A key or barrier of `step` opened."""
        self._high_step = max(self._high_step, step)

    @property
    def newest_step(self) -> int:
        """The highest step a key or barrier opened (-1: none yet)."""
        return self._high_step

    def first_step(self, worker_id: int) -> int:
        """The first step `worker_id` takes part in (0 unless it rejoined a running job)."""
        return self._first_step.get(worker_id, 0)

    def expected(self, step: int) -> frozenset[int]:
        """The workers whose contributions `step` waits for."""
        return frozenset(
            w for w in range(self.world_size) if w not in self._vacant and self.first_step(w) <= step
        )

    def live_workers(self) -> tuple[int, ...]:
        return tuple(w for w in range(self.world_size) if w not in self._vacant)
