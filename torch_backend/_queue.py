"""A process group's operations in issue order, run one at a time, on whichever thread is first.

torch's `dist.all_reduce(t)` is `work = group.allreduce(...)` then `work.wait()`: a synchronous
call. Handing such an operation to a background thread and its completion to another costs two
thread hand-offs, more than a small collective itself takes through the collective lane. So an
operation waits in this queue, and whoever comes first runs it: a caller's `wait()` (it runs the
operations ahead of its own too, since they must run first), on its own thread; or the group's
background thread, which takes the head of the queue once it has waited `pickup_delay_s` (at
once for eager, i.e. large, operations, which are worth overlapping with the caller's work).
Every operation runs, in order, whether or not anyone waits for it: an async operation issued
before what it depends on (two ranks driven from one thread, or a store handshake between
issuing and waiting) cannot deadlock.

The background thread is not woken for each small operation (a wake-up would compete with the
caller for the GIL at the very moment the caller runs it): while operations keep coming, it looks
at the queue every `poll_s`; after `idle_s` without any, it sleeps until the next one is queued.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Queued(Generic[T]):
    """One queued operation: `item` is the caller's, `eager` skips the pickup delay."""

    def __init__(self, item: T, *, eager: bool) -> None:
        self.item = item
        self.eager = eager
        self.queued_at = time.monotonic()
        self.started = False


class OperationQueue(Generic[T]):
    """The queue of one process group. `run(item)` carries an operation out on the calling
    thread; `ran_elsewhere(item)` gets each operation run by another thread than its waiter's
    (the background thread, or a waiter running the ones ahead of its own)."""

    def __init__(
        self,
        run: Callable[[T], None],
        ran_elsewhere: Callable[[T], None],
        *,
        pickup_delay_s: float,
        poll_s: float,
        idle_s: float,
        name: str,
    ) -> None:
        self._run = run
        self._ran_elsewhere = ran_elsewhere
        self._delay = pickup_delay_s
        self._poll = poll_s
        self._idle = idle_s
        self._cond = threading.Condition()
        self._queue: collections.deque[Queued[T]] = collections.deque()
        self._busy = False
        self._closed = False
        self._asleep = False  # the background thread waits for a notification, not a timeout
        self._last_submit = 0.0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T, *, eager: bool) -> Queued[T]:
        """Queues `item`; raises RuntimeError once the queue is closed."""
        queued = Queued(item, eager=eager)
        with self._cond:
            if self._closed:
                raise RuntimeError("the process group was shut down")
            self._queue.append(queued)
            self._last_submit = queued.queued_at
            if eager or self._asleep:
                self._cond.notify_all()
        return queued

    def expedite(self, queued: Queued[T]) -> None:
        """Nobody will wait for `queued` on its own thread (it is waited for through a future):
        the background thread takes it as soon as it reaches the head, without the delay."""
        with self._cond:
            if not queued.started and not queued.eager:
                queued.eager = True
                self._cond.notify_all()

    def run_if_first(self, queued: Queued[T], deadline: float) -> bool:
        """Runs the operations ahead of `queued` and then `queued` itself on this thread, while
        nothing else runs, until it has started (True when it ran here, False when another
        thread started it, the deadline came or the queue closed)."""
        while True:
            with self._cond:
                while True:
                    if queued.started:
                        return False
                    if self._queue and not self._busy:
                        head = self._take()
                        break
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        return False
                    self._cond.wait(None if left == float("inf") else left)
            self._run_one(head)
            if head is queued:
                return True
            self._ran_elsewhere(head.item)

    def close(self) -> list[T]:
        """Stops the background thread once the operation it runs (if any) ends; returns the
        operations that never started."""
        with self._cond:
            self._closed = True
            left = [q.item for q in self._queue]
            for queued in self._queue:
                queued.started = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        return left

    def _take(self) -> Queued[T]:
        queued = self._queue.popleft()
        queued.started = True
        self._busy = True
        return queued

    def _run_one(self, queued: Queued[T]) -> None:
        try:
            self._run(queued.item)
        finally:
            with self._cond:
                self._busy = False
                if self._queue:  # someone may be waiting to take the next one
                    self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                head = self._next_for_background()
                if head is None:
                    return
            self._run_one(head)
            self._ran_elsewhere(head.item)

    def _next_for_background(self) -> Queued[T] | None:
        """Waits (holding the condition) for an operation the background thread should run."""
        while not self._closed:
            now = time.monotonic()
            if self._queue and not self._busy:
                head = self._queue[0]
                wait = 0.0 if head.eager else head.queued_at + self._delay - now
                if wait <= 0:
                    return self._take()
                self._cond.wait(max(wait, self._poll))
            elif self._queue or now - self._last_submit < self._idle:
                self._cond.wait(self._poll)
            else:
                self._asleep = True
                self._cond.wait()
                self._asleep = False
        return None
