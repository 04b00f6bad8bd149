"""WorkerClient: the blocking API a training process uses to average gradients.

Names follow the reference WorkerClient. Sends return once the data is queued for the
transport; each receive returns the next average of that kind in the order this worker sent its
keys, so lockstep use (send block i, receive block i) and pipelined use (send all, then receive
all) both work. Every call has a deadline (`Timeouts`), and every failure is an exception of
`gradserver.common.errors`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Self

import grpc
import numpy as np

from gradserver.common import codec
from gradserver.common.chunking import chunk_spans
from gradserver.common.components import (
    BLOCK_GRAD_COMPONENTS,
    NonBlockComponent,
    parse_non_block_component,
)
from gradserver.common.config import parse_address
from gradserver.common.errors import (
    FailedPreconditionError,
    GradServerError,
    InvalidArgumentError,
    UnavailableError,
    error_from_status,
)
from gradserver.common.messages import (
    BarrierIn,
    ChunkHeader,
    ChunkIn,
    DType,
    HeartbeatIn,
    JoinAccepted,
    JoinRequestIn,
    KeyKind,
    SampleStats,
    ShardRequestIn,
    TensorKey,
)
from gradserver.common.rpc import JOIN_METHOD, worker_channel_options
from gradserver.common.security import TlsFiles, bearer_metadata
from gradserver.common.timeouts import Timeouts
from gradserver.common.wire_dtype import parse_wire_dtype

from ._exchange import ExchangeStream, PendingResult
from ._sharded import ShardedExchange, ShardLink, join_other_shards
from ._wire_encoder import WireEncoder
from .results import AveragedBlock, AveragedGradients, AveragedNonBlock, ShardAssignment
from .tensors import as_float32_array, as_result_buffer
from .transports.shm import ShmChannel

log = logging.getLogger("gradserver.worker")

# Progress while reaching the coordinator: a line every fifth of the connect timeout, within
# these bounds, so a long wait says what it is doing and a short one stays quiet enough.
_PROGRESS_MIN_S = 0.1
_PROGRESS_MAX_S = 5.0

TRANSPORTS = ("auto", "grpc", "shm")
TRANSPORT_ENV = "GRADSERVER_TRANSPORT"
DEFAULT_SHM_ARENA_MIB = 256.0


def _transport_choice(transport: str | None) -> str:
    """The argument, else $GRADSERVER_TRANSPORT, else auto; anything else is refused by name."""
    choice = transport if transport is not None else os.environ.get(TRANSPORT_ENV, "") or "auto"
    if choice not in TRANSPORTS:
        source = "transport" if transport is not None else TRANSPORT_ENV
        raise InvalidArgumentError(f"{source}={choice!r}: choose one of {', '.join(TRANSPORTS)}")
    return choice


def _why_not_shm(encoder: WireEncoder, shards: list[ShardLink] | None) -> str | None:
    """Why this worker's settings rule shared memory out, or None."""
    if encoder.dtype is not DType.FLOAT32:
        return f"the wire dtype is {encoder.dtype.name.lower()} (shared memory carries float32)"
    if shards:
        return "the coordinators are sharded (shared memory is for one coordinator on this host)"
    return None


def _open_shm(
    accepted: JoinAccepted, choice: str, arena_mib: float, timeout: float, why_not: str | None = None
) -> ShmChannel | None:
    """The shared-memory channel for `auto` or `shm`; auto falls back to gRPC with one INFO line
    saying why, shm raises the reason."""
    if choice == "grpc":
        return None
    try:
        if why_not is not None:
            raise FailedPreconditionError(why_not)
        if not accepted.shm_socket:
            raise FailedPreconditionError(
                "the coordinator offers no shared memory (it runs with --no-shm or without Linux memfd)"
            )
        return ShmChannel.open(accepted, int(arena_mib * 1024 * 1024), timeout)
    except GradServerError as exc:
        if choice == "shm":
            raise type(exc)(f"transport 'shm' is not available: {exc.message}") from None
        log.info("gradients go over gRPC: %s", exc.message)
        return None


def _wait_until_reachable(channel: grpc.Channel, address: str, limit: float, hint: str) -> None:
    """Waits (at most `limit` s) until the channel connects, logging progress now and then;
    raises UnavailableError naming the address and how long it was tried."""
    ready = grpc.channel_ready_future(channel)
    interval = min(_PROGRESS_MAX_S, max(_PROGRESS_MIN_S, limit / 5))
    started = time.monotonic()
    try:
        while True:
            remaining = started + limit - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(
                    f"cannot reach the coordinator at {address}: tried for {limit:g} s "
                    f"(the connect timeout){hint}"
                )
            try:
                ready.result(timeout=min(interval, remaining))
                return
            except grpc.FutureTimeoutError:
                elapsed = time.monotonic() - started
                if elapsed < limit:
                    log.info(
                        "still trying to reach the coordinator at %s (%.1f s of %g s)",
                        address,
                        elapsed,
                        limit,
                    )
    finally:
        ready.cancel()


def _join_at(
    address: str,
    request: JoinRequestIn,
    timeouts: Timeouts,
    tls: TlsFiles | None,
    server_name: str,
    metadata: tuple[tuple[str, str], ...],
) -> tuple[grpc.Channel, JoinAccepted]:
    """Reaches the coordinator (or shard) at `address` and joins; the channel stays open."""
    options: list[tuple[str, int | str]] = list(worker_channel_options())
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if tls is not None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
        )
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    try:
        hint = " (a TLS handshake may have failed: check --tls-ca and certificates)" if tls else ""
        _wait_until_reachable(channel, address, timeouts.connect, hint)
        join = channel.unary_unary(JOIN_METHOD)
        try:
            raw = join(codec.encode_join_request(request), timeout=timeouts.join, metadata=metadata)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code is grpc.StatusCode.DEADLINE_EXCEEDED and "join timed out" not in details:
                details = f"join did not complete within {timeouts.join:g} s ({details})"
            raise error_from_status(code, details) from exc
        accepted = codec.decode_join_accepted(raw)
        log.info("joined %s as worker %d of %d", address, accepted.worker_id, accepted.total_workers)
        return channel, accepted
    except BaseException:
        channel.close()
        raise


class WorkerClient:
    """A joined worker with one open Exchange stream. Create it with `WorkerClient.connect`."""

    def __init__(
        self,
        channel: grpc.Channel,
        accepted: JoinAccepted,
        timeouts: Timeouts,
        address: str,
        metadata: tuple[tuple[str, str], ...] = (),
        encoder: WireEncoder | None = None,
        shards: list[ShardLink] | None = None,
        shm: ShmChannel | None = None,
    ) -> None:
        self._channel = channel
        self._encoder = encoder or WireEncoder(DType.FLOAT32)
        self._accepted = accepted
        self.timeouts = timeouts
        self.address = address
        self._shm = shm
        # Sharded coordinators: `shards` are the joined shards 1..K-1 (see worker/_sharded.py).
        self._shard_links = shards or []
        self._stream: ExchangeStream | ShardedExchange
        if self._shard_links:
            self._stream = ShardedExchange((channel, accepted), self._shard_links, timeouts, metadata)
        else:
            self._stream = ExchangeStream(channel, accepted, timeouts, metadata, shm)
        self._sent: dict[KeyKind, collections.deque[TensorKey]] = {
            kind: collections.deque() for kind in KeyKind
        }
        self._closed = False

    @classmethod
    def connect(
        cls,
        address: str,
        node_id: str = "",
        gpu_count: int = 0,
        backend: str = "cpu",
        timeout: float | Timeouts | None = None,
        *,
        tls: TlsFiles | None = None,
        auth_token: str = "",
        server_name: str = "",
        committed_step: int | None = None,
        fingerprint: Mapping[str, str] | None = None,
        rank: int | None = None,
        wire_dtype: str | DType = "float32",
        error_feedback: bool = False,
        transport: str | None = None,
        shm_arena_mib: float = DEFAULT_SHM_ARENA_MIB,
    ) -> Self:
        """Reaches the coordinator at HOST:PORT, joins (waiting for the whole world) and opens
        the gradient stream. `timeout` is seconds for every wait, or a `Timeouts`. `tls` turns on
        TLS (its `ca` verifies the coordinator; `cert` and `key` are this worker's for mutual
        TLS); `auth_token` is sent on every call; `server_name` overrides the name the
        coordinator's certificate is checked against. `committed_step` (steps this worker has
        applied) is given when rejoining a restarted coordinator; `resume_step` then says where
        every worker resumes. `fingerprint` maps each setting that must agree across the job's
        workers to its value: the coordinator refuses a joiner whose map differs from the
        first joiner's, naming the fields. `rank` asks for that worker id (a torch rank) instead
        of the lowest free one: a rank out of range or already taken is refused, naming it.
        `wire_dtype` (float32, bfloat16, float16) is what gradients travel as: arrays are still
        given and returned as float32, rounded once before sending; `error_feedback` (16-bit
        only) adds each key slot's rounding error to its next gradient. Every worker of a job
        must use the same wire dtype (the coordinator fails a step whose workers differ).
        `transport` is "auto" (default, or $GRADSERVER_TRANSPORT): shared memory when the
        coordinator proves it is on this host, else gRPC; "grpc"; or "shm", which raises when
        shared memory is not available (also with a 16-bit wire or sharded coordinators, which
        are for networks). `shm_arena_mib` bounds this worker's input arena."""
        timeouts = Timeouts.of(timeout)
        choice = _transport_choice(transport)
        try:
            encoder = WireEncoder(parse_wire_dtype(wire_dtype), error_feedback=error_feedback)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        parse_address(address, what="coordinator address")
        node_id = node_id or socket.gethostname()
        metadata = bearer_metadata(auth_token)
        request = JoinRequestIn(
            node_id,
            gpu_count,
            backend,
            codec.PROTOCOL_VERSION,
            committed_step,
            dict(fingerprint or {}),
            rank=rank,
        )

        def join_at(at: str, request: JoinRequestIn) -> tuple[grpc.Channel, JoinAccepted]:
            return _join_at(at, request, timeouts, tls, server_name, metadata)

        channel, accepted = join_at(address, request)
        try:
            shards = None
            if len(accepted.shard_map) > 1:
                # Sharded coordinators: join every other shard as the worker id shard 0 gave.
                shards = join_other_shards(
                    accepted,
                    lambda index, at: join_at(
                        at, dataclasses.replace(request, rank=accepted.worker_id, shard_index=index)
                    ),
                )
            shm = _open_shm(accepted, choice, shm_arena_mib, timeouts.connect, _why_not_shm(encoder, shards))
            if shm is not None:
                log.info("worker %d sends its gradients through shared memory", accepted.worker_id)
            try:
                client = cls(channel, accepted, timeouts, address, metadata, encoder, shards, shm)
            except BaseException:
                if shm is not None:
                    shm.close()
                raise
            try:
                client._stream.confirm_open(timeouts.connect)
            except BaseException:
                client.close()
                raise
            return client
        except BaseException:
            channel.close()
            raise

    # --- identity -----------------------------------------------------------------------------

    @property
    def worker_id(self) -> int:
        return self._accepted.worker_id

    @property
    def total_workers(self) -> int:
        return self._accepted.total_workers

    @property
    def session_id(self) -> int:
        return self._accepted.session_id

    @property
    def chunk_bytes(self) -> int:
        return self._accepted.chunk_bytes

    @property
    def resume_step(self) -> int | None:
        """After a rejoin (`committed_step` given): the step every worker resumes from."""
        return self._accepted.resume_step

    @property
    def local_workers(self) -> int:
        """How many of the job's workers joined from this worker's host (itself included)."""
        return self._accepted.local_workers

    @property
    def max_steps(self) -> int:
        """The coordinator's --max-steps (0: no limit)."""
        return self._accepted.max_steps

    @property
    def wire_dtype(self) -> DType:
        return self._encoder.dtype

    @property
    def heartbeat_timeout(self) -> float:
        return self._accepted.heartbeat_timeout_s

    @property
    def transport(self) -> str:
        """How gradients move: "shm" (same-host shared memory) or "grpc"."""
        return "shm" if self._shm is not None else "grpc"

    def gradient_buffer(self, num_elements: int) -> np.ndarray:
        """A zeroed float32 array of `num_elements` to build gradients in. Over shared memory it
        lies in this worker's registered arena, so sending it (or a slice) copies nothing; keep
        its contents unchanged until the average of what was sent from it has been received. Under
        gRPC (or when the arena has no room left) it is a plain array."""
        if (
            isinstance(num_elements, bool)
            or not isinstance(num_elements, (int, np.integer))
            or num_elements < 0
        ):
            raise InvalidArgumentError(
                f"gradient_buffer needs a non-negative element count, got {num_elements!r}"
            )
        array = self._shm.gradient_buffer(int(num_elements)) if self._shm is not None else None
        if array is None:
            return np.zeros(int(num_elements), dtype=np.float32)
        array[:] = 0.0
        return array

    # --- per-block gradients ------------------------------------------------------------------

    def send_block_gradient(
        self,
        step: int,
        block_idx: int,
        num_blocks: int,
        gradients: Any,
        component_sizes: tuple[int, ...] | list[int],
        *,
        into: Any = None,
    ) -> None:
        """Contributes one block's flat gradient (9 components in protocol order).

        With `into` (a C-contiguous float32 numpy array or CPU tensor of the gradient's size; it
        may be `gradients` itself, for an in-place allreduce as gloo does) the average is written
        there chunk by chunk as it arrives, and the receive returns that array: no result array
        is allocated. Leave it alone until the receive returns; after a failed step its contents
        are unspecified. The other `send_*` methods take `into` too."""
        self._check_step(step)
        if not 0 <= block_idx < num_blocks:
            raise InvalidArgumentError(
                f"step {step}: block_idx {block_idx} is out of range for num_blocks {num_blocks}",
                step=step,
            )
        key = TensorKey.block(step, block_idx, num_blocks)
        sizes = tuple(int(s) for s in component_sizes)
        if len(sizes) != BLOCK_GRAD_COMPONENTS or any(s < 0 for s in sizes):
            raise InvalidArgumentError(
                f"{key}: need {BLOCK_GRAD_COMPONENTS} non-negative component_sizes, got {list(sizes)}",
                step=step,
                key=str(key),
            )
        array = as_float32_array(gradients, what=str(key))
        if array.size != sum(sizes):
            raise InvalidArgumentError(
                f"{key}: data length {array.size} != sum(component_sizes) {sum(sizes)}",
                step=step,
                key=str(key),
            )
        self._send_tensor(key, array, sizes, into=into)

    def receive_averaged_block(self, timeout: float | None = None) -> AveragedBlock:
        """The average of the oldest block this worker sent and has not received yet."""
        key, result = self._receive(KeyKind.BLOCK, timeout)
        return AveragedBlock(
            step=key.step,
            block_idx=key.index,
            num_blocks=key.num_blocks,
            gradients=result.array,
            component_sizes=result.component_sizes,
            num_contributors=result.num_contributors,
        )

    # --- non-block gradients ------------------------------------------------------------------

    def send_non_block_gradient(
        self, step: int, component: int | str | NonBlockComponent, gradients: Any, *, into: Any = None
    ) -> None:
        """Contributes the LM head (0), final norm (1) or embedding (2) gradient."""
        self._check_step(step)
        key = TensorKey.non_block(step, parse_non_block_component(component))
        self._send_tensor(key, as_float32_array(gradients, what=str(key)), (), into=into)

    def receive_averaged_non_block(self, timeout: float | None = None) -> AveragedNonBlock:
        key, result = self._receive(KeyKind.NON_BLOCK, timeout)
        return AveragedNonBlock(
            step=key.step,
            component=NonBlockComponent(key.index),
            gradients=result.array,
            num_contributors=result.num_contributors,
        )

    # --- whole-model gradients ----------------------------------------------------------------

    def send_gradients(
        self, step: int, gradients: Any, loss: float, correct: int, total: int, *, into: Any = None
    ) -> None:
        """Contributes a whole-model gradient with this worker's loss and sample counts."""
        self._check_step(step)
        key = TensorKey.whole_model(step)
        if not np.isfinite(loss) or correct < 0 or total < 0 or correct > total:
            raise InvalidArgumentError(
                f"{key}: need a finite loss and 0 <= correct <= total, got loss={loss} "
                f"correct={correct} total={total}",
                step=step,
                key=str(key),
            )
        stats = SampleStats(float(loss), int(correct), int(total))
        self._send_tensor(key, as_float32_array(gradients, what=str(key)), (), stats, into=into)

    def receive_averaged(self, timeout: float | None = None) -> AveragedGradients:
        key, result = self._receive(KeyKind.WHOLE_MODEL, timeout)
        stats = result.stats or SampleStats(float("nan"), 0, 0)
        return AveragedGradients(
            step=key.step,
            gradients=result.array,
            global_loss=stats.loss,
            correct=stats.correct,
            total=stats.total,
            num_contributors=result.num_contributors,
        )

    # --- barrier, shards, heartbeat -----------------------------------------------------------

    def barrier(self, step: int, name: str = "", timeout: float | None = None) -> None:
        """Returns when every worker has reached barrier `name` of `step`."""
        self._check_step(step)
        bar = self._stream.expect_barrier(step, name)
        try:
            self._stream.send(BarrierIn(self.worker_id, step, name))
        except BaseException:
            self._stream.forget_barrier(step, name)
            raise
        self._stream.wait_barrier(step, name, bar, timeout)

    def request_shard(self, step: int, dataset_size: int, batch_size: int) -> None:
        """Asks which samples this worker trains on at `step`; see `receive_shard`."""
        self._check_step(step)
        if dataset_size < 1 or batch_size < 1:
            raise InvalidArgumentError(
                f"step {step}: dataset_size and batch_size must be positive, got "
                f"{dataset_size} and {batch_size}",
                step=step,
            )
        self._stream.send(ShardRequestIn(self.worker_id, step, dataset_size, batch_size))

    def receive_shard(self, timeout: float | None = None) -> ShardAssignment:
        shard = self._stream.wait_shard(timeout)
        return ShardAssignment(shard.step, shard.worker_id, shard.ranges)

    def get_shard(self, step: int, dataset_size: int, batch_size: int) -> ShardAssignment:
        self.request_shard(step, dataset_size, batch_size)
        return self.receive_shard()

    def send_heartbeat(self) -> None:
        """Sends one heartbeat now (a background thread already sends them periodically)."""
        self._stream.send(HeartbeatIn(self.worker_id, 0))

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the job and closes the connection. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stream.close()
        finally:
            self._channel.close()
            for link in self._shard_links:
                link.channel.close()
            if self._shm is not None:
                self._shm.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------

    def _check_step(self, step: int) -> None:
        if self._closed:
            raise UnavailableError("this WorkerClient is closed")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative integer, got {step!r}")

    def _send_tensor(
        self,
        key: TensorKey,
        array: np.ndarray,
        sizes: tuple[int, ...],
        stats: SampleStats | None = None,
        *,
        into: Any = None,
    ) -> None:
        limit = self._accepted.max_tensor_elements
        if array.size > limit:
            raise InvalidArgumentError(
                f"{key}: {array.size} elements exceed the coordinator's limit of {limit}",
                step=key.step,
                key=str(key),
            )
        result = None if into is None else as_result_buffer(into, int(array.size), what=str(key))
        self._stream.raise_if_broken()
        payload = self._encoder.encode(key, array)
        header = ChunkHeader(self._encoder.dtype, int(array.size), sizes)
        self._stream.expect(key, sizes, int(array.size), self._encoder.dtype, array=result)
        try:
            # Chunks cut at the same element offsets whatever the dtype: the coordinator's chunk
            # size is in float32 elements, so a 16-bit chunk carries half the bytes.
            for offset, length in chunk_spans(int(array.size), self.chunk_bytes // 4):
                piece = payload[offset : offset + length]
                ref = self._shm.stage(key, offset, piece) if self._shm is not None else None
                if ref is None:
                    self._stream.send(ChunkIn(self.worker_id, key, header, offset, piece.data, stats))
                else:
                    self._stream.send(ChunkIn(self.worker_id, key, header, offset, b"", stats, ref))
        except BaseException:
            self._stream.forget(key)
            if self._shm is not None:
                self._shm.key_done(key)
            raise
        self._sent[key.kind].append(key)

    def _receive(self, kind: KeyKind, timeout: float | None) -> tuple[TensorKey, PendingResult]:
        if self._closed:
            raise UnavailableError("this WorkerClient is closed")
        sent = self._sent[kind]
        if not sent:
            raise FailedPreconditionError(
                f"nothing to receive: this worker has no {kind.value.replace('_', '-')} gradient "
                "awaiting its average"
            )
        key = sent[0]
        try:
            result = self._stream.wait_result(key, timeout)
        except BaseException:
            # A local timeout (or a broken stream) leaves the key first in line: a later receive
            # keeps waiting for it. An error about the key settles it.
            if not self._stream.awaiting(key):
                self._settle(sent, key)
            raise
        sent.popleft()
        return key, result

    def _settle(self, sent: collections.deque[TensorKey], key: TensorKey) -> None:
        """Takes `key` out of line after its receive raised. When its whole step failed, this
        kind's other keys of that step go too: the caller has been told the step is void, and
        they must not stand before the next step's keys (each kind reports a failed step once)."""
        if not self._stream.step_failed(key.step):
            sent.remove(key)
            return
        for stale in [k for k in sent if k.step == key.step]:
            sent.remove(stale)
            self._stream.forget(stale)
