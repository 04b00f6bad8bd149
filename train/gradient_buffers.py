"""Gradient containers in the wire layout, resident on the training device.

`BlockGradientSet` is one block's nine components as views into a single contiguous buffer, so
flattening for the wire costs nothing and unflattening an average is a view. The
`PerBlockGradientAccumulator` holds one set per block plus the LM head, final norm and embedding,
adds micro-batch gradients into them in place on the device (buffers are zeroed right after
allocation), and touches the host only when asked: `has_non_finite()` is the one synchronising
call, meant once per optimizer step, and host copies go through reusable pinned buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from gradserver.common.components import BLOCK_GRAD_COMPONENTS, NonBlockComponent, compute_block_sizes
from gradserver.common.errors import InvalidArgumentError


class ShapeMismatchError(InvalidArgumentError):
    """A gradient's size or shape differs from the buffer it is added into."""


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != BLOCK_GRAD_COMPONENTS or any(s < 0 for s in sizes):
        raise InvalidArgumentError(
            f"a block has {BLOCK_GRAD_COMPONENTS} non-negative component sizes, got {list(sizes)}"
        )
    return sizes


class BlockGradientSet:
    """The nine gradient components of one block, views into one flat buffer."""

    def __init__(self, flat: torch.Tensor, sizes: Sequence[int]) -> None:
        self._sizes = _check_sizes(sizes)
        if flat.dim() != 1 or flat.numel() != sum(self._sizes):
            raise ShapeMismatchError(
                f"flat gradient of {flat.numel()} elements does not match component sizes "
                f"{list(self._sizes)} (sum {sum(self._sizes)})"
            )
        self._flat = flat
        self.components: list[torch.Tensor] = list(torch.split(flat, list(self._sizes)))

    @classmethod
    def zeroed(
        cls,
        sizes: Sequence[int],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> BlockGradientSet:
        sizes = _check_sizes(sizes)
        return cls(torch.zeros(sum(sizes), device=device, dtype=dtype), sizes)

    @classmethod
    def from_flat(cls, flat: torch.Tensor, sizes: Sequence[int]) -> BlockGradientSet:
        """Views into `flat` (no copy); a clear error when the lengths disagree."""
        return cls(flat.reshape(-1), sizes)

    def total_elements(self) -> int:
        return self._flat.numel()

    def component_sizes(self) -> tuple[int, ...]:
        return self._sizes

    def flatten(self) -> torch.Tensor:
        """The contiguous wire-layout buffer itself (reused; copy it to keep a snapshot)."""
        return self._flat

    def zero_(self) -> None:
        self._flat.zero_()

    def accumulate(self, other: BlockGradientSet | Sequence[torch.Tensor]) -> None:
        """Adds another set, or nine tensors of the right sizes (any shapes), in place."""
        if isinstance(other, BlockGradientSet):
            if other.component_sizes() != self._sizes:
                raise ShapeMismatchError(
                    f"component sizes {list(other.component_sizes())} differ from {list(self._sizes)}"
                )
            self._flat.add_(other.flatten())
            return
        tensors = list(other)
        if len(tensors) != BLOCK_GRAD_COMPONENTS:
            raise ShapeMismatchError(f"expected {BLOCK_GRAD_COMPONENTS} tensors, got {len(tensors)}")
        for index, (mine, theirs) in enumerate(zip(self.components, tensors, strict=True)):
            if mine.numel() != theirs.numel():
                raise ShapeMismatchError(
                    f"component {index} has {mine.numel()} elements, the gradient {theirs.numel()}"
                )
        torch._foreach_add_(self.components, [t.reshape(-1) for t in tensors])

    def scale(self, divisor: float) -> None:
        if divisor == 0:
            raise InvalidArgumentError("cannot scale gradients by 1/0")
        self._flat.div_(divisor)

    def non_finite(self) -> torch.Tensor:
        """A device bool tensor: any NaN or Inf (no sync)."""
        return ~torch.isfinite(self._flat).all()

    def has_non_finite(self) -> bool:
        return bool(self.non_finite())


def _zeros(elements: int, *, device: torch.device) -> torch.Tensor:
    return torch.zeros(elements, device=device)


class PerBlockGradientAccumulator:
    """One BlockGradientSet per block plus the non-block gradients, all on `device`."""

    def __init__(
        self,
        num_blocks: int,
        block_sizes: Sequence[int],
        vocab_size: int,
        hidden_size: int,
        device: torch.device | str | None = None,
        *,
        tied: bool = False,
        allocate: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """`allocate(n)` (CPU only) makes each zeroed float32 buffer instead of torch.zeros, e.g. in
        a WorkerClient's shared memory (`gradient_buffer`), so sending it copies nothing."""
        if num_blocks < 1 or vocab_size < 1 or hidden_size < 1:
            raise InvalidArgumentError(
                "need num_blocks, vocab_size and hidden_size >= 1, "
                f"got {num_blocks}, {vocab_size}, {hidden_size}"
            )
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.block_component_sizes = _check_sizes(block_sizes)
        if allocate is None or self.device.type != "cpu":
            allocate = functools.partial(_zeros, device=self.device)
        self.block_grads = [
            BlockGradientSet(allocate(sum(self.block_component_sizes)), self.block_component_sizes)
            for _ in range(num_blocks)
        ]
        self.non_block: dict[NonBlockComponent, torch.Tensor] = {
            NonBlockComponent.FINAL_NORM: allocate(hidden_size),
            NonBlockComponent.EMBEDDING: allocate(vocab_size * hidden_size),
        }
        if not tied:
            self.non_block = {
                NonBlockComponent.LM_HEAD: allocate(vocab_size * hidden_size),
                **self.non_block,
            }
        self.accumulated_count = 0
        self._pinned: dict[object, torch.Tensor] = {}

    compute_block_sizes = staticmethod(compute_block_sizes)

    @property
    def num_blocks(self) -> int:
        return len(self.block_grads)

    def buffers(self) -> list[torch.Tensor]:
        return [b.flatten() for b in self.block_grads] + list(self.non_block.values())

    def zero_all(self) -> None:
        torch._foreach_zero_(self.buffers())
        self.accumulated_count = 0

    def accumulate_non_block(self, component: NonBlockComponent, grad: torch.Tensor) -> None:
        target = self.non_block.get(component)
        if target is None:
            raise InvalidArgumentError(f"this accumulator holds no {component.name} gradient")
        if target.numel() != grad.numel():
            raise ShapeMismatchError(
                f"{component.name}: expected {target.numel()} elements, got {grad.numel()}"
            )
        target.add_(grad.reshape(-1))

    def average(self) -> None:
        """Divides everything by the micro-batch count, which then becomes 1."""
        if self.accumulated_count > 1:
            torch._foreach_div_(self.buffers(), float(self.accumulated_count))
        self.accumulated_count = min(self.accumulated_count, 1)

    def has_non_finite(self) -> bool:
        """One host synchronisation for the whole model."""
        flags = [~torch.isfinite(t).all() for t in self.buffers()]
        return bool(torch.stack(flags).any())

    def to_host(self, key: object, tensor: torch.Tensor) -> torch.Tensor:
        """Copies `tensor` into a reusable host buffer (pinned on CUDA) without blocking the
        host; the copy is complete once the current stream reaches this point."""
        if tensor.device.type == "cpu":
            return tensor
        buffer = self._pinned.get(key)
        if buffer is None or buffer.numel() != tensor.numel():
            buffer = torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)
            self._pinned[key] = buffer
        buffer.copy_(tensor.reshape(-1), non_blocking=True)
        return buffer
