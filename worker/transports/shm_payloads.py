"""`ShmPayloads`: a same-host worker's payloads through shared memory, control still over gRPC.

The Exchange stream still carries every message (so ordering, back-pressure, errors and liveness
are the stream's), but a chunk's payload is written into this worker's input arena and only
named in its message, and a result (an average, or a byte-moving collective's raw bytes) is read
where the coordinator wrote it in its output arena. This strategy owns the `ShmChannel` and its
bookkeeping: a staged chunk's slot is free again once its average (for the collective kinds other
than REDUCE: once the whole result), its key's refusal or its step's failure arrived (the
coordinator then holds no view of it), and every output slot read is released. A chunk that finds
no free slot in time goes inline. Unpaced: a same-host worker shares no link, and its arena's
slots bound what it stages.
"""

from __future__ import annotations

import numpy as np

from gradserver.common.collective_rules import result_in_pieces
from gradserver.common.messages import AveragedChunkOut, ChunkHeader, DType, ErrorOut, ShmRef, TensorKey

from ..tensors import same_memory
from .base import payload_values
from .lane import LaneClient
from .result_ledger import ResultLedger
from .shm_channel import ShmChannel


class ShmPayloads:
    """Payloads in the shared-memory arenas of `arenas` (owned: closed with the stream)."""

    transport = "shm"
    paced = False

    def __init__(self, arenas: ShmChannel) -> None:
        self.arenas = arenas
        self._ledger: ResultLedger | None = None
        # Arena memory of keys given up on (a send failed midway, a refusal) while the
        # coordinator may still write averages over their chunks ("inout"): kept from reuse
        # until their step fails (the coordinator then holds nothing of it) or the link closes.
        self._unsettled: dict[TensorKey, np.ndarray] = {}

    @property
    def ledger(self) -> ResultLedger:
        assert self._ledger is not None, "attached before the stream opens"
        return self._ledger

    def attach(self, ledger: ResultLedger) -> None:
        self._ledger = ledger

    def lane(self) -> LaneClient | None:
        return self.arenas.lane

    def allocate(self, num_elements: int) -> np.ndarray | None:
        """An array in the registered input arena (sent from where it lies), or None when the
        arena has no contiguous room left."""
        return self.arenas.gradient_buffer(num_elements)

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        """A result array in the input arena: chunks are copied there instead of a staging slot
        and sent "inout", so the average is written over them and not copied out."""
        return self.arenas.result_buffer(num_elements)

    def stage(self, key: TensorKey, header: ChunkHeader, offset: int, piece: np.ndarray) -> ShmRef | None:
        # An empty chunk (a broadcast's non-root rank, a zero-size tensor) has nothing to stage.
        # The collective kinds other than REDUCE hold their slots until the whole result is in,
        # so waiting for one of theirs to free up would only delay this one: inline at once.
        if not piece.nbytes:
            return None
        if result_in_pieces(key):
            return self.arenas.stage(key, offset, piece, wait_s=0.0)
        return self._in_place(key, header, offset, piece) or self.arenas.stage(key, offset, piece)

    def _in_place(self, key: TensorKey, header: ChunkHeader, offset: int, piece: np.ndarray) -> ShmRef | None:
        """An "inout" reference when this chunk's average is to land in the input arena: in the
        memory it is sent from (`into=` the `gradient_buffer` sent), or, for a chunk from other
        memory, in arena memory (a `result_buffer`, or a `gradient_buffer` given as `into=`)
        that it is copied into first instead of a staging slot. The coordinator may then write
        the average over it and nothing is copied out (docs/PROTOCOL.md, "Shared memory"). None
        otherwise."""
        if header.dtype is not DType.FLOAT32:
            return None
        pending = self.ledger.pending(key)
        if pending is None or pending.dtype is not DType.FLOAT32:
            return None
        target = pending.array[offset : offset + piece.size]
        where = self.arenas.placed(target)
        if where is None or target.size != piece.size:
            return None
        if not same_memory(target, piece):
            # Sent from the arena already (one copy out either way), or overlapping its target
            # (copying would clobber what is still to send): as any chunk.
            if self.arenas.placed(piece) is not None or np.may_share_memory(target, piece):
                return None
            target[...] = piece
            self.arenas.staged_bytes += piece.nbytes
        else:
            self.arenas.zero_copy_bytes += piece.nbytes
        return ShmRef("inout", where, piece.nbytes)

    def received(self, event: AveragedChunkOut) -> bool:
        if not result_in_pieces(event.key):
            # Averaged: the coordinator holds no view of this chunk's input slot any more. (The
            # other collective kinds free their inputs once the whole result is in.)
            self.arenas.chunk_done(event.key, event.offset)
        if event.shm is None:
            return self.ledger.fill(event, payload_values(event.data, event.header.dtype))
        if event.shm.name == "in":
            # Written over this worker's own "inout" chunk: usually the very memory awaiting it,
            # so `fill` finds nothing to copy; no output slot to release.
            return self.ledger.fill(event, self.arenas.own_average(event.shm))
        try:
            if event.header.dtype is DType.BYTES:
                return self.ledger.fill(event, self.arenas.result_bytes(event.shm))
            if event.header.dtype is not DType.FLOAT32:
                # A 16-bit key's average (`send(..., wire="bfloat16")`): its bytes, widened.
                raw = self.arenas.result_bytes(event.shm)
                return self.ledger.fill(event, payload_values(raw.data, event.header.dtype))
            return self.ledger.fill(event, self.arenas.average(event.shm))
        finally:
            self.arenas.release(event.shm)

    def inputs_free(self, key: TensorKey) -> None:
        self.arenas.key_done(key)

    def forgetting(self, key: TensorKey) -> None:
        """Keeps `key`'s result memory from reuse while the coordinator may still write it."""
        with self.ledger.cond:
            self._keep_unsettled(key)

    def forgotten(self, key: TensorKey) -> None:
        """Frees the input slots `key`'s chunks were staged in."""
        self.arenas.key_done(key)

    def _keep_unsettled(self, key: TensorKey) -> None:
        """Keeps `key`'s result memory from reuse while it lies in the arena and its step has
        not failed (lock held)."""
        pending = self.ledger.pending(key)
        if (
            pending is not None
            and not self.ledger.step_failed(key.step)
            and self.arenas.placed(pending.array) is not None
        ):
            self._unsettled[key] = pending.array

    def dropped(self, event: ErrorOut) -> None:
        # A failed step or a refused key is dropped by the coordinator: its slots are free. A
        # refused key's chunks accepted before may still be averaged, though, so memory that
        # averages are written over stays taken until its step fails.
        if event.step_failed:
            self.arenas.step_done(event.step)
            for key in [k for k in self._unsettled if k.step == event.step]:
                del self._unsettled[key]
        elif event.key is not None:
            self._keep_unsettled(event.key)
            self.arenas.key_done(event.key)

    def coordinator_lost(self) -> None:
        self.arenas.coordinator_lost()

    def close(self) -> None:
        self._unsettled.clear()
        self.arenas.close()
