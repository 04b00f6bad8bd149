"""`GrpcLink`: the worker's side of one Exchange stream (a sender queue, a receiver thread, a
heartbeat), every payload inline in gRPC messages.

Sends go through a bounded queue that gRPC drains into the stream, so a coordinator applying
back-pressure makes `send` wait (with a deadline) instead of buffering the model in memory. A
receiver thread reads every message as it arrives and assembles averaged chunks straight into
the result arrays, so a worker may send all its keys before reading any result without blocking
the coordinator. Waits are bounded by the `Timeouts` value; a broken stream or a failed step wakes
every waiter with the error that explains it.

Errors are kept as `ErrorRecord`s (what was said), never as exception objects: an exception raised
again from storage grows its traceback on every raise, and the frames in it keep the gradient
arrays of the failed calls alive. Each call that reports a stored error raises a fresh exception.
Closing or breaking the stream always ends the request iterator, so gRPC's sending thread and the
stream's arrays do not outlive it.

Chunks to be reduced (gradients, REDUCE collectives) are paced: a worker keeps at most a window
of them on the stream whose averages have not come back (`_pace`). A coordinator averages a chunk
only once every worker's copy is in, so without it a worker whose TCP flow runs ahead on a shared
link fills the queues with chunks that cannot be averaged yet while the averages' direction
idles; with it every worker's flow moves at the pace of the averages, and the links' queues stay
short, so a step ends soon after its last chunk is sent (docs/PERFORMANCE.md, "Across machines: pacing").

Other transports that keep gRPC for control (`ShmLink`) subclass it and override the few hooks
that say how a chunk travels and what a result, an error or a lost connection frees.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from gradserver.common import codec
from gradserver.common.chunking import chunk_count
from gradserver.common.collective_rules import result_in_pieces
from gradserver.common.errors import (
    CoordinatorShutdownError,
    DeadlineExceededError,
    GradServerError,
    InternalError,
    InvalidArgumentError,
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

from ..tensors import same_memory
from .base import ErrorRecord, PeerSink, PendingResult, error_of, payload_values
from .lane import LaneClient

log = logging.getLogger("gradserver.worker")

_FAILED_STEPS_KEPT = 64
_OUTBOUND_MESSAGES = 8
# Pacing (see `GrpcLink._pace`): chunks to be reduced (gradients, allreduces) a worker may
# have on one stream without their answers. Four keep a remote link busy across the pipeline
# (bench.cluster: 2 left the partitions on their own hosts short of data, 8 let the links' queues
# and the skew between workers grow); how long a sender waits with no answer at all before it
# sends anyway.
_PACING_WINDOW_CHUNKS = 4
_PACING_PATIENCE_S = 0.25


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


@dataclasses.dataclass
class _PendingBarrier:
    released: bool = False
    error: ErrorRecord | None = None


class GrpcLink:
    """A `Link` whose chunks and averages travel inside gRPC messages."""

    transport = "grpc"

    def __init__(
        self,
        channel: grpc.Channel,
        accepted: JoinAccepted,
        timeouts: Timeouts,
        extra_metadata: tuple[tuple[str, str], ...] = (),
        *,
        cond: threading.Condition | None = None,
        on_break: Callable[[ErrorRecord], None] | None = None,
    ) -> None:
        """Opens the Exchange stream on `channel` (which the link owns and closes). Partitioned
        coordinators (`PartitionedLink`) give every partition's link one shared `cond`, so a waiter
        wakes on any partition's news, and `on_break`, called once when this link breaks (not
        when it is closed), so the other partitions' links break too."""
        self._channel = channel
        self.accepted = accepted
        self.timeouts = timeouts
        self._cond = cond if cond is not None else threading.Condition()
        self._on_break = on_break
        self._outbound = _Outbound(_OUTBOUND_MESSAGES)
        self._results: dict[TensorKey, PendingResult] = {}
        # Pacing: elements of chunks to be reduced sent on this stream whose answers have not
        # come back, per key (see `_pace`).
        self._window = self._pacing_window()
        self._unanswered: dict[TensorKey, int] = {}
        self._answers = 0
        self._unpaced_at = -1
        self._barriers: dict[tuple[int, str], _PendingBarrier] = {}
        # Answers to sample-range requests (SampleRangeAssignment messages), in the order asked.
        self._samples: collections.deque[SampleRangeAssignmentOut | ErrorRecord] = collections.deque()
        self._failed_steps: collections.OrderedDict[int, ErrorRecord] = collections.OrderedDict()
        self._broken: ErrorRecord | None = None
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

    def lane(self) -> LaneClient | None:
        return None

    def observe(self, news: Callable[[ServerEvent], bool]) -> None:
        """Has `news` see, on the receiver thread, every average first (it returns True for one it
        took, which this link then only counts as answered), every error after this link handled
        it, and what it does not handle itself (a host group member left): the host group's link
        (`HostLink`) wraps this one. It must not block."""
        self._news = news

    def on_peer_messages(self, sink: PeerSink) -> None:
        self._peers = sink
        with self._cond:
            broken = self._broken
        if broken is not None:
            sink.link_broken(broken.exception())

    def allocate(self, num_elements: int) -> np.ndarray | None:
        """Inline payloads are copied into messages whatever array they come from."""
        return None

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        """Inline averages are copied out of their messages wherever they go."""
        return None

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
        # Paced: keys answered chunk for chunk (gradients, REDUCE collectives), which is what
        # the window counts; the other collective kinds are answered in pieces of their own.
        if self._window and not result_in_pieces(key):
            self._pace(key, piece.size)
        self.send(ChunkIn(self.accepted.worker_id, key, header, offset, piece.data, stats, covers=covers))

    def _pacing_window(self) -> int:
        """Elements of chunks to be reduced this worker may have on the way without their
        answers (0: unpaced)."""
        return _PACING_WINDOW_CHUNKS * (self.accepted.chunk_bytes // 4)

    def pace_as_one_of(self, members: int) -> None:
        """This stream is one of `members` that share one host's link and send a share each (a
        host group's): the window is shared too, so the host keeps as many chunks unanswered
        as one stream would (2 hosts x 4 ranks, 200 Mbit/s: 0.68x gloo's time with a window
        each, 0.60x with the window shared)."""
        chunk = self.accepted.chunk_bytes // 4
        self._window = max(chunk, self._pacing_window() // max(1, members) // chunk * chunk)

    def _pace(self, key: TensorKey, elements: int) -> None:
        """Waits while a window of chunks is unanswered, so every worker's share of a shared
        link stays even and the links' queues stay short; gives up waiting (until the next
        answer) when no answer came for a while, so workers sending keys in different orders
        never wait on each other."""
        with self._cond:
            seen = self._answers
            if self._unpaced_at != seen:
                patience_ends = time.monotonic() + _PACING_PATIENCE_S
                while self.unanswered_elements() >= self._window and self._broken is None:
                    now = time.monotonic()
                    if self._answers != seen:
                        seen, patience_ends = self._answers, now + _PACING_PATIENCE_S
                    if now >= patience_ends:
                        self._unpaced_at = seen
                        break
                    self._cond.wait(patience_ends - now)
            self._unanswered[key] = self._unanswered.get(key, 0) + elements

    def unanswered_elements(self) -> int:
        """Elements of paced chunks on this stream still without their answers (a few keys in
        flight at most)."""
        with self._cond:  # reentrant: `_pace` asks with it held
            return sum(self._unanswered.values())

    def _answered(self, key: TensorKey, elements: int | None) -> None:
        """`elements` of `key`'s chunks were answered (None: all of them). Lock held."""
        held = self._unanswered.get(key)
        if held is None:
            return
        done = held if elements is None else min(held, elements)
        if done == held:
            del self._unanswered[key]
        else:
            self._unanswered[key] = held - done
        self._answers += 1

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
        with self._cond:
            self._wait(lambda: self._acks > seen, timeout, "the coordinator did not answer on the new stream")

    def raise_if_broken(self) -> None:
        if self._broken is not None:
            raise self._broken.exception()
        if self.shutdown_reason is not None:
            raise CoordinatorShutdownError(f"the coordinator is shutting down: {self.shutdown_reason}")

    # --- registering what we wait for ---------------------------------------------------------

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
        """Registers `key`'s average, arriving in `dtype` (`total` elements, None when only the
        result says); `PartitionedLink` passes the `array` every partition fills and the
        `num_chunks` this partition owns."""
        sized = total is not None or array is not None
        length = (array.size if array is not None else total) or 0
        pending = PendingResult(
            key=key,
            component_sizes=component_sizes,
            array=_result_array(length, dtype) if array is None else array,
            num_chunks=chunk_count(length, self.accepted.chunk_bytes // 4)
            if num_chunks is None
            else num_chunks,
            dtype=dtype,
            by_elements=result_in_pieces(key),
            sized=sized,
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

    def forget(self, key: TensorKey) -> None:
        """Stops waiting for `key` (inline chunks hold nothing once sent)."""
        with self._cond:
            self._results.pop(key, None)
            self._answered(key, None)
            self._cond.notify_all()

    def awaiting(self, key: TensorKey) -> bool:
        """Whether `key` is still registered (a receive for it timed out locally and may retry)."""
        with self._cond:
            return key in self._results

    def step_failed(self, step: int) -> bool:
        with self._cond:
            return step in self._failed_steps

    def trouble(self, step: int) -> ErrorRecord | None:
        """Why nothing of `step` can complete on this stream (broken, or the step failed)."""
        with self._cond:
            return self._broken or self._failed_steps.get(step)

    def result_ready(self, key: TensorKey) -> bool:
        """Whether `wait_result(key)` would return or raise without waiting."""
        with self._cond:
            pending = self._results.get(key)
            return (
                pending is None
                or pending.done
                or pending.error is not None
                or self.trouble(key.step) is not None
            )

    def barrier(self, step: int, name: str, timeout: float | None, digest: int | None = None) -> None:
        bar = self._expect_barrier(step, name)
        try:
            self.send(BarrierIn(self.accepted.worker_id, step, name, digest))
        except BaseException:
            self._forget_barrier(step, name)
            raise
        self._wait_barrier(step, name, bar, timeout)

    def _expect_barrier(self, step: int, name: str) -> _PendingBarrier:
        with self._cond:
            bar = self._barriers[(step, name)] = _PendingBarrier()
            failed = self._failed_steps.get(step)
            if failed is not None:
                bar.error = failed
            return bar

    def _forget_barrier(self, step: int, name: str) -> None:
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
                raise self._broken.exception()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(f"{what} within {limit:g} s", step=step)
            self._cond.wait(remaining)

    def wait_result(self, key: TensorKey, timeout: float | None = None) -> PendingResult:
        """Blocks until the average of `key` is complete; raises its error, its step's failure or
        a timeout. After a local timeout `key` stays registered (see `awaiting`)."""
        with self._cond:
            pending = self._results[key]
            self._wait(
                lambda: pending.done or pending.error is not None or key.step in self._failed_steps,
                timeout,
                f"no average for {key}",
                key.step,
            )
            del self._results[key]
            self._answered(key, None)
            # An average that arrived before its step failed is void too: every worker drops the
            # whole step, so none applies part of it. The step's failure names the original
            # culprit, where a later refusal of this key would not.
            error = self._failed_steps.get(key.step) or pending.error
        if error is not None:
            raise error.exception()
        return pending

    def _wait_barrier(self, step: int, name: str, bar: _PendingBarrier, timeout: float | None) -> None:
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
            raise bar.error.exception()

    def wait_samples(self, timeout: float | None) -> SampleRangeAssignmentOut:
        with self._cond:
            self._wait(lambda: bool(self._samples), timeout, "no sample-range assignment")
            item = self._samples.popleft()
        if isinstance(item, ErrorRecord):
            raise item.exception()
        return item

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
                self._coordinator_lost()
                self._break(UnavailableError(f"lost the connection to the coordinator: {details}"))
            else:
                self._break(error_from_status(code, details))
        except GradServerError as exc:
            self._break(exc)
        except Exception as exc:
            log.exception("receiver thread failed")
            self._break(InternalError(f"receiver failed: {exc!r}"))

    def _coordinator_lost(self) -> None:
        """Hook: the connection to the coordinator is lost, before anyone hears of it."""

    def _break(self, error: GradServerError) -> None:
        with self._cond:
            first = self._broken is None
            if first:
                self._broken = ErrorRecord.of(error)
            broken = self._broken
            self._cond.notify_all()
        self._stop_heartbeat.set()
        # The call is over: end the request iterator so that gRPC's sending thread returns.
        self._outbound.abort()
        if first and not self._closing and self._on_break is not None and broken is not None:
            self._on_break(broken)
        if first and self._peers is not None and broken is not None:
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
            else:
                self._on_chunk(event)
            return
        with self._cond:
            if isinstance(event, BarrierReleaseOut):
                bar = self._barriers.get((event.step, event.name))
                if bar is not None:
                    bar.released = True
            elif isinstance(event, SampleRangeAssignmentOut):
                self._samples.append(event)
            elif isinstance(event, HeartbeatAckOut):
                self.last_ack = time.monotonic()
                self._acks += 1
            elif isinstance(event, ShutdownOut):
                self.shutdown_reason = event.reason or "no reason given"
                log.info("coordinator is shutting down: %s", self.shutdown_reason)
            elif isinstance(event, ErrorOut):
                self._on_error(event)
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
            if event.key in self._unanswered:
                self._answered(event.key, len(event.data) // ITEM_SIZE[event.header.dtype])
                self._cond.notify_all()

    def _on_chunk(self, event: AveragedChunkOut) -> None:
        """Hook: one averaged chunk arrived; fills its result."""
        if event.shm is not None:
            raise InternalError(
                f"coordinator sent {event.key} through shared memory this worker has not mapped"
            )
        self._fill(event, payload_values(event.data, event.header.dtype))

    def _fill(self, event: AveragedChunkOut, data: np.ndarray) -> None:
        with self._cond:
            pending = self._results.get(event.key)
            if pending is not None and not pending.sized and event.header.dtype == pending.dtype:
                # An ALL_TO_ALL result: its first piece says how long it is.
                pending.array = _result_array(event.header.total_elements, pending.dtype)
                pending.sized = True
        if pending is None or pending.error is not None:
            return  # a key this worker gave up on (timeout, failed step): nothing to fill
        length = data.size
        end = event.offset + length
        error: ErrorRecord | None = None
        if (
            event.header.total_elements != pending.array.size
            or event.header.component_sizes != pending.component_sizes
            or event.header.dtype != pending.dtype
            or end > pending.array.size
            or (pending.by_elements and event.offset in pending.offsets)
        ):
            error = ErrorRecord(
                InternalError,
                f"coordinator sent an average for {event.key} that does not match what this "
                f"worker sent ({event.header.total_elements} {event.header.dtype.name} elements at "
                f"offset {event.offset}; this worker expects {pending.array.size} "
                f"{pending.dtype.name} elements)",
                step=event.key.step,
                key=str(event.key),
            )
        else:
            target = pending.array[event.offset : end]
            # An average written over the very memory awaiting it (shared memory, `into=` the
            # buffer sent) is already in place.
            if not same_memory(target, data):
                target[...] = data
        with self._cond:
            if error is not None:
                pending.error = error
            else:
                pending.offsets.add(event.offset)
                pending.elements += length
                pending.num_contributors = event.num_contributors
                pending.stats = event.stats
            complete = pending.done
            paced = event.key in self._unanswered
            if paced:
                self._answered(event.key, length)
            if complete or pending.error is not None or paced:
                self._cond.notify_all()
        if complete and pending.by_elements:
            self._inputs_free(event.key)

    def _inputs_free(self, key: TensorKey) -> None:
        """Hook: a collective result other than REDUCE is complete, so the coordinator no longer
        reads this worker's contribution to it (docs/PROTOCOL.md, "When inputs are free")."""

    def _coordinator_dropped(self, event: ErrorOut) -> None:
        """Hook: the coordinator dropped what `event` names (a failed step or a refused key), so
        it holds nothing of it any more. Called with the lock held."""

    def _on_error(self, event: ErrorOut) -> None:
        """Routes an in-stream error to what it is about (called with the lock held)."""
        exc = error_of(event)
        log.warning("coordinator: %s", exc)
        error = ErrorRecord.of(exc)
        self._coordinator_dropped(event)
        if event.step_failed:
            # The first report says why the step failed and who caused it; later refusals of
            # this step's messages repeat it about their own key.
            error = self._failed_steps.setdefault(event.step, error)
            while len(self._failed_steps) > _FAILED_STEPS_KEPT:
                self._failed_steps.popitem(last=False)
            for pending in self._results.values():
                if pending.key.step == event.step and not pending.done:
                    pending.error = error
            for key in [k for k in self._unanswered if k.step == event.step]:
                self._answered(key, None)
            for (step, _name), bar in self._barriers.items():
                if step == event.step:
                    bar.error = error
        elif event.key is not None:
            target = self._results.get(event.key)
            if target is not None and not target.done and target.error is None:
                target.error = error
            self._answered(event.key, None)
        elif event.barrier_name is not None:
            refused = self._barriers.get((event.step, event.barrier_name))
            if refused is not None:
                refused.error = error
        elif event.sample_range_step is not None:
            self._samples.append(error)
        elif event.peer_message is not None:
            pass  # a refused point-to-point message: the mailbox hears of it (`_on_event`)
        elif event.start_at is not None:
            # A refused StartAt (WorkerClient.start_at checks the same rules first): it is about
            # no result, and the worker takes part from its plan's step as before; logged above.
            pass
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
            self._outbound.put(raw, timeout=0)

    def close(self) -> None:
        """Says goodbye, half-closes the stream and waits (bounded) for the coordinator's end.
        Whatever state the stream is in, the request iterator ends, the helper threads stop and
        the arrays registered on the stream are released."""
        if self._closing:
            return
        self._closing = True
        self._stop_heartbeat.set()
        if self._broken is None:
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
        with self._cond:
            self._results.clear()
            self._barriers.clear()
            self._samples.clear()


def _result_array(length: int, dtype: DType) -> np.ndarray:
    """A result of `length` elements arriving in `dtype`: bytes stay bytes, floats are float32."""
    return np.empty(length, dtype=np.uint8 if dtype is DType.BYTES else np.float32)
