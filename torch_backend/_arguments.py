"""What a collective's arguments must be, checked at the call: one tensor where one is taken, a
root rank in range, one tensor per rank, tensors that cut into equal pieces per rank.

Each failure is a ValueError naming the call (`what`), raised before anything is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def single_tensor(what: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The one tensor of a call that takes exactly one (send, recv)."""
    if len(tensors) != 1:
        raise ValueError(f"gradserver {what}: expected one tensor, got {len(tensors)}")
    return tensors[0]


def root_of(what: str, opts: Any, size: int) -> int:
    """The root rank of a rooted call's options, checked against the group's size."""
    root = int(opts.rootRank)
    if not 0 <= root < size:
        raise ValueError(f"gradserver {what}: root rank {root} is out of range for a group of {size}")
    return root


def equal_pieces(
    what: str, tensor: torch.Tensor, size: int, like: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """`tensor` cut into `size` equal views along dim 0 (each the shape and dtype of `like`, when
    given), so a collective writing the pieces writes `tensor`."""
    if not tensor.is_contiguous():
        raise ValueError(f"gradserver {what}: the tensors must be contiguous")
    if like is not None:
        if tensor.numel() != like.numel() * size or tensor.dtype != like.dtype:
            raise ValueError(
                f"gradserver {what}: a {tensor.dtype} tensor of {tensor.numel()} elements cannot hold "
                f"{size} pieces of {like.numel()} {like.dtype} elements"
            )
        return [piece.view(like.shape) for piece in tensor.reshape(-1).chunk(size)]
    if tensor.dim() == 0 or tensor.shape[0] % size:
        raise ValueError(
            f"gradserver {what}: dim 0 of shape {tuple(tensor.shape)} does not split into {size} equal pieces"
        )
    return list(tensor.chunk(size))


def pieces_of_each(
    what: str, tensors: Sequence[torch.Tensor], likes: Sequence[torch.Tensor], size: int
) -> list[list[torch.Tensor]]:
    """Each of `tensors` cut into `size` pieces shaped like its partner in `likes`."""
    if len(tensors) != len(likes):
        raise ValueError(f"gradserver {what}: {len(tensors)} tensors for {len(likes)} partners")
    return [equal_pieces(what, tensor, size, like=like) for tensor, like in zip(tensors, likes, strict=True)]


def check_pieces(
    what: str, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], size: int
) -> None:
    """Checks the input lists of a list-of-lists call: one tensor per rank in each; for
    reduce_scatter also one list per output, each tensor the size of its output."""
    if len(outputs) != len(inputs) and what == "reduce_scatter":
        raise ValueError(f"gradserver {what}: {len(outputs)} outputs for {len(inputs)} input lists")
    for i, group in enumerate(inputs):
        if len(group) != size:
            raise ValueError(
                f"gradserver {what}: input list {i} holds {len(group)} tensors, the group {size}"
            )
        if what == "reduce_scatter" and any(t.numel() != outputs[i].numel() for t in group):
            raise ValueError(f"gradserver {what}: input list {i} has tensors of another size than output {i}")
