"""The reduction table's barriers: who arrived at which (step, name), and the vote on the state
digests they carry.

A barrier of a step waits for the workers that step expects; it is released once all of them
arrived (or were excused: lost under --on-worker-loss continue, or moved to a later first step).
Arrivals carry a state digest each or none does; with digests, `digests.vote` decides whom the
release reaches: the workers holding a strict majority's state, the others named as diverged
(`take_diverged`, the coordinator evicts them); with no strict majority the step fails
(`Undecided`). A released barrier name stays released up to its step: a later arrival at that or
an earlier step is refused.

Pure bookkeeping: the step rules (admit, advance, fail) are the ledger's, server/step_ledger.py;
the table calls both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gradserver.common.messages import BarrierIn, BarrierReleaseOut

from .digests import vote
from .outgoing import Outgoing


@dataclasses.dataclass
class Barrier:
    step: int
    name: str
    deadline: float
    opened: float = 0.0
    expected: frozenset[int] = frozenset()
    arrived: set[int] = dataclasses.field(default_factory=set)
    # Arrivals carry state digests (`digests.vote` decides whom the barrier releases) or none.
    with_digests: bool = False
    digests: dict[int, int] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        return f"step {self.step} barrier {self.name!r}"

    def overdue(self, timeout: float) -> str:
        """Why the barrier's step fails at its deadline."""
        missing = ", ".join(str(w) for w in sorted(self.expected - self.arrived))
        return (
            f"{self.describe()}: worker(s) {missing} did not arrive within the step timeout of {timeout:g} s"
        )


@dataclasses.dataclass(frozen=True)
class Undecided:
    """The digests at a barrier have no strict majority: why its step fails."""

    message: str


class Barriers:
    """The pending barriers of one job, and the step each name was last released at."""

    def __init__(self, clock: Callable[[], float], on_released: Callable[[float], None] | None) -> None:
        """`on_released` receives the seconds from a barrier's first arrival to its release."""
        self._clock = clock
        self._on_released = on_released
        self.pending: dict[tuple[int, str], Barrier] = {}
        self._released_at: dict[str, int] = {}
        self._diverged: list[tuple[int, str]] = []

    def __bool__(self) -> bool:
        return bool(self.pending)

    def steps(self) -> set[int]:
        return {bar.step for bar in self.pending.values()}

    def replay(self, arrival: BarrierIn) -> str | None:
        """Why `arrival` comes too late: its barrier name was released at its step or a later one."""
        last = self._released_at.get(arrival.name)
        if last is None or arrival.step > last:
            return None
        w, step, name = arrival.worker_id, arrival.step, arrival.name
        return (
            f"worker {w} arrived at step {step} barrier {name!r}, but barrier {name!r} was already "
            f"released at step {last}"
        )

    def get(self, step: int, name: str) -> Barrier | None:
        return self.pending.get((step, name))

    def open(self, arrival: BarrierIn, expected: frozenset[int], timeout: float) -> Barrier:
        """Opens the barrier `arrival` names, waiting for `expected` until `timeout` from now."""
        now = self._clock()
        bar = Barrier(
            arrival.step,
            arrival.name,
            now + timeout,
            now,
            expected=expected,
            with_digests=arrival.digest is not None,
        )
        self.pending[(bar.step, bar.name)] = bar
        return bar

    def arrival_refusal(self, bar: Barrier, arrival: BarrierIn) -> str | None:
        """Why `arrival` cannot count at `bar` (a second arrival, digests mixed with none)."""
        w, what = arrival.worker_id, bar.describe()
        if w in bar.arrived:
            return f"worker {w} arrived at {what} twice"
        if bar.with_digests != (arrival.digest is not None):
            said = "with a state digest" if arrival.digest is not None else "without a state digest"
            return (
                f"worker {w} arrived at {what} {said}, the others the other way: every arrival at "
                "one barrier carries a digest or none does"
            )
        return None

    def arrive(self, bar: Barrier, arrival: BarrierIn) -> None:
        bar.arrived.add(arrival.worker_id)
        if arrival.digest is not None:
            bar.digests[arrival.worker_id] = arrival.digest

    def excuse_lost(self, worker: int) -> list[Barrier]:
        """`worker` was lost (the job continues without it): the barriers it has not arrived at no
        longer wait for it. Returns those barriers, each to release if now complete."""
        excused = [
            bar for bar in self.pending.values() if worker in bar.expected and worker not in bar.arrived
        ]
        for bar in excused:
            bar.expected = bar.expected - {worker}
        return excused

    def excuse_before(self, worker: int, step: int) -> list[Barrier]:
        """`worker` takes part from `step`: no barrier of an earlier step waits for it (nor
        counts its digest). Returns those barriers, each to release if now complete."""
        excused = [bar for bar in self.pending.values() if bar.step < step and worker in bar.expected]
        for bar in excused:
            bar.expected = bar.expected - {worker}
        return excused

    def release(self, bar: Barrier, live: tuple[int, ...]) -> list[Outgoing] | Undecided:
        """Releases `bar` to the `live` workers if every worker it expects arrived (those the
        digest vote finds diverged excepted); nothing while it still waits."""
        if not bar.expected <= bar.arrived:
            return []
        released = live
        if bar.with_digests:
            # Only the digests of workers still expected count (a lost one's is void).
            verdict = vote(bar.step, bar.name, {w: d for w, d in bar.digests.items() if w in bar.expected})
            if verdict.undecided is not None:
                return Undecided(verdict.undecided)
            self._diverged += verdict.diverged.items()
            released = tuple(w for w in released if w not in verdict.diverged)
        del self.pending[(bar.step, bar.name)]
        self._released_at[bar.name] = bar.step
        if self._on_released is not None:
            self._on_released(self._clock() - bar.opened)
        return [Outgoing(released, BarrierReleaseOut(bar.step, bar.name))] if released else []

    def owed_by(self, worker: int, step: int) -> list[tuple[int, str]]:
        """(step, description) of the barriers before `step` that `worker` was expected at and has
        not arrived at (one it was excused from, lost before it and rejoined after, it owes none)."""
        return [
            (bar.step, bar.describe())
            for bar in self.pending.values()
            if bar.step < step and worker in bar.expected and worker not in bar.arrived
        ]

    def expired(self, now: float) -> list[Barrier]:
        return [bar for bar in self.pending.values() if bar.deadline <= now]

    def is_pending(self, bar: Barrier) -> bool:
        return self.pending.get((bar.step, bar.name)) is bar

    def drop_step(self, step: int) -> None:
        """`step` failed: its barriers are forgotten."""
        for ident in [ident for ident, bar in self.pending.items() if bar.step == step]:
            del self.pending[ident]

    def take_diverged(self) -> list[tuple[int, str]]:
        """Workers whose state digest differed from the majority's since the last call, and why."""
        diverged, self._diverged = self._diverged, []
        return diverged
