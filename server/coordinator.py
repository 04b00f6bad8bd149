"""GradientServer: the grpc.aio coordinator that averages every worker's gradients.

Data flow: a worker calls Join (waits for the whole world), then opens one Exchange stream. A
reader task per stream decodes messages and feeds the `ReductionTable`; whatever the table
answers is encoded once and queued to each recipient's writer task, so every worker receives the
same bytes. A monitor task evicts workers whose messages stop (heartbeat timeout) and fails steps
past their deadline. A reader stops reading while its worker's unreduced contributions plus its
unsent results exceed the in-flight budget, which turns into HTTP/2 back-pressure on that worker:
the coordinator's memory is bounded by chunks in flight, not by the model.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradserver.common import codec
from gradserver.common.config import CoordinatorConfig, parse_address
from gradserver.common.errors import (
    FailedPreconditionError,
    GradServerError,
    PermissionDeniedError,
    UnavailableError,
    status_code_from_value,
)
from gradserver.common.messages import (
    BarrierIn,
    ChunkIn,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    JoinAccepted,
    LeaveIn,
    ShardRequestIn,
    ShutdownOut,
    WorkerEvent,
)
from gradserver.common.rpc import (
    META_MEMBER_TOKEN,
    META_SESSION_ID,
    META_WORKER_ID,
    SERVICE_NAME,
    server_options,
)
from gradserver.common.security import TlsFiles, peer_identity, token_matches

from .membership import Member, Membership
from .metrics import CoordinatorMetrics
from .reduction import Outgoing, ReductionTable

log = logging.getLogger("gradserver.server")

_STOP = object()
_HEALTH_PREFIX = "/grpc.health.v1.Health/"


class _TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call without the shared token (UNAUTHENTICATED), except health checks, which
    container probes and load balancers make without credentials."""

    def __init__(self, token: str, on_reject: Any) -> None:
        self._token = token
        self._on_reject = on_reject

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if details.method.startswith(_HEALTH_PREFIX) or token_matches(
            details.invocation_metadata, self._token
        ):
            return handler
        self._on_reject()
        message = f"{details.method}: missing or wrong auth token"

        async def deny(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class _WorkerStream:
    """One worker's Exchange stream: its outbound queue and how it ends."""

    def __init__(self, member: Member, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.member = member
        self.context = context
        self.outbound: asyncio.Queue[bytes | object] = asyncio.Queue()
        self.outbound_bytes = 0
        self.room = asyncio.Event()
        self.room.set()
        self.paused = False
        self.said_goodbye = False
        self.ended: asyncio.Future[tuple[grpc.StatusCode, str] | None] = (
            asyncio.get_running_loop().create_future()
        )

    def send(self, raw: bytes) -> None:
        self.outbound_bytes += len(raw)
        self.outbound.put_nowait(raw)

    def end(self, status: tuple[grpc.StatusCode, str] | None) -> None:
        if not self.ended.done():
            self.ended.set_result(status)


class GradientServer:
    """The coordinator. `await start()` binds (port 0 picks one), `await stop()` drains and ends.

    Usable as `async with GradientServer(CoordinatorConfig(world_size=2, bind="127.0.0.1:0")) as s`.
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
        self._table = ReductionTable(
            config.world_size,
            config.chunk_bytes // 4,
            config.step_timeout,
            on_key_reduced=self.metrics.reduce_latency.observe,
            on_barrier_released=self.metrics.barrier_wait.observe,
            on_worker_loss=config.on_worker_loss,
        )
        self._counted = (0, 0)  # steps and keys already added to the metrics
        self._streams: dict[int, _WorkerStream] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._final_step: int | None = None
        self.port = 0

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        host, _ = parse_address(self.config.bind)
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port."""
        self._membership = Membership(self.config.world_size, self.config.join_timeout, self.session_id)
        interceptors = []
        if self.config.auth_token:
            reject = self.metrics.errors.labels(grpc.StatusCode.UNAUTHENTICATED.name).inc
            interceptors.append(_TokenInterceptor(self.config.auth_token, reject))
        server = grpc.aio.server(
            options=server_options(self.config.max_message_bytes), interceptors=interceptors
        )
        handler = grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Join": grpc.unary_unary_rpc_method_handler(self._join),
                "Exchange": grpc.stream_stream_rpc_method_handler(self._exchange),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            self.port = self._add_port(server)
        except RuntimeError as exc:
            raise UnavailableError(f"cannot bind {self.config.bind}: {exc}") from exc
        if self.port == 0:
            raise UnavailableError(f"cannot bind {self.config.bind}: address in use or invalid")
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._monitor = asyncio.create_task(self._monitor_loop(), name="gradserver-monitor")
        if self.config.metrics_port >= 0:
            host, _ = parse_address(self.config.bind)
            self.metrics.serve(host.strip("[]"), self.config.metrics_port)
        if self.config.port_file:
            tmp = f"{self.config.port_file}.tmp"
            with open(tmp, "w", encoding="ascii") as handle:
                handle.write(f"{self.port}\n")
            os.replace(tmp, self.config.port_file)
        log.info(
            "coordinator listening on %s for %d worker(s), session %#x",
            self.address,
            self.config.world_size,
            self.session_id,
        )
        return self.port

    def _add_port(self, server: grpc.aio.Server) -> int:
        cfg = self.config
        if not cfg.tls_cert:
            return int(server.add_insecure_port(cfg.bind))
        own = TlsFiles.load(cert=cfg.tls_cert, key=cfg.tls_key, what="coordinator TLS")
        client_ca = TlsFiles.load(ca=cfg.tls_client_ca, what="coordinator TLS") if cfg.tls_client_ca else None
        assert own is not None
        credentials = grpc.ssl_server_credentials(
            [(own.key, own.cert)],
            root_certificates=client_ca.ca if client_ca else None,
            require_client_auth=client_ca is not None,
        )
        return int(server.add_secure_port(cfg.bind, credentials))

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
        await self._health.enter_graceful_shutdown()
        self._broadcast(ShutdownOut(reason))
        deadline = time.monotonic() + self.config.drain_timeout
        while self._table.has_pending() and time.monotonic() < deadline and self._streams:
            await asyncio.sleep(0.05)
        self._deliver(self._table.fail_all(grpc.StatusCode.UNAVAILABLE, f"coordinator {reason}"))
        for stream in list(self._streams.values()):
            stream.end(None)
        if self._streams:
            await asyncio.wait(
                [asyncio.ensure_future(asyncio.sleep(self.config.drain_timeout))]
                + [asyncio.ensure_future(self._stream_gone(w)) for w in list(self._streams)],
                return_when=asyncio.ALL_COMPLETED,
                timeout=self.config.drain_timeout,
            )
        if self._monitor is not None:
            self._monitor.cancel()
        if self._server is not None:
            await self._server.stop(grace=1.0)
        self.metrics.close()
        self._stopped.set()
        log.info("coordinator stopped")

    async def _stream_gone(self, worker_id: int) -> None:
        while worker_id in self._streams:
            await asyncio.sleep(0.02)

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
            if self._stopping is not None:
                raise UnavailableError("the coordinator is shutting down")
            member = await self._membership.join(request, self._identity(context))
        except GradServerError as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises
        finally:
            self.metrics.workers_joined.set(self._membership.joined)
        self._table.worker_joined(member.worker_id)
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
            )
        )

    # --- Exchange -------------------------------------------------------------------------------

    async def _exchange(
        self, _requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        assert self._membership is not None
        try:
            member = self._authenticate(context)
            if member.worker_id in self._streams:
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
        stream = _WorkerStream(member, context)
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
            left = not cancelled and status is None and stream.said_goodbye
            if left:
                why = "left the job"
            elif cancelled:
                why = "disconnected (its stream was cancelled)"
            elif status is not None:
                why = status[1]
            else:
                why = "disconnected (its stream ended without a goodbye)"
            if self._membership.remove(member, why, expected=left):
                self._worker_gone(member.worker_id, why, lost=not left)
            stream.outbound.put_nowait(_STOP)
            try:
                await asyncio.wait_for(writer, timeout=self.config.drain_timeout)
            except (TimeoutError, asyncio.CancelledError):
                writer.cancel()
            if self._streams.get(member.worker_id) is stream:
                del self._streams[member.worker_id]
            member.streaming = False
            self._after_membership_change()
        if status is not None:
            await context.abort(status[0], status[1])

    def _identity(self, context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
        """The client certificate's name under mutual TLS; None otherwise."""
        if not self.config.tls_client_ca:
            return None
        return peer_identity(context.auth_context())

    def _worker_gone(self, worker_id: int, reason: str, *, lost: bool) -> None:
        assert self._membership is not None
        self.metrics.workers_joined.set(self._membership.joined)
        if lost:
            self.metrics.workers_lost.inc()
        self._deliver(self._table.worker_lost(worker_id, reason))

    def _authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Member:
        assert self._membership is not None
        metadata = {k: v for k, v in context.invocation_metadata() or ()}
        try:
            worker_id = int(metadata[META_WORKER_ID])
            session_id = int(metadata[META_SESSION_ID])
            token = int(metadata[META_MEMBER_TOKEN])
        except (KeyError, ValueError, TypeError):
            raise FailedPreconditionError(
                f"Exchange needs metadata {META_WORKER_ID}, {META_SESSION_ID} and "
                f"{META_MEMBER_TOKEN} from Join"
            ) from None
        member = self._membership.authenticate(worker_id, session_id, token)
        presented = self._identity(context)
        if member.identity is not None and presented != member.identity:
            raise PermissionDeniedError(
                f"worker {worker_id} joined as certificate {member.identity!r}; this connection "
                f"presents {presented!r} and cannot act as it",
                worker_id=worker_id,
            )
        return member

    def _reader_done(self, stream: _WorkerStream, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            stream.end(None)
        else:
            log.error("stream reader failed: %r", exc, extra={"worker_id": stream.member.worker_id})
            stream.end((grpc.StatusCode.INTERNAL, f"coordinator error: {exc!r}"))

    async def _read_loop(self, stream: _WorkerStream) -> None:
        w = stream.member.worker_id
        while True:
            while self._over_budget(stream):
                stream.paused = True
                stream.room.clear()
                await stream.room.wait()
            if stream.paused:
                stream.paused = False
                stream.member.last_seen = time.monotonic()
            raw = await stream.context.read()
            if raw is grpc.aio.EOF:
                return
            self.metrics.received_bytes.inc(len(raw))
            stream.member.last_seen = time.monotonic()
            try:
                event = codec.decode_worker_message(raw, self._limits)
                if self._handle(stream, event):
                    return
            except GradServerError as exc:
                log.info("rejected message: %s", exc.message, extra={"worker_id": w, "step": exc.step})
                self._send_error(stream, exc.code, exc.message, exc.step or 0)

    def _handle(self, stream: _WorkerStream, event: WorkerEvent) -> bool:
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
            if self._beyond_final_step(stream, event.key.step):
                return False
            self._deliver(self._table.contribute(event))
        elif isinstance(event, BarrierIn):
            if self._beyond_final_step(stream, event.step):
                return False
            self._deliver(self._table.barrier(event))
        elif isinstance(event, ShardRequestIn):
            self._deliver(self._table.shard(event))
        self._check_step_limit()
        return False

    def _beyond_final_step(self, stream: _WorkerStream, step: int) -> bool:
        if self._final_step is None or step <= self._final_step:
            return False
        message = (
            f"step {step} refused: the coordinator ran its --max-steps {self.config.max_steps} "
            f"steps (last step {self._final_step})"
        )
        self._send_error(stream, grpc.StatusCode.FAILED_PRECONDITION, message, step)
        self.request_stop(f"reached --max-steps {self.config.max_steps}")
        return True

    def _check_step_limit(self) -> None:
        limit = self.config.max_steps
        if limit and self._final_step is None and self._table.steps_completed >= limit:
            last = self._table.last_completed_step
            self._final_step = max(self._table.pending_steps() | {-1 if last is None else last})
            log.info("reached --max-steps %d at step %d", limit, self._final_step)

    def _after_membership_change(self) -> None:
        if self._final_step is not None and not self._streams and self._stopping is None:
            self.request_stop(f"all workers left after --max-steps {self.config.max_steps}")

    async def _write_loop(self, stream: _WorkerStream) -> None:
        while True:
            item = await stream.outbound.get()
            if item is _STOP:
                return
            assert isinstance(item, bytes)
            try:
                await stream.context.write(item)
                self.metrics.sent_bytes.inc(len(item))
            finally:
                stream.outbound_bytes -= len(item)
                self._wake_readers()

    def _send_error(self, stream: _WorkerStream, code: grpc.StatusCode, message: str, step: int) -> None:
        """An in-stream error about one message of this worker (counted in the metrics)."""
        self.metrics.errors.labels(code.name).inc()
        stream.send(codec.encode_server_event(ErrorOut(int(code.value[0]), message, step)))

    def _over_budget(self, stream: _WorkerStream) -> bool:
        held = self._table.buffered_bytes(stream.member.worker_id) + stream.outbound_bytes
        return held > self.config.max_inflight_bytes

    def _wake_readers(self) -> None:
        for stream in self._streams.values():
            if stream.paused and not self._over_budget(stream):
                stream.room.set()

    def _deliver(self, outgoing: list[Outgoing]) -> None:
        for item in outgoing:
            if isinstance(item.event, ErrorOut):
                code = status_code_from_value(item.event.code)
                self.metrics.errors.labels(code.name).inc(len(item.to))
            raw = codec.encode_server_event(item.event)
            for worker_id in item.to:
                stream = self._streams.get(worker_id)
                if stream is not None:
                    stream.send(raw)
        if outgoing:
            self._wake_readers()
        steps, keys = self._table.steps_completed, self._table.keys_reduced
        self.metrics.steps_completed.inc(steps - self._counted[0])
        self.metrics.keys_reduced.inc(keys - self._counted[1])
        self._counted = (steps, keys)

    def _broadcast(self, event: ShutdownOut) -> None:
        raw = codec.encode_server_event(event)
        for stream in self._streams.values():
            stream.send(raw)

    # --- liveness -------------------------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        assert self._membership is not None
        tick = min(1.0, self.config.heartbeat_timeout / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for member in self._membership.members():
                stream = self._streams.get(member.worker_id)
                if stream is not None and stream.paused:
                    continue
                silent = now - member.last_seen
                # A member that never opened its stream is silent too, once the world is
                # complete (before that, Join itself is still waiting for others).
                watched = member.streaming or self._membership.joined == self.config.world_size
                if watched and silent > self.config.heartbeat_timeout:
                    self._evict(
                        member,
                        f"lost: no message for {silent:.1f} s (heartbeat timeout "
                        f"{self.config.heartbeat_timeout:g} s)",
                    )
            self._deliver(self._table.expire())

    def _evict(self, member: Member, reason: str) -> None:
        assert self._membership is not None
        if not self._membership.remove(member, reason):
            return
        self._worker_gone(member.worker_id, reason, lost=True)
        stream = self._streams.get(member.worker_id)
        if stream is not None:
            stream.end((grpc.StatusCode.FAILED_PRECONDITION, f"worker {member.worker_id} evicted: {reason}"))
