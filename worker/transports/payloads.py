"""How a stream's chunk payloads and results travel: the strategy a `GrpcLink` is built with.

The Exchange stream carries every message of a worker (control, ordering, back-pressure,
errors, liveness); what varies between transports is only where the bytes of a chunk and of an
average lie. `InlinePayloads` puts them inside the gRPC messages. `shm_payloads.ShmPayloads`
puts them in shared-memory arenas and names them in the messages (a same-host worker). A new
way to carry payloads is one class implementing `Payloads`, with its own module, and one line
in `worker/transports/__init__.py`'s `open_link`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from gradserver.common.errors import InternalError
from gradserver.common.messages import AveragedChunkOut, ChunkHeader, ErrorOut, ShmRef, TensorKey

from .base import payload_values
from .lane import LaneClient
from .result_ledger import ResultLedger


class Payloads(Protocol):
    """Where one stream's payloads lie. Every hook but `stage` runs on the receiver thread and
    must not block."""

    transport: str  # what `Link.transport` says: "grpc" or "shm"
    paced: bool  # whether chunks to be reduced are paced by their answers (`pacing`)

    def attach(self, ledger: ResultLedger) -> None:
        """The stream's ledger, before any message is sent or received."""
        ...

    def lane(self) -> LaneClient | None:
        """The collective lane this transport offers (`Link.lane`), or None."""
        ...

    def allocate(self, num_elements: int) -> np.ndarray | None:
        """`Link.allocate`."""
        ...

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        """`Link.result_buffer`."""
        ...

    def stage(self, key: TensorKey, header: ChunkHeader, offset: int, piece: np.ndarray) -> ShmRef | None:
        """Where chunk `piece` was put for the coordinator to read, or None: it goes inline."""
        ...

    def received(self, event: AveragedChunkOut) -> bool:
        """Fills one averaged chunk into its result (`ResultLedger.fill`) from wherever its values
        lie, and frees what held them; returns what `fill` does."""
        ...

    def inputs_free(self, key: TensorKey) -> None:
        """A collective result other than REDUCE is complete: the coordinator no longer reads this
        worker's contribution to it (docs/PROTOCOL.md, "When inputs are free")."""
        ...

    def forgetting(self, key: TensorKey) -> None:
        """The worker stops waiting for `key` (its send failed midway, or it was dropped); called
        before the ledger forgets it."""
        ...

    def forgotten(self, key: TensorKey) -> None:
        """After the ledger forgot `key`."""
        ...

    def dropped(self, event: ErrorOut) -> None:
        """The coordinator dropped what `event` names (a failed step, a refused key), so it holds
        nothing of it any more. Lock held."""
        ...

    def coordinator_lost(self) -> None:
        """The connection to the coordinator is lost, before anyone hears of it."""
        ...

    def close(self) -> None:
        """The stream is closed (once)."""
        ...


class InlinePayloads:
    """Every payload inside the gRPC messages: nothing to stage, map or free."""

    transport = "grpc"
    paced = True

    def __init__(self) -> None:
        self._ledger: ResultLedger | None = None

    def attach(self, ledger: ResultLedger) -> None:
        self._ledger = ledger

    def lane(self) -> LaneClient | None:
        return None

    def allocate(self, num_elements: int) -> np.ndarray | None:
        """Inline payloads are copied into messages whatever array they come from."""
        return None

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        """Inline averages are copied out of their messages wherever they go."""
        return None

    def stage(self, key: TensorKey, header: ChunkHeader, offset: int, piece: np.ndarray) -> ShmRef | None:
        return None

    def received(self, event: AveragedChunkOut) -> bool:
        if event.shm is not None:
            raise InternalError(
                f"coordinator sent {event.key} through shared memory this worker has not mapped"
            )
        assert self._ledger is not None, "attached before the stream opens"
        return self._ledger.fill(event, payload_values(event.data, event.header.dtype))

    def inputs_free(self, key: TensorKey) -> None:
        return None

    def forgetting(self, key: TensorKey) -> None:
        return None

    def forgotten(self, key: TensorKey) -> None:
        return None

    def dropped(self, event: ErrorOut) -> None:
        return None

    def coordinator_lost(self) -> None:
        return None

    def close(self) -> None:
        return None
