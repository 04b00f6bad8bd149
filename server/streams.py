"""The coordinator's Exchange streams: each worker's outbound queue and write progress
(`WorkerStream`), and serving them all (`Streams`: a reader and a writer task per stream,
back-pressure by the in-flight budget, how a stream ends).

The writer task drains `outbound`; `outbound_bytes` (results queued but not yet written) counts
toward the worker's in-flight budget, and `write_progress` lets the liveness monitor tell a
stream whose writes stall from one that merely has nothing to send. A reader stops reading while
its worker's unreduced contributions plus its unsent results exceed the budget, which turns into
HTTP/2 back-pressure on that worker: the coordinator's memory is bounded by chunks in flight,
not by the model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gradserver.common import codec
from gradserver.common.errors import FailedPreconditionError, GradServerError, Status, UnavailableError
from gradserver.common.messages import (
    BarrierIn,
    ChunkIn,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    LeaveIn,
    PeerPiece,
    SampleRangeRequestIn,
    StartAtIn,
    StepFailureIn,
    TensorKey,
)
from gradserver.common.rpc import to_grpc

from .config import CoordinatorConfig
from .membership import Member
from .metrics import CoordinatorMetrics

log = logging.getLogger("gradserver.server")

_STOP = object()


@dataclasses.dataclass(frozen=True)
class _Written:
    """A mark in a stream's outbound queue: `then` runs once everything before it was written."""

    then: Callable[[], None]


# A client's cancel fails a pending write a moment before the cancellation reaches the handler.
_CANCEL_AFTER_FAILED_WRITE_S = 1.0
_LAST_WRITES_S = 1.0  # how long a shutdown waits for the streams' last writes, at most

# How a stream is ended by the coordinator: the status and message its RPC is aborted with.
Ending = tuple[Status, str]


class WorkerStream:
    """One worker's Exchange stream: its outbound queue, write progress and how it ends."""

    def __init__(self, member: Member, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.member = member
        self.context = context
        self.outbound: asyncio.Queue[bytes | object] = asyncio.Queue()
        self.outbound_bytes = 0
        self.room = asyncio.Event()
        self.room.set()
        self.paused = False
        self.said_goodbye = False
        self.by_shutdown = False
        # When the oldest unsent byte was queued or the last write completed, whichever is later.
        self.write_progress = time.monotonic()
        loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[Ending | None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def send(self, raw: bytes) -> None:
        if self.outbound_bytes == 0:
            self.write_progress = time.monotonic()
        self.outbound_bytes += len(raw)
        self.outbound.put_nowait(raw)

    def end(self, status: Ending | None) -> None:
        if not self.ended.done():
            self.ended.set_result(status)

    def stalled_for(self, now: float) -> float:
        """Seconds the writes to this worker made no progress while bytes waited (0 when none)."""
        return now - self.write_progress if self.outbound_bytes else 0.0


# What the coordinator does with one decoded contribution, barrier arrival or request.
Handled = ChunkIn | BarrierIn | SampleRangeRequestIn | StepFailureIn | PeerPiece | StartAtIn
Handle = Callable[[WorkerStream, Handled], None]
# Frees the member's place: (stream, why it ended, whether that was expected).
Ended = Callable[[WorkerStream, str, bool], None]


class Streams:
    """Every open Exchange stream of one coordinator, by worker id."""

    def __init__(
        self,
        config: CoordinatorConfig,
        metrics: CoordinatorMetrics,
        *,
        handle: Handle,
        refusal: Callable[[int], str | None],
        buffered: Callable[[int], int],
        stopping: Callable[[], bool],
        ended: Ended,
        opened: Callable[[int], None] = lambda _w: None,
        held_back: Callable[[int], bool] = lambda _w: False,
    ) -> None:
        """`opened(w)`: member w's stream is open (messages queued for it from now on reach it);
        `held_back(w)`: whether worker w's stream is to wait whatever its budget (the relay holds
        as much of what it sent to other workers as it may)."""
        self._config = config
        self._metrics = metrics
        # Until the job's chunk size is chosen (`chunk_elements`), the largest it can be; no stream
        # is read before then.
        self._limits = codec.WireLimits(
            chunk_elements=config.chunk_bytes // 4, max_tensor_elements=config.max_tensor_elements
        )
        self._handle = handle
        self._refusal = refusal
        self._buffered = buffered
        self._stopping = stopping
        self._ended = ended
        self._opened = opened
        self._held_back = held_back
        self.by_worker: dict[int, WorkerStream] = {}
        self.progress = asyncio.Event()  # set whenever a stream closes (and by the coordinator)
        self._shutdown_deadline: float | None = None  # loop time, once the shutdown ends the streams

    @property
    def chunk_elements(self) -> int:
        """The job's chunk size, elements: where every chunk read must be cut."""
        return self._limits.chunk_elements

    @chunk_elements.setter
    def chunk_elements(self, value: int) -> None:
        self._limits = dataclasses.replace(self._limits, chunk_elements=value)

    def __iter__(self) -> Iterator[WorkerStream]:
        return iter(list(self.by_worker.values()))

    def __bool__(self) -> bool:
        return bool(self.by_worker)

    def of(self, member: Member) -> WorkerStream | None:
        """`member`'s own open stream (not a predecessor's with its id)."""
        stream = self.by_worker.get(member.worker_id)
        return stream if stream is not None and stream.member is member else None

    def admit(self, member: Member) -> Member:
        """`member` may open its stream: raises when it has one open or the coordinator stops."""
        if self.of(member) is not None:
            raise FailedPreconditionError(
                f"worker {member.worker_id} already has an Exchange stream open",
                worker_id=member.worker_id,
            )
        if self._stopping():
            raise UnavailableError("the coordinator is shutting down")
        return member

    # --- sending --------------------------------------------------------------------------------

    def send(self, to: tuple[int, ...], raw: bytes) -> None:
        for worker_id in to:
            stream = self.by_worker.get(worker_id)
            if stream is not None:
                stream.send(raw)

    def broadcast(self, raw: bytes) -> None:
        for stream in self.by_worker.values():
            stream.send(raw)

    def send_error(
        self,
        stream: WorkerStream,
        code: Status,
        message: str,
        step: int,
        key: TensorKey | None = None,
        barrier: str | None = None,
    ) -> None:
        """An in-stream error about one message of this worker (counted in the metrics); with
        `key` (or `barrier`), the worker fails only that result (or barrier wait)."""
        self._metrics.errors.labels(code.name).inc()
        event = ErrorOut(int(code), message, step, key=key, barrier_name=barrier)
        stream.send(codec.encode_server_event(event))

    async def drain(self, pending: Callable[[], bool], deadline: float) -> None:
        """Waits until nothing is `pending` or no stream is left, at most until `deadline`
        (loop time): steps in flight complete before a shutdown fails them."""
        loop = asyncio.get_running_loop()
        while pending() and self.by_worker:
            self.progress.clear()
            try:
                await asyncio.wait_for(self.progress.wait(), deadline - loop.time())
            except TimeoutError:
                return

    async def end_all(self, deadline: float) -> None:
        """Ends every stream as the shutdown's doing; waits for them to close until `deadline`."""
        # Steps in flight had the drain; what is left to write (the shutdown notice, errors) takes
        # moments to a peer that reads, and is not worth a longer stop for one that does not.
        loop = asyncio.get_running_loop()
        self._shutdown_deadline = last_writes = min(deadline, loop.time() + _LAST_WRITES_S)
        streams = list(self.by_worker.values())
        for stream in streams:
            stream.by_shutdown = True
            stream.end(None)
        if streams:
            await asyncio.wait([s.closed for s in streams], timeout=max(0.0, last_writes - loop.time()))

    def wake_readers(self) -> None:
        for stream in self.by_worker.values():
            if stream.paused and not self._over_budget(stream):
                stream.room.set()

    # --- serving one stream ---------------------------------------------------------------------

    async def serve(self, member: Member, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Serves `member`'s stream until it ends; frees its place with the reason."""
        existing = self.by_worker.get(member.worker_id)
        if existing is not None:
            # The stream of this place's previous member is still closing: it cannot block the
            # new member, who replaces it.
            existing.end((Status.FAILED_PRECONDITION, f"worker {member.worker_id} was replaced"))
        stream = WorkerStream(member, context)
        member.streaming = True
        member.last_seen = time.monotonic()
        self.by_worker[member.worker_id] = stream
        self._opened(member.worker_id)
        writer = asyncio.create_task(self._write_loop(stream))
        reader = asyncio.create_task(self._read_loop(stream))
        reader.add_done_callback(lambda task: self._reader_done(stream, task))
        status: Ending | None = None
        cancelled = True
        try:
            status = await stream.ended
            cancelled = False
        finally:
            reader.cancel()
            self._stream_ended(stream, status, cancelled)
            # A peer that closed its side without a goodbye (its process ended) reads nothing
            # more: what is queued for it is dropped rather than waited on.
            gone = cancelled or (status is None and not stream.said_goodbye and not stream.by_shutdown)
            try:
                await self._finish_writer(stream, writer, drain=not gone)
            finally:
                # Also when the call is cancelled while its writer finishes (the peer went away
                # just as the shutdown ended its stream): the shutdown waits for `closed`.
                if self.by_worker.get(member.worker_id) is stream:
                    del self.by_worker[member.worker_id]
                member.streaming = False
                if not stream.closed.done():
                    stream.closed.set_result(None)
                self.progress.set()
        if status is not None:
            await context.abort(to_grpc(status[0]), status[1])

    def _stream_ended(self, stream: WorkerStream, status: Ending | None, cancelled: bool) -> None:
        """Frees the member's place (when it still holds it) with the reason its stream ended."""
        left = not cancelled and status is None and stream.said_goodbye
        expected = left or (not cancelled and status is None and stream.by_shutdown)
        if left:
            why = "left the job"
        elif expected:
            why = "disconnected: the coordinator is shutting down"
        elif cancelled:
            why = "disconnected (its stream was cancelled)"
        elif status is not None:
            why = status[1]
        else:
            why = "disconnected (its stream ended without a goodbye)"
        if self._stopping() and not expected:
            # Most likely the shutdown's doing (the worker gave up on hearing it): say so, rather
            # than blame the worker alone to the others.
            why += " while the coordinator is shutting down"
        self._ended(stream, why, expected)

    async def _finish_writer(self, stream: WorkerStream, writer: asyncio.Task[None], *, drain: bool) -> None:
        """Lets the writer send what is queued (bounded by drain_timeout; not at all for a
        cancelled stream, whose peer is gone). Never raises: the caller's clean-up must run."""
        stream.outbound.put_nowait(_STOP)
        if drain:
            timeout = self._config.drain_timeout
            if self._shutdown_deadline is not None:
                timeout = min(timeout, max(0.0, self._shutdown_deadline - asyncio.get_running_loop().time()))
            try:
                await asyncio.wait([writer], timeout=timeout)
            except asyncio.CancelledError:
                writer.cancel()  # the call itself was cancelled: no writer may outlive it
                raise
        if not writer.done():
            writer.cancel()
            await asyncio.wait([writer])

    def _reader_done(self, stream: WorkerStream, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            stream.end(None)
        else:
            log.error("stream reader failed: %r", exc, extra={"worker_id": stream.member.worker_id})
            stream.end((Status.INTERNAL, f"coordinator error: {exc!r}"))

    async def _read_loop(self, stream: WorkerStream) -> None:
        w = stream.member.worker_id
        limit = self._config.max_message_bytes
        while True:
            while self._over_budget(stream):
                if not stream.paused:
                    why = (
                        "relayed bytes wait for their receivers"
                        if self._held_back(w)
                        else "in-flight budget full"
                    )
                    log.debug("holding back worker %d's stream (%s)", w, why, extra={"worker_id": w})
                stream.paused = True
                stream.room.clear()
                await stream.room.wait()
            if stream.paused:
                stream.paused = False
                stream.member.last_seen = time.monotonic()
            raw = await stream.context.read()
            if raw is grpc.aio.EOF or stream.ended.done():
                # Ended (evicted, or its job reset) while this read was under way: what it read
                # belongs to a membership that is gone and must not reach the table.
                return
            self._metrics.received_bytes.inc(len(raw))
            stream.member.last_seen = time.monotonic()
            if len(raw) > limit:
                message = (
                    f"sent a message of {len(raw)} bytes, above the --max-message-mib limit of {limit} bytes"
                )
                stream.end((Status.RESOURCE_EXHAUSTED, message))
                return
            try:
                if self._dispatch(stream, codec.decode_worker_message(raw, self._limits)):
                    return
            except GradServerError as exc:
                log.info("rejected message: %s", exc.message, extra={"worker_id": w, "step": exc.step})
                key = codec.chunk_key(raw) if exc.key is not None else None
                # A refusal names its sender: the stream's member, when the message names none.
                message = exc.message if exc.message.startswith("worker ") else f"worker {w}: {exc.message}"
                self.send_error(stream, exc.code, message, exc.step or 0, key)

    def _dispatch(self, stream: WorkerStream, event: object) -> bool:
        """Answers what concerns the stream itself (goodbye, heartbeat, a step past the job's
        final one is refused) and passes the rest on; True when the worker announced that it
        leaves."""
        w = stream.member.worker_id
        if isinstance(event, LeaveIn):
            log.info("worker %d is leaving: %s", w, event.reason or "no reason given", extra={"worker_id": w})
            stream.said_goodbye = True
            return True
        if isinstance(event, StepFailureIn):
            # It names no sender: the stream's member sent it.
            self._handle(stream, dataclasses.replace(event, worker_id=w))
            return False
        if isinstance(event, PeerPiece):
            self._handle(stream, event)  # from the stream's member, for the worker it names
            return False
        assert isinstance(event, HeartbeatIn | ChunkIn | BarrierIn | SampleRangeRequestIn | StartAtIn)
        if event.worker_id != w:
            raise FailedPreconditionError(
                f"message names worker {event.worker_id}, but this stream belongs to worker {w}",
                worker_id=event.worker_id,
            )
        if isinstance(event, HeartbeatIn):
            stream.send(codec.encode_server_event(HeartbeatAckOut(event.sequence)))
            return False
        if isinstance(event, ChunkIn | BarrierIn):
            step = event.key.step if isinstance(event, ChunkIn) else event.step
            refusal = self._refusal(step)
            if refusal is not None:
                key, name = (event.key, None) if isinstance(event, ChunkIn) else (None, event.name)
                self.send_error(stream, Status.FAILED_PRECONDITION, refusal, step, key, name)
                return False
        self._handle(stream, event)
        return False

    def after_written(self, worker_id: int, then: Callable[[], None]) -> None:
        """Calls `then` (on the loop) once `worker_id`'s stream has written everything queued for
        it so far; never, if that stream ends first."""
        stream = self.by_worker.get(worker_id)
        if stream is not None:
            stream.outbound.put_nowait(_Written(then))

    async def _write_loop(self, stream: WorkerStream) -> None:
        while True:
            item = await stream.outbound.get()
            if item is _STOP:
                return
            if isinstance(item, _Written):
                item.then()
                continue
            assert isinstance(item, bytes)
            try:
                await stream.context.write(item)
                self._metrics.sent_bytes.inc(len(item))
            except Exception as exc:  # noqa: BLE001 - any failed write (e.g. ExecuteBatchError) means the peer is gone
                log.info("writing to worker %d failed: %r", stream.member.worker_id, exc)
                # Wait for that cancellation, if it is one, so the worker is reported as having
                # cancelled its stream rather than as a failed write (both free its place); the
                # handler cancels this task when it comes.
                await asyncio.wait([stream.closed], timeout=_CANCEL_AFTER_FAILED_WRITE_S)
                stream.end(
                    (
                        Status.UNAVAILABLE,
                        f"writing to worker {stream.member.worker_id} failed: {exc!r}",
                    )
                )
                return
            finally:
                stream.outbound_bytes -= len(item)
                stream.write_progress = time.monotonic()
                self.wake_readers()

    def _over_budget(self, stream: WorkerStream) -> bool:
        held = self._buffered(stream.member.worker_id) + stream.outbound_bytes
        return held > self._config.max_inflight_bytes or self._held_back(stream.member.worker_id)
