"""The worker's side of one Exchange stream: a sender queue, a receiver thread, a heartbeat.

Sends go through a bounded queue that gRPC drains into the stream, so a coordinator applying
back-pressure makes `send` wait (with a deadline) instead of buffering the model in memory. A
receiver thread reads every message as it arrives and assembles averaged chunks straight into
the result arrays, so a worker may send all its keys before reading any result without blocking
the coordinator. Waits are bounded by the `Timeouts` value; a broken stream or a failed step wakes
every waiter with the error that explains it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from gradserver.common import codec
from gradserver.common.chunking import chunk_count
from gradserver.common.errors import (
    CoordinatorShutdownError,
    DeadlineExceededError,
    GradServerError,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
    error_from_status,
    status_code_from_value,
)
from gradserver.common.messages import (
    AveragedChunkOut,
    BarrierReleaseOut,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    JoinAccepted,
    LeaveIn,
    SampleStats,
    ServerEvent,
    ShardAssignmentOut,
    ShutdownOut,
    TensorKey,
    WorkerEvent,
)
from gradserver.common.rpc import EXCHANGE_METHOD, stream_metadata
from gradserver.common.timeouts import Timeouts

log = logging.getLogger("gradserver.worker")

_END = object()
_FAILED_STEPS_KEPT = 64
_OUTBOUND_MESSAGES = 8


@dataclasses.dataclass
class PendingResult:
    """An average being assembled; `array` is filled chunk by chunk by the receiver thread."""

    key: TensorKey
    component_sizes: tuple[int, ...]
    array: np.ndarray
    num_chunks: int
    offsets: set[int] = dataclasses.field(default_factory=set)
    num_contributors: int = 0
    stats: SampleStats | None = None
    error: GradServerError | None = None

    @property
    def done(self) -> bool:
        return len(self.offsets) == self.num_chunks


@dataclasses.dataclass
class _PendingBarrier:
    released: bool = False
    error: GradServerError | None = None


class ExchangeStream:
    def __init__(
        self,
        channel: grpc.Channel,
        accepted: JoinAccepted,
        timeouts: Timeouts,
        extra_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.accepted = accepted
        self.timeouts = timeouts
        self._cond = threading.Condition()
        self._outbound: queue.Queue[bytes | object] = queue.Queue(maxsize=_OUTBOUND_MESSAGES)
        self._results: dict[TensorKey, PendingResult] = {}
        self._barriers: dict[tuple[int, str], _PendingBarrier] = {}
        self._shards: collections.deque[ShardAssignmentOut | GradServerError] = collections.deque()
        self._failed_steps: collections.OrderedDict[int, GradServerError] = collections.OrderedDict()
        self._broken: GradServerError | None = None
        self._closing = False
        self.shutdown_reason: str | None = None
        self.last_ack = time.monotonic()
        self._stop_heartbeat = threading.Event()
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
        while True:
            item = self._outbound.get()
            if item is _END:
                return
            assert isinstance(item, bytes)
            yield item

    def send(self, event: WorkerEvent) -> None:
        """Queues one message; waits (bounded by timeouts.send) while the transport is full."""
        self.raise_if_broken()
        raw = codec.encode_worker_event(event)
        deadline = time.monotonic() + self.timeouts.send
        while True:
            try:
                self._outbound.put(raw, timeout=0.25)
                return
            except queue.Full:
                self.raise_if_broken()
                if time.monotonic() >= deadline:
                    raise DeadlineExceededError(
                        f"could not send within {self.timeouts.send:g} s: the coordinator is not "
                        "reading this worker's stream"
                    ) from None

    def raise_if_broken(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self.shutdown_reason is not None:
            raise CoordinatorShutdownError(f"the coordinator is shutting down: {self.shutdown_reason}")

    # --- registering what we wait for ---------------------------------------------------------

    def expect(self, key: TensorKey, component_sizes: tuple[int, ...], total: int) -> PendingResult:
        pending = PendingResult(
            key=key,
            component_sizes=component_sizes,
            array=np.empty(total, dtype=np.float32),
            num_chunks=chunk_count(total, self.accepted.chunk_bytes // 4),
        )
        with self._cond:
            if key in self._results:
                raise InvalidArgumentError(
                    f"{key} was already sent by this worker and is still awaiting its average",
                    step=key.step,
                    key=str(key),
                )
            failed = self._failed_steps.get(key.step)
            if failed is not None:
                pending.error = failed
            self._results[key] = pending
        return pending

    def forget(self, key: TensorKey) -> None:
        with self._cond:
            self._results.pop(key, None)

    def expect_barrier(self, step: int, name: str) -> _PendingBarrier:
        with self._cond:
            bar = self._barriers[(step, name)] = _PendingBarrier()
            failed = self._failed_steps.get(step)
            if failed is not None:
                bar.error = failed
            return bar

    def forget_barrier(self, step: int, name: str) -> None:
        with self._cond:
            self._barriers.pop((step, name), None)

    # --- waiting ------------------------------------------------------------------------------

    def _wait(
        self, ready: Callable[[], bool], timeout: float | None, what: str, step: int | None = None
    ) -> None:
        """Waits (holding the lock) until `ready()`; raises the stream's error or a timeout
        naming `what`."""
        limit = self.timeouts.receive if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not ready():
            if self._broken is not None:
                raise self._broken
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(f"{what} within {limit:g} s", step=step)
            self._cond.wait(remaining)

    def wait_result(self, key: TensorKey, timeout: float | None = None) -> PendingResult:
        """Blocks until the average of `key` is complete; raises its error or a timeout."""
        with self._cond:
            pending = self._results[key]
            self._wait(
                lambda: pending.done or pending.error is not None, timeout, f"no average for {key}", key.step
            )
            del self._results[key]
        if pending.error is not None:
            raise pending.error
        return pending

    def wait_barrier(self, step: int, name: str, bar: _PendingBarrier, timeout: float | None) -> None:
        with self._cond:
            try:
                self._wait(
                    lambda: bar.released or bar.error is not None,
                    timeout,
                    f"step {step} barrier {name!r} not released",
                    step,
                )
            finally:
                self._barriers.pop((step, name), None)
        if bar.error is not None:
            raise bar.error

    def wait_shard(self, timeout: float | None) -> ShardAssignmentOut:
        with self._cond:
            self._wait(lambda: bool(self._shards), timeout, "no shard assignment")
            item = self._shards.popleft()
        if isinstance(item, GradServerError):
            raise item
        return item

    # --- receiving ----------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        try:
            for raw in self._call:
                self._on_event(codec.decode_server_message(raw))
            reason = self.shutdown_reason or "the coordinator closed the stream"
            self._break(CoordinatorShutdownError(f"stream ended: {reason}"))
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if self._closing and code is grpc.StatusCode.CANCELLED:
                self._break(UnavailableError("the client was closed"))
            elif code is grpc.StatusCode.UNAVAILABLE:
                self._break(UnavailableError(f"lost the connection to the coordinator: {details}"))
            else:
                self._break(error_from_status(code, details))
        except GradServerError as exc:
            self._break(exc)
        except Exception as exc:
            log.exception("receiver thread failed")
            self._break(InternalError(f"receiver failed: {exc!r}"))

    def _break(self, error: GradServerError) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = error
            self._cond.notify_all()
        self._stop_heartbeat.set()

    def _on_event(self, event: ServerEvent) -> None:
        if isinstance(event, AveragedChunkOut):
            self._on_chunk(event)
            return
        with self._cond:
            if isinstance(event, BarrierReleaseOut):
                bar = self._barriers.get((event.step, event.name))
                if bar is not None:
                    bar.released = True
            elif isinstance(event, ShardAssignmentOut):
                self._shards.append(event)
            elif isinstance(event, HeartbeatAckOut):
                self.last_ack = time.monotonic()
            elif isinstance(event, ShutdownOut):
                self.shutdown_reason = event.reason or "no reason given"
                log.info("coordinator is shutting down: %s", self.shutdown_reason)
            elif isinstance(event, ErrorOut):
                self._on_error(event)
            self._cond.notify_all()

    def _on_chunk(self, event: AveragedChunkOut) -> None:
        with self._cond:
            pending = self._results.get(event.key)
        if pending is None or pending.error is not None:
            return  # a key this worker gave up on (timeout, failed step): nothing to fill
        length = len(event.data) // 4
        end = event.offset + length
        error: GradServerError | None = None
        if (
            event.header.total_elements != pending.array.size
            or event.header.component_sizes != pending.component_sizes
            or end > pending.array.size
        ):
            error = InternalError(
                f"coordinator sent an average for {event.key} that does not match what this "
                f"worker sent ({event.header.total_elements} elements at offset {event.offset})"
            )
        else:
            pending.array[event.offset : end] = np.frombuffer(event.data, dtype="<f4")
        with self._cond:
            if error is not None:
                pending.error = error
            else:
                pending.offsets.add(event.offset)
                pending.num_contributors = event.num_contributors
                pending.stats = event.stats
            if pending.done or pending.error is not None:
                self._cond.notify_all()

    def _on_error(self, event: ErrorOut) -> None:
        """Routes an in-stream error to what it is about (called with the lock held)."""
        error = error_from_status(
            status_code_from_value(event.code),
            event.message,
            step=event.step,
            key=str(event.key) if event.key is not None else None,
            worker_id=event.culprit_worker_id,
        )
        log.warning("coordinator: %s", error)
        if event.step_failed:
            self._failed_steps[event.step] = error
            while len(self._failed_steps) > _FAILED_STEPS_KEPT:
                self._failed_steps.popitem(last=False)
            for pending in self._results.values():
                if pending.key.step == event.step and not pending.done:
                    pending.error = error
            for (step, _name), bar in self._barriers.items():
                if step == event.step:
                    bar.error = error
        elif event.key is not None:
            target = self._results.get(event.key)
            if target is not None and not target.done:
                target.error = error
        elif event.barrier_name is not None:
            refused = self._barriers.get((event.step, event.barrier_name))
            if refused is not None:
                refused.error = error
        elif event.shard_step is not None:
            self._shards.append(error)
        else:
            # A message the coordinator could not attribute (malformed): nothing waiting can
            # trust the stream's ordering any more.
            for pending in self._results.values():
                if not pending.done:
                    pending.error = error

    # --- heartbeat and close ------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        interval = max(0.05, self.accepted.heartbeat_interval_s)
        sequence = 0
        while not self._stop_heartbeat.wait(interval):
            sequence += 1
            raw = codec.encode_worker_event(HeartbeatIn(self.accepted.worker_id, sequence))
            # A full queue means chunks are flowing or the coordinator is holding this worker
            # back on purpose; either way a heartbeat would add nothing.
            with contextlib.suppress(queue.Full):
                self._outbound.put_nowait(raw)

    def close(self) -> None:
        """Says goodbye, half-closes the stream and waits (bounded) for the coordinator's end."""
        if self._closing:
            return
        self._closing = True
        self._stop_heartbeat.set()
        if self._broken is None:
            try:
                self._outbound.put(
                    codec.encode_worker_event(LeaveIn("worker closed")), timeout=self.timeouts.close
                )
                self._outbound.put(_END, timeout=self.timeouts.close)
            except queue.Full:
                pass
        self._receiver.join(self.timeouts.close)
        if self._receiver.is_alive():
            self._call.cancel()
            self._receiver.join(self.timeouts.close)
        self._break(UnavailableError("the client was closed"))
