"""The coordinator's liveness monitor task: a tick every quarter heartbeat timeout (at most a
second) that evicts silent workers and fails steps past their deadline.

Which member counts as lost is `Job.liveness_verdict`'s decision; this module only keeps the tick
going. Heartbeat eviction and step expiry must never end silently: a failed tick is logged and
the loop restarted, and every failure in a row is reported (the job fails after a few).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("gradserver.server")


class Monitor:
    """Calls `tick()` every `interval` seconds until `stop()`; `on_failure(count, error)` hears
    each failure with the number of failures in a row."""

    def __init__(
        self, interval: float, tick: Callable[[], None], on_failure: Callable[[int, BaseException], None]
    ) -> None:
        self._interval = interval
        self._tick = tick
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
