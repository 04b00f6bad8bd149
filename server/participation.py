"""Which workers take part in which step: the reduction table's membership policy.

A lost worker's place is vacant (with the reason) until a replacement joins. With
`rejoin_next_step` (the job continues without lost workers), a worker that (re)joins takes part
from the step after the highest one seen so far, since the steps already open were opened
without it; otherwise a worker takes part in every step.
"""

from __future__ import annotations


class Participation:
    def __init__(self, world_size: int, *, rejoin_next_step: bool) -> None:
        self.world_size = world_size
        self._rejoin_next_step = rejoin_next_step
        self._vacant: dict[int, str] = {}
        self._first_step: dict[int, int] = {}
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
            self._first_step[worker_id] = self._high_step + 1

    def start_at(self, worker_id: int, step: int) -> None:
        """`worker_id` (which joined a running job) takes part from `step` instead."""
        self._first_step[worker_id] = step

    def saw_step(self, step: int) -> None:
        """A key or barrier of `step` opened."""
        self._high_step = max(self._high_step, step)

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
