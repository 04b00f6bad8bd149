"""16-bit wire dtypes: conversions, single rounding and the checks around them (numpy only).

The names of every wire dtype live here too, the block-quantized int8 and int4 among them (their
codec: common/quantized_wire.py; their payload elements are 4-byte words of records, which
`widen` leaves as they are: the client decodes a whole key once it is in).

Workers may send gradients as bfloat16 or float16 instead of float32 (`--wire-dtype`), halving
the bytes on every link. The worker API still takes and returns float32: `narrow` rounds a
float32 array to the wire dtype before sending and `widen` turns received 16-bit averages back
into float32. The coordinator widens every contribution to float64, sums in worker-id order,
divides, and rounds once to the wire dtype (`reduce_16`), so every worker gets the same bytes
and the result is within half an ulp of the wire dtype of the exact mean of what was sent.

bfloat16 is the top half of a float32, rounded to nearest even here in integer arithmetic (no
torch on the coordinator). A float64 result reaches bfloat16 through float32 by round-to-odd:
rounding to odd at 24 bits and then to nearest even at 8 bits equals one rounding to 8 bits, where
two round-to-nearest steps could round twice. float16 goes straight from float64 (numpy's
conversion rounds once, to nearest even).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .messages import QUANTIZED_DTYPES, DType

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_U32 = np.dtype("<u4")

WIRE_DTYPES: dict[str, DType] = {
    "float32": DType.FLOAT32,
    "bfloat16": DType.BFLOAT16,
    "float16": DType.FLOAT16,
    "int8": DType.INT8_BLOCK64,
    "int4": DType.INT4_BLOCK64,
}
_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}
# The largest finite value of each 16-bit dtype, for error messages.
_MAX = {DType.BFLOAT16: 3.3895313892515355e38, DType.FLOAT16: 65504.0}
_BF16_QUIET_NAN = np.uint16(0x7FC0)


def parse_wire_dtype(value: str | DType) -> DType:
    """The DType named by `value` (float32, bfloat16, float16, int8, int4); raises ValueError
    naming the choices otherwise."""
    if isinstance(value, DType):
        if value in _NAMES:
            return value
        raise ValueError(f"wire dtype {value.name} is not one of {', '.join(WIRE_DTYPES)}")
    try:
        return WIRE_DTYPES[value.strip().lower()]
    except KeyError:
        raise ValueError(f"wire dtype {value!r} is not one of {', '.join(WIRE_DTYPES)}") from None


def wire_dtype_name(dtype: DType) -> str:
    return _NAMES[dtype]


_STORAGE: dict[DType, np.dtype[np.generic]] = {
    DType.FLOAT32: _F32,
    DType.BFLOAT16: _U16,
    DType.FLOAT16: _F16,
    DType.INT8_BLOCK64: _U32,
    DType.INT4_BLOCK64: _U32,
}


def numpy_dtype(dtype: DType) -> np.dtype[np.generic]:
    """How the payload's elements are stored: bfloat16 as its raw 16 bits, a quantized dtype as
    the 4-byte words of its records."""
    return _STORAGE[dtype]


class WireOverflow(Exception):
    """A finite value beyond the range of the 16-bit dtype, at `element`."""

    def __init__(self, dtype: DType, element: int, value: float) -> None:
        super().__init__(
            f"element {element} = {value:g} is beyond the {wire_dtype_name(dtype)} range "
            f"(largest finite value {_MAX[dtype]:g})"
        )
        self.dtype = dtype
        self.element = element
        self.value = value


# --- float32 <-> 16 bits ------------------------------------------------------------------------


def bf16_from_f32(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN, Inf stays Inf,
    and a finite value that rounds past the largest bfloat16 becomes Inf (as IEEE rounding does)."""
    bits = np.ascontiguousarray(array, dtype=_F32).view(_U32)
    # Adding 0x7FFF plus the kept part's lowest bit, then truncating, rounds to nearest even.
    # In place on one temporary: this runs on every gradient a 16-bit worker sends.
    wide = bits >> 16
    wide &= 1
    wide += 0x7FFF
    wide += bits
    wide >>= 16
    rounded = wide.astype(_U16)
    nan = np.isnan(array)
    if nan.any():
        # The carry above could turn a NaN whose payload is in the low bits into Inf.
        rounded[nan] = _BF16_QUIET_NAN | ((bits[nan] >> 16) & 0x8000).astype(_U16)
    return rounded


def f32_from_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> float32, exact."""
    return (bits.astype(_U32) << 16).view(_F32)


def narrow(array: np.ndarray, dtype: DType) -> np.ndarray:
    """A float32 array rounded once (to nearest even) to `dtype`, as the payload's element type.
    Raises WireOverflow for the first finite element that does not fit; NaN and Inf pass through
    (the coordinator refuses them, naming the worker)."""
    if dtype is DType.FLOAT32:
        return array
    if dtype is DType.BFLOAT16:
        out = bf16_from_f32(array)
        # Inf in bfloat16 bits, without widening the whole array first.
        rounded_inf = (out & 0x7FFF) == 0x7F80
    else:
        with np.errstate(over="ignore"):
            out = array.astype(_F16)
        rounded_inf = np.isinf(out)
    if rounded_inf.any():
        overflow = rounded_inf & np.isfinite(array)
        if not overflow.any():
            return out
        element = int(np.flatnonzero(overflow)[0])
        raise WireOverflow(dtype, element, float(array[element]))
    return out


def widen(payload: bytes | memoryview, dtype: DType) -> np.ndarray:
    """A payload of `dtype` elements as float32 (exact: both 16-bit dtypes fit in float32); a
    quantized dtype's words as they are (records decode only as a whole key, laid out in chunks)."""
    raw = np.frombuffer(payload, dtype=numpy_dtype(dtype))
    if dtype is DType.FLOAT32 or dtype in QUANTIZED_DTYPES:
        return raw
    if dtype is DType.BFLOAT16:
        return f32_from_bf16(raw)
    return raw.astype(_F32)


def _widen64(payload: bytes | memoryview, dtype: DType, start: int, stop: int) -> np.ndarray:
    raw = np.frombuffer(payload, dtype=numpy_dtype(dtype))[start:stop]
    if dtype is DType.BFLOAT16:
        return f32_from_bf16(raw)
    return raw


# --- float64 -> 16 bits, rounded once -----------------------------------------------------------


def _f32_round_to_odd(wide: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: exact values stay, inexact ones become the neighbour
    (of the two float32 values around them) whose last mantissa bit is 1."""
    with np.errstate(over="ignore"):
        near = wide.astype(_F32)
    inexact = (near.astype(np.float64) != wide) & np.isfinite(near)
    even = (near.view(_U32) & 1) == 0
    fix = inexact & even
    if fix.any():
        toward = np.where(wide[fix] > near[fix], np.float32(np.inf), np.float32(-np.inf))
        near[fix] = np.nextafter(near[fix], toward)
    return near


def round_f64(wide: np.ndarray, dtype: DType) -> np.ndarray:
    """float64 values rounded once (to nearest even) to `dtype`'s payload elements."""
    if dtype is DType.FLOAT32:
        with np.errstate(over="ignore"):
            return wide.astype(_F32)
    if dtype is DType.FLOAT16:
        with np.errstate(over="ignore"):
            return wide.astype(_F16)
    return bf16_from_f32(_f32_round_to_odd(wide))


def is_finite(payload: np.ndarray, dtype: DType) -> np.ndarray:
    """Element-wise finiteness of payload elements of `dtype`."""
    finite: np.ndarray = (payload & 0x7F80) != 0x7F80 if dtype is DType.BFLOAT16 else np.isfinite(payload)
    return finite


_BLOCK = 65536


def reduce_16(
    contributions: Sequence[bytes | memoryview],
    dtype: DType,
    *,
    divide: bool,
    scratch: np.ndarray | None = None,
    count: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The mean (or with `divide` False the sum) of 16-bit payloads given in worker-id order:
    widened to float64, summed in that order, divided (by `count`, default one per payload),
    rounded once to `dtype`. Returns the payload and a boolean mask of its finite elements (the
    caller names what is not)."""
    size = len(contributions[0]) // numpy_dtype(dtype).itemsize
    count = len(contributions) if count is None else count
    if scratch is None or scratch.size < _BLOCK:
        scratch = np.empty(_BLOCK, dtype=np.float64)
    out = np.empty(size, dtype=numpy_dtype(dtype))
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, size, _BLOCK):
            stop = min(start + _BLOCK, size)
            acc = scratch[: stop - start]
            np.copyto(acc, _widen64(contributions[0], dtype, start, stop))
            for payload in contributions[1:]:
                np.add(acc, _widen64(payload, dtype, start, stop), out=acc)
            if divide:
                np.divide(acc, count, out=acc)
            out[start:stop] = round_f64(acc, dtype)
    return out, is_finite(out, dtype)


def first_non_finite(payloads: Sequence[bytes | memoryview], dtype: DType) -> tuple[int, int] | None:
    """(position, element) of the first non-finite element among `payloads`, or None."""
    for position, payload in enumerate(payloads):
        raw = np.frombuffer(payload, dtype=numpy_dtype(dtype))
        bad = np.flatnonzero(~is_finite(raw, dtype))
        if bad.size:
            return position, int(bad[0])
    return None
