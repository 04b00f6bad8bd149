"""`GrpcLink`: the worker's side of one Exchange stream (a sender queue, a receiver thread, a
heartbeat), with what it awaits in a `ResultLedger`, its pacing in a `Pacer` and its payloads
where a `Payloads` strategy puts them (inline in the messages, or shared memory).

Sends go through a bounded queue that gRPC drains into the stream, so a coordinator applying
back-pressure makes `send` wait (with a deadline) instead of buffering the model in memory. A
receiver thread reads every message as it arrives and routes it: averaged chunks to the payload
strategy, which fills them straight into the result arrays (so a worker may send all its keys
before reading any result without blocking the coordinator); barrier releases, sample answers
and errors to the ledger; point-to-point messages and membership news to the mailbox; and, for a
host group's link that wraps this one, everything to its observer. Waits are bounded by the
`Timeouts` value; a broken stream or a failed step wakes every waiter with the error that
explains it.

Closing or breaking the stream always ends the request iterator, so gRPC's sending thread and the
stream's arrays do not outlive it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from gradserver.common import codec
from gradserver.common.collective_rules import result_in_pieces
from gradserver.common.errors import (
    CoordinatorShutdownError,
    DeadlineExceededError,
    GradServerError,
    InternalError,
    Status,
    UnavailableError,
    error_from_status,
)
from gradserver.common.messages import (
    ITEM_SIZE,
    AveragedChunkOut,
    BarrierIn,
    BarrierReleaseOut,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    JoinAccepted,
    LeaveIn,
    MemberJoinedOut,
    MemberLeftOut,
    PeerDeliveredOut,
    PeerPiece,
    SampleRangeAssignmentOut,
    SampleStats,
    ServerEvent,
    ShutdownOut,
    TensorKey,
    WorkerEvent,
)
from gradserver.common.rpc import EXCHANGE_METHOD, from_grpc, stream_metadata
from gradserver.common.timeouts import Timeouts

from .base import ErrorRecord, PeerSink, PendingResult, error_of
from .lane import LaneClient
from .pacing import WINDOW_CHUNKS, Pacer
from .payloads import InlinePayloads, Payloads
from .result_ledger import ResultLedger

log = logging.getLogger("gradserver.worker")

_OUTBOUND_MESSAGES = 8


class _Outbound:
    """The bounded hand-off from senders to gRPC's request iterator.

    `end()` lets the iterator finish once what is queued has been sent; `abort()` drops what is
    queued and ends it at once. Both wake every waiter: gRPC's thread blocked in `get()` returns,
    and senders waiting for room see the stream's fate instead of waiting out their deadline.
    """

    def __init__(self, maxsize: int) -> None:
        self._cond = threading.Condition()
        self._items: collections.deque[bytes] = collections.deque()
        self._maxsize = maxsize
        self._ended = False

    @property
    def ended(self) -> bool:
        return self._ended

    def put(self, item: bytes, timeout: float) -> bool:
        """Queues `item`, waiting up to `timeout` s for room; False if not queued (full or ended)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ended or len(self._items) < self._maxsize, timeout)
            if self._ended or len(self._items) >= self._maxsize:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self) -> bytes | None:
        """The next message, or None once ended. Unbounded on purpose: the stream lives as long as
        the worker wants it, and `GrpcLink.close` and `_break` always end it."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._items) or self._ended)
            if not self._items:
                return None
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._ended = True
            self._items.clear()
            self._cond.notify_all()


class GrpcLink:
    """A `Link` over one Exchange stream: the stream's I/O here, what is awaited in its
    `ResultLedger`, pacing in its `Pacer`, and where payloads lie in its `Payloads`."""

    def __init__(
        self,
        channel: grpc.Channel,
        accepted: JoinAccepted,
        timeouts: Timeouts,
        extra_metadata: tuple[tuple[str, str], ...] = (),
        *,
        payloads: Payloads | None = None,
        cond: threading.Condition | None = None,
        on_break: Callable[[ErrorRecord], None] | None = None,
    ) -> None:
        """Opens the Exchange stream on `channel` (which the link owns and closes), its payloads
        carried as `payloads` says (default inline; owned, closed with the link). Partitioned
        coordinators (`PartitionedLink`) give every partition's link one shared `cond`, so a
        waiter wakes on any partition's news, and `on_break`, called once when this link breaks
        (not when it is closed), so the other partitions' links break too."""
        self._channel = channel
        self.accepted = accepted
        self.timeouts = timeouts
        self.payloads: Payloads = payloads if payloads is not None else InlinePayloads()
        self.transport = self.payloads.transport
        self.host_group: tuple[int, ...] = ()
        cond = cond if cond is not None else threading.Condition()
        self._cond = cond
        chunk_elements = accepted.chunk_bytes // 4
        self.pacer = Pacer(cond, chunk_elements, WINDOW_CHUNKS if self.payloads.paced else 0)
        self.ledger = ResultLedger(cond, chunk_elements, timeouts, self.pacer.answered)
        self.payloads.attach(self.ledger)
        self._on_break = on_break
        self._outbound = _Outbound(_OUTBOUND_MESSAGES)
        self._closing = False
        self.shutdown_reason: str | None = None
        self.last_ack = time.monotonic()
        self._acks = 0
        self._stop_heartbeat = threading.Event()
        self._news: Callable[[ServerEvent], bool] | None = None
        self._peers: PeerSink | None = None
        exchange = channel.stream_stream(EXCHANGE_METHOD)
        metadata = stream_metadata(accepted.worker_id, accepted.session_id, accepted.member_token)
        metadata += extra_metadata
        self._call: Any = exchange(self._requests(), metadata=metadata)
        self._receiver = threading.Thread(
            target=self._receive_loop, name=f"gradserver-recv-{accepted.worker_id}", daemon=True
        )
        self._receiver.start()
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name=f"gradserver-hb-{accepted.worker_id}", daemon=True
        )
        self._heartbeat.start()

    # --- sending ------------------------------------------------------------------------------

    def _requests(self) -> Iterator[bytes]:
        while (item := self._outbound.get()) is not None:
            yield item

    @property
    def control(self) -> GrpcLink:
        """The stream carries its own control plane (`send`, `barrier`, `wait_samples`, ...)."""
        return self

    def lane(self) -> LaneClient | None:
        return self.payloads.lane()

    def observe(self, news: Callable[[ServerEvent], bool]) -> None:
        """Has `news` see, on the receiver thread, every average first (it returns True for one it
        took, which this link then only counts as answered), every error after this link handled
        it, and what it does not handle itself (a host group member left): the host group's link
        (`HostLink`) wraps this one. It must not block."""
        self._news = news

    def on_peer_messages(self, sink: PeerSink) -> None:
        self._peers = sink
        broken = self.ledger.trouble(-1)
        if broken is not None:
            sink.link_broken(broken.exception())

    def allocate(self, num_elements: int) -> np.ndarray | None:
        return self.payloads.allocate(num_elements)

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        return self.payloads.result_buffer(num_elements)

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
        """`covers`: the host group whose partial sum `piece` is (see `HostLink`)."""
        ref = self.payloads.stage(key, header, offset, piece)
        if ref is not None:
            self.send(ChunkIn(self.accepted.worker_id, key, header, offset, b"", stats, ref, covers))
            return
        # Paced: keys answered chunk for chunk (gradients, REDUCE collectives), which is what
        # the window counts; the other collective kinds are answered in pieces of their own.
        if not result_in_pieces(key):
            self.pacer.pace(key, piece.size, lambda: self.ledger.broken is not None)
        self.send(ChunkIn(self.accepted.worker_id, key, header, offset, piece.data, stats, covers=covers))

    def pace_as_one_of(self, members: int) -> None:
        """This stream is one of `members` that share one host's link (`Pacer.share_with`)."""
        self.pacer.share_with(members)

    def send(self, event: WorkerEvent) -> None:
        """Queues one message; waits (bounded by timeouts.send) while the transport is full."""
        self.raise_if_broken()
        raw = codec.encode_worker_event(event)
        if self._outbound.put(raw, self.timeouts.send):
            return
        self.raise_if_broken()
        if self._outbound.ended:
            raise UnavailableError("the stream to the coordinator is closed")
        raise DeadlineExceededError(
            f"could not send within {self.timeouts.send:g} s: the coordinator is not "
            "reading this worker's stream"
        )

    def confirm_open(self, timeout: float) -> None:
        """Returns once the coordinator answered a heartbeat on this stream, so the stream is
        registered there before the caller goes on (gRPC opens it in the background otherwise);
        raises the coordinator's refusal or a timeout."""
        with self._cond:
            seen = self._acks
        self.send(HeartbeatIn(self.accepted.worker_id, 0))
        self.ledger.wait(
            lambda: self._acks > seen, timeout, "the coordinator did not answer on the new stream"
        )

    def raise_if_broken(self) -> None:
        broken = self.ledger.broken
        if broken is not None:
            raise broken.exception()
        if self.shutdown_reason is not None:
            raise CoordinatorShutdownError(f"the coordinator is shutting down: {self.shutdown_reason}")

    # --- what is awaited: the ledger's ----------------------------------------------------------

    def expect(
        self,
        key: TensorKey,
        component_sizes: tuple[int, ...],
        total: int | None,
        dtype: DType = DType.FLOAT32,
        *,
        array: np.ndarray | None = None,
        num_chunks: int | None = None,
    ) -> None:
        """`ResultLedger.expect`; `PartitionedLink` passes the `array` every partition fills and
        the `num_chunks` this partition owns."""
        self.ledger.expect(key, component_sizes, total, dtype, array=array, num_chunks=num_chunks)

    def forget(self, key: TensorKey) -> None:
        """Stops waiting for `key` and frees what its payloads held."""
        self.payloads.forgetting(key)
        self.ledger.forget(key)
        self.payloads.forgotten(key)

    def awaiting(self, key: TensorKey) -> bool:
        return self.ledger.awaiting(key)

    def step_failed(self, step: int) -> bool:
        return self.ledger.step_failed(step)

    def trouble(self, step: int) -> ErrorRecord | None:
        return self.ledger.trouble(step)

    def result_ready(self, key: TensorKey) -> bool:
        return self.ledger.result_ready(key)

    def wait_result(self, key: TensorKey, timeout: float | None = None) -> PendingResult:
        return self.ledger.wait_result(key, timeout)

    def barrier(self, step: int, name: str, timeout: float | None, digest: int | None = None) -> None:
        bar = self.ledger.expect_barrier(step, name)
        try:
            self.send(BarrierIn(self.accepted.worker_id, step, name, digest))
        except BaseException:
            self.ledger.forget_barrier(step, name)
            raise
        self.ledger.wait_barrier(step, name, bar, timeout)

    def wait_samples(self, timeout: float | None) -> SampleRangeAssignmentOut:
        return self.ledger.wait_samples(timeout)

    # --- receiving ----------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        try:
            for raw in self._call:
                self._on_event(codec.decode_server_message(raw))
            reason = self.shutdown_reason or "the coordinator closed the stream"
            self._break(CoordinatorShutdownError(f"stream ended: {reason}"))
        except grpc.RpcError as exc:
            code, details = from_grpc(exc.code()), exc.details() or ""
            if self._closing and code is Status.CANCELLED:
                self._break(UnavailableError("the client was closed"))
            elif code is Status.UNAVAILABLE:
                self.payloads.coordinator_lost()
                self._break(UnavailableError(f"lost the connection to the coordinator: {details}"))
            else:
                self._break(error_from_status(code, details))
        except GradServerError as exc:
            self._break(exc)
        except Exception as exc:
            log.exception("receiver thread failed")
            self._break(InternalError(f"receiver failed: {exc!r}"))

    def _break(self, error: GradServerError) -> None:
        first, broken = self.ledger.break_with(error)
        self._stop_heartbeat.set()
        # The call is over: end the request iterator so that gRPC's sending thread returns.
        self._outbound.abort()
        if first and not self._closing and self._on_break is not None:
            self._on_break(broken)
        if first and self._peers is not None:
            self._peers.link_broken(broken.exception())

    def abort_with(self, error: GradServerError) -> None:
        """Breaks the link from outside (another partition's link broke) and cancels the call, so
        the coordinator counts this worker as lost and fails its steps in flight."""
        self._break(error)
        self._call.cancel()

    def _on_event(self, event: ServerEvent) -> None:
        news = self._news
        if isinstance(event, PeerPiece | PeerDeliveredOut):
            if self._peers is not None:
                self._peers.peer_message(event)
            return
        if isinstance(event, MemberJoinedOut):
            log.info("worker %d joined the job in a departed worker's place", event.worker_id)
            if self._peers is not None:
                self._peers.peer_joined(event.worker_id, event.first_step)
            return
        if isinstance(event, AveragedChunkOut):
            if news is not None and news(event):
                self._taken_elsewhere(event)
            elif self.payloads.received(event):
                self.payloads.inputs_free(event.key)
            return
        with self._cond:
            if isinstance(event, BarrierReleaseOut):
                self.ledger.released(event.step, event.name)
            elif isinstance(event, SampleRangeAssignmentOut):
                self.ledger.samples_answered(event)
            elif isinstance(event, HeartbeatAckOut):
                self.last_ack = time.monotonic()
                self._acks += 1
            elif isinstance(event, ShutdownOut):
                self.shutdown_reason = event.reason or "no reason given"
                log.info("coordinator is shutting down: %s", self.shutdown_reason)
            elif isinstance(event, ErrorOut):
                exc = error_of(event)
                log.warning("coordinator: %s", exc)
                self.payloads.dropped(event)
                self.ledger.on_error(event, ErrorRecord.of(exc))
            self._cond.notify_all()
        if isinstance(event, ErrorOut) and event.peer_message is not None and self._peers is not None:
            self._peers.peer_refused(event.peer_message, error_of(event))
        if news is not None and isinstance(event, ErrorOut | MemberLeftOut):
            news(event)
        if isinstance(event, MemberLeftOut):
            log.info("worker %d left the job: %s", event.worker_id, event.reason)
            if self._peers is not None:
                self._peers.peer_left(event.worker_id, event.reason, aborts=event.aborts)

    def _taken_elsewhere(self, event: AveragedChunkOut) -> None:
        """An average the observer took: it still answers this stream's paced chunks."""
        with self._cond:
            if self.pacer.answered(event.key, len(event.data) // ITEM_SIZE[event.header.dtype]):
                self._cond.notify_all()

    # --- heartbeat and close ------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        interval = max(0.05, self.accepted.heartbeat_interval_s)
        sequence = 0
        while not self._stop_heartbeat.wait(interval):
            sequence += 1
            raw = codec.encode_worker_event(HeartbeatIn(self.accepted.worker_id, sequence))
            # A full queue means chunks are flowing or the coordinator is holding this worker
            # back on purpose; either way a heartbeat would add nothing.
            self._outbound.put(raw, timeout=0)

    def close(self) -> None:
        """Says goodbye, half-closes the stream and waits (bounded) for the coordinator's end.
        Whatever state the stream is in, the request iterator ends, the helper threads stop, the
        arrays registered on the stream are released and the payloads' resources closed."""
        if self._closing:
            return
        self._closing = True
        try:
            self._stop_heartbeat.set()
            if self.ledger.broken is None:
                self._outbound.put(
                    codec.encode_worker_event(LeaveIn("worker closed")), timeout=self.timeouts.close
                )
            self._outbound.end()
            self._receiver.join(self.timeouts.close)
            if self._receiver.is_alive():
                self._call.cancel()
                self._receiver.join(self.timeouts.close)
            self._break(UnavailableError("the client was closed"))
            self._heartbeat.join(self.timeouts.close)
            self._channel.close()
            self.ledger.clear()
        finally:
            self.payloads.close()
