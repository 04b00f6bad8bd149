"""The reduction table's pending keys: one slot per key identity (a block index, a non-block
component, the whole model, a collective's name), opened by a key's first chunk and closed when
every result went out or its step failed, and the step each identity was last done at.

A key identity is reduced at one step at a time: a chunk of another step while it is pending is
refused, and so is one of the step it was done at or an earlier one (a replay, or a stale key).
The kind of each slot (server/slots.py) decides what its chunks become; the chunks it expects are
those this coordinator owns (server/chunk_ownership.py). Pure bookkeeping for the table.
"""

from __future__ import annotations

from collections.abc import Callable

from gradserver.common.chunking import chunk_count
from gradserver.common.errors import Status
from gradserver.common.messages import ChunkHeader, KeyKind, TensorKey

from .chunk_ownership import ChunkOwnership
from .inflight import InFlightBytes
from .message_rules import Refusal
from .slots import Opening, Reduce, ReducedSlot, Slot, SlotSetting, open_slot


class PendingKeys:
    """The keys of one job waiting for contributions or averages."""

    def __init__(
        self,
        setting: SlotSetting,
        *,
        step_timeout: float,
        clock: Callable[[], float],
        ownership: ChunkOwnership,
        inflight: InFlightBytes,
        on_key_reduced: Callable[[float], None] | None,
    ) -> None:
        """`on_key_reduced` receives the seconds from a key's first contribution to its end."""
        self._setting = setting
        self._step_timeout = step_timeout
        self._clock = clock
        self._ownership = ownership
        self._inflight = inflight
        self._on_key_reduced = on_key_reduced
        self.by_identity: dict[tuple[KeyKind, int], Slot] = {}
        self._last_step: dict[tuple[KeyKind, int], int] = {}
        self.keys_reduced = 0
        self.contributions_counted = 0

    # --- queries ------------------------------------------------------------------------------

    def __bool__(self) -> bool:
        return bool(self.by_identity)

    def slots(self) -> list[Slot]:
        """The pending slots (a copy: failing a step while going through them drops some)."""
        return list(self.by_identity.values())

    def get(self, key: TensorKey) -> Slot | None:
        """The slot pending for `key`'s identity, at whatever step."""
        return self.by_identity.get(key.slot)

    def is_pending(self, slot: Slot) -> bool:
        return self.by_identity.get(slot.key.slot) is slot

    def steps(self) -> set[int]:
        return {slot.key.step for slot in self.by_identity.values()}

    def last_step(self, key: TensorKey) -> int | None:
        """The step `key`'s identity was last averaged or failed at (None: never)."""
        return self._last_step.get(key.slot)

    def awaiting(self, request: Reduce) -> ReducedSlot | None:
        """The slot whose average `request` is, while still awaited (not when its step failed
        or its job was reset meanwhile)."""
        slot = self.by_identity.get(request.key.slot)
        return slot if isinstance(slot, ReducedSlot) and slot.awaits(request) else None

    def refusal(self, w: int, key: TensorKey, slot: Slot | None) -> Refusal | None:
        """Why `key` from `w` cannot be taken at its step: its identity is pending (`slot`) at
        another step, or was already done at this step (a second copy) or a later one (stale)."""
        if slot is not None:
            if slot.key.step == key.step:
                return None
            return Refusal(
                Status.FAILED_PRECONDITION,
                f"worker {w} sent {key}, but {key.describe()} is being reduced at step {slot.key.step}",
            )
        last = self._last_step.get(key.slot)
        if last is None or key.step > last:
            return None
        if key.step == last:
            return Refusal(
                Status.INVALID_ARGUMENT,
                f"worker {w} sent {key} again after it was reduced; the first copy counts",
            )
        return Refusal(
            Status.FAILED_PRECONDITION,
            f"worker {w} sent {key}, which is stale: {key.describe()} was reduced at step {last}",
        )

    def owed_by(self, w: int, step: int, owes: Callable[[int, TensorKey], bool]) -> list[tuple[int, str]]:
        """(step, key) of the keys before `step` that `w` has not completed, of those it `owes`
        in the order of its own steps."""
        return [
            (slot.key.step, str(slot.key))
            for slot in self.by_identity.values()
            if slot.key.step < step and w in slot.missing_workers() and owes(w, slot.key)
        ]

    def expired(self, now: float) -> list[Slot]:
        """Slots past their deadline that still wait for a contribution (a slot with every chunk
        received is only being averaged: that is no one's delay)."""
        return [slot for slot in self.by_identity.values() if slot.deadline <= now and slot.missing_workers()]

    # --- changes ------------------------------------------------------------------------------

    def open(self, key: TensorKey, header: ChunkHeader, expected: frozenset[int]) -> Slot:
        """Opens `key`'s slot, waiting for `expected` until the step timeout from now."""
        now = self._clock()
        whole = chunk_count(header.total_elements, self._setting.chunk_elements)
        opening = Opening(
            key=key,
            header=header,
            num_chunks=self._ownership.owned_chunks(key, whole),
            opened=now,
            deadline=now + self._step_timeout,
            expected=expected,
            charges=self._inflight.charges(),
        )
        slot = self.by_identity[key.slot] = open_slot(opening, self._setting)
        return slot

    def finish(self, slot: Slot, contributors: int) -> None:
        """`slot` is done: every result went out."""
        del self.by_identity[slot.key.slot]
        self._last_step[slot.key.slot] = slot.key.step
        self.contributions_counted += contributors
        self.keys_reduced += 1
        if self._on_key_reduced is not None:
            self._on_key_reduced(self._clock() - slot.opened)

    def drop_step(self, step: int) -> None:
        """`step` failed: its keys are given up (their held bytes released)."""
        for identity, slot in list(self.by_identity.items()):
            if slot.key.step == step:
                slot.drop()
                del self.by_identity[identity]
                self._last_step[identity] = step

    def copy_held(self, worker: int) -> None:
        for slot in self.by_identity.values():
            slot.copy_held(worker)
