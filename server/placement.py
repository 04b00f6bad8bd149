"""Placement: whose contribution one chunk is, where it sits among a key's parts, and who gets the
results it went into: one worker's own chunk, or a host group's partial sum.

A host group's members (server/host_groups.py) sum their chunks on their host and one of them
sends the sum, covering the whole group (`ChunkIn.covers`). Everything the reduction table does
differently for such a sum is decided here, so the table itself never looks at `covers`:
- a partial sum counts for each worker it covers, and takes its group's first place among the
  parts, whoever of the group sent it, so the sum runs in the same order whichever member sent it;
- it is sent when its host summed it, not in the order of its sender's own steps, so "steps only
  move forward" holds only for a worker's own chunks (`in_order`), and a grouped worker moving on
  to a later step says nothing of the keys its host sums (`Placements.owes_in_step_order`);
- the average it went into goes to its sender only, which hands it to the rest of its group on
  their host (`forwarded`), and a piece every rank gets alike goes to one member per group
  (`Placements.piece_recipients`).
"""

from __future__ import annotations

import dataclasses

from gradserver.common.collective_rules import handed_on_hosts, summed_on_hosts
from gradserver.common.messages import ChunkIn, TensorKey

from .host_groups import HostGroups
from .message_rules import Refusal, covers_refusal


@dataclasses.dataclass(frozen=True)
class OwnChunk:
    """A worker's own chunk: it counts for its sender alone."""

    sender: int

    @property
    def covers(self) -> tuple[int, ...]:
        return (self.sender,)

    @property
    def place(self) -> int:
        """Where the chunk sits among the key's parts (parts are summed in place order)."""
        return self.sender

    @property
    def in_order(self) -> bool:
        """Whether the chunk must not be older than its sender's newest step."""
        return True

    @property
    def forwarded(self) -> tuple[int, ...]:
        """The workers that get the average through its sender, not from the coordinator."""
        return ()

    def refusal(self, world_size: int, groups: HostGroups) -> Refusal | None:
        return None

    def duplicate_note(self, worker: int) -> str:
        """Said of `worker`'s chunk sent twice."""
        return ""


@dataclasses.dataclass(frozen=True)
class PartialSum:
    """A host group's sum of its members' chunks (`covers`, in id order), sent by one of them."""

    sender: int
    covers: tuple[int, ...]

    @property
    def place(self) -> int:
        return self.covers[0]

    @property
    def in_order(self) -> bool:
        return False

    @property
    def forwarded(self) -> tuple[int, ...]:
        return tuple(v for v in self.covers if v != self.sender)

    def refusal(self, world_size: int, groups: HostGroups) -> Refusal | None:
        """Whether the sum may cover `covers` (ids of this world, the sender's active group)."""
        return covers_refusal(self.sender, self.covers, world_size, groups)

    def duplicate_note(self, worker: int) -> str:
        return "" if worker == self.sender else f" (in a partial sum from worker {self.sender})"


Placement = OwnChunk | PartialSum


class Placements:
    """The table's placement strategy, over the job's host groups (none: every chunk is a worker's own)."""

    def __init__(self, groups: HostGroups) -> None:
        self.groups = groups
        self._own: dict[int, OwnChunk] = {}  # one per worker: asked for every chunk

    def of(self, chunk: ChunkIn) -> Placement:
        """Whose contribution `chunk` is."""
        if chunk.covers:
            return PartialSum(chunk.worker_id, chunk.covers)
        own = self._own.get(chunk.worker_id)
        if own is None:
            own = self._own[chunk.worker_id] = OwnChunk(chunk.worker_id)
        return own

    def owes_in_step_order(self, worker: int, key: TensorKey) -> bool:
        """Whether `worker` sends its part of `key` itself, in the order of its steps: not when
        its host group sums it (sent whenever the host summed it), so then `worker` moving on to
        a later step says nothing of it."""
        return self.groups.group_of(worker) is None or not summed_on_hosts(key)

    def piece_recipients(self, key: TensorKey, to: tuple[int, ...], turn: int) -> tuple[int, ...]:
        """Who of `to` is sent a result piece of `key`: when every rank gets the same bytes, one
        member per host group (its member number `turn`) gets them for its group."""
        return self.groups.one_per_group(to, turn) if handed_on_hosts(key) else to
