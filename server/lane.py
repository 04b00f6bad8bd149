"""The coordinator's collective lane: its arena and the thread that serves its rounds
(docs/PROTOCOL.md, "The collective lane"; the shared layout is `common/lane.py`).

`Lane` owns one arena per coordinator, handed read-write to every worker that registers for
shared memory (`ShmHub`'s handshake). Its state word opens once every worker of the job has
registered, and closes for the job as soon as one joins without it (its Exchange stream opens
unregistered): a job's collectives then all go over gRPC, so no worker waits in the lane for one
that never comes. While open, one thread serves the rounds in order: it sleeps on the next
worker's `posted` word, plans the round (`lane_rounds.plan_round`: every worker issued the same
operation, sizes as this version posts them), averages REDUCE and REDUCE_SCATTER rounds with the
coordinator's `Averager` (the same bytes as the gRPC path) and publishes `done`.

Everything that ends a round other than success fails the lane for the job, with the status and
message the gRPC path would give (a lost or departed worker, a disagreement, a non-finite value,
`--step-timeout` with the workers that did not post, a worker that gave up waiting, the
coordinator stopping); workers raise it and send later collectives over gRPC. A fresh job
(every worker left) resets the lane.

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

from gradserver.common import lane as shared
from gradserver.common import shm
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
        self._round = 1
        self._planner = RoundPlanner(self.memory)
        self._spin = shared.spin_for(world)
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
                self._fail_locked(
                    Status.ABORTED,
                    worker_id,
                    Status.FAILED_PRECONDITION,
                    f"worker {worker_id} does not use shared memory; the collective lane is closed",
                )

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
                self._fail_locked(
                    Status.ABORTED,
                    worker_id,
                    Status.FAILED_PRECONDITION,
                    f"worker {worker_id} stopped using shared memory; the collective lane is closed",
                )

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
            self._fail_locked(Status.ABORTED, worker_id, Status.ABORTED, message, key, quiet=key is None)

    def reset(self) -> None:
        """A fresh job: the lane forms again, with rounds from 1."""
        with self._lock:
            self._registered.clear()
            self._generation += 1
            self._round = 1
            self.memory.reset(self._generation)

    def stopping(self, reason: str) -> None:
        """The coordinator is stopping: whatever waits in the lane fails as UNAVAILABLE (later
        collectives go over gRPC, where the coordinator's shutdown answers them)."""
        with self._lock:
            if self.memory.state in (LaneState.OPEN, LaneState.FORMING):
                key = self._in_flight() if self.memory.state is LaneState.OPEN else None
                message = f"{f'{key} failed: ' if key else ''}the coordinator is stopping: {reason}"
                self._fail_locked(
                    Status.UNAVAILABLE, None, Status.UNAVAILABLE, message, key, quiet=key is None
                )

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
                shared.futex_wait(self.memory.state_address(), int(self.memory.state), _IDLE_SLICE_S)
                continue
            try:
                self._serve_round(self._round)
            except _Stopped:
                continue
            except Exception as exc:
                log.exception("collective lane thread failed")
                self._fail(
                    Status.INTERNAL,
                    None,
                    Status.INTERNAL,
                    f"the coordinator's collective lane failed: {exc!r}",
                )

    def _serve_round(self, g: int) -> None:
        memory, world = self.memory, self.layout.world
        generation = memory.generation
        self._wait_posted(g, generation)
        plan = self._planner.plan(g)
        if isinstance(plan, RoundProblem):
            self._fail(plan.status, plan.culprit, plan.culprit_status, plan.message, self._in_flight(g))
            return
        # A peer round is the workers' to read and reduce: checked and counted here, no more.
        if not plan.peer and plan.reduce_bytes and not self._reduce(g, plan):
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
            # A peer round's readers do not wait for this, but its slots are reused only after it.
            memory.set_done(g)
            self._round = shared.next_round(g)

    def _wait_posted(self, g: int, generation: int) -> None:
        """Returns once every worker posted round `g`; fails the lane past the step timeout (from
        the first post) or when a worker gave up; `_Stopped` when stopping or no longer OPEN."""
        memory, world = self.memory, self.layout.world
        first_post: float | None = None
        for w in range(world):
            while not shared.reached(memory.posted(w), g):
                if (
                    self._stop.is_set()
                    or memory.state is not LaneState.OPEN
                    or memory.generation != generation
                ):
                    raise _Stopped
                self._fail_if_given_up(g)
                now = self._clock()
                if first_post is None and any(shared.reached(memory.posted(v), g) for v in range(world)):
                    first_post = now
                if first_post is not None and now - first_post > self._step_timeout:
                    missing = ", ".join(
                        str(v) for v in range(world) if not shared.reached(memory.posted(v), g)
                    )
                    key = self._in_flight(g)
                    what = str(key) if key is not None else f"collective lane round {g}"
                    message = (
                        f"{what} timed out after {self._step_timeout:g} s waiting for worker(s) {missing}"
                    )
                    self._fail(Status.ABORTED, None, Status.ABORTED, message, key)
                    raise _Stopped
                if first_post is not None and self._spin and self._spun(w, g):
                    continue
                slice_s = _BUSY_SLICE_S if first_post is not None else _IDLE_SLICE_S
                shared.futex_wait(memory.posted_address(w), memory.posted(w), slice_s)
        # A worker that gave up after posting would never read this round nor post the next.
        self._fail_if_given_up(g)

    def _spun(self, w: int, g: int) -> bool:
        """Whether worker `w` posted round `g` within a few quick looks (cores to spare only)."""
        posted = self.memory.posted
        return any(shared.reached(posted(w), g) for _ in range(self._spin))

    def _fail_if_given_up(self, g: int) -> None:
        """Fails the lane (and raises `_Stopped`) when a worker marked itself as having given up
        on the operation in flight (its own deadline, or an error on its side)."""
        memory = self.memory
        quitter = next((v for v in range(self.layout.world) if memory.abandoned(v)), None)
        if quitter is None:
            return
        key = self._in_flight(g)
        what = str(key) if key is not None else "a collective"
        message = f"{what} aborted: worker {quitter} gave up on it (its own deadline or error)"
        self._fail(Status.ABORTED, quitter, Status.DEADLINE_EXCEEDED, message, key)
        raise _Stopped

    def _reduce(self, g: int, plan: RoundPlan) -> bool:
        """Averages round `g`'s input slots into its output slot; False (the lane failed) on a
        non-finite value or an overflowing sum that the operation does not let through."""
        problem = reduce_round(
            self._averager, self.memory, g, plan, self.memory.output_slot(g, plan.reduce_bytes)
        )
        if problem is not None:
            self._fail(
                problem.status, problem.culprit, problem.culprit_status, problem.message, self._in_flight(g)
            )
            return False
        return True

    # --- failing ------------------------------------------------------------------------------

    def _fail(
        self,
        status: Status,
        culprit: int | None,
        culprit_status: Status,
        message: str,
        key: TensorKey | None = None,
    ) -> None:
        with self._lock:
            if self.memory.state is LaneState.OPEN:
                self._fail_locked(status, culprit, culprit_status, message, key)

    def _fail_locked(
        self,
        status: Status,
        culprit: int | None,
        culprit_status: Status,
        message: str,
        key: TensorKey | None = None,
        *,
        quiet: bool = False,
    ) -> None:
        """Fails the lane. Every worker that tries an operation some worker had begun in it hears
        this failure, then or later; later operations go over gRPC. (`key`, the operation the
        message names, is the caller's.)"""
        del key
        operation = self.memory.newest_operation()
        self.memory.record_failure(int(status), culprit, int(culprit_status), message, operation)
        if quiet:
            log.info("collective lane closed: %s", message)
            return
        self._metrics.errors.labels(status.name).inc()
        log.warning("collective lane failed: %s", message)

    def _in_flight(self, g: int | None = None) -> TensorKey | None:
        """The operation of the round being served (or of round `g`), from a worker's descriptor;
        None when no worker has posted it."""
        memory = self.memory
        g = self._round if g is None else g
        for w in range(self.layout.world):
            if shared.reached(memory.posted(w), g):
                with contextlib.suppress(ValueError):
                    return key_of(memory.read_descriptor(w, g))
        return None
