"""The coordinator's collective lane: its arena and the thread that serves its rounds
(docs/PROTOCOL.md, "The collective lane"; the shared layout is `common/lane.py`).

`Lane` owns one arena per coordinator, handed read-write to every worker that registers for
shared memory (`ShmHub`'s handshake). Its state word opens once every worker of the job has
registered, and closes for the job as soon as one joins without it (its Exchange stream opens
unregistered): a job's collectives then all go over gRPC, so no worker waits in the lane for one
that never comes. While open, one thread serves the *coordinator rounds* (large reductions) in
order: it sleeps on the workers' bells, checks the round (`lane_rounds.RoundPlanner`: every
worker issued the same operation, sizes as this version posts them), averages it with the
coordinator's `Averager` (the same bytes as the gRPC path) into an output slot and publishes
`done`. *Peer rounds* (the kinds that move bytes, small reductions) never wake it: the workers
check, read and reduce them themselves, count them in their control blocks, and this thread
reports those counts (`sync_counters`) and, on its idle looks, fails a peer round that has
waited past `--step-timeout`.

Everything that ends a round other than success fails the lane for the job, with the status and
message the gRPC path would give (a lost or departed worker, a disagreement, a non-finite value,
`--step-timeout` with the workers that did not post, a worker that gave up, the coordinator
stopping); workers raise it and send later collectives over gRPC. A fresh job (every worker left)
resets the lane.

The event loop calls `registered`, `streaming`, `worker_gone`, `reset` and `close`; the lane
thread touches only the arena, the averager and the counters, and takes the lock for every
change of state, so a failure and a completed round never both publish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from gradserver.common import futex, shm
from gradserver.common import lane as shared
from gradserver.common.averaging import Averager
from gradserver.common.errors import Status
from gradserver.common.lane import LaneLayout, LaneMemory, LaneState
from gradserver.common.lane_rounds import RoundPlan, RoundPlanner, RoundProblem, key_of, reduce_round
from gradserver.common.messages import TensorKey

from .metrics import CoordinatorMetrics

log = logging.getLogger("gradserver.server.lane")

_IDLE_SLICE_S = 0.5  # how often an idle lane thread looks at its stop flag (a stop also wakes it)
_BUSY_SLICE_S = 0.05  # while a round is under way: how often the step timeout is checked
_JOIN_S = 5.0


class _Stopped(Exception):
    """The lane thread was asked to stop, or the lane left OPEN, while it waited."""


class Lane:
    """One coordinator's collective lane for a job of `world` workers."""

    def __init__(
        self,
        world: int,
        chunk_bytes: int,
        averager: Averager,
        metrics: CoordinatorMetrics,
        step_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layout = LaneLayout(world, shared.slot_bytes_for(chunk_bytes, world))
        self.fd, self._mapping = shm.create_arena(self.layout.size, "gradserver-lane")
        self.memory = LaneMemory.create(self._mapping, self.layout)
        self._averager = averager
        self._metrics = metrics
        self._step_timeout = step_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._registered: set[int] = set()
        self._registration: dict[int, int] = {}  # worker -> its registration's number
        self._registrations = 0
        self._generation = 1
        self._served = 0  # the last coordinator round served
        self._counted: dict[int, tuple[int, int, int]] = {}  # peer counters already reported
        self._waiting_since: tuple[int, float] | None = None
        self._planner = RoundPlanner(self.memory)
        self._spin = futex.spin_for(world + 1)
        self._stop = threading.Event()
        self.memory.reset(self._generation)
        self._thread = threading.Thread(target=self._serve, name="gradserver-lane", daemon=True)
        self._thread.start()

    # --- the event loop's side ----------------------------------------------------------------

    @property
    def state(self) -> LaneState:
        return self.memory.state

    def shared_fd(self) -> int:
        """A new read-write descriptor of the arena, for one worker's handshake (the caller
        closes it once sent)."""
        return os.dup(self.fd)

    def registered(self, worker_id: int) -> None:
        """`worker_id` mapped the arena; the lane opens when every worker of the job has."""
        with self._lock:
            self._registered.add(worker_id)
            self._registrations += 1
            self._registration[worker_id] = self._registrations
            if self.memory.state is LaneState.FORMING and len(self._registered) == self.layout.world:
                self.memory.set_state(LaneState.OPEN)
                log.info("collective lane open for %d workers", self.layout.world)

    def streaming(self, worker_id: int) -> None:
        """`worker_id`'s Exchange stream opened: if it did not register, it never will (a worker
        registers before it opens its stream), so this job's collectives go over gRPC."""
        with self._lock:
            if worker_id in self._registered:
                return
            if self.memory.state is LaneState.FORMING:
                self.memory.set_state(LaneState.CLOSED)
                log.info("collective lane closed: worker %d does not use shared memory", worker_id)
            elif self.memory.state is LaneState.OPEN:
                message = f"worker {worker_id} does not use shared memory; the collective lane is closed"
                self._fail_locked(RoundProblem(message, worker_id, culprit_status=Status.FAILED_PRECONDITION))

    def socket_closed(self, worker_id: int) -> int | None:
        """`worker_id` closed its shared-memory socket. While the lane forms, it no longer counts
        as registered; once open, the registration it holds is returned, for `stopped_using`
        after a grace period (a departing worker's departure fails the lane first, with its
        reason)."""
        with self._lock:
            if self.memory.state is LaneState.FORMING:
                self._registered.discard(worker_id)
                return None
            return self._registration.get(worker_id) if worker_id in self._registered else None

    def stopped_using(self, worker_id: int, registration: int | None) -> None:
        """`worker_id` (its `registration`, when given: unless it registered again since) no
        longer uses shared memory but stays in the job: its collectives go over gRPC, so an
        open lane fails and a forming one no longer counts it."""
        with self._lock:
            if worker_id not in self._registered:
                return
            if registration is not None and self._registration.get(worker_id) != registration:
                return
            self._registered.discard(worker_id)
            if self.memory.state is LaneState.OPEN:
                message = f"worker {worker_id} stopped using shared memory; the collective lane is closed"
                self._fail_locked(RoundProblem(message, worker_id, culprit_status=Status.FAILED_PRECONDITION))

    def worker_gone(self, worker_id: int, reason: str, *, lost: bool) -> None:
        """A worker left: an open lane fails (whoever waits for it would wait in vain)."""
        with self._lock:
            self._registered.discard(worker_id)
            if self.memory.state is LaneState.FORMING:
                # It will not register now: whoever waits for the lane to form goes over gRPC,
                # where the job's rules answer for the missing worker.
                self.memory.set_state(LaneState.CLOSED)
                log.info("collective lane closed: worker %d %s before it formed", worker_id, reason)
                return
            if self.memory.state is not LaneState.OPEN:
                return
            key = self._in_flight()
            if key is not None:
                message = f"{key} aborted: worker {worker_id} {reason}"
            else:
                message = f"worker {worker_id} {reason}; the collective lane is closed"
            # Nothing in flight: the end of a job, or a loss the job reports itself.
            problem = RoundProblem(message, worker_id, culprit_status=Status.ABORTED)
            self._fail_locked(problem, quiet=key is None)

    def reset(self) -> None:
        """A fresh job: the lane forms again, with rounds from 1."""
        with self._lock:
            self._registered.clear()
            self._generation += 1
            self._served = 0
            self._counted.clear()
            self._waiting_since = None
            self.memory.reset(self._generation)

    def stopping(self, reason: str) -> None:
        """The coordinator is stopping: whatever waits in the lane fails as UNAVAILABLE (later
        collectives go over gRPC, where the coordinator's shutdown answers them)."""
        with self._lock:
            if self.memory.state in (LaneState.OPEN, LaneState.FORMING):
                key = self._in_flight() if self.memory.state is LaneState.OPEN else None
                message = f"{f'{key} failed: ' if key else ''}the coordinator is stopping: {reason}"
                problem = RoundProblem(message, None, Status.UNAVAILABLE, Status.UNAVAILABLE)
                self._fail_locked(problem, quiet=key is None)

    def close(self, reason: str = "coordinator stopped") -> None:
        """Fails whatever waits (UNAVAILABLE), ends the thread and unmaps the arena."""
        self.stopping(reason)
        self._stop.set()
        self.memory.wake_everyone()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)
        self.memory.close()
        os.close(self.fd)
        with contextlib.suppress(BufferError):
            self._mapping.close()

    # --- the lane thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.memory.state is not LaneState.OPEN:
                futex.futex_wait(self.memory.state_address(), int(self.memory.state), _IDLE_SLICE_S)
                self.sync_counters()
                continue
            try:
                g = self._next_bell()
                if g is None:
                    self.sync_counters()
                    continue
                self._serve_round(g)
            except _Stopped:
                continue
            except Exception as exc:
                log.exception("collective lane thread failed")
                message = f"the coordinator's collective lane failed: {exc!r}"
                self._fail(RoundProblem(message, None, Status.INTERNAL, Status.INTERNAL))

    def _next_bell(self) -> int | None:
        """The next coordinator round a worker rang for, or None after an idle slice (in which a
        worker that gave up, or a peer round past the step timeout, fails the lane)."""
        memory, world = self.memory, self.layout.world
        bell = memory.bell(0)  # read first: a ring after it wakes the wait below at once
        after = shared.next_round(self._served)
        rung = [memory.rung(w, parity) for w in range(world) for parity in (0, 1)]
        pending = [r for r in rung if r and shared.reached(r, after)]
        if pending:
            return min(pending, key=lambda r: (r - after) & 0xFFFFFFFF)  # rounds are served in order
        self._fail_if_given_up()
        self._check_peer_timeout()
        futex.futex_wait(memory.bell_address(0), bell, _IDLE_SLICE_S)
        return None

    def _serve_round(self, g: int) -> None:
        """One coordinator round: every worker's descriptor checked, the round reduced into its
        output slot, counted, `done`."""
        memory, world = self.memory, self.layout.world
        generation = memory.generation
        self._wait_bells(g, generation)
        plan = self._planner.plan(g)
        if isinstance(plan, RoundProblem):
            self._fail(plan)
            return
        if plan.reduce_bytes and not self._reduce(g, plan):
            return
        with self._lock:
            if memory.state is not LaneState.OPEN or memory.generation != generation:
                return
            # Counted before the workers see the round done, so what they read afterwards has it.
            metrics = self._metrics
            for w in range(world):
                metrics.payload_received(w, plan.received[w])
                metrics.payload_sent((w,), plan.sent[w])
            metrics.received_bytes.inc(sum(plan.received))
            metrics.sent_bytes.inc(sum(plan.sent))
            metrics.lane_rounds.inc()
            memory.set_done(g)
            self._served = g

    def _wait_bells(self, g: int, generation: int) -> None:
        """Returns once every worker rang for coordinator round `g`; fails the lane past the step
        timeout (from the first ring) or when a worker gave up; `_Stopped` when stopping or no
        longer OPEN."""
        memory, world = self.memory, self.layout.world
        first_ring = self._clock()
        started = time.perf_counter()
        for w in range(world):
            while True:
                bell = memory.bell(w)  # read first: a ring after it wakes the wait below at once
                if memory.rung(w, g & 1) == g:
                    break
                if (
                    self._stop.is_set()
                    or memory.state is not LaneState.OPEN
                    or memory.generation != generation
                ):
                    raise _Stopped
                self._fail_if_given_up()
                if self._clock() - first_ring > self._step_timeout:
                    missing = [v for v in range(world) if memory.rung(v, g & 1) != g]
                    self._fail_timed_out(missing)
                    raise _Stopped
                if self._spin.budget_s > 0 and self._spun(w, g):
                    continue
                futex.futex_wait(memory.bell_address(w), bell, _BUSY_SLICE_S)
        self._spin.observe(time.perf_counter() - started)
        # A worker that gave up after ringing would never read this round nor post the next.
        self._fail_if_given_up()

    def _check_peer_timeout(self) -> None:
        """Fails the lane when a round some worker posted has waited for the others' posts longer
        than the step timeout (peer rounds never wake this thread: looked at on idle slices)."""
        memory, world = self.memory, self.layout.world
        posted = [memory.posted(w) for w in range(world)]
        newest = max(posted, key=lambda p: (p - self._served) & 0xFFFFFFFF)
        if all(p == newest for p in posted):
            self._waiting_since = None
            return
        now = self._clock()
        if self._waiting_since is None or self._waiting_since[0] != newest:
            self._waiting_since = (newest, now)
        elif now - self._waiting_since[1] > self._step_timeout:
            self._fail_timed_out([w for w in range(world) if posted[w] != newest])
            raise _Stopped

    def _fail_timed_out(self, missing: list[int]) -> None:
        key = self._in_flight()
        what = str(key) if key is not None else "a collective"
        names = ", ".join(map(str, missing))
        message = f"{what} timed out after {self._step_timeout:g} s waiting for worker(s) {names}"
        self._fail(RoundProblem(message, None, culprit_status=Status.ABORTED))

    def sync_counters(self) -> None:
        """Adds what the workers counted of their peer rounds since the last call to the
        coordinator's counters (the lane thread does every half second; `traffic` first)."""
        memory, metrics = self.memory, self._metrics
        with self._lock:
            for w in range(self.layout.world):
                counted = memory.peer_counters(w)
                seen = self._counted.get(w, (0, 0, 0))
                rounds, posted, read = (max(0, c - s) for c, s in zip(counted, seen, strict=True))
                self._counted[w] = counted
                if posted:
                    metrics.payload_received(w, posted)
                    metrics.received_bytes.inc(posted)
                if read:
                    metrics.payload_sent((w,), read)
                    metrics.sent_bytes.inc(read)
                if w == 0 and rounds:
                    metrics.lane_rounds.inc(rounds)

    def _spun(self, w: int, g: int) -> bool:
        """Whether worker `w` rang for round `g` within the spin (cores to spare only)."""
        rung, parity = self.memory.rung, g & 1
        return self._spin.until(lambda: rung(w, parity) == g)

    def _fail_if_given_up(self) -> None:
        """Fails the lane (and raises `_Stopped`) when a worker marked itself as having given up
        on the operation in flight (its own deadline, or an error on its side)."""
        memory = self.memory
        quitter = next((v for v in range(self.layout.world) if memory.abandoned(v)), None)
        if quitter is None:
            return
        key = self._in_flight()
        what = str(key) if key is not None else "a collective"
        message = f"{what} aborted: worker {quitter} gave up on it (its own deadline or error)"
        self._fail(RoundProblem(message, quitter, culprit_status=Status.DEADLINE_EXCEEDED))
        raise _Stopped

    def _reduce(self, g: int, plan: RoundPlan) -> bool:
        """Averages round `g`'s input slots into its output slot; False (the lane failed) on a
        non-finite value or an overflowing sum that the operation does not let through."""
        problem = reduce_round(
            self._averager, self.memory, g, plan, self.memory.output_slot(g, plan.reduce_bytes)
        )
        if problem is not None:
            self._fail(problem)
            return False
        return True

    # --- failing ------------------------------------------------------------------------------

    def _fail(self, problem: RoundProblem) -> None:
        with self._lock:
            if self.memory.state is LaneState.OPEN:
                self._fail_locked(problem)

    def _fail_locked(self, problem: RoundProblem, *, quiet: bool = False) -> None:
        """Fails the lane: `problem.culprit` hears `culprit_status`, the others `status`. Every
        worker that tries an operation some worker had begun in it hears this failure, then or
        later; later operations go over gRPC."""
        operation = self.memory.newest_operation()
        status, culprit, culprit_status, message = (
            problem.status,
            problem.culprit,
            problem.culprit_status,
            problem.message,
        )
        self.memory.record_failure(int(status), culprit, int(culprit_status), message, operation)
        if quiet:
            log.info("collective lane closed: %s", message)
            return
        self._metrics.errors.labels(status.name).inc()
        log.warning("collective lane failed: %s", message)

    def operation_in_flight(self) -> int | None:
        """The number (the key's step) of the collective under way in the lane, if any: what a
        supervisor names when it hears of a lost worker."""
        key = self._in_flight()
        return None if key is None else key.step

    def _in_flight(self) -> TensorKey | None:
        """The newest operation any worker has posted a round of while some worker has not read
        that round yet (what a failure interrupts), from its descriptor; None when nothing is
        under way."""
        memory, world = self.memory, self.layout.world
        newest, key = None, None
        for w in range(world):
            posted = memory.posted(w)
            if posted and (newest is None or (posted - newest) & 0xFFFFFFFF < 0x80000000):
                with contextlib.suppress(ValueError):
                    key = key_of(memory.read_descriptor(w, posted))
                    newest = posted
        if newest is None or all(shared.reached(memory.taken(w), newest) for w in range(world)):
            return None
        return key
