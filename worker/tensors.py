"""Turning a user's gradient (numpy array, torch tensor on any device, sequence) into float32,
and a collective's tensor into the raw bytes the byte-moving kinds carry.

The wire carries little-endian float32. CPU data that already is contiguous float32 is used as
is (no copy); a CUDA tensor is copied to the host once. Any other dtype is refused with a clear
error rather than converted silently, because a silent float64 to float32 cast would change what
the worker believes it sent.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from gradserver.common.errors import InvalidArgumentError

_F32 = np.dtype("<f4")


def as_float32_array(gradients: Any, *, what: str) -> np.ndarray:
    """A 1-D little-endian float32 view (or, when unavoidable, copy) of `gradients`."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(gradients, torch.Tensor):
        tensor = gradients.detach()
        if tensor.dtype != torch.float32:
            raise InvalidArgumentError(f"{what}: dtype {tensor.dtype} is not allowed; send float32")
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        array = tensor.contiguous().numpy()
    elif isinstance(gradients, np.ndarray):
        array = gradients
    else:
        try:
            array = np.asarray(gradients, dtype=_F32)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"{what}: expected a numpy array, a torch tensor or a sequence of floats, "
                f"got {type(gradients).__name__}"
            ) from exc
    if array.dtype.kind != "f" or array.dtype.itemsize != 4:
        raise InvalidArgumentError(f"{what}: dtype {array.dtype} is not allowed; send float32")
    if array.dtype.byteorder == ">":
        array = array.astype(_F32)
    return np.ascontiguousarray(array).reshape(-1)


def as_result_buffer(into: Any, num_elements: int, *, what: str) -> np.ndarray:
    """A 1-D float32 view of `into` (a numpy array or CPU torch tensor) that averages are written
    straight into; refused, naming `what`, when writing there would not reach the caller's memory
    (another dtype or byte order, not contiguous, read-only, on a GPU) or the size differs."""
    array = _host_array(into, what, torch_dtype="float32")
    if array.dtype != _F32:
        raise InvalidArgumentError(f"{what}: into= has dtype {array.dtype}; it must be little-endian float32")
    _check_writable(array, what)
    if array.size != num_elements:
        raise InvalidArgumentError(f"{what}: into= holds {array.size} elements, the gradient {num_elements}")
    return array.reshape(-1)


def as_byte_array(data: Any, *, what: str) -> np.ndarray:
    """The raw bytes of `data` (a numpy array or torch tensor of any dtype, or bytes), 1-D uint8,
    for the collective kinds that move bytes unreduced: a view when the memory is contiguous on
    the host, else a copy."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor):
        data = data.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    elif isinstance(data, bytes | bytearray | memoryview):
        data = np.frombuffer(data, dtype=np.uint8)
    if not isinstance(data, np.ndarray):
        raise InvalidArgumentError(
            f"{what}: expected a numpy array, a torch tensor or bytes, got {type(data).__name__}"
        )
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def as_byte_buffer(into: Any, num_bytes: int | None, *, what: str) -> np.ndarray:
    """A 1-D uint8 view of `into` (a numpy array or CPU torch tensor of any dtype) that a
    byte-moving collective's result is written straight into; refused, naming `what`, when
    writing there would not reach the caller's memory or its size in bytes differs from
    `num_bytes` (None: the result's length is not known yet, `into` says what it must be)."""
    array = _host_array(into, what)
    _check_writable(array, what)
    if num_bytes is not None and array.nbytes != num_bytes:
        raise InvalidArgumentError(f"{what}: into= holds {array.nbytes} bytes, the result {num_bytes}")
    return array.reshape(-1).view(np.uint8)


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` and `b` are the very same elements (same start, same length): a result
    written in place, where copying one into the other would be a wasted pass."""
    return bool(a.size == b.size and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _host_array(into: Any, what: str, *, torch_dtype: str = "") -> np.ndarray:
    """`into` as a numpy array over the caller's memory: a numpy array as it is, a CPU torch tensor
    (of `torch_dtype` when given) as a view; refused, naming `what`, otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(into, torch.Tensor):
        if into.device.type != "cpu":
            raise InvalidArgumentError(f"{what}: into= must be in host memory, got a tensor on {into.device}")
        if torch_dtype and into.dtype != getattr(torch, torch_dtype):
            raise InvalidArgumentError(f"{what}: into= has dtype {into.dtype}; it must be {torch_dtype}")
        into = into.detach().numpy()
    if not isinstance(into, np.ndarray):
        raise InvalidArgumentError(
            f"{what}: into= must be a numpy array or a CPU torch tensor, got {type(into).__name__}"
        )
    return into


def _check_writable(into: np.ndarray, what: str) -> None:
    if not into.flags.c_contiguous or not into.flags.writeable:
        raise InvalidArgumentError(f"{what}: into= must be a C-contiguous, writable array")
