"""GradientServer: the grpc.aio coordinator that averages every worker's gradients.

Data flow: a worker calls Join (waits for the whole world), then opens one Exchange stream. A
reader task per stream decodes messages and feeds the `ReductionTable`; whatever the table
answers is encoded once and queued to each recipient's writer task, so every worker receives the
same bytes. A monitor task evicts workers whose messages stop (heartbeat timeout) and fails steps
past their deadline. A reader stops reading while its worker's unreduced contributions plus its
unsent results exceed the in-flight budget, which turns into HTTP/2 back-pressure on that worker:
the coordinator's memory is bounded by chunks in flight, not by the model. A paused stream
whose writes make no progress for the heartbeat timeout counts as lost, and server keepalive
pings catch a stopped worker even while nothing is read from it (within 2.5 heartbeat timeouts).

The job is a small state machine (docs/RELIABILITY.md): waiting for joins -> running ->
finished | failed, with restarting while a lost worker's place may be retaken within
`--rejoin-timeout`. Finished and failed stop the coordinator (exit 0 and 1 from the CLI); a job
whose workers all left cleanly without `--max-steps` makes way for a fresh job.

Beside it: `auth` (the token interceptor), `binding` (plain/TLS port, exclusive bind, port file),
`streams` (one worker's outbound queue and write progress), `membership` (join and member
tokens), `reduction` (the table), `metrics` and `peers` (sharded coordinators: --shard-map).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradserver.common import codec
from gradserver.common import shm as shm_support
from gradserver.common.config import parse_address
from gradserver.common.errors import (
    FailedPreconditionError,
    GradServerError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnavailableError,
    status_code_from_value,
)
from gradserver.common.messages import (
    AveragedChunkOut,
    BarrierIn,
    ChunkIn,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    JoinAccepted,
    LeaveIn,
    ShardRequestIn,
    ShutdownOut,
    TensorKey,
    WorkerEvent,
)
from gradserver.common.rpc import (
    META_MEMBER_TOKEN,
    META_SESSION_ID,
    META_WORKER_ID,
    SERVICE_NAME,
    server_options,
)
from gradserver.common.security import peer_identity

from .auth import TokenInterceptor, peer_host
from .binding import bind_port, write_port_file
from .config import CoordinatorConfig
from .events import EventLog
from .membership import Member, Membership
from .metrics import CoordinatorMetrics
from .outgoing import Outgoing
from .peers import ShardRole
from .reduction import ReductionTable
from .shm import ShmHub
from .streams import WorkerStream

log = logging.getLogger("gradserver.server")

_STOP = object()
_MONITOR_RESTARTS = 5  # consecutive monitor failures before the job fails loudly
# A client's cancel fails a pending write a moment before the cancellation reaches the handler.
_CANCEL_AFTER_FAILED_WRITE_S = 1.0


def _auto_reduce_threads() -> int:
    """Half the cores, 1 to 8: the other half copies the averages out on the workers' side (on
    2 cores, splitting over both made a two-worker shared-memory step slower: 0.19 s -> 0.25 s)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


class JobState(enum.Enum):
    """Where the coordinator's job is (docs/RELIABILITY.md draws the transitions)."""

    WAITING = "waiting"  # for the world to join
    RUNNING = "running"
    RESTARTING = "restarting"  # a lost worker's place may be retaken until --rejoin-timeout
    FINISHED = "finished"
    FAILED = "failed"


class GradientServer:
    """The coordinator. `await start()` binds (port 0 picks one), `await stop()` drains and ends.

    Usable as `async with GradientServer(CoordinatorConfig(world_size=2, bind="127.0.0.1:0")) as s`.
    `state` is the job's state; `exit_code` is 1 once the job failed, else 0.
    """

    def __init__(self, config: CoordinatorConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = CoordinatorConfig(**overrides)
        elif overrides:
            import dataclasses

            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.session_id = secrets.randbits(64)
        self._limits = codec.WireLimits(
            chunk_elements=config.chunk_bytes // 4, max_tensor_elements=config.max_tensor_elements
        )
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._membership: Membership | None = None
        self.metrics = CoordinatorMetrics(config.world_size)
        shards = config.shards
        # Sharded coordinators (--shard-map): this process averages only its shard's chunks.
        self._shard = ShardRole(shards, config.shard_index, config) if shards is not None else None
        self.shm: ShmHub | None = None  # the same-host fast path, when offered
        self._table = self._new_table()
        self._counted = (0, 0)  # steps and keys of this job already added to the metrics
        self._streams: dict[int, WorkerStream] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._monitor_failures = 0
        self._stopping: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._progress = asyncio.Event()  # set whenever the reduction table answers or a stream closes
        self._final_step: int | None = config.max_steps - 1 if config.max_steps else None
        self.state = JobState.WAITING
        self.failure: str | None = None
        self._departures: list[str] = []  # why each worker of this job left, for the failure line
        self.events = EventLog(config.events_file)
        self._had_loss = False
        self._limit_logged = False
        self._rejoin_timer: asyncio.TimerHandle | None = None
        self.metrics.job_state.state(self.state.value)
        self.port = 0

    def _new_table(self) -> ReductionTable:
        table = ReductionTable(
            self.config.world_size,
            self.config.chunk_bytes // 4,
            self.config.step_timeout,
            on_key_reduced=self.metrics.reduce_latency.observe,
            on_barrier_released=self.metrics.barrier_wait.observe,
            on_worker_loss=self.config.on_worker_loss,
            shard=(self._shard.shard_map, self._shard.own_index) if self._shard is not None else None,
            reduce_threads=self.config.reduce_threads or _auto_reduce_threads(),
        )
        table.output_buffers = self.shm
        return table

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        host, _ = parse_address(self.config.bind)
        return f"{host}:{self.port}"

    @property
    def exit_code(self) -> int:
        return 1 if self.state is JobState.FAILED else 0

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port. A bound address raises
        `AddressInUseError` (ports are exclusive: no SO_REUSEPORT)."""
        self._membership = Membership(self.config.world_size, self.config.join_timeout, self.session_id)
        interceptors = []
        if self.config.auth_token:
            interceptors.append(TokenInterceptor(self.config.auth_token, self._auth_refused))
        server = grpc.aio.server(
            options=server_options(self.config.max_message_bytes, self.config.heartbeat_timeout),
            interceptors=interceptors,
        )
        handler = grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Join": grpc.unary_unary_rpc_method_handler(self._join),
                "Exchange": grpc.stream_stream_rpc_method_handler(self._exchange),
                "NotifyShard": grpc.unary_unary_rpc_method_handler(self._notify_shard),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        self.port = bind_port(server, self.config)
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        await self._start_shm()
        # Where its leftovers would be, for a supervisor that has to SIGKILL it.
        self.events.write("serving", port=self.port, shm_socket=self.shm.path if self.shm is not None else "")
        self._start_monitor()
        if self._shard is not None:
            shard = self._shard
            shard.peers.watch(lambda index, why: self._deliver(shard.unreachable(index, why, self._table)))
        if self.config.metrics_port >= 0:
            host, _ = parse_address(self.config.bind)
            self.metrics.serve(host.strip("[]"), self.config.metrics_port)
        if self.config.port_file:
            write_port_file(self.config.port_file, self.port)
        log.info(
            "coordinator listening on %s for %d worker(s), session %#x; job %s",
            self.address,
            self.config.world_size,
            self.session_id,
            self.state.value,
        )
        return self.port

    async def _start_shm(self) -> None:
        """Offers the shared-memory path unless --no-shm or the platform lacks it; a failure to
        set it up leaves gRPC only, with a warning."""
        if self.config.no_shm or not shm_support.supported():
            return
        hub = ShmHub(
            self.config.shm_dir,
            self.config.shm_arena_bytes,
            self.config.chunk_bytes,
            self.config.heartbeat_timeout,
            self._authenticate_shm,
        )
        try:
            await hub.start()
        except OSError as exc:
            log.warning("shared memory is off (gRPC only): %r", exc)
            await hub.stop()
            return
        self.shm = hub
        self._table.output_buffers = hub

    def _authenticate_shm(self, worker_id: int, session_id: int, token: int) -> Member:
        assert self._membership is not None
        return self._membership.authenticate(worker_id, session_id, token)

    async def stop(self, reason: str = "coordinator stopped") -> None:
        """Graceful shutdown: NOT_SERVING, workers told, steps in flight drained (bounded by
        drain_timeout) or failed, streams closed. Safe to call more than once."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._shutdown(reason))
        await asyncio.shield(self._stopping)

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

    async def _shutdown(self, reason: str) -> None:
        log.info("shutting down: %s", reason)
        self._cancel_rejoin_timer()
        await self._health.enter_graceful_shutdown()
        self._broadcast(ShutdownOut(reason))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout
        while self._table.has_pending() and self._streams:
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), deadline - loop.time())
            except TimeoutError:
                break
        self._deliver(self._table.fail_all(grpc.StatusCode.UNAVAILABLE, f"coordinator {reason}"))
        streams = list(self._streams.values())
        for stream in streams:
            stream.by_shutdown = True
            stream.end(None)
        if streams:
            await asyncio.wait([s.closed for s in streams], timeout=max(0.0, deadline - loop.time()))
        if self._monitor is not None:
            self._monitor.cancel()
        if self._shard is not None:
            await self._shard.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.shm is not None:
            await self.shm.stop()
        self.metrics.close()
        self.events.close()
        self._stopped.set()
        log.info("coordinator stopped")

    # --- job state ----------------------------------------------------------------------------

    def _set_state(self, new: JobState, why: str) -> None:
        if new is self.state:
            return
        old, self.state = self.state, new
        self.metrics.job_state.state(new.value)
        if new in (JobState.FINISHED, JobState.FAILED):
            self.events.write("job_ended", state=new.value, reason=why)
        if new is JobState.FAILED:
            self.failure = why
            log.error("job failed: %s", why)
        else:
            log.info("job %s -> %s: %s", old.value, new.value, why)
        if new is not JobState.RESTARTING:
            self._cancel_rejoin_timer()
        if new in (JobState.FINISHED, JobState.FAILED):
            self.request_stop(f"job {new.value}: {why}")

    def _world_complete(self) -> None:
        if self.state in (JobState.WAITING, JobState.RESTARTING):
            self._departures.clear()
            self._had_loss = False
            self._set_state(JobState.RUNNING, f"the world of {self.config.world_size} is complete")

    def _job_done(self) -> bool:
        last = self._table.last_completed_step
        return self._final_step is not None and last is not None and last >= self._final_step

    def _after_departure(self, lost: bool) -> None:
        """Moves the job on after a member left (`lost`: without a goodbye)."""
        assert self._membership is not None
        if self._stopping is not None or self.state not in (JobState.RUNNING, JobState.RESTARTING):
            return
        self._had_loss = self._had_loss or lost
        empty = self._membership.joined == 0
        if empty and self._job_done():
            self._set_state(
                JobState.FINISHED,
                f"step {self._final_step} (--max-steps {self.config.max_steps}) done and every worker left",
            )
            return
        if empty:
            self._reset_job()
            if not self._had_loss and self._final_step is None:
                self._departures.clear()
                self._set_state(JobState.WAITING, "every worker left; the next Join starts a new job")
                return
        if empty or (lost and self.config.on_worker_loss == "abort"):
            self._restarting()

    def _restarting(self) -> None:
        self._set_state(JobState.RESTARTING, "; ".join(self._departures))
        if self._rejoin_timer is None:
            self._rejoin_timer = asyncio.get_running_loop().call_later(
                self.config.rejoin_timeout, self._rejoin_expired
            )

    def _rejoin_expired(self) -> None:
        self._rejoin_timer = None
        if self.state is JobState.RESTARTING and self._stopping is None:
            self._set_state(
                JobState.FAILED,
                f"the world of {self.config.world_size} did not complete again within --rejoin-timeout "
                f"{self.config.rejoin_timeout:g} s: {'; '.join(self._departures)}",
            )

    def _cancel_rejoin_timer(self) -> None:
        if self._rejoin_timer is not None:
            self._rejoin_timer.cancel()
            self._rejoin_timer = None

    def _reset_job(self) -> None:
        """No member is left: nothing of this job may leak into the next joiners' (ids, steps,
        reductions, barriers, shards, fingerprint)."""
        self._table = self._new_table()
        self._counted = (0, 0)
        if self._shard is not None:
            self._shard.reset()
        log.info("job state reset: the next joiners start with ids from 0 and fresh steps")

    # --- Join -----------------------------------------------------------------------------------

    async def _join(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        assert self._membership is not None
        try:
            request = codec.decode_join_request(raw)
            if request.protocol_version != codec.PROTOCOL_VERSION:
                raise FailedPreconditionError(
                    f"node {request.node_id!r} speaks protocol version {request.protocol_version}, "
                    f"this coordinator {codec.PROTOCOL_VERSION}"
                )
            if self._stopping is not None or self.state in (JobState.FINISHED, JobState.FAILED):
                raise UnavailableError(f"the coordinator is shutting down (job {self.state.value})")
            if self._shard is not None:
                self._shard.check_join(request)
            elif request.shard_index is not None:
                raise FailedPreconditionError(
                    f"node {request.node_id!r} asked for shard {request.shard_index}, but this "
                    "coordinator runs without --shard-map"
                )
            member = await self._membership.join(request, self._identity(context), peer_host(context.peer()))
        except GradServerError as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises
        finally:
            self.metrics.workers_joined.set(self._membership.joined)
        self._table.worker_joined(member.worker_id)
        self._world_complete()
        cfg = self.config
        return codec.encode_join_accepted(
            JoinAccepted(
                worker_id=member.worker_id,
                total_workers=cfg.world_size,
                session_id=self.session_id,
                member_token=member.token,
                protocol_version=codec.PROTOCOL_VERSION,
                chunk_bytes=cfg.chunk_bytes,
                max_message_bytes=cfg.max_message_bytes,
                max_tensor_elements=cfg.max_tensor_elements,
                heartbeat_interval_s=cfg.heartbeat_interval,
                heartbeat_timeout_s=cfg.heartbeat_timeout,
                step_timeout_s=cfg.step_timeout,
                max_steps=cfg.max_steps,
                resume_step=self._membership.resume_step(),
                local_workers=self._membership.local_workers(member),
                shard_map=self._shard.shard_map.addresses if self._shard is not None else (),
                shard_index=self._shard.own_index if self._shard is not None else 0,
                shm_socket=self.shm.path if self.shm is not None else "",
                shm_nonce=self.shm.nonce if self.shm is not None else b"",
            )
        )

    async def _notify_shard(self, raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        """Another shard failed a step (or lost a worker): fail it here too."""
        try:
            if self._shard is None:
                raise FailedPreconditionError("NotifyShard: this coordinator runs without --shard-map")
            self._deliver(self._shard.heard(raw, self._table))
        except GradServerError as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(exc.code, exc.message)
            raise
        return b""

    # --- Exchange -------------------------------------------------------------------------------

    async def _exchange(
        self, _requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        assert self._membership is not None
        try:
            member = self._authenticate(context)
            existing = self._streams.get(member.worker_id)
            if existing is not None and existing.member is member:
                raise FailedPreconditionError(
                    f"worker {member.worker_id} already has an Exchange stream open",
                    worker_id=member.worker_id,
                )
            if self._stopping is not None:
                raise UnavailableError("the coordinator is shutting down")
        except GradServerError as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(exc.code, exc.message)
            raise
        if existing is not None:
            # The stream of this place's previous member is still closing: it cannot block the
            # new member, who replaces it.
            existing.end((grpc.StatusCode.FAILED_PRECONDITION, f"worker {member.worker_id} was replaced"))
        stream = WorkerStream(member, context)
        member.streaming = True
        member.last_seen = time.monotonic()
        self._streams[member.worker_id] = stream
        writer = asyncio.create_task(self._write_loop(stream))
        reader = asyncio.create_task(self._read_loop(stream))
        reader.add_done_callback(lambda task: self._reader_done(stream, task))
        status: tuple[grpc.StatusCode, str] | None = None
        cancelled = True
        try:
            status = await stream.ended
            cancelled = False
        finally:
            reader.cancel()
            self._stream_ended(stream, status, cancelled)
            await self._finish_writer(stream, writer, drain=not cancelled)
            if self._streams.get(member.worker_id) is stream:
                del self._streams[member.worker_id]
            member.streaming = False
            stream.closed.set_result(None)
            self._progress.set()
        if status is not None:
            await context.abort(status[0], status[1])

    def _stream_ended(
        self, stream: WorkerStream, status: tuple[grpc.StatusCode, str] | None, cancelled: bool
    ) -> None:
        """Frees the member's place (when it still holds it) with the reason its stream ended."""
        assert self._membership is not None
        member = stream.member
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
        if self._stopping is not None and not expected:
            # Most likely the shutdown's doing (the worker gave up on hearing it): say so, rather
            # than blame the worker alone to the others.
            why += " while the coordinator is shutting down"
        if self._membership.remove(member, why, expected=expected):
            self._worker_gone(member, why, lost=not expected)

    async def _finish_writer(self, stream: WorkerStream, writer: asyncio.Task[None], *, drain: bool) -> None:
        """Lets the writer send what is queued (bounded by drain_timeout; not at all for a
        cancelled stream, whose peer is gone). Never raises: the caller's clean-up must run."""
        stream.outbound.put_nowait(_STOP)
        if drain:
            await asyncio.wait([writer], timeout=self.config.drain_timeout)
        if not writer.done():
            writer.cancel()
            await asyncio.wait([writer])

    def _identity(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """The client certificate's name under mutual TLS; None otherwise."""
        if not self.config.tls_client_ca:
            return None
        return peer_identity(context.auth_context())

    def _worker_gone(self, member: Member, reason: str, *, lost: bool) -> None:
        assert self._membership is not None
        worker_id = member.worker_id
        self.metrics.workers_joined.set(self._membership.joined)
        if lost:
            self.metrics.workers_lost.inc()
            # Before the others are told (below), so a supervisor finds it when they exit.
            step = min(self._table.pending_steps(), default=None)
            self.events.write("worker_lost", worker=worker_id, node=member.node_id, reason=reason, step=step)
        self._departures.append(f"worker {worker_id} {reason}")
        if lost and self._shard is not None:
            self._shard.worker_lost(worker_id, reason, self._table.unsettled_steps())
        if self.shm is not None:
            # Its arena may still be written (a zombie): what the table keeps of it is copied.
            self._table.own_worker_data(worker_id)
            self.shm.worker_gone(worker_id)
        self._deliver(self._table.worker_lost(worker_id, reason))
        self._after_departure(lost)

    def _auth_refused(self, peer: str, code: grpc.StatusCode, check: str) -> None:
        """Logs and counts a refused credential (the peer and the check, never a secret)."""
        self.metrics.errors.labels(code.name).inc()
        log.warning("refused a call from %s: %s", peer, check)

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Member:
        assert self._membership is not None
        metadata = {k: v for k, v in context.invocation_metadata() or ()}
        try:
            worker_id = int(metadata[META_WORKER_ID])
            session_id = int(metadata[META_SESSION_ID])
            token = int(metadata[META_MEMBER_TOKEN])
        except (KeyError, ValueError, TypeError):
            log.warning("refused an Exchange from %s: no membership metadata", context.peer())
            raise FailedPreconditionError(
                f"Exchange needs metadata {META_WORKER_ID}, {META_SESSION_ID} and "
                f"{META_MEMBER_TOKEN} from Join"
            ) from None
        try:
            member = self._membership.authenticate(worker_id, session_id, token)
        except GradServerError as exc:
            log.warning("refused an Exchange from %s: %s", context.peer(), exc.message)
            raise
        presented = self._identity(context)
        if member.identity is not None and presented != member.identity:
            log.warning(
                "refused an Exchange from %s: certificate %r does not match worker %d's %r",
                context.peer(),
                presented,
                worker_id,
                member.identity,
            )
            raise PermissionDeniedError(
                f"worker {worker_id} joined as certificate {member.identity!r}; this connection "
                f"presents {presented!r} and cannot act as it",
                worker_id=worker_id,
            )
        return member

    def _reader_done(self, stream: WorkerStream, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            stream.end(None)
        else:
            log.error("stream reader failed: %r", exc, extra={"worker_id": stream.member.worker_id})
            stream.end((grpc.StatusCode.INTERNAL, f"coordinator error: {exc!r}"))

    async def _read_loop(self, stream: WorkerStream) -> None:
        w = stream.member.worker_id
        while True:
            while self._over_budget(stream):
                if not stream.paused:
                    log.debug(
                        "holding back worker %d's stream (in-flight budget full)", w, extra={"worker_id": w}
                    )
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
            self.metrics.received_bytes.inc(len(raw))
            stream.member.last_seen = time.monotonic()
            if len(raw) > self.config.max_message_bytes:
                stream.end(
                    (
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"sent a message of {len(raw)} bytes, above the --max-message-mib "
                        f"limit of {self.config.max_message_bytes} bytes",
                    )
                )
                return
            try:
                event = codec.decode_worker_message(raw, self._limits)
                if self._handle(stream, event):
                    return
            except GradServerError as exc:
                log.info("rejected message: %s", exc.message, extra={"worker_id": w, "step": exc.step})
                key = codec.chunk_key(raw) if exc.key is not None else None
                self._send_error(stream, exc.code, exc.message, exc.step or 0, key)

    def _handle(self, stream: WorkerStream, event: WorkerEvent) -> bool:
        """Dispatches one decoded message; True when the worker announced that it leaves."""
        w = stream.member.worker_id
        if isinstance(event, LeaveIn):
            log.info("worker %d is leaving: %s", w, event.reason or "no reason given", extra={"worker_id": w})
            stream.said_goodbye = True
            return True
        if event.worker_id != w:
            raise FailedPreconditionError(
                f"message names worker {event.worker_id}, but this stream belongs to worker {w}",
                worker_id=event.worker_id,
            )
        if isinstance(event, HeartbeatIn):
            stream.send(codec.encode_server_event(HeartbeatAckOut(event.sequence)))
            return False
        if isinstance(event, ChunkIn):
            if self._beyond_final_step(stream, event.key.step, key=event.key):
                return False
            if event.shm is not None:
                if self.shm is None:
                    raise InvalidArgumentError(
                        f"worker {w}, {event.key}: chunk names shared memory, which this coordinator "
                        "does not offer",
                        step=event.key.step,
                        key=str(event.key),
                        worker_id=w,
                    )
                event = self.shm.resolve(event, stream.member)
                self.metrics.shm_received_bytes.inc(len(event.data))
                self.metrics.received_bytes.inc(len(event.data))
            self._deliver(self._table.contribute(event))
        elif isinstance(event, BarrierIn):
            if self._beyond_final_step(stream, event.step, barrier=event.name):
                return False
            self._deliver(self._table.barrier(event))
        elif isinstance(event, ShardRequestIn):
            self._deliver(self._table.shard(event))
        return False

    def _beyond_final_step(
        self, stream: WorkerStream, step: int, *, key: TensorKey | None = None, barrier: str | None = None
    ) -> bool:
        if self._final_step is None or step <= self._final_step:
            return False
        message = (
            f"step {step} refused: --max-steps {self.config.max_steps} ends the job after step "
            f"{self._final_step}"
        )
        self._send_error(stream, grpc.StatusCode.FAILED_PRECONDITION, message, step, key, barrier)
        return True

    def _check_step_limit(self) -> None:
        if not self._limit_logged and self._job_done():
            self._limit_logged = True
            log.info("reached --max-steps %d at step %s", self.config.max_steps, self._final_step)

    async def _write_loop(self, stream: WorkerStream) -> None:
        while True:
            item = await stream.outbound.get()
            if item is _STOP:
                return
            assert isinstance(item, bytes)
            try:
                await stream.context.write(item)
                self.metrics.sent_bytes.inc(len(item))
            except Exception as exc:  # noqa: BLE001 - any failed write (e.g. ExecuteBatchError) means the peer is gone
                log.info("writing to worker %d failed: %r", stream.member.worker_id, exc)
                # Wait for that cancellation, if it is one, so the worker is reported as having
                # cancelled its stream rather than as a failed write (both free its place); the
                # handler cancels this task when it comes.
                await asyncio.wait([stream.closed], timeout=_CANCEL_AFTER_FAILED_WRITE_S)
                stream.end(
                    (
                        grpc.StatusCode.UNAVAILABLE,
                        f"writing to worker {stream.member.worker_id} failed: {exc!r}",
                    )
                )
                return
            finally:
                stream.outbound_bytes -= len(item)
                stream.write_progress = time.monotonic()
                self._wake_readers()

    def _send_error(
        self,
        stream: WorkerStream,
        code: grpc.StatusCode,
        message: str,
        step: int,
        key: TensorKey | None = None,
        barrier: str | None = None,
    ) -> None:
        """An in-stream error about one message of this worker (counted in the metrics); with
        `key` (or `barrier`), the worker fails only that result (or barrier wait)."""
        self.metrics.errors.labels(code.name).inc()
        event = ErrorOut(int(code.value[0]), message, step, key=key, barrier_name=barrier)
        stream.send(codec.encode_server_event(event))

    def _over_budget(self, stream: WorkerStream) -> bool:
        held = self._table.buffered_bytes(stream.member.worker_id) + stream.outbound_bytes
        return held > self.config.max_inflight_bytes

    def _wake_readers(self) -> None:
        for stream in self._streams.values():
            if stream.paused and not self._over_budget(stream):
                stream.room.set()

    def _deliver(self, outgoing: list[Outgoing]) -> None:
        if self._shard is not None:
            self._shard.failed_steps(outgoing)
        for item in outgoing:
            if isinstance(item.event, ErrorOut):
                code = status_code_from_value(item.event.code)
                self.metrics.errors.labels(code.name).inc(len(item.to))
            for event, to in self._split_by_transport(item):
                raw = codec.encode_server_event(event)
                for worker_id in to:
                    stream = self._streams.get(worker_id)
                    if stream is not None:
                        stream.send(raw)
        if outgoing:
            self._wake_readers()
        steps, keys = self._table.steps_completed, self._table.keys_reduced
        self.metrics.steps_completed.inc(steps - self._counted[0])
        self.metrics.keys_reduced.inc(keys - self._counted[1])
        self._counted = (steps, keys)
        self._check_step_limit()
        self._progress.set()

    def _split_by_transport(self, item: Outgoing) -> list[tuple[Any, tuple[int, ...]]]:
        """Averages go through the output arena to shared-memory workers, inline to the rest."""
        if self.shm is None or not isinstance(item.event, AveragedChunkOut):
            return [(item.event, item.to)]
        parts = self.shm.publish(item.event, item.to)
        for event, to in parts:
            if event.shm is not None:
                self.metrics.shm_bytes.inc(event.shm.length * len(to))
                self.metrics.sent_bytes.inc(event.shm.length * len(to))
        return list(parts)

    def _broadcast(self, event: ShutdownOut) -> None:
        raw = codec.encode_server_event(event)
        for stream in self._streams.values():
            stream.send(raw)

    # --- liveness -------------------------------------------------------------------------------

    def _start_monitor(self) -> None:
        self._monitor = asyncio.create_task(self._monitor_loop(), name="gradserver-monitor")
        self._monitor.add_done_callback(self._monitor_done)

    def _monitor_done(self, task: asyncio.Task[None]) -> None:
        """Heartbeat eviction and step expiry must never end silently: a failed monitor is
        logged and restarted; one that keeps failing fails the job."""
        if task.cancelled() or self._stopping is not None:
            return
        exc = task.exception()
        self._monitor_failures += 1
        log.error("liveness monitor failed (%d in a row): %r", self._monitor_failures, exc, exc_info=exc)
        if self._monitor_failures >= _MONITOR_RESTARTS:
            self._set_state(
                JobState.FAILED, f"the liveness monitor failed {self._monitor_failures} times: {exc!r}"
            )
            return
        self._start_monitor()

    async def _monitor_loop(self) -> None:
        tick = min(1.0, self.config.heartbeat_timeout / 4)
        while True:
            await asyncio.sleep(tick)
            self._check_liveness(time.monotonic())
            self._deliver(self._table.expire())
            self._monitor_failures = 0

    def _check_liveness(self, now: float) -> None:
        assert self._membership is not None
        limit = self.config.heartbeat_timeout
        for member in self._membership.members():
            stream = self._streams.get(member.worker_id)
            if stream is not None and stream.member is member:
                stalled = stream.stalled_for(now)
                if stalled > limit:
                    self._evict(
                        member,
                        f"lost: it read nothing of its results for {stalled:.1f} s (heartbeat "
                        f"timeout {limit:g} s)",
                    )
                    continue
                if stream.paused:
                    continue  # the coordinator holds it back: its silence is not its fault
            silent = now - member.last_seen
            # A member that never opened its stream is silent too, once the world is
            # complete (before that, Join itself is still waiting for others).
            watched = member.streaming or self._membership.complete
            if watched and silent > limit:
                self._evict(member, f"lost: no message for {silent:.1f} s (heartbeat timeout {limit:g} s)")

    def _evict(self, member: Member, reason: str) -> None:
        assert self._membership is not None
        if not self._membership.remove(member, reason):
            return
        self._worker_gone(member, reason, lost=True)
        stream = self._streams.get(member.worker_id)
        if stream is not None:
            stream.end((grpc.StatusCode.FAILED_PRECONDITION, f"worker {member.worker_id} evicted: {reason}"))
