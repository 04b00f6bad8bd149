"""Deterministic averaging of one chunk from every worker.

The sum runs in worker-id order in float64 and is divided by the number of contributors before a
single rounding to float32, so the result does not depend on arrival order, is within half an
ulp-of-float32 of the exact mean in practice, and every worker receives the same bytes. A
non-finite input makes the float64 sum non-finite (finite float32 values cannot overflow it), so
one cheap check guards the result and the culprit is searched only on failure.
"""

from __future__ import annotations

import numpy as np

_F32 = np.dtype("<f4")


class NonFiniteContribution(Exception):
    """Raised when a contribution holds NaN or Inf; `position` indexes the contributions."""

    def __init__(self, position: int, element: int) -> None:
        super().__init__(f"contribution {position} holds a non-finite value at element {element}")
        self.position = position
        self.element = element


def average_chunk(contributions: list[bytes]) -> bytes:
    """Mean of little-endian float32 buffers, given in worker-id order."""
    arrays = [np.frombuffer(c, dtype=_F32) for c in contributions]
    acc = arrays[0].astype(np.float64)
    # inf - inf is expected input here (reported below), not a numerical accident to warn about.
    with np.errstate(invalid="ignore", over="ignore"):
        for array in arrays[1:]:
            np.add(acc, array, out=acc)
        if len(arrays) > 1:
            np.divide(acc, len(arrays), out=acc)
        finite = np.isfinite(acc.sum())
    if not finite:
        raise _locate_non_finite(arrays)
    if len(arrays) == 1:
        return contributions[0]
    return acc.astype(_F32).tobytes()


def _locate_non_finite(arrays: list[np.ndarray]) -> NonFiniteContribution:
    for position, array in enumerate(arrays):
        bad = np.flatnonzero(~np.isfinite(array))
        if bad.size:
            return NonFiniteContribution(position, int(bad[0]))
    # Unreachable for finite float32 inputs; kept so a failed invariant still names something.
    return NonFiniteContribution(0, 0)
