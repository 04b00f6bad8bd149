"""Deterministic averaging of one chunk from every worker.

The sum runs in worker-id order in float64 and is divided by the number of contributors before a
single rounding to float32, so the result does not depend on arrival order, is within half a
float32 ulp of the exact mean in practice, and every worker receives the same bytes. A non-finite
input makes the float64 sum, and so the float32 result, non-finite (the mean of finite float32
values always fits float32), so one check of the result guards it and the culprit is searched
only on failure.

The float64 accumulator is small and reused: the chunk is processed in blocks that stay in the
CPU cache (measured 25% faster than whole-chunk passes), and allocating a chunk-sized buffer
afresh would cost more in page faults than the arithmetic itself. A block is 64K elements (a
512 KiB float64 accumulator, within L2), except for an average written over its contributors
(`InPlace`, the one-host exchange), whose blocks are 256K: each block costs about ten numpy
calls, each of which gives up the GIL and takes it back, and there the coordinator's range
threads compete with the workers' copies for the cores, so every such hand-over can wait for a
wake-up. Large blocks on every path looked ~8% slower for DDP at 4 ranks on 2 cores over 8
runs, within reach of that bench's noise (docs/PERFORMANCE.md, "Larger averaging blocks"), so
the other paths keep 64K.

Two contributions (the common case of two workers on one host) take a float32 path that gives
the same bytes at about half the cost: the float32 sum a + b is the float64 sum rounded once to
float32 (rounding to 53 bits first cannot change a 24-bit rounding: 53 >= 2 * 24 + 2), and
halving commutes with rounding (a result below the smallest normal comes from a sum that float32
holds exactly, so it is rounded once either way). Only overflow differs: a finite mean whose sum
exceeds float32 gives inf there, so a block whose result is not finite is redone in float64
before anything is reported. tests/test_averaging.py checks the bytes against the float64 path.

An average may also be written straight into its contributors' own buffers (`InPlace`: the
same-host workers that sent a chunk from shared memory they want the average in): each block is
reduced into a cache-sized float32 scratch, checked, and only then copied over every
contribution, so a block whose average is not finite leaves every input of it untouched and the
culprit is found as usual (the blocks before it hold their averages by then).

With `threads` > 1 a large chunk is cut into that many element ranges (multiples of the block)
summed by a thread pool at once (numpy releases the GIL); every element goes through the same
operations in the same order, so the bytes are those of the single-threaded sum.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from .chunking import payload_nbytes
from .messages import QUANTIZED_DTYPES, DType
from .quantized_wire import BadRecord, QuantizedOverflow, reduce_records
from .wire_dtype import first_non_finite, reduce_16

_F32 = np.dtype("<f4")


class NonFiniteContribution(Exception):
    """Raised when a contribution holds NaN or Inf (or, quantized, a record no encoder makes:
    `what` says which); `position` indexes the contributions."""

    def __init__(self, position: int, element: int, what: str = "a non-finite value (NaN or Inf)") -> None:
        super().__init__(f"contribution {position} holds {what} at element {element}")
        self.position = position
        self.element = element
        self.what = what


_BLOCK = 65536  # elements per in-cache pass (module docstring)
_IN_PLACE_BLOCK = 262144  # the same for an average written over its contributors (`InPlace`)
_SMALL = 4096  # elements: below this, one pass without the block loop (`_sum_small`)


@dataclasses.dataclass(frozen=True, eq=False)
class InPlace:
    """Write the average over every one of `targets` (writable views of the contributions
    themselves, in worker-id order) instead of into one buffer; `targets[0]` stands for the
    result afterwards."""

    targets: tuple[memoryview, ...]


class OutputBuffers(Protocol):
    """Where averages may be written straight away (a transport's outbox offers them, e.g. the
    shared-memory output arena, so that sending an average copies nothing)."""

    def take(self, nbytes: int) -> memoryview | None: ...

    def in_place(self, contributions: Sequence[bytes | memoryview]) -> InPlace | None:
        """The contributions' own writable memory, when every contributor asked for its average
        there (else None)."""
        ...

    def give_back(self, view: memoryview) -> None: ...


Output = memoryview | InPlace


class Averager:
    """Averages chunks; owns a cache-sized float64 scratch buffer (one per thread)."""

    def __init__(self, threads: int = 1, *, in_place_threads: int | None = None) -> None:
        """`threads` split a large average; `in_place_threads` (default: `threads`) one written
        over its contributors, which then wait with nothing to copy out."""
        self._threads = max(1, threads)
        self._in_place_threads = max(1, in_place_threads or threads)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # Scratch buffers are per thread: the coordinator averages on its loop and off it at once.
        self._local = threading.local()
        # Set by an outbox while it offers them: float32 averages are written there.
        self.output_buffers: OutputBuffers | None = None

    def close(self) -> None:
        """Ends the range-summing threads (the coordinator's shutdown)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None

    def take_output(
        self,
        contributions: Sequence[bytes | memoryview],
        dtype: DType,
        *,
        divide: bool = True,
        finite_only: bool = True,
        count: int | None = None,
    ) -> Output | None:
        """Where `output_buffers` has the average of `contributions` written, when they offer a
        place (float32 averages of several contributions only: one is returned as is): over the
        contributions themselves when each asked for that (means of finite values only, so that
        a failure still finds its culprit; not when partial sums stand for more contributors
        than there are contributions), else a buffer."""
        buffers = self.output_buffers
        if buffers is None or dtype is not DType.FLOAT32 or len(contributions) < 2:
            return None
        if divide and finite_only and count in (None, len(contributions)):
            in_place = buffers.in_place(contributions)
            if in_place is not None:
                return in_place
        return buffers.take(payload_nbytes(contributions[0]))

    def give_back(self, out: Output | None) -> None:
        """Returns what `take_output` gave that holds no average after all."""
        if out is not None and self.output_buffers is not None:
            self.output_buffers.give_back(out.targets[0] if isinstance(out, InPlace) else out)

    def reduce(
        self,
        contributions: Sequence[bytes | memoryview],
        *,
        divide: bool = True,
        dtype: DType = DType.FLOAT32,
        finite_only: bool = True,
        count: int | None = None,
    ) -> bytes | memoryview:
        """`average`, written into a buffer from `output_buffers` when one is offered (and given
        back when the average fails)."""
        out = None
        if self.output_buffers is not None:
            out = self.take_output(contributions, dtype, divide=divide, finite_only=finite_only, count=count)
        try:
            return self.average(
                contributions, divide=divide, dtype=dtype, out=out, finite_only=finite_only, count=count
            )
        except (SumOverflow, NonFiniteContribution):
            self.give_back(out)
            raise

    def average(
        self,
        contributions: Sequence[bytes | memoryview],
        *,
        divide: bool = True,
        dtype: DType = DType.FLOAT32,
        out: Output | None = None,
        finite_only: bool = True,
        count: int | None = None,
    ) -> bytes | memoryview:
        """Mean of little-endian float32 buffers, given in worker-id order; with `divide` False
        their sum (collective SUM keys), rounded once the same way. `count`: how many contributors
        the buffers stand for when some are host groups' partial sums (default: one each); the
        sum is divided by it. A sum of finite values that
        overflows float32 raises `SumOverflow`, a non-finite input `NonFiniteContribution`;
        without `finite_only` both are results (the float64 sum rounded once: Inf, NaN), as
        torch.distributed gives them. 16-bit `dtype` payloads: see `_average_16`; quantized
        ones: `_reduce_quantized`.
        A writable float32-sized `out` receives the result and is returned itself (one input
        is returned as is, without touching `out`); an `InPlace` `out` gets it over every one of
        its targets, and the first is returned."""
        n = len(contributions) if count is None else count
        if isinstance(out, InPlace):
            if (
                dtype is not DType.FLOAT32
                or not divide
                or not finite_only
                or len(contributions) < 2
                or n != len(contributions)
            ):
                raise ValueError("averages in place are float32 means of several finite contributions")
            return self._average_in_place(contributions, out)
        if dtype in QUANTIZED_DTYPES:
            return _reduce_quantized(contributions, dtype, divide, n)
        if dtype is not DType.FLOAT32:
            return self._average_16(contributions, dtype, divide, finite_only, n)
        arrays = [np.frombuffer(c, dtype=_F32) for c in contributions]
        if len(arrays) == 1 and (not divide or n == 1):
            if finite_only and not np.isfinite(arrays[0]).all():
                raise _locate_non_finite(arrays)
            return contributions[0]
        size = arrays[0].size
        result = np.empty(size, dtype=_F32) if out is None else np.frombuffer(out, dtype=_F32)
        if size <= _SMALL:
            finite = _sum_small(arrays, result, divide, n)
            if not finite and finite_only:
                raise _locate_non_finite(arrays, overflow_possible=not divide)
            return result.data if out is None else out
        finite = self._over_ranges(
            size, self._threads, lambda begin, end: self._sum_range(arrays, result, begin, end, divide, n)
        )
        if not finite and finite_only:
            raise _locate_non_finite(arrays, overflow_possible=not divide)
        return result.data if out is None else out

    def _average_in_place(self, contributions: Sequence[bytes | memoryview], out: InPlace) -> memoryview:
        arrays = [np.frombuffer(c, dtype=_F32) for c in contributions]
        targets = [np.frombuffer(t, dtype=_F32) for t in out.targets]
        size = arrays[0].size
        if any(t.size != size for t in targets):
            raise ValueError("every in-place target must be as long as the contributions")
        finite = self._over_ranges(
            size, self._in_place_threads, lambda begin, end: self._in_place_range(arrays, targets, begin, end)
        )
        if not finite:
            raise _locate_non_finite(arrays)
        return out.targets[0]

    def _over_ranges(self, size: int, threads: int, work: Callable[[int, int], bool]) -> bool:
        """Runs `work(begin, end)` over `size` elements: at once, or cut into up to `threads`
        ranges (multiples of `_BLOCK`, at least two each) on the range threads; True when every
        range was finite. Every element goes through the same operations wherever a range or a
        block starts, so the bytes do not depend on the cut."""
        parts = min(threads, size // (2 * _BLOCK))
        if parts <= 1:
            return work(0, size)
        bounds = [size * i // parts // _BLOCK * _BLOCK for i in range(parts)] + [size]
        pool = self._range_pool()
        jobs = [pool.submit(work, bounds[i], bounds[i + 1]) for i in range(parts)]
        return all([job.result() for job in jobs])

    def _in_place_range(
        self, arrays: list[np.ndarray], targets: list[np.ndarray], begin: int, end: int
    ) -> bool:
        """Averages elements [begin, end) block by block into a float32 scratch (the same
        operations as `_sum_range`, so the same bytes) and copies each finite block over every
        target; stops at the first block that is not, leaving its inputs as they were."""
        block = getattr(self._local, "block", None)
        if block is None:
            block = self._local.block = np.empty(_IN_PLACE_BLOCK, dtype=_F32)
        for start in range(begin, end, _IN_PLACE_BLOCK):
            stop = min(start + _IN_PLACE_BLOCK, end)
            result = block[: stop - start]
            chunk = [a[start:stop] for a in arrays]
            if not self._sum_range(chunk, result, 0, stop - start, True, block_size=_IN_PLACE_BLOCK):
                return False
            for target in targets:
                target[start:stop] = result
        return True

    def _range_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                workers = max(self._threads, self._in_place_threads)
                self._pool = concurrent.futures.ThreadPoolExecutor(workers, "gradserver-reduce")
            return self._pool

    def _thread_scratch(self) -> np.ndarray:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = np.empty(_IN_PLACE_BLOCK, dtype=np.float64)
        return scratch

    def _thread_widened(self) -> np.ndarray:
        widened = getattr(self._local, "widened", None)
        if widened is None:
            widened = self._local.widened = np.empty(_IN_PLACE_BLOCK, dtype=np.float64)
        return widened

    def _thread_flags(self) -> np.ndarray:
        flags = getattr(self._local, "flags", None)
        if flags is None:
            flags = self._local.flags = np.empty(_IN_PLACE_BLOCK, dtype=np.bool_)
        return flags

    def _sum_range(
        self,
        arrays: list[np.ndarray],
        out: np.ndarray,
        begin: int,
        end: int,
        divide: bool,
        count: int | None = None,
        scratch: np.ndarray | None = None,
        block_size: int = _BLOCK,
    ) -> bool:
        """Writes the mean (or sum; divided by `count`, default the number of arrays) of
        elements [begin, end) into `out`, `block_size` elements at a time; False if any is not
        finite.
        Each block is checked for finite values while it is in the cache (a check of the whole
        range afterwards read it all again from memory, into a new array of flags, and cost as
        much as the sum)."""
        if scratch is None:
            scratch = self._thread_scratch()
        flags = self._thread_flags()
        finite = True
        # inf - inf is expected input here (reported below), not a numerical accident to warn about.
        count = len(arrays) if count is None else count
        with np.errstate(invalid="ignore", over="ignore"):
            if len(arrays) == 2 and (not divide or count == 2):
                a, b = arrays
                starts = []
                for start in range(begin, end, block_size):
                    block = out[start : min(start + block_size, end)]
                    np.add(a[start : start + block.size], b[start : start + block.size], out=block)
                    if divide:
                        np.multiply(block, np.float32(0.5), out=block)
                    if not np.isfinite(block, out=flags[: block.size]).all():
                        # An overflowing float32 sum (or a non-finite input): redone below.
                        starts.append(start)
                if not starts:
                    return True
            else:
                starts = list(range(begin, end, block_size))
            widened = self._thread_widened()
            for start in starts:
                stop = min(start + block_size, end)
                acc, wide = scratch[: stop - start], widened[: stop - start]
                # Each input widened on its own, then float64 + float64: the same operations as
                # numpy's mixed-type add, without its buffered casting (~13% of a 4-worker
                # average); likewise divided in float64, then rounded once into `out`.
                np.copyto(acc, arrays[0][start:stop])
                for array in arrays[1:]:
                    np.copyto(wide, array[start:stop])
                    np.add(acc, wide, out=acc)
                if divide:
                    _divide(acc, count)
                block = out[start:stop]
                np.copyto(block, acc, casting="same_kind")
                finite = finite and bool(np.isfinite(block, out=flags[: block.size]).all())
        return finite

    def _average_16(
        self,
        contributions: Sequence[bytes | memoryview],
        dtype: DType,
        divide: bool,
        finite_only: bool = True,
        count: int | None = None,
    ) -> bytes | memoryview:
        """The same float64 mean of 16-bit payloads, rounded once to `dtype` (not float32), so
        the bytes returned are what every worker gets. A finite sum beyond the dtype's range (a
        SUM key, or a mean rounding past the largest value) raises `SumOverflow`."""
        out, finite = reduce_16(
            contributions, dtype, divide=divide, scratch=self._thread_scratch(), count=count
        )
        if finite_only and not finite.all():
            bad = first_non_finite(contributions, dtype)
            if bad is not None:
                raise NonFiniteContribution(*bad)
            raise SumOverflow(int(np.flatnonzero(~finite)[0]), dtype=dtype)
        return out.data


def _reduce_quantized(
    contributions: Sequence[bytes | memoryview], dtype: DType, divide: bool, count: int
) -> bytes | memoryview:
    """One chunk of quantized records summed (or averaged) and encoded once (`reduce_records`).
    Records have no NaN or Inf to pass on, so `finite_only` does not apply: a bad record is
    always refused, naming its contributor, and so is a sum beyond float32."""
    try:
        return memoryview(reduce_records(contributions, dtype, divide=divide, count=count))
    except BadRecord as exc:
        raise NonFiniteContribution(exc.position, exc.word, f"a {dtype.name} record that {exc.why}") from None
    except QuantizedOverflow as exc:
        raise SumOverflow(exc.word, dtype=DType.FLOAT32) from None


def _sum_small(arrays: list[np.ndarray], out: np.ndarray, divide: bool, count: int | None = None) -> bool:
    """`Averager._sum_range` for a chunk of at most one block (a small collective), without its
    per-block bookkeeping: the same operations in the same order, so the same bytes (checked by
    tests/test_averaging.py against the float64 path); False if the result is not finite."""
    count = len(arrays) if count is None else count
    with np.errstate(invalid="ignore", over="ignore"):
        if len(arrays) == 2 and (not divide or count == 2):
            np.add(arrays[0], arrays[1], out=out)
            if divide:
                np.multiply(out, np.float32(0.5), out=out)
            if np.isfinite(out).all():
                return True
        acc = arrays[0].astype(np.float64)
        for array in arrays[1:]:
            np.add(acc, array.astype(np.float64), out=acc)
        if divide:
            _divide(acc, count)
        np.copyto(out, acc, casting="same_kind")
        return bool(np.isfinite(out).all())


def _divide(acc: np.ndarray, count: int) -> None:
    """`acc /= count` in float64. By a power of two it is a multiplication by its exact inverse,
    which gives the same bytes (float64 sums of float32 values never reach float64's subnormals)
    at a third of the cost."""
    if count & (count - 1) == 0:
        np.multiply(acc, 1.0 / count, out=acc)
    else:
        np.divide(acc, count, out=acc)


class SumOverflow(Exception):
    """A sum (or mean) of finite contributions is beyond the range of `dtype` at `element`."""

    def __init__(self, element: int, *, dtype: DType = DType.FLOAT32) -> None:
        super().__init__(f"the sum overflows {dtype.name.lower()} at element {element}")
        self.element = element
        self.dtype = dtype


def _locate_non_finite(
    arrays: list[np.ndarray], *, overflow_possible: bool = False
) -> NonFiniteContribution | SumOverflow:
    for position, array in enumerate(arrays):
        bad = np.flatnonzero(~np.isfinite(array))
        if bad.size:
            return NonFiniteContribution(position, int(bad[0]))
    if overflow_possible:
        with np.errstate(over="ignore"):
            total = np.sum([a.astype(np.float64) for a in arrays], axis=0).astype(_F32)
        return SumOverflow(int(np.flatnonzero(~np.isfinite(total))[0]))
    # Unreachable for finite float32 inputs; kept so a failed invariant still names something.
    return NonFiniteContribution(0, 0)
