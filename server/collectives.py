"""Where the result pieces of one native collective go, and when.

Pure bookkeeping for the reduction table. `ByteCollective` (ALL_GATHER, BROADCAST, ALL_TO_ALL)
holds the contributions' chunks that cannot be forwarded yet and answers each arriving chunk with
the result pieces that became ready (no float work: bytes are only sliced and routed).
`ScatterParts` cuts a REDUCE_SCATTER's reduced chunks into the ranks' parts. The table does the
checks that concern every key (step order, duplicates, liveness, headers across ranks) before a
chunk gets here.

- ALL_GATHER: chunk i of every rank is forwarded (to every rank, as rank j's bytes at j·S + i·C)
  once every rank sent its chunk i.
- BROADCAST: the root's chunks are relayed to every rank once every other rank sent its
  header-only chunk, so a missing rank holds the operation rather than half of it going out.
- ALL_TO_ALL: chunks are routed piece by piece once every rank's split_bytes are known (from its
  first chunk); the piece that would complete a rank's result is held until every contribution
  arrived, so no rank sees its result complete while others' inputs are still to be read
  (docs/PROTOCOL.md, "Native collectives": a worker may then reuse its input).
"""

from __future__ import annotations

import dataclasses

from gradserver.common.chunking import chunk_count, payload_nbytes
from gradserver.common.messages import CollectiveKind, TensorKey

Data = bytes | memoryview


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of a result: `data` at byte `offset` of a result of `total` bytes, for `to` (every
    rank of the operation, or one)."""

    to: tuple[int, ...]
    total: int
    offset: int
    data: Data


class ByteCollective:
    """One pending ALL_GATHER, BROADCAST or ALL_TO_ALL of `ranks` workers, cut at `chunk` bytes."""

    def __init__(self, key: TensorKey, ranks: int, chunk: int, size: int) -> None:
        """`size`: the first contributor's total_elements (S; the table checks the others')."""
        self.key = key
        self.kind = key.collective_kind
        self.ranks = ranks
        self.chunk = chunk
        self.size = size
        # Per rank: its contribution's total and split_bytes once its first chunk arrived.
        self.totals: list[int | None] = [None] * ranks
        self.splits: list[tuple[int, ...]] = [()] * ranks
        self._held: dict[tuple[int, int], Data] = {}  # (rank, chunk index) -> bytes not forwarded
        self._held_bytes = [0] * ranks  # per rank, the bytes in `_held`
        self._received = [0] * ranks  # chunks per rank
        self._forwarded_indices = 0  # ALL_GATHER: chunk indices sent
        self._relayed = 0  # BROADCAST: root chunks sent
        # ALL_TO_ALL: per destination, bytes sent and the piece kept back for the end.
        self._sent = [0] * ranks
        self._kept: dict[int, list[Piece]] = {}

    # --- queries ------------------------------------------------------------------------------

    def expected_chunks(self, rank: int) -> int | None:
        """How many chunks `rank` sends (None: not known before its first chunk)."""
        if self.kind is CollectiveKind.BROADCAST and rank != self.key.root:
            return 1
        total = self.totals[rank] if self.kind is CollectiveKind.ALL_TO_ALL else self.size
        return None if total is None else chunk_count(total, self.chunk)

    def held_bytes(self, rank: int) -> int:
        """Bytes of `rank`'s contribution held here (not forwarded yet)."""
        return self._held_bytes[rank]

    def complete(self) -> bool:
        """Every rank's every chunk arrived and everything was sent."""
        return self._all_received() and not self._held and not self._kept

    def result_size(self, rank: int) -> int:
        """The length of `rank`'s result (ALL_TO_ALL: once every rank's splits are known)."""
        if self.kind is CollectiveKind.ALL_GATHER:
            return self.ranks * self.size
        if self.kind is CollectiveKind.BROADCAST:
            return self.size
        return sum(splits[rank] for splits in self.splits)

    def copy_held(self, rank: int) -> None:
        """Replaces views of `rank`'s held chunks by private copies (its memory may change)."""
        for (w, index), data in list(self._held.items()):
            if w == rank and isinstance(data, memoryview):
                self._held[(w, index)] = bytes(data)

    # --- arrivals -----------------------------------------------------------------------------

    def add(self, rank: int, index: int, data: Data, total: int, splits: tuple[int, ...]) -> list[Piece]:
        """Takes chunk `index` of `rank` (already checked by the table); returns what is ready."""
        if self.totals[rank] is None:
            self.totals[rank] = total
            self.splits[rank] = splits
        self._received[rank] += 1
        self._held[(rank, index)] = data
        self._held_bytes[rank] += payload_nbytes(data)
        if self.kind is CollectiveKind.ALL_GATHER:
            return self._gather_ready()
        if self.kind is CollectiveKind.BROADCAST:
            return self._relay_ready()
        return self._route_ready()

    def _take(self, rank: int, index: int) -> Data:
        data = self._held.pop((rank, index))
        self._held_bytes[rank] -= payload_nbytes(data)
        return data

    def _all_received(self) -> bool:
        return all(self._received[w] == self.expected_chunks(w) for w in range(self.ranks))

    def _everyone(self) -> tuple[int, ...]:
        return tuple(range(self.ranks))

    def _gather_ready(self) -> list[Piece]:
        out: list[Piece] = []
        total = self.ranks * self.size
        while True:
            index = self._forwarded_indices
            if not all((w, index) in self._held for w in range(self.ranks)):
                return out
            parts = [self._take(w, index) for w in range(self.ranks)]
            self._forwarded_indices += 1
            if total == 0:
                return [Piece(self._everyone(), 0, 0, b"")]  # one empty piece for an empty result
            for w, part in enumerate(parts):
                out.append(Piece(self._everyone(), total, w * self.size + index * self.chunk, part))

    def _relay_ready(self) -> list[Piece]:
        root = self.key.root
        others = [w for w in range(self.ranks) if w != root]
        if not all(self._received[w] for w in others):
            return []
        for w in others:
            if (w, 0) in self._held:
                self._take(w, 0)  # header-only: nothing to send
        out: list[Piece] = []
        while (root, self._relayed) in self._held:
            data = self._take(root, self._relayed)
            out.append(Piece(self._everyone(), self.size, self._relayed * self.chunk, data))
            self._relayed += 1
        return out

    def _route_ready(self) -> list[Piece]:
        if any(total is None for total in self.totals):
            return []
        out: list[Piece] = []
        for source, index in sorted(self._held):
            out += self._route(source, index, self._take(source, index))
        if self._all_received():
            for rank in range(self.ranks):
                kept = self._kept.pop(rank, [])
                if self.result_size(rank) == 0:
                    kept = [Piece((rank,), 0, 0, b"")]
                out += kept
        return out

    def _route(self, source: int, index: int, data: Data) -> list[Piece]:
        """The pieces of `source`'s chunk `index` for each destination; the one completing a
        destination's result is kept back until every contribution arrived."""
        start, stop = index * self.chunk, index * self.chunk + payload_nbytes(data)
        view = memoryview(data).cast("B")
        splits = self.splits[source]
        out: list[Piece] = []
        begin = 0  # where `source`'s piece for `rank` starts in its contribution
        for rank, length in enumerate(splits):
            lo, hi = max(start, begin), min(stop, begin + length)
            if lo < hi:
                at = sum(self.splits[s][rank] for s in range(source)) + lo - begin
                size = self.result_size(rank)
                self._sent[rank] += hi - lo
                piece = Piece((rank,), size, at, view[lo - start : hi - start])
                if self._sent[rank] == size and not self._all_received():
                    # The completing piece: copied, since its sender may reuse its memory once
                    # its own result is complete.
                    self._kept.setdefault(rank, []).append(dataclasses.replace(piece, data=bytes(piece.data)))
                else:
                    out.append(piece)
            begin += length
        return out


class ScatterParts:
    """Cuts the reduced chunks of one REDUCE_SCATTER into the ranks' parts as they come: rank r
    gets elements [r·P, (r+1)·P) of the result (P = S / ranks), or with `parts` (elements per
    rank, the key's `split_bytes`) the r-th of those consecutive ranges, pieces at offsets
    within its part; a rank whose part is empty gets an empty piece once every chunk is reduced
    (its result is complete then). The piece that would complete a rank's part is kept (copied)
    until every chunk is reduced, so no rank sees its part complete while others' inputs are
    still being read."""

    def __init__(
        self, ranks: int, size: int, item_size: int, num_chunks: int, parts: tuple[int, ...] = ()
    ) -> None:
        self.ranks = ranks
        self.parts = parts or (size // ranks,) * ranks
        self.starts = [sum(self.parts[:r]) for r in range(ranks)]
        self.item = item_size
        self._chunks_left = num_chunks
        self._sent = [0] * ranks  # elements of each part sent or kept
        self._kept: list[Piece] = []

    def reduced(self, start: int, data: Data) -> list[Piece]:
        """Takes the reduced elements from `start` (`data`, whole elements); returns the pieces
        ready to send (with every chunk reduced, the kept ones too)."""
        self._chunks_left -= 1
        view = memoryview(data).cast("B")
        stop = start + len(view) // self.item
        out: list[Piece] = []
        for rank in range(self.ranks):
            part, first = self.parts[rank], self.starts[rank]
            lo, hi = max(start, first), min(stop, first + part)
            if lo >= hi and not (part == 0 and self._chunks_left == 0):
                continue
            if part == 0:
                lo = hi = first  # the empty piece that ends an empty part
            piece = Piece(
                (rank,),
                part,
                lo - first,
                view[(lo - start) * self.item : (hi - start) * self.item],
            )
            self._sent[rank] += max(0, hi - lo)
            if self._sent[rank] == part and self._chunks_left:
                self._kept.append(dataclasses.replace(piece, data=bytes(piece.data)))
            else:
                out.append(piece)
        if not self._chunks_left:
            out += self._kept
            self._kept = []
        return out
