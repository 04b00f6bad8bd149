"""Turning a user's gradient (numpy array, torch tensor on any device, sequence) into float32.

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
