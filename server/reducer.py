"""Averaging as an effect, off the event loop: runs the reduction table's `Reduce` requests.

A large chunk's average (1.8-7.7 ms for 8 MiB) used to hold the event loop, during which no
stream was read or written. Here each request is averaged on one dedicated thread (numpy
releases the GIL; the `Averager` may still split a large chunk over its own range threads), and
the results go back to their table on the loop strictly in request order, so every worker sees
the averages in the order their chunks completed and the bytes are those of the inline path. A
small request with nothing ahead of it is averaged at once on the loop: a thread hop would cost
more than it saves.

An output buffer (the shared-memory output arena) is taken and given back on the loop only; the
thread just writes the average into it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable

from gradserver.common.messages import AveragedChunkOut

from .averaging import Averager, NonFiniteContribution, SumOverflow
from .outgoing import Outgoing
from .reduction import Reduce, ReductionTable

log = logging.getLogger("gradserver.server")

INLINE_BELOW_BYTES = 256 * 1024  # of contributions in all: averaged on the loop when nothing waits

Result = tuple[bytes | memoryview | None, SumOverflow | NonFiniteContribution | None]
# Hands a result to its table on the loop; returns what was sent (nothing when it was dropped).
Finish = Callable[[ReductionTable, Reduce, Result], list[Outgoing]]
_Pending = tuple[ReductionTable, Reduce, "memoryview | None", "asyncio.Future[Result]"]


class Reducer:
    """Averages `Reduce` requests in order; `finish` takes each result on the event loop."""

    def __init__(self, averager: Averager, finish: Finish) -> None:
        self._averager = averager
        self._finish = finish
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._drainer: asyncio.Task[None] | None = None

    def submit(self, table: ReductionTable, request: Reduce) -> None:
        # A reduce-scatter's chunks are copied into its result: no output buffer is worth taking.
        out = None if request.scattered else self._averager.take_output(request.data, request.dtype)
        if not self._queue and request.nbytes < INLINE_BELOW_BYTES:
            self._done(table, request, out, self._average(request, out))
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "gradserver-average")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._average, request, out)
        self._queue.append((table, request, out, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="gradserver-averages")

    async def close(self) -> None:
        """Waits for the averages under way (a few milliseconds each) and drops their results;
        ends the averaging threads (the coordinator's shutdown)."""
        if self._drainer is not None:
            self._drainer.cancel()
        futures = [future for *_, future in self._queue]
        if futures:
            await asyncio.wait(futures)
        for _, _, out, _ in self._queue:
            self._averager.give_back(out)
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._averager.close()

    async def _drain(self) -> None:
        while self._queue:
            table, request, out, future = self._queue[0]
            await asyncio.wait([future])
            self._queue.popleft()
            self._done(table, request, out, future.result())

    def _average(self, request: Reduce, out: memoryview | None) -> Result:
        try:
            averaged = self._averager.average(
                request.data,
                divide=request.divide,
                dtype=request.dtype,
                out=out,
                finite_only=request.finite_only,
            )
        except (SumOverflow, NonFiniteContribution) as exc:
            return None, exc
        return averaged, None

    def _done(self, table: ReductionTable, request: Reduce, out: memoryview | None, result: Result) -> None:
        sent = self._finish(table, request, result)
        averaged = result[0]
        used = any(isinstance(o.event, AveragedChunkOut) and o.event.data is averaged for o in sent)
        if not used:
            self._averager.give_back(out)  # its step failed meanwhile: the buffer holds nothing sent
