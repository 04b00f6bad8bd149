"""`ShmLink`: gRPC for control, shared memory for the gradients of a same-host worker.

The Exchange stream still carries every message (so ordering, back-pressure, errors and liveness
are the gRPC link's), but a chunk's payload is written into this worker's input arena and only
named in its message, and a result (an average, or a byte-moving collective's raw bytes) is read
where the coordinator wrote it in its output arena. This link owns the `ShmChannel` and its
bookkeeping: a staged chunk's slot is free again once its average (for the collective kinds other
than REDUCE: once the whole result), its key's refusal or its step's failure arrived (the
coordinator then holds no view of it), and every output slot read is released. A chunk that finds
no free slot in time goes inline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import numpy as np

from gradserver.common.collective_rules import result_in_pieces
from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    JoinAccepted,
    SampleStats,
    ShmRef,
    TensorKey,
)
from gradserver.common.timeouts import Timeouts

from ..tensors import same_memory
from .base import ErrorRecord
from .grpc_link import GrpcLink
from .lane import LaneClient
from .shm_channel import ShmChannel


class ShmLink(GrpcLink):
    """A `Link` whose payloads travel through the shared-memory arenas of `channel`."""

    transport = "shm"

    def __init__(
        self,
        channel: grpc.Channel,
        accepted: JoinAccepted,
        timeouts: Timeouts,
        extra_metadata: tuple[tuple[str, str], ...],
        arenas: ShmChannel,
        *,
        cond: threading.Condition | None = None,
        on_break: Callable[[ErrorRecord], None] | None = None,
    ) -> None:
        """Takes ownership of `arenas` (closed with the link) before the stream opens, so that
        the receiver thread finds them from its first message."""
        self.arenas = arenas
        # Arena memory of keys given up on (a send failed midway, a refusal) while the
        # coordinator may still write averages over their chunks ("inout"): kept from reuse
        # until their step fails (the coordinator then holds nothing of it) or the link closes.
        self._unsettled: dict[TensorKey, np.ndarray] = {}
        super().__init__(channel, accepted, timeouts, extra_metadata, cond=cond, on_break=on_break)

    def _pacing_window(self) -> int:
        """Unpaced: a same-host worker shares no link, and its arena's slots bound what it stages."""
        return 0

    def lane(self) -> LaneClient | None:
        return self.arenas.lane

    def allocate(self, num_elements: int) -> np.ndarray | None:
        """An array in the registered input arena (sent from where it lies), or None when the
        arena has no contiguous room left."""
        return self.arenas.gradient_buffer(num_elements)

    def send_chunk(
        self,
        key: TensorKey,
        header: ChunkHeader,
        offset: int,
        piece: np.ndarray,
        stats: SampleStats | None,
        *,
        covers: tuple[int, ...] = (),
    ) -> None:
        # An empty chunk (a broadcast's non-root rank, a zero-size tensor) has nothing to stage.
        # The collective kinds other than REDUCE hold their slots until the whole result is in,
        # so waiting for one of theirs to free up would only delay this one: inline at once.
        if not piece.nbytes:
            ref = None
        elif result_in_pieces(key):
            ref = self.arenas.stage(key, offset, piece, wait_s=0.0)
        else:
            ref = self._in_place(key, header, offset, piece) or self.arenas.stage(key, offset, piece)
        if ref is None:
            super().send_chunk(key, header, offset, piece, stats, covers=covers)
        else:
            self.send(ChunkIn(self.accepted.worker_id, key, header, offset, b"", stats, ref, covers))

    def _in_place(self, key: TensorKey, header: ChunkHeader, offset: int, piece: np.ndarray) -> ShmRef | None:
        """An "inout" reference when this chunk's average is to land in the input arena: in the
        memory it is sent from (`into=` the `gradient_buffer` sent), or, for a chunk from other
        memory, in arena memory (a `result_buffer`, or a `gradient_buffer` given as `into=`)
        that it is copied into first instead of a staging slot. The coordinator may then write
        the average over it and nothing is copied out (docs/PROTOCOL.md, "Shared memory"). None
        otherwise."""
        if header.dtype is not DType.FLOAT32:
            return None
        with self._cond:
            pending = self._results.get(key)
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

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        """A result array in the input arena: chunks are copied there instead of a staging slot
        and sent "inout", so the average is written over them and not copied out."""
        return self.arenas.result_buffer(num_elements)

    def forget(self, key: TensorKey) -> None:
        """Stops waiting for `key` and frees the input slots its chunks were staged in (called
        when its send failed midway, or once the coordinator dropped it)."""
        with self._cond:
            self._keep_unsettled(key)
        super().forget(key)
        self.arenas.key_done(key)

    def _keep_unsettled(self, key: TensorKey) -> None:
        """Keeps `key`'s result memory from reuse while it lies in the arena and its step has
        not failed (lock held)."""
        pending = self._results.get(key)
        if (
            pending is not None
            and key.step not in self._failed_steps
            and self.arenas.placed(pending.array) is not None
        ):
            self._unsettled[key] = pending.array

    def _on_chunk(self, event: AveragedChunkOut) -> None:
        if not result_in_pieces(event.key):
            # Averaged: the coordinator holds no view of this chunk's input slot any more. (The
            # other collective kinds free their inputs once the whole result is in.)
            self.arenas.chunk_done(event.key, event.offset)
        if event.shm is None:
            super()._on_chunk(event)
            return
        if event.shm.name == "in":
            # Written over this worker's own "inout" chunk: usually the very memory awaiting it,
            # so `_fill` finds nothing to copy; no output slot to release.
            self._fill(event, self.arenas.own_average(event.shm))
            return
        try:
            if event.header.dtype is DType.BYTES:
                self._fill(event, self.arenas.result_bytes(event.shm))
            else:
                self._fill(event, self.arenas.average(event.shm))
        finally:
            self.arenas.release(event.shm)

    def _inputs_free(self, key: TensorKey) -> None:
        self.arenas.key_done(key)

    def _coordinator_dropped(self, event: ErrorOut) -> None:
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

    def _coordinator_lost(self) -> None:
        self.arenas.coordinator_lost()

    def close(self) -> None:
        if self._closing:
            return  # the arenas' descriptors must be closed once only
        try:
            super().close()
        finally:
            self._unsettled.clear()
            self.arenas.close()
