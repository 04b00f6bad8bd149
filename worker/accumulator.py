"""Gradient accumulation over named parameters, for effective batches larger than memory allows.

Register each parameter's shape, feed one micro-batch of gradients per `step(...)`, and apply an
update when `step` returns True (or `should_update`). `get_gradients()` averages when
`normalize` and clips to `max_grad_norm` without leaving the device. Every misuse raises an
error of gradserver's hierarchy naming the parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from gradserver.common.errors import (
    AccumulatorFullError,
    InvalidArgumentError,
    NoGradientsError,
    ShapeMismatchError,
    UnknownParameterError,
)
from gradserver.train.clipping import clip_by_global_norm_


@dataclasses.dataclass(frozen=True)
class AccumulationConfig:
    accumulation_steps: int = 4
    normalize: bool = True
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.accumulation_steps < 1:
            raise InvalidArgumentError(
                f"accumulation_steps must be at least 1, got {self.accumulation_steps}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise InvalidArgumentError(f"max_grad_norm must be positive, got {self.max_grad_norm}")

    def effective_batch_size(self, micro_batch_size: int) -> int:
        return micro_batch_size * self.accumulation_steps


@dataclasses.dataclass(frozen=True)
class AccumulationStats:
    total_micro_batches: int
    total_updates: int
    accumulation_steps: int
    registered_params: int
    total_param_elements: int

    @property
    def effective_batch_multiplier(self) -> int:
        return self.accumulation_steps


class GradientAccumulator:
    def __init__(
        self, config: AccumulationConfig | None = None, device: torch.device | str | None = None
    ) -> None:
        self.config = config or AccumulationConfig()
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._micro_batches = 0
        self._updates = 0

    def register(self, name: str, shape: Sequence[int]) -> None:
        """Adds a zeroed buffer for `name` (registering the same name again keeps it)."""
        if name not in self._buffers:
            self._buffers[name] = torch.zeros(tuple(shape), device=self.device)
            self._counts[name] = 0

    def accumulate(self, name: str, grad: torch.Tensor) -> None:
        buffer = self._buffers.get(name)
        if buffer is None:
            known = ", ".join(sorted(self._buffers)) or "none"
            raise UnknownParameterError(f"parameter {name!r} is not registered (registered: {known})")
        if self._counts[name] >= self.config.accumulation_steps:
            raise AccumulatorFullError(
                f"parameter {name!r} already holds {self.config.accumulation_steps} micro-batches; "
                "apply the update and reset() first"
            )
        if tuple(grad.shape) != tuple(buffer.shape):
            raise ShapeMismatchError(
                f"parameter {name!r}: expected shape {tuple(buffer.shape)}, got {tuple(grad.shape)}"
            )
        buffer.add_(grad.to(buffer.device, buffer.dtype))
        self._counts[name] += 1

    def step(self, gradients: Mapping[str, torch.Tensor]) -> bool:
        """Accumulates one micro-batch; True once an update is due."""
        if not gradients:
            raise NoGradientsError("step() was given no gradients")
        for name, grad in gradients.items():
            self.accumulate(name, grad)
        self._micro_batches += 1
        return self.should_update

    @property
    def should_update(self) -> bool:
        return any(c >= self.config.accumulation_steps for c in self._counts.values())

    def get_gradients(self) -> dict[str, torch.Tensor]:
        """Accumulated gradients (averaged if `normalize`, clipped if `max_grad_norm`)."""
        if not self._buffers or not any(self._counts.values()):
            raise NoGradientsError("no gradients have been accumulated")
        grads = {
            name: (buf / self._counts[name] if self.config.normalize and self._counts[name] else buf.clone())
            for name, buf in self._buffers.items()
        }
        if self.config.max_grad_norm is not None:
            clip_by_global_norm_(list(grads.values()), self.config.max_grad_norm)
        return grads

    def reset(self) -> None:
        torch._foreach_zero_(list(self._buffers.values()))
        self._counts = dict.fromkeys(self._counts, 0)
        self._updates += 1

    def stats(self) -> AccumulationStats:
        return AccumulationStats(
            total_micro_batches=self._micro_batches,
            total_updates=self._updates,
            accumulation_steps=self.config.accumulation_steps,
            registered_params=len(self._buffers),
            total_param_elements=sum(b.numel() for b in self._buffers.values()),
        )
