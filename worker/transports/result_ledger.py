"""`ResultLedger`: what one stream's worker is waiting for, whatever carries the bytes.

The transport-independent half of a link: the results registered before their chunks go
(`expect`), filled chunk by chunk from the receiver thread (`fill`) and collected by the caller
(`wait_result`); the barriers in flight; the answers to sample-range requests in the order asked;
the steps the coordinator reported failed; and the error that broke the stream. Every wait is
bounded and wakes on the one condition variable the link gives (partitioned coordinators share
one between their partitions' links, so a waiter wakes on any partition's news).

A stream's in-stream errors are routed here (`on_error`): a failed step fails everything of that
step (results, barriers), a refused key its result, a refused barrier or sample request its
waiter; an error about nothing in particular fails every incomplete result, since nothing can
trust the stream's order any more.

Errors are kept as `ErrorRecord`s, never as exception objects (see `base.ErrorRecord`). Whoever
paces sends by their answers (`pacing.Pacer`) hears of every answer through `answered`, called
with the lock held.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

from gradserver.common.chunking import chunk_count
from gradserver.common.collective_rules import result_in_pieces
from gradserver.common.errors import (
    DeadlineExceededError,
    GradServerError,
    InternalError,
    InvalidArgumentError,
)
from gradserver.common.messages import (
    QUANTIZED_DTYPES,
    AveragedChunkOut,
    DType,
    ErrorOut,
    SampleRangeAssignmentOut,
    TensorKey,
)
from gradserver.common.timeouts import Timeouts

from ..tensors import same_memory
from .base import ErrorRecord, PendingResult

_FAILED_STEPS_KEPT = 64

Answered = Callable[[TensorKey, "int | None"], bool]


@dataclasses.dataclass
class PendingBarrier:
    released: bool = False
    error: ErrorRecord | None = None


def _nothing_answered(key: TensorKey, elements: int | None) -> bool:
    return False


class ResultLedger:
    """One stream's results, barriers, sample answers, failed steps and breakage."""

    def __init__(
        self,
        cond: threading.Condition,
        chunk_elements: int,
        timeouts: Timeouts,
        answered: Answered = _nothing_answered,
    ) -> None:
        """`cond` guards everything here (reentrant: `threading.Condition()`'s default lock);
        `chunk_elements` counts a result's chunks; `answered(key, elements)` hears, lock held,
        that `elements` of `key`'s chunks were answered (None: all of them), and says whether it
        was counting them (then waiters are woken)."""
        self.cond = cond
        self.timeouts = timeouts
        self._chunk_elements = chunk_elements
        self._answered = answered
        self._results: dict[TensorKey, PendingResult] = {}
        self._barriers: dict[tuple[int, str], PendingBarrier] = {}
        self._samples: collections.deque[SampleRangeAssignmentOut | ErrorRecord] = collections.deque()
        self._failed_steps: collections.OrderedDict[int, ErrorRecord] = collections.OrderedDict()
        self.broken: ErrorRecord | None = None

    # --- registering what we wait for ---------------------------------------------------------

    def expect(
        self,
        key: TensorKey,
        component_sizes: tuple[int, ...],
        total: int | None,
        dtype: DType = DType.FLOAT32,
        *,
        array: np.ndarray | None = None,
        num_chunks: int | None = None,
    ) -> None:
        """Registers `key`'s average, arriving in `dtype` (`total` elements, None when only the
        result says), written into `array` when given; `num_chunks`: how many of its chunks this
        stream is answered (default all of them)."""
        sized = total is not None or array is not None
        length = (array.size if array is not None else total) or 0
        pending = PendingResult(
            key=key,
            component_sizes=component_sizes,
            array=result_array(length, dtype) if array is None else array,
            num_chunks=chunk_count(length, self._chunk_elements) if num_chunks is None else num_chunks,
            dtype=dtype,
            by_elements=result_in_pieces(key),
            sized=sized,
        )
        with self.cond:
            if key in self._results:
                raise InvalidArgumentError(
                    f"{key} was already sent by this worker and is still awaiting its average",
                    step=key.step,
                    key=str(key),
                )
            failed = self._failed_steps.get(key.step)
            if failed is not None:
                pending.error = failed
            self._results[key] = pending

    def pending(self, key: TensorKey) -> PendingResult | None:
        """`key`'s result while it is registered."""
        with self.cond:
            return self._results.get(key)

    def forget(self, key: TensorKey) -> None:
        """Stops waiting for `key`."""
        with self.cond:
            self._results.pop(key, None)
            self._answered(key, None)
            self.cond.notify_all()

    def awaiting(self, key: TensorKey) -> bool:
        """Whether `key` is still registered (a receive for it timed out locally and may retry)."""
        with self.cond:
            return key in self._results

    def step_failed(self, step: int) -> bool:
        with self.cond:
            return step in self._failed_steps

    def trouble(self, step: int) -> ErrorRecord | None:
        """Why nothing of `step` can complete on this stream (broken, or the step failed)."""
        with self.cond:
            return self.broken or self._failed_steps.get(step)

    def result_ready(self, key: TensorKey) -> bool:
        """Whether `wait_result(key)` would return or raise without waiting."""
        with self.cond:
            pending = self._results.get(key)
            return (
                pending is None
                or pending.done
                or pending.error is not None
                or self.trouble(key.step) is not None
            )

    def expect_barrier(self, step: int, name: str) -> PendingBarrier:
        with self.cond:
            bar = self._barriers[(step, name)] = PendingBarrier()
            failed = self._failed_steps.get(step)
            if failed is not None:
                bar.error = failed
            return bar

    def forget_barrier(self, step: int, name: str) -> None:
        with self.cond:
            self._barriers.pop((step, name), None)

    # --- waiting ------------------------------------------------------------------------------

    def wait(
        self, ready: Callable[[], bool], timeout: float | None, what: str, step: int | None = None
    ) -> None:
        """Waits (holding the lock) until `ready()`; raises the stream's error or a timeout
        naming `what`."""
        limit = self.timeouts.receive if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self.cond:
            while not ready():
                if self.broken is not None:
                    raise self.broken.exception()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError(f"{what} within {limit:g} s", step=step)
                self.cond.wait(remaining)

    def wait_result(self, key: TensorKey, timeout: float | None = None) -> PendingResult:
        """Blocks until the average of `key` is complete; raises its error, its step's failure or
        a timeout. After a local timeout `key` stays registered (see `awaiting`)."""
        with self.cond:
            pending = self._results[key]
            self.wait(
                lambda: pending.done or pending.error is not None or key.step in self._failed_steps,
                timeout,
                f"no average for {key}",
                key.step,
            )
            del self._results[key]
            self._answered(key, None)
            # An average that arrived before its step failed is void too: every worker drops the
            # whole step, so none applies part of it. The step's failure names the original
            # culprit, where a later refusal of this key would not.
            error = self._failed_steps.get(key.step) or pending.error
        if error is not None:
            raise error.exception()
        return pending

    def wait_barrier(self, step: int, name: str, bar: PendingBarrier, timeout: float | None) -> None:
        with self.cond:
            try:
                self.wait(
                    lambda: bar.released or bar.error is not None,
                    timeout,
                    f"step {step} barrier {name!r} not released",
                    step,
                )
            finally:
                self._barriers.pop((step, name), None)
        if bar.error is not None:
            raise bar.error.exception()

    def wait_samples(self, timeout: float | None) -> SampleRangeAssignmentOut:
        with self.cond:
            self.wait(lambda: bool(self._samples), timeout, "no sample-range assignment")
            item = self._samples.popleft()
        if isinstance(item, ErrorRecord):
            raise item.exception()
        return item

    # --- what the receiver thread records -----------------------------------------------------

    def released(self, step: int, name: str) -> None:
        """Barrier `name` of `step` was released (lock held)."""
        bar = self._barriers.get((step, name))
        if bar is not None:
            bar.released = True

    def samples_answered(self, answer: SampleRangeAssignmentOut) -> None:
        """The oldest sample-range request's answer arrived (lock held)."""
        self._samples.append(answer)

    def fill(self, event: AveragedChunkOut, data: np.ndarray) -> bool:
        """Writes one averaged chunk's values (`data`, as the result holds them) into its result;
        True when that completed a result that arrives in pieces (its inputs are free then: see
        docs/PROTOCOL.md, "When inputs are free"). A chunk that does not match what this worker
        sent fails its result, naming both."""
        with self.cond:
            pending = self._results.get(event.key)
            if pending is not None and not pending.sized and event.header.dtype == pending.dtype:
                # An ALL_TO_ALL result: its first piece says how long it is.
                pending.array = result_array(event.header.total_elements, pending.dtype)
                pending.sized = True
        if pending is None or pending.error is not None:
            return False  # a key this worker gave up on (timeout, failed step): nothing to fill
        if data.dtype != pending.array.dtype and data.dtype.itemsize == pending.array.dtype.itemsize:
            # Quantized words read as float32 (a shared-memory average): the bits, not a cast.
            data = data.view(pending.array.dtype)
        length = data.size
        end = event.offset + length
        error: ErrorRecord | None = None
        if (
            event.header.total_elements != pending.array.size
            or event.header.component_sizes != pending.component_sizes
            or event.header.dtype != pending.dtype
            or end > pending.array.size
            or (pending.by_elements and event.offset in pending.offsets)
        ):
            error = ErrorRecord(
                InternalError,
                f"coordinator sent an average for {event.key} that does not match what this "
                f"worker sent ({event.header.total_elements} {event.header.dtype.name} elements at "
                f"offset {event.offset}; this worker expects {pending.array.size} "
                f"{pending.dtype.name} elements)",
                step=event.key.step,
                key=str(event.key),
            )
        else:
            target = pending.array[event.offset : end]
            # An average written over the very memory awaiting it (shared memory, `into=` the
            # buffer sent) is already in place.
            if not same_memory(target, data):
                target[...] = data
        with self.cond:
            if error is not None:
                pending.error = error
            else:
                pending.offsets.add(event.offset)
                pending.elements += length
                pending.num_contributors = event.num_contributors
                pending.stats = event.stats
            complete = pending.done
            paced = self._answered(event.key, length)
            # Waiters wake for what they wait for: a result done or failed, room in the window.
            if complete or pending.error is not None or paced:
                self.cond.notify_all()
        return complete and pending.by_elements

    def on_error(self, event: ErrorOut, error: ErrorRecord) -> None:
        """Routes an in-stream error to what it is about (lock held)."""
        if event.step_failed:
            # The first report says why the step failed and who caused it; later refusals of
            # this step's messages repeat it about their own key.
            error = self._failed_steps.setdefault(event.step, error)
            while len(self._failed_steps) > _FAILED_STEPS_KEPT:
                self._failed_steps.popitem(last=False)
            for pending in self._results.values():
                if pending.key.step == event.step:
                    self._answered(pending.key, None)
                    if not pending.done:
                        pending.error = error
            for (step, _name), bar in self._barriers.items():
                if step == event.step:
                    bar.error = error
        elif event.key is not None:
            target = self._results.get(event.key)
            if target is not None and not target.done and target.error is None:
                target.error = error
            self._answered(event.key, None)
        elif event.barrier_name is not None:
            refused = self._barriers.get((event.step, event.barrier_name))
            if refused is not None:
                refused.error = error
        elif event.sample_range_step is not None:
            self._samples.append(error)
        elif event.peer_message is not None or event.start_at is not None:
            # A refused point-to-point message (the mailbox hears of it) or StartAt (the client
            # checks the same rules first; the worker takes part from its plan's step as before):
            # about no result here.
            pass
        else:
            # A message the coordinator could not attribute (malformed): nothing waiting can
            # trust the stream's ordering any more.
            for pending in self._results.values():
                if not pending.done:
                    pending.error = error

    def break_with(self, error: GradServerError) -> tuple[bool, ErrorRecord]:
        """Records why the stream broke (the first reason wins) and wakes every waiter; returns
        whether this was the first, and the reason kept."""
        with self.cond:
            first = self.broken is None
            if self.broken is None:
                self.broken = ErrorRecord.of(error)
            self.cond.notify_all()
            return first, self.broken

    def clear(self) -> None:
        """Drops everything registered (the link closed), so no array outlives the stream."""
        with self.cond:
            self._results.clear()
            self._barriers.clear()
            self._samples.clear()


def result_array(length: int, dtype: DType) -> np.ndarray:
    """A result of `length` elements arriving in `dtype`: bytes stay bytes, quantized words stay
    words (the client decodes the whole key), floats are float32."""
    if dtype is DType.BYTES:
        return np.empty(length, dtype=np.uint8)
    if dtype in QUANTIZED_DTYPES:
        return np.empty(length, dtype="<u4")
    return np.empty(length, dtype=np.float32)
