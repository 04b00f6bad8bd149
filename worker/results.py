"""What the receive calls of WorkerClient return."""

from __future__ import annotations

import dataclasses

import numpy as np

from gradserver.common.components import BlockComponent, NonBlockComponent
from gradserver.common.messages import SampleRange, SampleStats, TensorKey


@dataclasses.dataclass(frozen=True)
class AveragedTensor:
    """The result of any one key (`WorkerClient.receive`): what the kind-specific results below
    are made from. `stats` is set for whole-model keys."""

    key: TensorKey
    gradients: np.ndarray
    component_sizes: tuple[int, ...]
    num_contributors: int
    stats: SampleStats | None = None


@dataclasses.dataclass(frozen=True)
class AveragedBlock:
    """The average of one transformer block's nine components, flat in protocol order."""

    step: int
    block_idx: int
    num_blocks: int
    gradients: np.ndarray
    component_sizes: tuple[int, ...]
    num_contributors: int

    def components(self) -> dict[BlockComponent, np.ndarray]:
        """Views of the nine components (no copies)."""
        out: dict[BlockComponent, np.ndarray] = {}
        offset = 0
        for component, size in zip(BlockComponent, self.component_sizes, strict=True):
            out[component] = self.gradients[offset : offset + size]
            offset += size
        return out


@dataclasses.dataclass(frozen=True)
class AveragedNonBlock:
    step: int
    component: NonBlockComponent
    gradients: np.ndarray
    num_contributors: int


@dataclasses.dataclass(frozen=True)
class AveragedGradients:
    """Whole-model average, with the sample-weighted global loss and summed counts."""

    step: int
    gradients: np.ndarray
    global_loss: float
    correct: int
    total: int
    num_contributors: int


@dataclasses.dataclass(frozen=True)
class SampleRangeAssignment:
    """The sample indices this worker trains on at `step`."""

    step: int
    worker_id: int
    ranges: tuple[SampleRange, ...]

    def indices(self) -> list[int]:
        return [i for r in self.ranges for i in r.indices()]
