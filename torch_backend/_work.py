"""The Work engine of a process group: its collectives from issue to completion, and the Works
torch gets for them (a collective's, a send's or a receive's).

A collective is numbered in issue order and queued (`_queue.OperationQueue`); whoever comes first
runs it: a synchronous call's `wait()` on the caller's thread (and completes it right there), else
the group's thread, whose operations are completed on a pool of other threads (torch runs a
future's callbacks on the thread that completes it, and a callback may issue the next collective
and wait for it, as DDP comm hooks do). A failed collective fails its Work's future as C++ sees
it (DDP raises a RuntimeError carrying the message, never a crash), and `wait()` raises the
library's own error. Sends and receives are not queued (`PeerWork`): their `wait()` moves the
bytes, and their future completes on the same pool.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import itertools
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradserver.common.errors import DeadlineExceededError, GradServerError
from gradserver.worker import PeerReceive, PeerSend

from ._devices import DeviceTransfers
from ._queue import OperationQueue, Queued
from ._staging import Staging

_COMPLETION_THREADS = 64  # the most callbacks that may block at once (one per DDP bucket in flight)
# An operation nobody waits for yet is run by the group's thread after this delay, unless it is
# larger than _EAGER_BYTES (host bytes of every tensor involved): then at once, so it overlaps
# with the caller's work (DDP's backward). A synchronous call waits at once and runs it itself.
_PICKUP_DELAY_S = 0.0002
_EAGER_BYTES = 1 << 20
# Host operations up to this size are never eager: `submit_host` takes them without a `Staging`.
SMALL_BYTES = _EAGER_BYTES
# The staging of every operation on host tensors alone: it copies nothing, and is shared.
_HOST_ONLY = Staging("host", [], DeviceTransfers())
# The group's thread looks for such operations this often while they keep coming, and sleeps
# until the next one after this long without any.
_POLL_S = 0.002
_IDLE_S = 1.0


class Operations:
    """The collectives of the process group of rank `rank`: `submit` numbers and queues one and
    returns its Work; `close` ends them. `completions` is the pool that completes Works."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        # Operations run in issue order, one at a time: on the thread that waits for one (a
        # synchronous call), or on the group's own thread (`_queue`).
        self._queue: OperationQueue[_Operation] = OperationQueue(
            self._run,
            self._ran_in_background,
            pickup_delay_s=_PICKUP_DELAY_S,
            poll_s=_POLL_S,
            idle_s=_IDLE_S,
            name="gradserver-pg",
        )
        # Works are completed on other threads than the one that runs the collectives: torch runs
        # a future's callbacks on the thread that completes it, and a callback that issues a
        # collective and waits for it (DDP comm hooks such as PowerSGD) would otherwise wait for
        # the very thread it blocks. One blocked callback holds one thread; more start as needed.
        self._completions = concurrent.futures.ThreadPoolExecutor(
            _COMPLETION_THREADS, thread_name_prefix="gradserver-pg-done"
        )
        self._pending: dict[int, CollectiveWork] = {}
        # Notified whenever one of the group's Works completes (one per group, not per Work:
        # a synchronous call, which completes its own Work, never waits on it).
        self._completed = threading.Condition(threading.Lock())
        self._sequence = itertools.count()
        self._issue = threading.Lock()
        self._closed = False

    @property
    def completions(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that complete Works (and run the callbacks chained on their futures)."""
        return self._completions

    def close(self) -> bool:
        """Refuses new operations, fails those that never ran and stops the group's thread;
        False when it was closed already."""
        if self._closed:
            return False
        with self._issue:
            self._closed = True
        # Operations that never ran: their Works must still end, or a waiter would hang. (Those
        # that ran are being completed by the completion threads.)
        for operation in self._queue.close():
            error = RuntimeError(f"{operation.work.name}: the process group was shut down first")
            self._finish(operation.sequence, operation.work, error)
        self._completions.shutdown(wait=False)
        return True

    def submit(
        self,
        what: str,
        staging: Staging,
        run: Callable[[int], None],
        result: list[torch.Tensor],
    ) -> dist.Work:
        """Queues `run` (the collective on the staged host tensors); the Work's value is `result`,
        the caller's tensors."""
        # A host operation's future is made only if someone asks for it (most calls only wait).
        future = staging.future() if staging.device_resident else None
        # Device tensors are always worth overlapping: their copies to the host and back alone
        # take longer than a small collective.
        eager = staging.device_resident or staging.nbytes > _EAGER_BYTES
        return self._queue_operation(what, staging, run, result, future, eager)

    def submit_host(self, what: str, run: Callable[[int], None], result: list[torch.Tensor]) -> dist.Work:
        """`submit` for an operation on host tensors (the caller's own, nothing to copy) of at
        most SMALL_BYTES: no `Staging` to build for it."""
        return self._queue_operation(what, _HOST_ONLY, run, result, None, False)

    def _queue_operation(
        self,
        what: str,
        staging: Staging,
        run: Callable[[int], None],
        result: list[torch.Tensor],
        future: torch.futures.Future[list[torch.Tensor]] | None,
        eager: bool,
    ) -> dist.Work:
        with self._issue:
            if self._closed:
                raise RuntimeError(f"gradserver {what}: this process group was shut down")
            sequence = next(self._sequence)
            name = f"rank {self._rank}: gradserver {what} (operation {sequence})"
            work = CollectiveWork(name, future, self._completed)
            operation = _Operation(what, sequence, run, result, work, staging)
            self._pending[sequence] = work
            queued = self._queue.submit(operation, eager=eager)
        work.run_here = functools.partial(self._run_here, queued)
        work.expedite = functools.partial(self._queue.expedite, queued)
        return work

    def _run_here(self, queued: Queued[_Operation], deadline: float) -> None:
        """A waiter's turn: runs the operation on the waiter's thread and completes it there,
        when it comes first (no thread hand-off for a synchronous call)."""
        if self._queue.run_if_first(queued, deadline):
            operation = queued.item
            assert operation.outcome is not None
            self._finish(operation.sequence, operation.work, operation.outcome, operation.staging)

    def _run(self, operation: _Operation) -> None:
        operation.outcome = self._outcome(operation)
        # The collective's closure holds the host buffers: a Work the caller keeps (DDP keeps a
        # step's) must not keep them from being reused.
        operation.run = _ran

    def _ran_in_background(self, operation: _Operation) -> None:
        """Completes an operation that another thread than its waiter's ran (the group's, or a
        waiter of a later one), on a completion thread: a callback chained on its future may
        issue and wait for the next collective."""
        assert operation.outcome is not None
        args = (operation.sequence, operation.work, operation.outcome, operation.staging)
        try:
            self._completions.submit(self._finish, *args)
        except RuntimeError:  # shut down meanwhile: complete it here, nobody can chain on it now
            self._finish(*args)

    def _outcome(self, operation: _Operation) -> list[torch.Tensor] | Exception:
        """Runs one collective (device tensors copied in before, results copied out after): its
        result tensors, or the exception to fail its Work with."""
        what, sequence, work, staging = operation.what, operation.sequence, operation.work, operation.staging
        work.started = True
        outcome: list[torch.Tensor] | Exception
        try:
            with staging.running():
                staging.copy_in()
                operation.run(sequence)
                staging.copy_out()
            outcome = operation.result
        except GradServerError as exc:
            message = f"rank {self._rank}: gradserver {what} (operation {sequence}) failed: {exc.message}"
            outcome = type(exc)(message, step=exc.step, key=exc.key, worker_id=exc.worker_id)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work, not the thread
            outcome = exc if isinstance(exc, Exception) else RuntimeError(f"{work.name} failed: {exc!r}")
        finally:
            staging.release()
        return outcome

    def _finish(
        self,
        sequence: int,
        work: CollectiveWork,
        outcome: list[torch.Tensor] | Exception,
        staging: Staging | None = None,
    ) -> None:
        """Completes `work` (once): callbacks chained on its future run here; for device tensors,
        after the copies of the results (torch records the future's events behind them)."""
        if self._pending.pop(sequence, None) is None:
            return
        with staging.completing() if staging is not None else contextlib.nullcontext():
            if isinstance(outcome, Exception):
                work.fail(outcome)
            else:
                work.complete(outcome)


def _ran(sequence: int) -> None:
    raise RuntimeError(f"gradserver: operation {sequence} ran already")


@dataclasses.dataclass
class _Operation:
    """One issued collective: what runs it, its Work and, once run, its outcome."""

    what: str
    sequence: int
    run: Callable[[int], None]
    result: list[torch.Tensor]
    work: CollectiveWork
    staging: Staging
    outcome: list[torch.Tensor] | Exception | None = None


class CollectiveWork(dist.Work):
    """The Work of one collective: `wait()` raises the collective's own error (the library's
    exception, naming the lost rank), and `get_future()` is a future that C++ sees as failed.

    Why two futures: torch's Python `Future.set_exception` completes the C++ future *successfully*
    with the exception object as its value (an unwrap function re-raises it only for Python
    callers). DDP's reducer reads that value in C++ as a list of tensors, finds none and indexes
    past the end: every surviving rank segfaulted when a collective failed during backward. The
    future handed out is therefore `then`-chained on the result: a callback that raises marks the
    chained future as failed in C++, so DDP raises a RuntimeError carrying the message.
    (torch 2.13's `_create_work_from_future` is no alternative: its wait and future swallow the
    error, so a lost rank would pass unnoticed and leave tensors unreduced.)

    A host operation's result future is made only when `get_future()` is first called (a
    synchronous call never asks, and a future and an event per call cost more than a 4-byte
    collective's own work); device operations get theirs at the call, so that its completion
    is ordered on their streams. Completion is a flag under the group's `completed`
    condition."""

    def __init__(
        self,
        name: str,
        result: torch.futures.Future[list[torch.Tensor]] | None,
        completed: threading.Condition,
    ) -> None:
        super().__init__()
        self.name = name
        self.started = False  # set by the group's thread when the collective begins
        self._result = result  # None: a host operation's, made when first asked for
        self._on_device = result is not None
        self._completed = completed
        self._done = False
        self._value: list[torch.Tensor] = []
        self._error: Exception | None = None
        # The chained future, made when first asked for (most calls never ask: a synchronous
        # collective only waits), which costs a callback less per operation.
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        # Set by the group: runs the operation on the waiting thread when it comes first.
        self.run_here: Callable[[float], None] | None = None
        # Set by the group: the operation will be waited for through its future (DDP's reducer,
        # comm hooks), never through wait(): the group's thread takes it at once.
        self.expedite: Callable[[], None] | None = None

    def complete(self, tensors: list[torch.Tensor]) -> None:
        # Done before the future is set: its callbacks run inside set_result and may ask
        # is_completed(). A future made after this (host operations) is set by get_future.
        with self._completed:
            self._value = tensors
            self._done = True
            result = self._result
            self._completed.notify_all()
        if result is not None:
            result.set_result(tensors)

    def fail(self, error: Exception) -> None:
        with self._completed:
            self._error = error
            self._done = True
            result = self._result
            self._completed.notify_all()
        if result is not None:
            result.set_exception(error)  # type: ignore[arg-type]  # the stubs mistype it

    def _value_or_raise(self, result: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
        if self._error is not None:
            # A fresh exception without the worker thread's traceback: C++ keeps only its text,
            # which then ends with one frame instead of the whole collective's stack.
            raise type(self._error)(*self._error.args).with_traceback(None)
        return result.value()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Waits for the collective (bounded by the coordinator's step timeout and the receive
        timeout) or, given a positive `timeout`, at most that long: then DeadlineExceededError,
        and the collective goes on in the background, as with torch's own backends. Without a
        timeout (a synchronous call), an operation nobody has started yet runs right here."""
        synchronous = timeout is None or not timeout.total_seconds()
        if synchronous and self.run_here is not None and not self._done:
            self.run_here(float("inf"))
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if not self._done:
            with self._completed:
                if seconds > 0:
                    if not self._completed.wait_for(self._is_done, seconds):
                        raise DeadlineExceededError(
                            f"{self.name} did not complete within the {seconds:g} s given to wait()"
                        )
                else:
                    self._completed.wait_for(self._is_done)
        if self._on_device:
            assert self._result is not None
            self._result.wait()  # raises the collective's error; orders the caller's stream
        elif self._error is not None:
            raise self._error
        return True

    def _is_done(self) -> bool:
        return self._done

    def is_completed(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        settle = False
        with self._completed:
            if self._future is not None:
                return self._future
            if self._result is None:
                self._result = torch.futures.Future()
                settle = self._done  # completed before anyone asked: set it here
            result = self._result
            self._future = result.then(self._value_or_raise)
            future = self._future
        if settle:
            if self._error is not None:
                result.set_exception(self._error)  # type: ignore[arg-type]  # the stubs mistype it
            else:
                result.set_result(self._value)
        if self.expedite is not None:
            self.expedite()
        return future


class PeerWork(dist.Work):
    """The Work of a send or receive: `wait()` moves the bytes (a receive's waiter reads them
    in, then copies them into a device tensor on the group's copy stream, which the waiter's
    stream then waits for) and raises the operation's error (naming the peer rank), bounded by
    the group's timeout or the `timeout` given; `get_future()` completes on a completion thread
    that waits."""

    def __init__(
        self,
        name: str,
        operation: PeerSend | PeerReceive,
        tensors: list[torch.Tensor],
        timeout_s: float | None,
        completions: concurrent.futures.ThreadPoolExecutor,
        staging: Staging,
        write_back: Callable[[], None] | None = None,
        *,
        keep: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self._operation = operation
        self._tensors = tensors  # kept until complete: a send reads them, a receive writes them
        self._timeout_s = timeout_s
        self._completions = completions
        self._staging = staging
        self._write_back = write_back
        self._keep = keep  # a send's host copy, read until the message is delivered
        self._finished = False
        self._lock = threading.Lock()
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._complete(timeout)
        self._staging.order_current()
        return True

    def _complete(self, timeout: datetime.timedelta | None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        bound = seconds if seconds > 0 else self._timeout_s
        try:
            self._operation.wait(bound)
        except DeadlineExceededError:
            raise DeadlineExceededError(f"{self.name} did not complete within {bound:g} s") from None
        except GradServerError as exc:
            raise type(exc)(f"{self.name} failed: {exc.message}", worker_id=exc.worker_id) from None
        with self._lock:
            if not self._finished:
                self._finished = True
                self._keep = None
                if self._write_back is not None:
                    self._write_back()

    def is_completed(self) -> bool:
        return self._operation.done and (self._write_back is None or self._finished)

    def is_success(self) -> bool:
        return self._operation.done and self._operation.error is None

    def _source_rank(self) -> int:
        """The rank a receive's message came from (what `dist.recv(src=None)` returns)."""
        assert isinstance(self._operation, PeerReceive)
        return self._operation.sender

    def source_rank(self) -> int:
        return self._source_rank()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        with self._lock:
            if self._future is not None:
                return self._future
            future = self._staging.future()
            self._future = future

        def complete() -> None:
            try:
                self._complete(None)
            except Exception as exc:  # noqa: BLE001 - the future carries any failure
                future.set_exception(RuntimeError(str(exc)))  # type: ignore[arg-type]
            else:
                with self._staging.completing():
                    future.set_result(self._tensors)

        self._completions.submit(complete)
        return future
