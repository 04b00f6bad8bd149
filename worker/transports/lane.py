"""The worker's side of the collective lane (docs/PROTOCOL.md, "The collective lane"; the shared
layout and futexes are `common/lane.py`).

`LaneClient.run` carries one whole collective through the lane: round by round it copies its
part into its input slot, describes it and posts it, then waits (a futex on the coordinator's
`done` word) and reads its result: from the output slot (REDUCE, REDUCE_SCATTER) or straight
from the other workers' input slots (ALL_GATHER, BROADCAST, ALL_TO_ALL). Two rounds are in
flight at once, so copying in, reducing and copying out overlap for large operations.

`run` answers None while the lane is not open for the job (the coordinator closed it because a
worker uses gRPC, or it failed earlier): the caller then sends the operation over gRPC, as every
other worker does, since they all read the same state word. Every wait is bounded: by the
caller's deadline (then this worker marks itself as having given up, so the coordinator fails
the operation for everyone, naming it), by the lane's failure (raised as the coordinator's
error) and by `check` (the link's own view: a broken stream raises at once).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable

import numpy as np

from gradserver.common import futex
from gradserver.common import lane as shared
from gradserver.common.averaging import Averager
from gradserver.common.errors import (
    AbortedError,
    DeadlineExceededError,
    GradServerError,
    UnavailableError,
    error_from_status,
)
from gradserver.common.lane import Descriptor, LaneMemory, LaneState
from gradserver.common.lane_rounds import RoundPlanner, RoundProblem, reduce_round
from gradserver.common.messages import CollectiveKind, TensorKey

from ..tensors import same_memory


class LaneClient:
    """One worker's use of a lane arena (mapped read-write by its `ShmChannel`)."""

    def __init__(self, memory: LaneMemory, worker_id: int) -> None:
        self.memory = memory
        self.worker_id = worker_id
        self._generation = memory.generation
        self._next = 1  # the next round this worker posts
        self._posted = 0
        self._operations = 0  # lane operations begun, the same count on every worker
        self._usable = True
        # Peer rounds need only the workers running; the coordinator's rounds need it too.
        self._spin_peer = futex.spin_for(memory.layout.world)
        self._spin_coordinator = futex.spin_for(memory.layout.world + 1)
        self._lock = threading.Lock()
        self._planner = RoundPlanner(memory)
        self._averager = Averager(1)
        # Says which word this worker sleeps on (its writer wakes it only then).
        self._announce = functools.partial(memory.set_sleeping, worker_id)

    def run(
        self,
        key: TensorKey,
        data: np.ndarray,
        result: np.ndarray | None,
        deadline: float,
        check: Callable[[], None],
    ) -> np.ndarray | None:
        """Runs collective `key` with this worker's input `data` (uint8); its result goes into
        `result` (uint8, the result's exact size; None: allocated here, as an ALL_TO_ALL's size
        is known only from the others' descriptors). Returns the result, or None when the lane is
        not open (send it over gRPC). Raises the operation's failure."""
        with self._lock:  # one operation at a time, whatever threads call
            open_ = self._open(deadline, check)
            # Every worker counts every operation it begins (the lane's failure covers them by count).
            self._operations += 1
            if not open_:
                self._raise_if_covered(key)
                return None
            operation = _Operation(self, key, data, result, self._operations)
            sized_later = key.collective_kind is CollectiveKind.ALL_TO_ALL
            pending: collections.deque[tuple[int, int]] = collections.deque()
            part = 0
            try:
                while part < operation.rounds or pending:
                    # An ALL_TO_ALL learns how many rounds it has from round 0's descriptors.
                    if (
                        part < operation.rounds
                        and len(pending) < 2
                        and not (sized_later and part == 1 and pending)
                    ):
                        pending.append((part, self._post(operation, part, deadline, check)))
                        part += 1
                        continue
                    done_part, g = pending.popleft()
                    self._finish(operation, done_part, g, deadline, check)
                if operation.quitter is not None:
                    raise self._given_up(key, operation.quitter)
            except BaseException:
                self._give_up()
                raise
            assert operation.result is not None
            return operation.result

    # --- rounds -------------------------------------------------------------------------------

    def _post(self, op: _Operation, part: int, deadline: float, check: Callable[[], None]) -> int:
        memory, w = self.memory, self.worker_id
        g = self._next
        if self._posted >= 2:
            # Round g reuses round g-2's slots: every worker must have read that round (of a
            # coordinator round, only once the coordinator was done with it).
            reuse = (g - 2) & 0xFFFFFFFF or 0xFFFFFFFF
            for r in range(memory.layout.world):
                if not shared.reached(memory.taken(r), reuse):
                    taken = functools.partial(memory.taken, r)
                    self._wait(taken, memory.taken_address(r), reuse, deadline, check, op, g)
        op.fill(part, g, memory.input_slot(w, g, memory.layout.slot_bytes))
        memory.set_posted(w, g)
        if not op.peer:
            memory.ring(w, g)
        self._next = shared.next_round(g)
        self._posted += 1
        return g

    def _finish(self, op: _Operation, part: int, g: int, deadline: float, check: Callable[[], None]) -> None:
        memory = self.memory
        if op.peer:
            # Read from the others' input slots once they are all there, checked (and reduced)
            # here as the coordinator would.
            for r in range(memory.layout.world):
                if not shared.reached(memory.posted(r), g):
                    posted = functools.partial(memory.posted, r)
                    self._wait(posted, memory.posted_address(r), g, deadline, check, op, g)
            # Checked first: a worker that found the round wrong (or non-finite) gave up because
            # of it, and everyone finds the same. Then whether anyone gave up for another reason:
            # its data is there, but the operation fails for everyone as the coordinator fails it.
            self._read_peer(op, part, g)
            self._raise_if_given_up(op, part, g)
        else:
            self._wait(lambda: memory.done, memory.done_address(), g, deadline, check, op, g)
            op.read(part, g)
        memory.set_taken(self.worker_id, g)

    def _read_peer(self, op: _Operation, part: int, g: int) -> None:
        plan = self._planner.plan(g)
        if isinstance(plan, RoundProblem):
            raise self._error(plan, op.key)
        me = self.worker_id
        # The coordinator does not see peer rounds: it reports what workers count of them.
        self.memory.count_peer_round(me, plan.received[me], plan.sent[me])
        if not plan.reduce_bytes:
            op.read(part, g)
            return
        world = self.memory.layout.world
        offset, length = shared.round_span(op.kind, op.total, world, op.slot, part)
        assert op.result is not None
        if op.kind is CollectiveKind.REDUCE:
            out = op.result[offset : offset + length]
        else:  # REDUCE_SCATTER: the whole slot, so a NaN anywhere fails it on every worker alike
            out = np.empty(plan.reduce_bytes, np.uint8)
        problem = reduce_round(self._averager, self.memory, g, plan, out)
        if problem is not None:
            raise self._error(problem, op.key)
        if op.kind is CollectiveKind.REDUCE_SCATTER:
            op.result[offset : offset + length] = out[me * length : (me + 1) * length]

    def _raise_if_given_up(self, op: _Operation, part: int, g: int) -> None:
        """A worker that gave up on this operation may have posted the round before it did: its
        data is then there, but it reads no more, and the operation fails here as the coordinator
        fails it. When it had posted every round of the operation, this worker still reads them
        all first (`op.quitter`: the operation fails once they are read), so that a later round's
        problem is named as that worker found it: one that found the last round non-finite gave
        up because of it, and a worker a round behind must name the same culprit and element, not
        only that it gave up. (Anything else that failed the lane meanwhile does not undo a round
        whose data is all there: a worker that left after it had it, say.)"""
        memory = self.memory
        for r in range(memory.layout.world):
            quit_at = memory.abandoned(r)
            if quit_at and shared.reached(op.index & 0xFFFFFFFF or 1, quit_at):
                last = g  # the operation's last round (found only here: every round passes by)
                for _ in range(op.rounds - 1 - part):
                    last = shared.next_round(last)
                if not shared.reached(memory.posted(r), last):
                    raise self._given_up(op.key, r)
                if op.quitter is None:
                    op.quitter = r

    @staticmethod
    def _given_up(key: TensorKey, quitter: int) -> AbortedError:
        return AbortedError(
            f"{key} aborted: worker {quitter} gave up on it (its own deadline or error)",
            step=key.step,
            key=str(key),
            worker_id=quitter,
        )

    def _error(self, problem: RoundProblem, key: TensorKey) -> GradServerError:
        """The error this worker raises for a round it found wrong itself (each worker finds the
        same, as the coordinator does): the culprit hears its own status."""
        code = problem.culprit_status if problem.culprit == self.worker_id else problem.status
        return error_from_status(
            code, problem.message, step=key.step, key=str(key), worker_id=problem.culprit
        )

    def _wait(
        self,
        read: Callable[[], int],
        address: int,
        target: int,
        deadline: float,
        check: Callable[[], None],
        op: _Operation,
        g: int,
    ) -> None:
        def raise_failure() -> None:
            self._raise_if_failed(op.key)
            check()

        spin = self._spin_coordinator if address == self.memory.done_address() else self._spin_peer
        if shared.wait_word(
            read, address, target, deadline, raise_failure, spin=spin, announce=self._announce
        ):
            return
        missing = [r for r in range(self.memory.layout.world) if not shared.reached(self.memory.posted(r), g)]
        waiting = (
            f"worker(s) {', '.join(map(str, missing))} had not contributed" if missing else "the coordinator"
        )
        raise DeadlineExceededError(
            f"{op.key}: no result within this worker's deadline ({waiting})",
            step=op.key.step,
            key=str(op.key),
        )

    def _give_up(self) -> None:
        """This worker leaves an operation half done (its deadline, a failure, a bad result
        buffer): the others must not wait for its next round. Unless the lane failed anyway, it
        says so in the lane, and the coordinator fails the operation for everyone, naming it.
        Either way this worker sends its later collectives over gRPC."""
        self._usable = False
        if self.memory.state is LaneState.OPEN and self.memory.generation == self._generation:
            self.memory.set_abandoned(self.worker_id, self._operations)

    def _open(self, deadline: float, check: Callable[[], None]) -> bool:
        """Whether the lane is open for this job (waiting, bounded, while it forms)."""
        memory = self.memory
        if not self._usable:
            return False
        if memory.open_as(self._generation):
            return True
        while memory.state is LaneState.FORMING and memory.generation == self._generation:
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(
                    "the coordinator did not say within this worker's deadline whether every worker "
                    "uses the collective lane"
                )
            futex.futex_wait(memory.state_address(), int(LaneState.FORMING), min(left, 0.05))
        if memory.generation != self._generation:
            self._usable = False
            raise UnavailableError("the coordinator started a fresh job: this worker is no longer a member")
        return memory.state is LaneState.OPEN

    def _raise_if_covered(self, key: TensorKey) -> None:
        """Raises the lane's failure when another worker had begun this operation (this worker's
        latest) in the lane when it failed: every worker that tries it hears why, even one that
        comes to it later. Operations no worker had begun go over gRPC."""
        memory = self.memory
        if memory.state is LaneState.FAILED:
            covered = memory.failed_operation()
            if covered is not None and covered >= self._operations:
                self._raise_if_failed(key)

    def _raise_if_failed(self, key: TensorKey) -> None:
        memory = self.memory
        if memory.generation != self._generation:
            raise UnavailableError("the coordinator started a fresh job: this worker is no longer a member")
        if memory.state is not LaneState.FAILED:
            return
        status, culprit, culprit_status, message = memory.failure()
        code = culprit_status if culprit == self.worker_id else status
        raise error_from_status(code, message, step=key.step, key=str(key), worker_id=culprit)


class _Operation:
    """One collective's geometry on this worker: what each round posts and reads."""

    def __init__(
        self, lane: LaneClient, key: TensorKey, data: np.ndarray, result: np.ndarray | None, index: int
    ) -> None:
        self.index = index
        self.lane = lane
        self.key = key
        # A worker that gave up on this operation after posting all of it (see
        # `LaneClient._raise_if_given_up`): its rounds are read, then the operation fails.
        self.quitter: int | None = None
        self.data = data
        self.result = result
        self.kind = key.collective_kind
        memory = lane.memory
        self.world = memory.layout.world
        self.slot = memory.layout.slot_bytes
        self.total = int(data.size)
        self.rounds = shared.own_rounds(self.kind, self.total, self.world, self.slot)
        self.peer = shared.peer_operation(self.kind, self.total, self.world)
        self._flags = shared.FLAG_PROPAGATE_NON_FINITE if key.propagate_non_finite else 0
        self._receive_at: list[int] = []  # ALL_TO_ALL: where each sender's piece starts in the result
        # A broadcast root whose result is its own input holds the bytes already.
        self._in_place = (
            self.kind is CollectiveKind.BROADCAST and result is not None and same_memory(result, data)
        )

    def fill(self, part: int, g: int, slot: np.ndarray) -> None:
        """Copies round `part`'s bytes into `slot` (this worker's input slot of round `g`) and
        writes their descriptor."""
        kind, world, total = self.kind, self.world, self.total
        offset, length = shared.round_span(kind, total, world, self.slot, part)
        me = self.lane.worker_id
        if kind is CollectiveKind.REDUCE_SCATTER:
            per_part = total // world
            for j in range(world):
                start = j * per_part + offset
                slot[j * length : (j + 1) * length] = self.data[start : start + length]
        elif kind is not CollectiveKind.BROADCAST or me == self.key.root:
            slot[:length] = self.data[offset : offset + length]
        posted = shared.posted_length(kind, length, world, root=me == self.key.root)
        self.lane.memory.describe(
            me,
            g,
            self.index,
            self.key.step,
            total,
            offset,
            posted,
            part,
            self.key.index,
            self.key.root,
            kind,
            self.key.op,
            self._flags,
            tuple(self.key.split_bytes) if kind is CollectiveKind.ALL_TO_ALL else (),
        )

    def read(self, part: int, g: int) -> None:
        memory, kind, world, me = self.lane.memory, self.kind, self.world, self.lane.worker_id
        if kind is CollectiveKind.ALL_TO_ALL:
            self._read_all_to_all(part, g)
            return
        assert self.result is not None
        offset, length = shared.round_span(kind, self.total, world, self.slot, part)
        if kind is CollectiveKind.REDUCE:
            self.result[offset : offset + length] = memory.output_slot(g, length)
        elif kind is CollectiveKind.REDUCE_SCATTER:
            self.result[offset : offset + length] = memory.output_slot(g, world * length)[
                me * length : (me + 1) * length
            ]
        elif kind is CollectiveKind.ALL_GATHER:
            for r in range(world):
                at = r * self.total + offset
                self.result[at : at + length] = memory.input_slot(r, g, length)
        elif not (self._in_place and me == self.key.root):  # BROADCAST
            self.result[offset : offset + length] = memory.input_slot(self.key.root, g, length)

    def _read_all_to_all(self, part: int, g: int) -> None:
        memory, me = self.lane.memory, self.lane.worker_id
        senders = [memory.read_descriptor(s, g) for s in range(self.world)]
        if part == 0:
            self._size_all_to_all(senders)
        assert self.result is not None
        for s, d in enumerate(senders):
            piece_start = shared.splits_offsets(d.splits)[me]
            piece_end = piece_start + d.splits[me]
            start, end = max(d.offset, piece_start), min(d.offset + d.length, piece_end)
            if start < end:
                at = self._receive_at[s] + start - piece_start
                self.result[at : at + end - start] = memory.input_slot(s, g, d.length)[
                    start - d.offset : end - d.offset
                ]

    def _size_all_to_all(self, senders: list[Descriptor]) -> None:
        """After round 0: how many rounds the operation has (the most any sender needs), and
        where each sender's piece for this worker goes."""
        me = self.lane.worker_id
        self.rounds = max(shared.own_rounds(self.kind, d.total, self.world, self.slot) for d in senders)
        sizes = [d.splits[me] for d in senders]
        self._receive_at = shared.splits_offsets(sizes)
        needed = sum(sizes)
        if self.result is None:
            self.result = np.empty(needed, np.uint8)
        elif self.result.size != needed:
            raise ValueError(
                f"{self.key}: the other workers send this worker {needed} bytes, but the result "
                f"buffer holds {self.result.size}"
            )
