"""GradientServer: the grpc.aio coordinator, a thin shell over two pure cores.

The cores decide, the shell carries out. `Job` (server/job.py) holds the job's lifecycle:
waiting for joins -> running -> finished | failed, with restarting while a lost worker's place
may be retaken within `--rejoin-timeout`; it answers events with effects (state changes, event
lines, the rejoin timer, a reset, stop). `ReductionTable` (server/reduction.py) answers every
contribution, barrier and loss with the messages to send (`Outgoing`).

The shell: the gRPC servicer (Join, Exchange, Probe and the calls features serve) behind one
error-mapping boundary, the stream loops (`streams`), the liveness tick (`liveness`), and
`_deliver`, which hands the table's messages to the transports' outboxes (`outbox`), encodes each
message once and queues the same bytes to each recipient. Finished and failed stop the
coordinator (exit 0 and 1 from the CLI).

It names no feature: the features (`features`) subscribe to its lifecycle events (`lifecycle`:
a join, the world complete, a stream opened, messages sent, a departure, a reset, a shutdown)
and borrow from it only what `lifecycle.Shell` lends them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2

from gradserver.common import codec
from gradserver.common.averaging import Averager
from gradserver.common.config import parse_address
from gradserver.common.cores import available_cores
from gradserver.common.errors import (
    GradServerError,
    Status,
)
from gradserver.common.messages import (
    BarrierIn,
    ChunkIn,
    PeerPiece,
    SampleRangeRequestIn,
    ShutdownOut,
    StartAtIn,
    StepFailureIn,
)
from gradserver.common.rpc import SERVICE_NAME, to_grpc

from . import join
from .auth import client_identity, peer_host, stream_member
from .binding import bind_port, grpc_server, publish_endpoints
from .chunk_size import ChunkChoice, choose_chunk
from .config import CoordinatorConfig
from .events import EventLog
from .features import assemble
from .job import (
    ArmTimer,
    CancelTimer,
    Job,
    JobEffect,
    JobState,
    ResetJob,
    StateChanged,
    Stop,
    WriteEvent,
)
from .lifecycle import Departure, Lifecycle, Shell
from .liveness import Monitor, Timer
from .membership import Member, Membership
from .metrics import CoordinatorMetrics, Traffic
from .outbox import Outboxes
from .outgoing import Outgoing
from .reducer import Reducer, Result
from .reduction import Reduce, ReductionTable
from .streams import Streams, WorkerStream

__all__ = ["GradientServer", "JobState"]

log = logging.getLogger("gradserver.server")
T = TypeVar("T")
_MONITOR_RESTARTS = 5  # consecutive monitor failures before the job fails loudly


def _auto_reduce_threads() -> int:
    """Half the cores, 1 to 8: the other half copies the averages out on the workers' side (on
    2 cores, splitting over both made a two-worker shared-memory step slower: 0.19 s -> 0.25 s)."""
    return max(1, min(8, available_cores() // 2))


def _auto_in_place_threads() -> int:
    """Every core, 1 to 8, for an average written over its contributors' own memory: they copy
    nothing out and wait for it (four workers on 2 cores: ~0.37 s -> ~0.31 s per step)."""
    return max(1, min(8, available_cores()))


def _new_table(
    config: CoordinatorConfig,
    metrics: CoordinatorMetrics,
    lifecycle: Lifecycle,
    averager: Averager,
    chunk_bytes: int,
) -> ReductionTable:
    """A fresh job's reduction table, with what the features put into it (`TableParts`)."""
    return ReductionTable(
        config.world_size,
        chunk_bytes // 4,
        config.step_timeout,
        on_key_reduced=metrics.reduce_latency.observe,
        on_barrier_released=metrics.barrier_wait.observe,
        on_worker_loss=config.on_worker_loss,
        averager=averager,
        defer_reductions=True,  # averaged by the `Reducer`, off the event loop
        **lifecycle.table_parts(),
    )


def _new_job(config: CoordinatorConfig) -> Job:
    return Job(
        config.world_size,
        rejoin_timeout=config.rejoin_timeout,
        heartbeat_timeout=config.heartbeat_timeout,
        max_steps=config.max_steps,
        on_worker_loss=config.on_worker_loss,
    )


def _report_state_change(change: StateChanged, metrics: CoordinatorMetrics) -> None:
    metrics.job_state.state(change.new.value)
    if change.new is JobState.FAILED:
        log.error("job failed: %s", change.why)
    else:
        log.info("job %s -> %s: %s", change.old.value, change.new.value, change.why)


class GradientServer:
    """The coordinator. `await start()` binds (port 0 picks one), `await stop()` drains and ends.

    Usable as `async with GradientServer(CoordinatorConfig(world_size=2, bind="127.0.0.1:0")) as s`.
    `state` is the job's state; `exit_code` is 1 once the job failed, else 0.
    """

    def __init__(self, config: CoordinatorConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = CoordinatorConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.session_id = secrets.randbits(64)
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._membership = Membership(config.world_size, config.join_timeout, self.session_id)
        self.metrics = CoordinatorMetrics(config.world_size)
        self._averager = Averager(
            config.reduce_threads or _auto_reduce_threads(),
            in_place_threads=config.reduce_threads or _auto_in_place_threads(),
        )
        # The job's chunk size: fixed by the configuration, or chosen as its world completes
        # (`_choose_chunk`); until then buffers and the table are sized for the largest it can be.
        self._chunk: ChunkChoice | None = None
        self._lifecycle = Lifecycle()
        self._job = _new_job(config)
        self._streams = Streams(
            config,
            self.metrics,
            handle=self._handle,
            refusal=self._job.refusal,
            buffered=lambda w: self._table.buffered_bytes(w),  # noqa: PLW0108 - a reset replaces the table
            stopping=lambda: self._stopping is not None,
            ended=self._stream_ended,
            opened=self._lifecycle.stream_opened,
            held_back=self._lifecycle.holding_back,
        )
        self._outboxes = Outboxes(self._streams, self.metrics)
        shell = Shell(
            config,
            self.metrics,
            self._averager,
            authenticate=self._membership.authenticate,
            deliver=self._deliver,
            add_outbox=self._outboxes.add,
            after_written=self._streams.after_written,
            streaming_workers=lambda: self._streams.by_worker,
            table=lambda: self._table,
            chunk_bytes=lambda: self.chunk_bytes,
            resume_step=self._membership.resume_step,
            cores=available_cores(),
        )
        # By name, what each feature's `subscribe` returned (for tests and inspection).
        self.features = assemble(self._lifecycle, shell)
        self._new_table = functools.partial(_new_table, config, self.metrics, self._lifecycle, self._averager)
        self._table = self._new_table(self.chunk_bytes)
        self._reducer = Reducer(self._averager, self._reduced, self._lifecycle.average_on_loop)
        watched = (self._job, self._membership, self._streams)
        interval = min(1.0, config.heartbeat_timeout / 4)
        expire = lambda: self._deliver(self._table.expire())  # noqa: E731 - a reset replaces the table
        self._monitor = Monitor(interval, watched, self._evict, expire, self._monitor_failed)
        self._stopping: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self.events = EventLog(config.events_file)
        self._rejoin_timer = Timer()
        self.metrics.job_state.state(self.state.value)
        self.port = 0

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def state(self) -> JobState:
        return self._job.state

    @property
    def address(self) -> str:
        return f"{parse_address(self.config.bind)[0]}:{self.port}"

    @property
    def chunk_bytes(self) -> int:
        """The current job's chunk size (JoinAccepted.chunk_bytes); before its world is complete,
        the largest it can be."""
        return self._chunk.chunk_bytes if self._chunk is not None else self.config.chunk_bytes

    @property
    def exit_code(self) -> int:
        return 1 if self.state is JobState.FAILED else 0

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port. A bound address raises
        `AddressInUseError` (ports are exclusive: no SO_REUSEPORT)."""
        cfg = self.config
        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(self._join),
            "Exchange": grpc.stream_stream_rpc_method_handler(self._exchange),
            "Probe": grpc.unary_unary_rpc_method_handler(self._probe),
        }
        for method, call in self._lifecycle.calls.items():
            handlers[method] = grpc.unary_unary_rpc_method_handler(functools.partial(self._call, call))
        server = grpc_server(cfg, handlers, self._health, self.metrics)
        self.port = bind_port(server, cfg)
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        await self._lifecycle.start()
        # Where its leftovers would be, for a supervisor that has to SIGKILL it.
        self.events.write("serving", port=self.port, shm_socket=self._outboxes.offer().get("shm_socket", ""))
        self._monitor.start()
        publish_endpoints(cfg, self.metrics, self.port)
        facts = (self.address, cfg.world_size, self.session_id, self.state.value)
        log.info("coordinator listening on %s for %d worker(s), session %#x; job %s", *facts)
        return self.port

    async def stop(self, reason: str = "coordinator stopped") -> None:
        """Graceful shutdown: NOT_SERVING, workers told, steps in flight drained (bounded by
        drain_timeout) or failed, streams closed. Safe to call more than once."""
        self.request_stop(reason)
        assert self._stopping is not None
        await asyncio.shield(self._stopping)

    def traffic(self, worker_id: int) -> Traffic:
        """Payload bytes read from and written to `worker_id` so far (inline and shared memory
        together, the collective lane's included; headers not counted)."""
        self._lifecycle.counting()  # e.g. what the workers counted of their lane's peer rounds
        return self.metrics.traffic(worker_id)

    def pending_steps(self) -> set[int]:
        """Steps with a key or barrier waiting for contributions (read on the server's loop)."""
        return self._table.pending_steps()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> GradientServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def request_stop(self, reason: str) -> None:
        """Starts a graceful shutdown from a signal handler or callback without awaiting it."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._shutdown(reason))
            self._apply(self._job.stop())
            refusal = self._job.join_refusal()
            if refusal is not None:  # a Join still waiting for the world is answered at once
                self._membership.refuse_waiting(refusal)

    async def _shutdown(self, reason: str) -> None:
        log.info("shutting down: %s", reason)
        await self._health.enter_graceful_shutdown()
        self._streams.broadcast(codec.encode_server_event(ShutdownOut(reason)))
        self._lifecycle.stopping(reason)
        deadline = asyncio.get_running_loop().time() + self.config.drain_timeout
        await self._streams.drain(lambda: self._table.has_pending(), deadline)  # noqa: PLW0108 - a reset replaces the table
        self._deliver(self._table.fail_all(Status.UNAVAILABLE, f"coordinator {reason}"))
        await self._streams.end_all(deadline)
        self._monitor.stop()
        await self._reducer.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self._lifecycle.close()
        self.metrics.close()
        self.events.close()
        self._stopped.set()
        log.info("coordinator stopped")

    # --- the effect dispatcher ----------------------------------------------------------------

    def _apply(self, effects: list[JobEffect]) -> None:
        for effect in effects:
            if isinstance(effect, StateChanged):
                _report_state_change(effect, self.metrics)
            elif isinstance(effect, WriteEvent):
                self.events.write(effect.name, **dict(effect.fields))
            elif isinstance(effect, ArmTimer):
                self._rejoin_timer.arm(effect.delay, lambda: self._apply(self._job.time_passed()))
            elif isinstance(effect, CancelTimer):
                self._rejoin_timer.cancel()
            elif isinstance(effect, ResetJob):
                self._chunk = None  # the next job's world chooses the chunk size again
                self._lifecycle.reset()  # before the new table: features put fresh parts into it
                self._table = self._new_table(self.chunk_bytes)
                self.metrics.new_table()
                log.info("job state reset: the next joiners start with ids from 0 and fresh steps")
            elif isinstance(effect, Stop):
                self.request_stop(effect.reason)

    def _deliver(self, outgoing: list[Outgoing]) -> None:
        self._lifecycle.sent(outgoing)
        self._outboxes.deliver(outgoing)
        # A replica whose state digest differs from the others' is never averaged with again.
        for worker_id, reason in self._table.take_diverged():
            diverged = self._membership.get(worker_id)
            if diverged is not None:
                self._evict(diverged, reason)
        for request in self._table.take_reductions():
            self._reducer.submit(self._table, request)
        self.metrics.count_table(self._table.steps_completed, self._table.keys_reduced)
        if self._job.steps_completed(self._table.last_completed_step):
            log.info("reached --max-steps %d at step %s", self.config.max_steps, self._job.final_step)
        self._streams.progress.set()

    def _reduced(self, table: ReductionTable, request: Reduce, result: Result) -> list[Outgoing]:
        sent = table.reduced(request, *result) if table is self._table else []  # else: a reset
        self._deliver(sent)
        return sent

    def _worker_gone(self, member: Member, reason: str, *, lost: bool) -> None:
        worker_id = member.worker_id
        self.metrics.workers_joined.set(self._membership.joined)
        if lost:
            self.metrics.workers_lost.inc()
        # Before the others are told (below), so a supervisor finds it when they exit.
        step = min(self._table.pending_steps(), default=None)
        if step is None:
            step = self._lifecycle.step_in_flight()
        self._apply(self._job.worker_left(worker_id, reason, lost=lost, node=member.node_id, step=step))
        self._lifecycle.departed(Departure(worker_id, reason, lost))
        self._deliver(self._table.worker_lost(worker_id, reason))
        members = self._membership.members()
        waiting = sum(1 for m in members if not self._took_part(m))
        self._apply(self._job.after_departure(lost=lost, members_left=len(members), waiting_left=waiting))

    def _took_part(self, member: Member) -> bool:
        """Whether `member` took part in a completed step of this job: a replacement whose Join
        or heal is still under way has not (its first step is past every completed one)."""
        last = self._table.last_completed_step
        return member.streaming and last is not None and self._table.first_step(member.worker_id) <= last

    # --- the servicer -------------------------------------------------------------------------

    async def _refusing(self, context: grpc.aio.ServicerContext[Any, Any], work: Awaitable[T]) -> T:
        """The one error boundary of the handlers: a refusal is counted and ends the call with
        its status code and message."""
        try:
            return await work
        except GradServerError as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(to_grpc(exc.code), exc.message)
            raise  # unreachable: abort raises

    async def _join(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        try:
            member = await self._refusing(context, self._admit(raw, context))
        finally:
            self.metrics.workers_joined.set(self._membership.joined)
        if self._chunk is None:
            self._lifecycle.world_complete(self._membership.members())
            self._choose_chunk()
        self._table.worker_joined(member.worker_id)
        self._apply(self._job.world_complete())
        offers = self._outboxes.offer() | self._lifecycle.joined(member, self._membership.members())
        return join.accepted(member, self._membership, self.config, self.session_id, self.chunk_bytes, offers)

    def _choose_chunk(self) -> None:
        """The job's chunk size, chosen once its world is complete (the first Join to return
        comes here before any returns) from where its members joined from, and everything sized
        by it: the reduction table (still untouched: no stream opens before the world is
        complete), the streams' chunk checks and the output arena's slots."""
        members = self._membership.members()
        inputs = self._lifecycle.chunk_inputs({m.worker_id: m.link_bytes_per_s for m in members}, members)
        choice = choose_chunk(
            self.config,
            [m.host for m in members],
            shared_memory=inputs.shared_memory,
            link_rates=[inputs.link_rates[m.worker_id] for m in members],
            item_sizes=[m.wire_item_size for m in members],
            brought=[m.job_chunk_bytes for m in members],
        )
        self._chunk = choice
        if self._table.chunk_elements != choice.chunk_bytes // 4:
            self._table = self._new_table(choice.chunk_bytes)
        resume = self._membership.resume_step()
        if resume is not None:
            self._table.resumes_at(resume)
        self._streams.chunk_elements = choice.chunk_bytes // 4
        self._lifecycle.chunk_chosen(choice.chunk_bytes)
        log.info("chunk size %g MiB: %s", choice.chunk_bytes / 2**20, choice.why)

    async def _admit(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Member:
        request = codec.decode_join_request(raw)
        join.check_request(request, self._job)
        self._lifecycle.check_join(request)
        identity = client_identity(context, self.config.tls_client_ca)
        return await self._membership.join(request, identity, peer_host(context.peer()))

    async def _probe(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """A worker timing its link before Join: answered at once, once its payload arrived."""
        await self._refusing(context, _probed(raw))
        return b""

    async def _call(
        self, call: Callable[[bytes], list[Outgoing]], raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """A unary call a feature serves (NotifyPartition): what it answers goes out."""
        await self._refusing(context, self._called(call, raw))
        return b""

    async def _called(self, call: Callable[[bytes], list[Outgoing]], raw: bytes) -> None:
        self._deliver(call(raw))

    async def _exchange(self, _: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        async def admit() -> Member:
            return self._streams.admit(stream_member(context, self._membership, self.config.tls_client_ca))

        member = await self._refusing(context, admit())
        await self._streams.serve(member, context)

    def _handle(
        self,
        stream: WorkerStream,
        event: ChunkIn | BarrierIn | SampleRangeRequestIn | StepFailureIn | PeerPiece | StartAtIn,
    ) -> None:
        """Hands one contribution, barrier arrival, request, host group's report or later first
        step to the table, and any other event to the feature that handles its kind."""
        if isinstance(event, ChunkIn):
            chunk = self._outboxes.resolve(event, stream.member)
            self.metrics.payload_received(chunk.worker_id, len(chunk.data))
            self._deliver(self._table.contribute(chunk, borrowed=event.shm is not None))
        elif isinstance(event, BarrierIn):
            self._deliver(self._table.barrier(event))
        elif isinstance(event, StepFailureIn):
            self._deliver(self._table.step_failure_reported(event))
        elif isinstance(event, StartAtIn):
            self._deliver(self._table.start_at(event))
        elif isinstance(event, SampleRangeRequestIn):
            self._deliver(self._table.sample_ranges(event))
        else:
            handler = self._lifecycle.message_handler(type(event))
            assert handler is not None, f"no feature takes {type(event).__name__}"
            handler(stream.member, event)

    def _stream_ended(self, stream: WorkerStream, why: str, expected: bool) -> None:
        if self._membership.remove(stream.member, why, expected=expected):
            self._worker_gone(stream.member, why, lost=not expected)

    # --- liveness -------------------------------------------------------------------------------

    def _monitor_failed(self, failures: int, error: BaseException) -> None:
        self._apply(self._job.monitor_failed(failures, _MONITOR_RESTARTS, repr(error)))

    def _evict(self, member: Member, reason: str) -> None:
        if not self._membership.remove(member, reason):
            return
        self._worker_gone(member, reason, lost=True)
        stream = self._streams.by_worker.get(member.worker_id)
        if stream is not None:
            stream.end((Status.FAILED_PRECONDITION, f"worker {member.worker_id} evicted: {reason}"))


async def _probed(raw: bytes) -> None:
    """Checks a link probe (the error boundary takes awaitables)."""
    codec.decode_link_probe(raw)
