"""The worker's side of a 16-bit wire: rounding what it sends, and optional error feedback.

With `--wire-dtype bfloat16|float16` every float32 gradient is rounded once (to nearest even)
before it is cut into chunks. With error feedback, the rounding error of each key slot (block i,
a non-block component, the whole model, a collective group) is kept in float32 and added to the
next gradient sent for that slot, so what is lost to rounding at one step is sent at a later one
and the sum of the averages over steps tracks the sum of the exact means. The residual is
updated when the gradient is sent, whether or not its step then completes: a failed step's
gradient is void on every worker anyway, and its residual is a small correction either way.

A value beyond float16's range is refused before anything is sent (not scaled): scaling would
need the same factor on every worker, which the coordinator does not negotiate.

With `--wire-dtype int8|int4` (`QuantizingEncoder`) a gradient becomes block-quantized records
(common/quantized_wire.py) instead, with the same per-slot error feedback: the residual is what
was to be sent less the decoding of what was; the client lays the records out in its chunks.
"""

from __future__ import annotations

import numpy as np

from gradserver.common.errors import InvalidArgumentError
from gradserver.common.messages import QUANTIZED_DTYPES, DType, KeyKind, TensorKey
from gradserver.common.quantized_wire import NonFiniteValue, decode_records, encode_records
from gradserver.common.wire_dtype import WireOverflow, narrow, widen


class WireEncoder:
    """The float32 wire: what is given is what is sent. The base of every wire encoder."""

    dtype = DType.FLOAT32
    error_feedback = False

    def encode(self, key: TensorKey, array: np.ndarray) -> np.ndarray:
        """The payload elements to send for `array` (float32, 1-D)."""
        return array

    def residual(self, key: TensorKey) -> np.ndarray | None:
        """The rounding error kept for `key`'s slot (error feedback only)."""
        return None


class _CompensatingEncoder(WireEncoder):
    """A lossy wire: what `_payload` makes of each gradient, with the error it left kept per key
    slot and added to the slot's next gradient when `error_feedback` is on."""

    def __init__(self, dtype: DType, *, error_feedback: bool = False) -> None:
        self.dtype = dtype
        self.error_feedback = error_feedback
        self._residuals: dict[tuple[KeyKind, int], np.ndarray] = {}

    def encode(self, key: TensorKey, array: np.ndarray) -> np.ndarray:
        wanted = array
        residual = self._residuals.get(key.slot) if self.error_feedback else None
        if residual is not None and residual.size == array.size:
            wanted = array + residual
        payload = self._payload(key, wanted)
        if self.error_feedback:
            self._residuals[key.slot] = self._error(wanted, payload)
        return payload

    def residual(self, key: TensorKey) -> np.ndarray | None:
        return self._residuals.get(key.slot)

    def _payload(self, key: TensorKey, wanted: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _error(self, wanted: np.ndarray, payload: np.ndarray) -> np.ndarray:
        """What `payload` lost of `wanted` (float32, `wanted`'s size)."""
        raise NotImplementedError


class NarrowingEncoder(_CompensatingEncoder):
    """Rounds float32 gradients to a 16-bit wire dtype; keeps per-slot residuals when asked."""

    def _payload(self, key: TensorKey, wanted: np.ndarray) -> np.ndarray:
        """Raises InvalidArgumentError naming the key and element when a value does not fit the
        wire dtype."""
        try:
            return narrow(wanted, self.dtype)
        except WireOverflow as exc:
            raise InvalidArgumentError(
                f"{key}: {exc}; scale the loss or gradients down, or use --wire-dtype bfloat16 or float32",
                step=key.step,
                key=str(key),
            ) from None

    def _error(self, wanted: np.ndarray, payload: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            error = wanted - widen(payload.data, self.dtype)
        # A NaN or Inf sent (the coordinator refuses it) must not poison every later step.
        finite: np.ndarray = np.nan_to_num(error, nan=0.0, posinf=0.0, neginf=0.0)
        return finite


class QuantizingEncoder(_CompensatingEncoder):
    """Quantizes float32 gradients to records of a block-quantized dtype (`encode` gives the
    records, shape (blocks, record bytes)); keeps per-slot residuals when asked."""

    def _payload(self, key: TensorKey, wanted: np.ndarray) -> np.ndarray:
        """Raises InvalidArgumentError naming the key and element of a NaN or Inf (records carry
        finite values only)."""
        try:
            return encode_records(wanted, self.dtype)
        except NonFiniteValue as exc:
            raise InvalidArgumentError(f"{key}: {exc}", step=key.step, key=str(key)) from None

    def _error(self, wanted: np.ndarray, payload: np.ndarray) -> np.ndarray:
        error: np.ndarray = wanted - decode_records(payload, self.dtype)[: wanted.size]
        return error


def wire_encoder(dtype: DType, *, error_feedback: bool = False) -> WireEncoder:
    """The encoder layer for `dtype`, chosen once when the worker connects (or per call)."""
    if dtype is DType.FLOAT32:
        if error_feedback:
            raise InvalidArgumentError(
                "error feedback needs a 16-bit or quantized wire dtype (bfloat16, float16, int8, int4)"
            )
        return WireEncoder()
    if dtype in QUANTIZED_DTYPES:
        return QuantizingEncoder(dtype, error_feedback=error_feedback)
    return NarrowingEncoder(dtype, error_feedback=error_feedback)
