"""Chunk ownership: which chunks of a key this coordinator expects and averages.

One coordinator owns every chunk of every key (`WholeJob`). Partitioned coordinators
(common/partition_map.py) each own the chunks the map assigns them (`Partition`): a partition's
table counts a key complete when its own chunks are averaged, refuses a chunk the map assigns to
another partition, and takes only REDUCE among the native collectives (the others move bytes
between ranks, which needs every chunk in one place). The table is handed one of these and asks
it, so no branch of the table tests whether it is partitioned.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from gradserver.common.errors import Status
from gradserver.common.messages import CollectiveKind, KeyKind, TensorKey
from gradserver.common.partition_map import PartitionMap

from .message_rules import Refusal


class ChunkOwnership(Protocol):
    @property
    def partitioned(self) -> bool:
        """Whether other coordinators own part of the job's chunks."""

    def owned_chunks(self, key: TensorKey, num_chunks: int) -> int:
        """How many of `key`'s `num_chunks` chunks this coordinator owns."""

    def refusal(self, worker: int, key: TensorKey, index: int) -> Refusal | None:
        """Why chunk `index` of `key` from `worker` is not this coordinator's to take."""


class WholeJob:
    """One coordinator: every chunk is its own."""

    @property
    def partitioned(self) -> bool:
        return False

    def owned_chunks(self, key: TensorKey, num_chunks: int) -> int:
        return num_chunks

    def refusal(self, worker: int, key: TensorKey, index: int) -> Refusal | None:
        return None


@dataclasses.dataclass(frozen=True)
class Partition:
    """Partition `own` of `partition_map`: the chunks the map assigns to it."""

    partition_map: PartitionMap
    own: int

    @property
    def partitioned(self) -> bool:
        return True

    def owned_chunks(self, key: TensorKey, num_chunks: int) -> int:
        return self.partition_map.owned_chunks(key, num_chunks, self.own)

    def refusal(self, worker: int, key: TensorKey, index: int) -> Refusal | None:
        if key.kind is KeyKind.COLLECTIVE and key.collective_kind is not CollectiveKind.REDUCE:
            return Refusal(
                Status.FAILED_PRECONDITION,
                f"worker {worker} sent {key}: partitioned coordinators average only REDUCE collectives, "
                f"not {key.collective_kind.name}",
            )
        owner = self.partition_map.owner(key, index)
        if owner == self.own:
            return None
        return Refusal(
            Status.INVALID_ARGUMENT,
            f"worker {worker} sent chunk {index} of {key} to {self.partition_map.describe(self.own)}, but "
            f"the partition map assigns it to {self.partition_map.describe(owner)}",
        )


def chunk_ownership(partition: ChunkOwnership | tuple[PartitionMap, int] | None) -> ChunkOwnership:
    """The ownership a table is given: `WholeJob` for None, a `Partition` for (map, own index)."""
    if partition is None:
        return WholeJob()
    if isinstance(partition, tuple):
        return Partition(*partition)
    return partition
