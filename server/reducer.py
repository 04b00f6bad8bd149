"""Averaging as an effect, off the event loop: runs the reduction table's `Reduce` requests.

A large chunk's average (1.8-7.7 ms for 8 MiB) used to hold the event loop, during which no
stream was read or written. Here each request is averaged on one dedicated thread (numpy
releases the GIL; the `Averager` may still split a large chunk over its own range threads), and
the results go back to their table on the loop strictly in request order, so every worker sees
the averages in the order their chunks completed and the bytes are those of the inline path. A
small request with nothing ahead of it is averaged at once on the loop: a thread hop would cost
more than it saves.

So is every request, whatever its size, while `on_loop` says so (`average_on_loop`: every
stream is a same-host shared-memory worker's and no core is left for the thread). The loop then
serves only those workers' small control messages, and the thread bought nothing: it competed
with the workers and the loop for the same cores, and every numpy call in it handed the GIL to
the loop and waited to get it back. Measured on 2 cores, two shared-memory workers, 4 MiB
chunks: a chunk's average took 1.6-2.0 ms on the thread for 0.9 ms of CPU (1.0-1.1 ms on the
loop), the queue in front of it stayed ~13 deep, each entry holding an output slot, and a step
took ~0.30 s instead of ~0.22 s (docs/PERFORMANCE.md, "Averaging on the loop or a thread").

An output buffer (the shared-memory output arena) is taken and given back on the loop only; the
thread just writes the average into it. An average written over the workers' own chunks
(`InPlace`) is always computed on the loop: the loop also sends the step failures after which a
worker may reuse that memory, so no such write can still be under way when one is sent.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable, Collection

from gradserver.common.averaging import Averager, InPlace, NonFiniteContribution, Output, SumOverflow
from gradserver.common.messages import AveragedChunkOut

from .outgoing import Outgoing
from .reduction import Reduce, ReductionTable

log = logging.getLogger("gradserver.server")

INLINE_BELOW_BYTES = 256 * 1024  # of contributions in all: averaged on the loop when nothing waits


def average_on_loop(workers: Collection[int], uses_shm: Callable[[int], bool], cores: int) -> bool:
    """Whether large averages run on the event loop rather than the averaging thread: only when
    every worker with a stream (`workers`) uses shared memory, so no stream's payload waits for
    the loop, and the host has no core for the thread besides one per such worker (they run
    here) and the loop's."""
    return bool(workers) and len(workers) + 2 > cores and all(uses_shm(w) for w in workers)


Result = tuple[bytes | memoryview | None, SumOverflow | NonFiniteContribution | None]
# Hands a result to its table on the loop; returns what was sent (nothing when it was dropped).
Finish = Callable[[ReductionTable, Reduce, Result], list[Outgoing]]
_Pending = tuple[ReductionTable, Reduce, "Output | None", "asyncio.Future[Result]"]


class Reducer:
    """Averages `Reduce` requests in order; `finish` takes each result on the event loop."""

    def __init__(
        self, averager: Averager, finish: Finish, on_loop: Callable[[], bool] = lambda: False
    ) -> None:
        self._averager = averager
        self._finish = finish
        self._on_loop = on_loop
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._drainer: asyncio.Task[None] | None = None

    def submit(self, table: ReductionTable, request: Reduce) -> None:
        # A reduce-scatter's chunks are copied into its result: no output buffer is worth taking.
        out = (
            None
            if request.scattered
            else self._averager.take_output(
                request.data,
                request.dtype,
                divide=request.divide,
                finite_only=request.finite_only,
                count=request.count,
            )
        )
        loop = asyncio.get_running_loop()
        if isinstance(out, InPlace):
            # Written over the workers' own memory, here on the loop: a step failure (after which
            # a worker may reuse that memory) is sent from the loop too, so none can be sent while
            # such a write is under way. Its result still goes back in request order.
            result = self._average(request, out)
            if not self._queue:
                self._done(table, request, out, result)
                return
            future: asyncio.Future[Result] = loop.create_future()
            future.set_result(result)
        # Only with nothing ahead of it: the results go back in request order.
        elif not self._queue and (request.nbytes < INLINE_BELOW_BYTES or self._on_loop()):
            self._done(table, request, out, self._average(request, out))
            return
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, "gradserver-average")
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

    def _average(self, request: Reduce, out: Output | None) -> Result:
        try:
            averaged = self._averager.average(
                request.data,
                divide=request.divide,
                dtype=request.dtype,
                out=out,
                finite_only=request.finite_only,
                count=request.count,
            )
        except (SumOverflow, NonFiniteContribution) as exc:
            return None, exc
        return averaged, None

    def _done(self, table: ReductionTable, request: Reduce, out: Output | None, result: Result) -> None:
        sent = self._finish(table, request, result)
        averaged = result[0]
        used = any(isinstance(o.event, AveragedChunkOut) and o.event.data is averaged for o in sent)
        if not used:
            self._averager.give_back(out)  # its step failed meanwhile: the buffer holds nothing sent
