"""The coordinator's liveness monitor task: a tick every quarter heartbeat timeout (at most a
second) that evicts silent workers and fails steps past their deadline.

Which member counts as lost is `Job.liveness_verdict`'s decision; this module observes each
member and keeps the tick going. Heartbeat eviction and step expiry must never end silently: a
failed tick is logged and the loop restarted, and every failure in a row is reported (the job
fails after a few).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .job import Job, Liveness
from .membership import Member, Membership
from .streams import Streams, WorkerStream

log = logging.getLogger("gradserver.server")


class Monitor:
    """Every `interval` seconds until `stop()`: each member the job rules lost is passed to
    `evict(member, why)`, then `expire()` runs. `on_failure(count, error)` hears each failure
    with the number of failures in a row."""

    def __init__(
        self,
        interval: float,
        watched: tuple[Job, Membership, Streams],
        evict: Callable[[Member, str], None],
        expire: Callable[[], None],
        on_failure: Callable[[int, BaseException], None],
    ) -> None:
        self._interval = interval
        self._job, self._membership, self._streams = watched
        self._evict = evict
        self._expire = expire
        self._on_failure = on_failure
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.failures = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="gradserver-monitor")
        self._task.add_done_callback(self._done)

    def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    def _tick(self) -> None:
        now = time.monotonic()
        for member in self._membership.members():
            seen = observe(member, self._streams.of(member), now, world_complete=self._membership.complete)
            why = self._job.liveness_verdict(seen)
            if why is not None:
                self._evict(member, why)
        self._expire()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self._tick()
            self.failures = 0

    def _done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._stopped:
            return
        exc = task.exception()
        assert exc is not None  # the loop only ends by raising or being cancelled
        self.failures += 1
        log.error("liveness monitor failed (%d in a row): %r", self.failures, exc, exc_info=exc)
        self._on_failure(self.failures, exc)
        if not self._stopped:
            self.start()


def observe(member: Member, stream: WorkerStream | None, now: float, *, world_complete: bool) -> Liveness:
    """What `Job.liveness_verdict` needs to know of `member` (`stream`: its own open one)."""
    return Liveness(
        silent_s=now - member.last_seen,
        stalled_s=stream.stalled_for(now) if stream is not None else 0.0,
        has_stream=stream is not None,
        paused=stream is not None and stream.paused,
        streaming=member.streaming,
        world_complete=world_complete,
    )


class Timer:
    """One pending call on the running loop (the job's rejoin deadline); arming replaces it."""

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, delay: float, callback: Callable[[], None]) -> None:
        self.cancel()
        self._handle = asyncio.get_running_loop().call_later(delay, callback)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
