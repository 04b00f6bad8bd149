"""What every worker transport offers the `WorkerClient`: the `Link` interface and its records.

A link is one joined worker's connection to its coordinator(s), whatever carries the bytes. The
client validates, encodes and cuts nothing itself beyond the wire dtype: it registers the result
it expects, hands the link one chunk at a time, and waits for the result, a barrier or a sample
range through the link. Each transport is one class under `worker/transports/` that implements
this interface; only `worker/transports/` names the concrete classes (`open_link` picks one).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from gradserver.common.errors import GradServerError, error_from_status
from gradserver.common.messages import (
    ChunkHeader,
    DType,
    ErrorOut,
    JoinAccepted,
    PeerDeliveredOut,
    PeerPiece,
    SampleRangeAssignmentOut,
    SampleStats,
    TensorKey,
    WorkerEvent,
)
from gradserver.common.wire_dtype import widen

from .lane import LaneClient


@dataclasses.dataclass(frozen=True)
class ErrorRecord:
    """What an error said (class, message, step, key, worker), to raise afresh on every call."""

    kind: type[GradServerError]
    message: str
    step: int | None = None
    key: str | None = None
    worker_id: int | None = None

    @classmethod
    def of(cls, error: GradServerError) -> ErrorRecord:
        return cls(type(error), error.message, error.step, error.key, error.worker_id)

    def exception(self) -> GradServerError:
        return self.kind(self.message, step=self.step, key=self.key, worker_id=self.worker_id)


def payload_values(data: bytes | memoryview, dtype: DType) -> np.ndarray:
    """An average's payload as the result array holds it: float32 as is, bytes as uint8, a
    16-bit wire dtype widened to float32."""
    if dtype is DType.FLOAT32:
        return np.frombuffer(data, dtype="<f4")
    if dtype is DType.BYTES:
        return np.frombuffer(data, dtype=np.uint8)
    return widen(data, dtype)


def error_of(event: ErrorOut) -> GradServerError:
    """The exception an in-stream error stands for (its class by status code)."""
    return error_from_status(
        event.code,
        event.message,
        step=event.step,
        key=str(event.key) if event.key is not None else None,
        worker_id=event.culprit_worker_id,
    )


@dataclasses.dataclass
class PendingResult:
    """An average being assembled; `array` is filled chunk by chunk by a receiver thread."""

    key: TensorKey
    component_sizes: tuple[int, ...]
    array: np.ndarray
    num_chunks: int
    offsets: set[int] = dataclasses.field(default_factory=set)
    # What the chunks travel as; the array is float32 whatever it is (uint8 for BYTES).
    dtype: DType = DType.FLOAT32
    num_contributors: int = 0
    stats: SampleStats | None = None
    error: ErrorRecord | None = None
    # A collective result other than REDUCE arrives in pieces at any offsets, so it is complete
    # once its elements are all there (`num_chunks` is unused); an ALL_TO_ALL's length is known
    # only from its first piece (`sized` False until then).
    by_elements: bool = False
    sized: bool = True
    elements: int = 0

    @property
    def done(self) -> bool:
        if self.by_elements:
            return self.sized and bool(self.offsets) and self.elements == self.array.size
        return len(self.offsets) == self.num_chunks


class PeerSink(Protocol):
    """What a link tells the worker's point-to-point mailbox (worker/transports/mailbox.py), from
    its receiver thread; none of it may block."""

    def peer_message(self, event: PeerPiece | PeerDeliveredOut) -> None:
        """A piece of a message relayed to this worker, or a send of its delivered."""
        ...

    def peer_refused(self, piece: PeerPiece, error: GradServerError) -> None:
        """The coordinator refused message `piece.sequence` of this worker."""
        ...

    def link_broken(self, error: GradServerError) -> None:
        """The link broke (once): nothing more will be relayed."""
        ...

    def peer_left(self, worker_id: int, reason: str, *, aborts: bool) -> None:
        """Worker `worker_id` left the job (`aborts`: every operation in flight fails)."""
        ...

    def peer_joined(self, worker_id: int, first_step: int) -> None:
        """A worker took the place of `worker_id`, which had left, from step `first_step`."""
        ...


class ControlPlane(Protocol):
    """What a worker says to its coordinator besides chunks, and what comes back that is no
    result: joining the stream, control messages, barriers, sample ranges, point-to-point news.
    A link that wraps another (`HostLink`) hands on the inner link's control plane as it is."""

    def confirm_open(self, timeout: float) -> None:
        """Returns once the coordinator holds this worker's stream(s)."""
        ...

    def send(self, event: WorkerEvent) -> None:
        """Sends one control message (heartbeat, sample-range request)."""
        ...

    def barrier(self, step: int, name: str, timeout: float | None, digest: int | None = None) -> None:
        """Returns when every worker reached barrier `name` of `step` (with `digest`: when the
        majority's state digest is this worker's; see server/digests.py)."""
        ...

    def wait_samples(self, timeout: float | None) -> SampleRangeAssignmentOut:
        """The answer to the oldest sample-range request sent with `send`."""
        ...

    def on_peer_messages(self, sink: PeerSink) -> None:
        """Has `sink` hear the point-to-point messages relayed to this worker, its sends'
        deliveries and refusals, and the link's end (`PeerPiece` messages go out with `send`)."""
        ...


class Link(Protocol):
    """One worker's connection to its coordinator(s). Every wait is bounded (the `Timeouts` the
    link was opened with, or the `timeout` given); every failure is a `GradServerError`."""

    @property
    def accepted(self) -> JoinAccepted:
        """The coordinator's answer to this worker's Join (for partitioned coordinators: partition 0's)."""
        ...

    @property
    def transport(self) -> str:
        """How gradients move: "grpc" or "shm"."""
        ...

    @property
    def control(self) -> ControlPlane:
        """This link's control plane (`ControlPlane`)."""
        ...

    @property
    def host_group(self) -> tuple[int, ...]:
        """The worker ids of the host group this link sums with (empty: none; see `HostLink`)."""
        ...

    def raise_if_broken(self) -> None:
        """Raises why nothing more can be sent, if anything says so."""
        ...

    def allocate(self, num_elements: int) -> np.ndarray | None:
        """A float32 array this transport sends without a copy, or None (then a plain array
        serves just as well)."""
        ...

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        """A float32 array for a result the caller gave no `into=` for, where this transport
        can have the average written without copying it out (its contents unspecified; freed
        when collected), or None (then the client's own array)."""
        ...

    def expect(
        self,
        key: TensorKey,
        component_sizes: tuple[int, ...],
        total: int | None,
        dtype: DType,
        *,
        array: np.ndarray | None = None,
    ) -> None:
        """Registers `key`'s average (written into `array` when given) before its chunks go;
        `total` is its length in elements, None when only the result says (an ALL_TO_ALL)."""
        ...

    def send_chunk(
        self,
        key: TensorKey,
        header: ChunkHeader,
        offset: int,
        piece: np.ndarray,
        stats: SampleStats | None,
    ) -> None:
        """Sends the chunk `piece` (payload elements from `offset` of `key`); waits, bounded,
        while the transport is full."""
        ...

    def forget(self, key: TensorKey) -> None:
        """Stops waiting for `key` and frees whatever the transport holds for it."""
        ...

    def awaiting(self, key: TensorKey) -> bool:
        """Whether `key` is still registered (a receive for it timed out locally and may retry)."""
        ...

    def step_failed(self, step: int) -> bool:
        """Whether the coordinator reported `step` as failed."""
        ...

    def wait_result(self, key: TensorKey, timeout: float | None = None) -> PendingResult:
        """The complete average of `key`; raises its error, its step's failure or a timeout."""
        ...

    def lane(self) -> LaneClient | None:
        """The collective lane this link can run one-shot collectives through (same host, the
        coordinator offers it), or None."""
        ...

    def close(self) -> None:
        """Leaves the job, ends every helper thread and closes every connection; idempotent."""
        ...
