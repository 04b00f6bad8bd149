"""Tensors as bytes on the host: the views, copies and byte counts every collective moves.

A collective sends and receives numpy arrays of raw bytes (or of float32 for the coordinator's
reductions). Here the caller's host tensors are seen as such arrays without a copy where they are
contiguous (`host_view`: never `Tensor.numpy()`, which would make the tensor's storage
non-resizable for good), results are written back into tensors (or found already there, when
they were received into the tensor's own memory: `host_bytes`), and the memory relations that say
whether a result may be received straight into an output (`overlaps`, `same_memory`) are decided.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes on the host: a view of its memory when it is a contiguous host
    tensor (read it within the collective), else of a copy."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return host_view(flat.view(torch.uint8))


def host_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over the memory of `tensor` (contiguous, on the host), for the duration of one
    collective. Not `Tensor.numpy()`: that marks the storage as not resizable for good, and the
    caller's tensor must stay as it was (`resize_` works after a collective, as with gloo). The
    view must not outlive the collective, which holds the tensor meanwhile."""
    dtype = _numpy_dtype(tensor.dtype)
    if not tensor.numel():
        return np.zeros(0, dtype)
    return np.asarray(_TensorMemory(tensor, dtype))


class _TensorMemory:
    """Exposes a contiguous host tensor's memory to numpy; the array's `base` keeps the tensor."""

    def __init__(self, tensor: torch.Tensor, dtype: np.dtype[Any]) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "data": (tensor.data_ptr(), False),
            "shape": (tensor.numel(),),
            "typestr": dtype.str,
            "version": 3,
        }


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype of a torch dtype (TypeError for those numpy lacks, e.g. bfloat16)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


def write_bytes_into(tensors: Sequence[torch.Tensor], data: np.ndarray, *, what: str) -> None:
    """The bytes of `data` into `tensors`, in order; they must hold exactly that many. A tensor
    whose memory the result was received into (`host_bytes`) already holds its bytes."""
    needed = sum(nbytes_of(t) for t in tensors)
    if data.size != needed:
        raise ValueError(f"{what}: received {data.size} bytes for tensors holding {needed}")
    offset = 0
    for tensor in tensors:
        nbytes = nbytes_of(tensor)
        if nbytes and not _lies_at(tensor, data, offset):
            raw = torch.from_numpy(np.ascontiguousarray(data[offset : offset + nbytes]))
            tensor.copy_(raw.view(tensor.dtype).reshape(tensor.shape))
        offset += nbytes


def _lies_at(tensor: torch.Tensor, data: np.ndarray, offset: int) -> bool:
    """Whether `tensor`'s memory is `data`'s bytes from `offset` (the result was received there)."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.data_ptr() == int(data.__array_interface__["data"][0]) + offset
    )


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect (same device)."""
    if a.device != b.device or not nbytes_of(a) or not nbytes_of(b):
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + (a.untyped_storage().nbytes() if not a.is_contiguous() else nbytes_of(a))
    b_end = b_start + (b.untyped_storage().nbytes() if not b.is_contiguous() else nbytes_of(b))
    return a_start < b_end and b_start < a_end


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors cover exactly the same bytes."""
    return (
        a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
        and a.data_ptr() == b.data_ptr()
        and nbytes_of(a) == nbytes_of(b)
    )


def nbytes_of(tensor: torch.Tensor) -> int:
    """The bytes of `tensor`'s elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()


def concat_bytes(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """The tensors' bytes, in order (a view of the one tensor's memory when it is a contiguous
    host tensor, else a copy)."""
    if len(tensors) == 1:
        return bytes_of(tensors[0])
    if not tensors:
        return np.zeros(0, np.uint8)
    return np.concatenate([bytes_of(t) for t in tensors])


def host_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """The bytes of `tensor`'s own memory, for a collective to write its result straight there;
    None when it is not a contiguous host tensor (the result is copied in afterwards)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return host_view(tensor.detach().reshape(-1).view(torch.uint8))


def slice_bytes(
    what: str, name: str, tensor: torch.Tensor, splits: Sequence[int], size: int
) -> tuple[int, ...]:
    """The bytes of each of the `size` slices of `tensor` along dim 0: equal ones when `splits`
    is empty, else those `splits` (rows per rank)."""
    if not tensor.is_contiguous():
        raise ValueError(f"gradserver {what}: the {name} tensor must be contiguous")
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = nbytes_of(tensor) // rows if rows else 0
    if not splits:
        if rows % size:
            raise ValueError(
                f"gradserver {what}: dim 0 of the {name} shape {tuple(tensor.shape)} does not split into "
                f"{size} equal pieces; give {name}_split_sizes"
            )
        return (rows // size * row_bytes,) * size
    if len(splits) != size or any(n < 0 for n in splits) or sum(splits) != rows:
        raise ValueError(
            f"gradserver {what}: {name}_split_sizes {list(splits)} must hold {size} non-negative sizes "
            f"summing to dim 0 of the {name} shape {tuple(tensor.shape)}"
        )
    return tuple(int(n) * row_bytes for n in splits)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, in order, as one contiguous 1-D host tensor (one copy; none for a
    single contiguous host tensor, whose flat view it is)."""
    if len(tensors) == 1 and not tensors[0].is_cuda and tensors[0].is_contiguous():
        return tensors[0].detach().view(-1)
    flat = [t.detach().reshape(-1).to("cpu") for t in tensors]
    return (flat[0] if len(flat) == 1 else torch.cat(flat)).contiguous()


def scatter_into(tensors: Sequence[torch.Tensor], result: torch.Tensor) -> None:
    """The elements of the 1-D `result` into `tensors`, in order (a reduction's result into the
    tensors it was flattened from)."""
    if len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].data_ptr() == result.data_ptr():
        return  # an in-place allreduce of one contiguous host tensor: the result is there already
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        piece = result[offset : offset + n]
        # An in-place allreduce of one contiguous host tensor already left the result there.
        if not (tensor.is_contiguous() and n and tensor.data_ptr() == piece.data_ptr()):
            tensor.copy_(piece.reshape(tensor.shape))
        offset += n
