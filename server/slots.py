"""The pending key of each kind: what one key holds while its contributions arrive, and what it
sends as they complete. One interface (`Slot`), three kinds:

- `AveragedSlot`, the training keys and a REDUCE: each chunk is averaged (or summed) once every
  expected worker's part of it arrived (`Reduce`), and the result goes out as it is;
- `ScatteredSlot`, a REDUCE_SCATTER: reduced the same way, each result cut into the ranks' parts
  (`ScatterParts`, server/collectives.py);
- `RoutedSlot`, ALL_GATHER, BROADCAST, ALL_TO_ALL: no float work, the bytes are routed to the
  ranks as they become ready (`ByteCollective`, server/collectives.py).

`open_slot` picks the kind of a key: a new collective gets its slot kind here (and its shape rules
in server/chunk_rules.py). A slot holds a key's parts only until their chunk is averaged or routed,
charging them to their senders' in-flight bytes (server/inflight.py); where a part sits and whom
a result reaches is the placement's (server/placement.py). The table does the checks every key
shares (step order, duplicates, liveness) before a chunk gets here.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator

from gradserver.common.chunking import payload_nbytes
from gradserver.common.errors import Status
from gradserver.common.messages import (
    BYTE_KINDS,
    ITEM_SIZE,
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    CollectiveKind,
    DType,
    KeyKind,
    ReduceOp,
    SampleStats,
    TensorKey,
)
from gradserver.common.partition_map import key_hash

from .chunk_rules import declares_alike, identity_mismatch, size_mismatch
from .collectives import ByteCollective, Piece, ScatterParts
from .inflight import Charges
from .message_rules import Refusal
from .outgoing import Outgoing
from .placement import Placement, Placements

Data = bytes | memoryview


@dataclasses.dataclass(eq=False)
class Reduce:
    """One complete chunk to average, in worker-id order: computing it reads nothing of the
    table, so it may run off the event loop; `ReductionTable.reduced` takes its result."""

    key: TensorKey
    index: int
    contributors: tuple[int, ...]
    data: list[bytes | memoryview]
    dtype: DType
    divide: bool
    finite_only: bool
    to: tuple[int, ...]  # the live workers when it completed (less those a partial sum covers)
    # Who sent each of `data` (a host group's partial sum covers several contributors).
    senders: tuple[int, ...] = ()

    @property
    def scattered(self) -> bool:
        """A REDUCE_SCATTER chunk: its result is copied into the rank parts, not sent as is."""
        return self.key.collective_kind is CollectiveKind.REDUCE_SCATTER

    @property
    def nbytes(self) -> int:
        return sum(payload_nbytes(d) for d in self.data)

    @property
    def count(self) -> int:
        """How many workers' contributions the average stands for (a partial sum stands for its
        host group)."""
        return len(self.contributors)


@dataclasses.dataclass(slots=True)
class Accepted:
    """What taking one chunk (or an average) gave: messages ready now, the chunk it completed
    (to average), and whether the key is done (every result went out)."""

    out: list[Outgoing]
    request: Reduce | None = None
    done: bool = False


@dataclasses.dataclass(frozen=True)
class SlotSetting:
    """What every slot of one table shares."""

    world_size: int
    chunk_elements: int
    placements: Placements
    live_workers: Callable[[], tuple[int, ...]]  # asked only when a result goes out


@dataclasses.dataclass(frozen=True)
class Opening:
    """What a key is opened with: its first contributor's key and header, how many of its chunks
    this coordinator owns, when it opened and must complete, whom its step expects, and the
    record of what it charges to in-flight bytes."""

    key: TensorKey
    header: ChunkHeader
    num_chunks: int
    opened: float
    deadline: float
    expected: frozenset[int]
    charges: Charges


class Slot(abc.ABC):
    """One pending key: its parts received so far, and whom it still waits for."""

    def __init__(self, opening: Opening, setting: SlotSetting) -> None:
        self.key = opening.key
        self.header = opening.header
        self.num_chunks = opening.num_chunks
        self.opened = opening.opened
        self.deadline = opening.deadline
        self.expected = opening.expected
        self.charges = opening.charges
        self.setting = setting
        self.received: list[set[int]] = [set() for _ in range(setting.world_size)]
        self.stats: list[SampleStats | None] = [None] * setting.world_size

    # --- queries ------------------------------------------------------------------------------

    def chunks_of(self, w: int) -> int | None:
        """How many chunks worker `w` sends for this key (None: not known yet)."""
        return self.num_chunks

    def missing_workers(self) -> list[int]:
        return [w for w in sorted(self.expected) if len(self.received[w]) != self.chunks_of(w)]

    def overdue(self, timeout: float) -> str:
        """Why the key's step fails at its deadline."""
        missing = ", ".join(map(str, self.missing_workers()))
        return (
            f"{self.key}: no complete contribution from worker(s) {missing} within the step timeout "
            f"of {timeout:g} s"
        )

    def mismatch(self, chunk: ChunkIn) -> str | None:
        """What `chunk` declares unlike the key's first contributor (its step then fails)."""
        if declares_alike(self.key, self.header, chunk):
            return self._rank_mismatch(chunk)  # the common case, without naming anyone
        first = min((v for v, r in enumerate(self.received) if r), default=None)
        other = f"worker {first}'s" if first is not None else "the first contributor's"
        return identity_mismatch(self.key, self.header, chunk, other) or self._shape_mismatch(chunk, other)

    def _shape_mismatch(self, chunk: ChunkIn, other: str) -> str | None:
        """What `chunk`'s shape declares unlike the first contributor's."""
        return size_mismatch(self.header, chunk, other)

    def _rank_mismatch(self, chunk: ChunkIn) -> str | None:
        """What `chunk` declares unlike its sender's own earlier chunks (a kind that lets each
        rank declare its own shape checks it here)."""
        return None

    def refusal(self, placement: Placement, index: int, chunk: ChunkIn) -> Refusal | None:
        """Why chunk `index` cannot count (a worker it covers is no contributor, or sent it
        already; another sample stats than in the sender's other chunks): refused to its sender."""
        key, w = self.key, chunk.worker_id
        for v in placement.covers:
            if v not in self.expected:
                return Refusal(
                    Status.FAILED_PRECONDITION,
                    f"worker {v} is not a contributor of {key}; it (re)joined later",
                )
        for v in placement.covers:
            if index in self.received[v]:
                return Refusal(
                    Status.INVALID_ARGUMENT,
                    f"worker {v} sent the chunk at offset {chunk.offset} of {key} twice"
                    f"{placement.duplicate_note(v)}; the first copy counts",
                )
        known = self.stats[w]
        if key.kind is KeyKind.WHOLE_MODEL and known is not None and known != chunk.stats:
            return Refusal(
                Status.INVALID_ARGUMENT,
                f"worker {w} sent sample stats {chunk.stats} in one chunk of {key} and {known} in another",
            )
        return None

    # --- changes ------------------------------------------------------------------------------

    def accept(self, placement: Placement, index: int, chunk: ChunkIn, charge: int) -> Accepted:
        """Takes chunk `index` (no `refusal`), charging its sender `charge` bytes while held."""
        if self.key.kind is KeyKind.WHOLE_MODEL:
            self.stats[chunk.worker_id] = chunk.stats
        for v in placement.covers:
            self.received[v].add(index)
        return self._take(placement, index, chunk, charge)

    @abc.abstractmethod
    def _take(self, placement: Placement, index: int, chunk: ChunkIn, charge: int) -> Accepted: ...

    @abc.abstractmethod
    def take_complete(self) -> Iterator[Reduce]:
        """Hands out, one by one, the chunks complete now (after `without`) to be averaged."""

    @abc.abstractmethod
    def without(self, worker: int, why: str) -> str | None:
        """Stops waiting for `worker` (its parts dropped), or says why the step must fail instead."""

    @abc.abstractmethod
    def copy_held(self, worker: int) -> None:
        """Replaces views of `worker`'s parts held here by private copies (its memory may change)."""

    def drop(self) -> None:
        """The key is given up (its step failed): nothing of it counts as held any more."""
        self.charges.release_all()

    def _piece_out(self, piece: Piece, live: tuple[int, ...]) -> Outgoing:
        """A result piece for the live workers it is for (one per host group when every rank
        gets the same bytes)."""
        to = tuple(w for w in piece.to if w in live)
        turn = piece.offset // self.setting.chunk_elements + key_hash(self.key)
        return Outgoing(
            self.setting.placements.piece_recipients(self.key, to, turn),
            AveragedChunkOut(
                key=self.key,
                header=ChunkHeader(self.header.dtype, piece.total),
                offset=piece.offset,
                data=piece.data,
                num_contributors=len(self.expected),
            ),
        )


class ReducedSlot(Slot):
    """A key whose chunks are averaged (or summed) once every expected worker's part arrived."""

    def __init__(self, opening: Opening, setting: SlotSetting) -> None:
        super().__init__(opening, setting)
        # Per chunk index, the parts held by place (a partial sum's is its group's first worker).
        self.parts: dict[int, dict[int, tuple[Data, Placement]]] = {}
        # Chunks handed out to be averaged (`Reduce`), their parts kept until the result is back.
        self.inflight: dict[int, dict[int, tuple[Data, Placement]]] = {}
        # Per chunk index held, the workers its parts count for.
        self.covered: dict[int, set[int]] = {}
        self.reduced_chunks = 0

    def chunk_complete(self, index: int) -> bool:
        covered = self.covered.get(index)
        return covered is not None and self.expected <= covered

    def take_complete(self) -> Iterator[Reduce]:
        for index in sorted(self.parts):
            if self.chunk_complete(index):
                yield self._hand_out(index)

    def _take(self, placement: Placement, index: int, chunk: ChunkIn, charge: int) -> Accepted:
        self.parts.setdefault(index, {})[placement.place] = (chunk.data, placement)
        self.covered.setdefault(index, set()).update(placement.covers)
        self.charges.hold(index, placement.sender, charge)
        return Accepted([], self._hand_out(index) if self.chunk_complete(index) else None)

    def _hand_out(self, index: int) -> Reduce:
        """Hands complete chunk `index` out to be averaged."""
        parts = self.inflight[index] = self.parts.pop(index)
        del self.covered[index]
        contributors = tuple(sorted(self.expected))
        placed = [parts[w] for w in contributors if w in parts]
        forwarded = {v for _, placement in parts.values() for v in placement.forwarded}
        return Reduce(
            key=self.key,
            index=index,
            contributors=contributors,
            data=[data for data, _ in placed],
            dtype=self.header.dtype,
            divide=self.key.op is not ReduceOp.SUM,
            finite_only=not self.key.propagate_non_finite,
            to=self._recipients(self.setting.live_workers(), forwarded),
            senders=tuple(placement.sender for _, placement in placed),
        )

    @abc.abstractmethod
    def _recipients(self, live: tuple[int, ...], forwarded: set[int]) -> tuple[int, ...]:
        """Who is sent chunk results (`forwarded` get them through a partial sum's sender)."""

    def awaits(self, request: Reduce) -> bool:
        """Whether `request` is this key's and its result is still awaited."""
        return request.key == self.key and request.index in self.inflight

    def reduced(self, request: Reduce, averaged: Data) -> Accepted:
        """Takes the average of `request`'s chunk: what it sends, and whether the key is done."""
        del self.inflight[request.index]
        self.charges.release_chunk(request.index)
        out = self._results(request, averaged)
        self.reduced_chunks += 1
        return Accepted(out, done=self.reduced_chunks == self.num_chunks)

    @abc.abstractmethod
    def _results(self, request: Reduce, averaged: Data) -> list[Outgoing]: ...

    def copy_held(self, worker: int) -> None:
        for parts in self.parts.values():
            held = parts.get(worker)
            if held is not None and isinstance(held[0], memoryview):
                parts[worker] = (bytes(held[0]), held[1])


class AveragedSlot(ReducedSlot):
    """A training key or a REDUCE: each chunk's average goes out as it is."""

    def _recipients(self, live: tuple[int, ...], forwarded: set[int]) -> tuple[int, ...]:
        # An average a partial sum went into goes to the member that sent it, which hands it to
        # the rest of its group on their host.
        return tuple(v for v in live if v not in forwarded)

    def _results(self, request: Reduce, averaged: Data) -> list[Outgoing]:
        stats = self._global_stats() if self.key.kind is KeyKind.WHOLE_MODEL else None
        event = AveragedChunkOut(
            key=self.key,
            header=self.header,
            offset=request.index * self.setting.chunk_elements,
            data=averaged,
            num_contributors=len(request.contributors),
            stats=stats,
        )
        return [Outgoing(request.to, event)]

    def _global_stats(self) -> SampleStats:
        stats = [s for w, s in enumerate(self.stats) if s is not None and w in self.expected]
        total = sum(s.total for s in stats)
        if total:
            loss = sum(s.loss * s.total for s in stats) / total
        else:
            loss = sum(s.loss for s in stats) / len(stats)
        return SampleStats(loss, sum(s.correct for s in stats), total)

    def without(self, worker: int, why: str) -> str | None:
        if self.reduced_chunks or self.inflight:
            return f"step {self.key.step} aborted: {why} after part of {self.key} was averaged with its data"
        self.expected = self.expected - {worker}
        for index, parts in self.parts.items():
            dropped = parts.pop(worker, None)
            if dropped is not None:
                self.covered[index].difference_update(dropped[1].covers)
        self.charges.release_worker(worker)
        self.received[worker].clear()
        return None


class ScatteredSlot(ReducedSlot):
    """A REDUCE_SCATTER: each reduced chunk is cut into the ranks' parts."""

    def __init__(self, opening: Opening, setting: SlotSetting) -> None:
        super().__init__(opening, setting)
        parts = tuple(b // 4 for b in self.key.split_bytes)  # float32 bytes: elements
        item = ITEM_SIZE[self.header.dtype]
        world = self.setting.world_size
        self.scatter = ScatterParts(world, self.header.total_elements, item, self.num_chunks, parts)

    def _recipients(self, live: tuple[int, ...], forwarded: set[int]) -> tuple[int, ...]:
        return live  # every rank gets its own part

    def _results(self, request: Reduce, averaged: Data) -> list[Outgoing]:
        pieces = self.scatter.reduced(request.index * self.setting.chunk_elements, averaged)
        return [o for o in (self._piece_out(piece, request.to) for piece in pieces) if o.to]

    def without(self, worker: int, why: str) -> str | None:
        return f"step {self.key.step} aborted: {why}; {self.key} needs every rank"


class RoutedSlot(Slot):
    """An ALL_GATHER, BROADCAST or ALL_TO_ALL: chunks routed to the ranks, never averaged."""

    def __init__(self, opening: Opening, setting: SlotSetting) -> None:
        super().__init__(opening, setting)
        world, chunk = self.setting.world_size, self.setting.chunk_elements
        self.collective = ByteCollective(self.key, world, chunk, self.header.total_elements)

    def chunks_of(self, w: int) -> int | None:
        return self.collective.expected_chunks(w)

    def _shape_mismatch(self, chunk: ChunkIn, other: str) -> str | None:
        if chunk.key.collective_kind is CollectiveKind.ALL_TO_ALL:
            return self._rank_mismatch(chunk)
        return super()._shape_mismatch(chunk, other)

    def _rank_mismatch(self, chunk: ChunkIn) -> str | None:
        """ALL_TO_ALL: each rank sends its own total and splits, the same in every one of its chunks."""
        if chunk.key.collective_kind is not CollectiveKind.ALL_TO_ALL:
            return None
        w, key = chunk.worker_id, chunk.key
        total, splits = self.collective.totals[w], self.collective.splits[w]
        if total is None or (total == chunk.header.total_elements and splits == key.split_bytes):
            return None
        return (
            f"worker {w} sent a chunk of {key} declaring {chunk.header.total_elements} bytes split "
            f"{list(key.split_bytes)}, but its first chunk declared {total} bytes split {list(splits)}"
        )

    def _take(self, placement: Placement, index: int, chunk: ChunkIn, charge: int) -> Accepted:
        collective = self.collective
        pieces = collective.add(
            chunk.worker_id, index, chunk.data, chunk.header.total_elements, chunk.key.split_bytes
        )
        for v in range(self.setting.world_size):
            self.charges.follow(v, collective.held_bytes(v))
        live = self.setting.live_workers() if pieces else ()
        out = [o for o in (self._piece_out(piece, live) for piece in pieces) if o.to]
        return Accepted(out, done=collective.complete())

    def take_complete(self) -> Iterator[Reduce]:
        return iter(())  # its chunks are routed, never averaged

    def without(self, worker: int, why: str) -> str | None:
        return f"step {self.key.step} aborted: {why}; {self.key} needs every rank"

    def copy_held(self, worker: int) -> None:
        self.collective.copy_held(worker)


def open_slot(opening: Opening, setting: SlotSetting) -> Slot:
    """The pending slot of the kind of the key `opening` names."""
    key = opening.key
    if key.kind is KeyKind.COLLECTIVE and key.collective_kind in BYTE_KINDS:
        return RoutedSlot(opening, setting)
    if key.kind is KeyKind.COLLECTIVE and key.collective_kind is CollectiveKind.REDUCE_SCATTER:
        return ScatteredSlot(opening, setting)
    return AveragedSlot(opening, setting)
