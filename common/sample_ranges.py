"""Sample ranges: which samples of the data set each worker trains on.

`batches_of_rank` is the reference's rule (batch i goes to worker i mod world_size).
`step_sample_ranges` is what the coordinator hands out per step: step s covers the W*b
consecutive positions starting at s*W*b of an endless walk over the data set, and worker w takes
every W-th of them starting at w, so within a step the workers' ranges are disjoint and together
complete, and consecutive steps walk the whole data set before any sample repeats.
"""

from __future__ import annotations

import warnings

from .errors import InvalidArgumentError
from .messages import SampleRange


def batches_of_rank(num_batches: int, rank: int, world_size: int) -> list[int]:
    """Batch indices of `rank`: rank, rank + world_size, ... below num_batches."""
    if world_size < 1 or not 0 <= rank < world_size or num_batches < 0:
        raise InvalidArgumentError(
            f"batches_of_rank needs 0 <= rank < world_size and num_batches >= 0, "
            f"got rank={rank} world_size={world_size} num_batches={num_batches}"
        )
    return list(range(rank, num_batches, world_size))


def shard_batches(num_batches: int, rank: int, world_size: int) -> list[int]:
    """Deprecated name of `batches_of_rank`, from when "shard" named both data ranges and
    coordinator partitions; goes in the next release."""
    warnings.warn(
        "gradserver.common.shard_batches is deprecated and goes in the next release: use batches_of_rank",
        DeprecationWarning,
        stacklevel=2,
    )
    return batches_of_rank(num_batches, rank, world_size)


def step_sample_ranges(
    step: int, worker_id: int, world_size: int, dataset_size: int, batch_size: int
) -> tuple[SampleRange, ...]:
    """Sample index ranges worker `worker_id` trains on at `step` (at most two: one wrap)."""
    if world_size < 1 or not 0 <= worker_id < world_size:
        raise InvalidArgumentError(f"worker {worker_id} is outside a world of {world_size}")
    if dataset_size < 1 or batch_size < 1:
        raise InvalidArgumentError(
            f"step {step}: dataset_size and batch_size must be positive, got {dataset_size} and {batch_size}"
        )
    global_batch = world_size * batch_size
    if global_batch > dataset_size:
        raise InvalidArgumentError(
            f"step {step}: global batch {world_size} workers x {batch_size} = {global_batch} "
            f"exceeds the data set of {dataset_size} samples"
        )
    start = (step * global_batch + worker_id) % dataset_size
    first = min(batch_size, -(-(dataset_size - start) // world_size))
    ranges = [SampleRange(start, start + (first - 1) * world_size + 1, world_size)]
    rest = batch_size - first
    if rest:
        wrapped = start + first * world_size - dataset_size
        ranges.append(SampleRange(wrapped, wrapped + (rest - 1) * world_size + 1, world_size))
    return tuple(ranges)
