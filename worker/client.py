"""WorkerClient: the blocking API a training process uses to average gradients.

Names follow the reference WorkerClient. Sends return once the data is queued for the
transport; each receive returns the next average of that kind in the order this worker sent its
keys, so lockstep use (send block i, receive block i) and pipelined use (send all, then receive
all) both work. Every call has a deadline (`Timeouts`), and every failure is an exception of
`gradserver.common.errors`.

`send(key, array)`, `receive(kind)` and `allocate(n)` are the general calls; the per-kind ones
(`send_block_gradient`, `receive_averaged`, ...) are thin wrappers on them. How the bytes travel
is the `Link`'s business (`worker/transports/`, picked by `open_link` in `connect`): this class
only checks arguments, applies the wire-dtype layer, cuts chunks and keeps the receive order.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Self

import grpc
import numpy as np

from gradserver.common import codec, collective_rules
from gradserver.common.chunking import chunk_spans
from gradserver.common.components import (
    BLOCK_GRAD_COMPONENTS,
    NonBlockComponent,
    parse_non_block_component,
)
from gradserver.common.config import environment_value, parse_address
from gradserver.common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from gradserver.common.messages import (
    BYTE_KINDS,
    QUANTIZED_DTYPES,
    START_AT_WINDOW,
    ChunkHeader,
    CollectiveKind,
    DType,
    HeartbeatIn,
    JoinAccepted,
    JoinRequestIn,
    KeyKind,
    SampleRangeRequestIn,
    SampleStats,
    StartAtIn,
    TensorKey,
)
from gradserver.common.quantized_wire import decode_words, pack
from gradserver.common.security import TlsFiles, bearer_metadata
from gradserver.common.timeouts import Timeouts
from gradserver.common.wire_dtype import parse_wire_dtype

from . import transports
from ._wire_encoder import WireEncoder, wire_encoder
from .joining import join_at
from .recovery import RESERVED_TAGS, RecoveredState, StateServer, StateSnapshot, recover
from .results import (
    AveragedBlock,
    AveragedGradients,
    AveragedNonBlock,
    AveragedTensor,
    SampleRangeAssignment,
)
from .tensors import as_byte_array, as_byte_buffer, as_float32_array, as_result_buffer
from .transports import DEFAULT_SHM_ARENA_MIB, TRANSPORTS, LaneClient, Link, Mailbox, PeerReceive, PeerSend

# TRANSPORTS stays importable from here: `gradserver worker` offers them as --transport choices.
__all__ = ["TRANSPORTS", "WorkerClient"]


class WorkerClient:
    """A joined worker with an open link to its coordinator(s). Create it with
    `WorkerClient.connect`.

    Results: a key sent with `into=` is averaged into that buffer. Without it, the result is a
    numpy array the client owns. Over shared memory it lies in this worker's input arena while
    room is left there: the chunks are copied there instead of into staging slots and the
    coordinator writes the average over them, so nothing is copied out; its memory returns to
    the arena when the array (and every view of it) is collected. Otherwise, to spare a fresh
    allocation (and its page faults) per key and step, the client reuses the array it returned
    for the same key slot (kind and index: a block, a non-block component, the whole model, a
    collective's group) at an earlier step, when it has the same size and nothing but the client
    holds it: no reference to the array itself, to a view of it (a slice, `reshape`, a component
    of `AveragedBlock.components()`), a memoryview, a `torch.from_numpy` tensor or a weak
    reference. A result you keep is therefore never overwritten; one you dropped may be (only a
    raw pointer taken from it, such as `array.ctypes.data`, is not seen). At most one array per
    key slot is kept."""

    def __init__(
        self,
        link: Link,
        encoder: WireEncoder,
        timeouts: Timeouts,
        address: str,
        mailbox: Mailbox | None = None,
    ) -> None:
        self._link = link
        # Point-to-point messages; without shared rings (a client built around a link) all relayed.
        self._mailbox = mailbox or Mailbox(link.control, link.accepted, timeouts.receive, None)
        self._encoder = encoder
        self._accepted = link.accepted
        self.timeouts = timeouts
        self.address = address
        self._sent: dict[KeyKind, collections.deque[TensorKey]] = {
            kind: collections.deque() for kind in KeyKind
        }
        # The result arrays of keys sent without `into`: at most one per key slot (kind, index),
        # handed out again for the same slot's next key when nobody else holds it (`_result_for`).
        self._pool: dict[tuple[KeyKind, int], np.ndarray] = {}
        self._pool_lock = threading.Lock()
        # Keys sent in a quantized dtype: their words arrive in the link's array and are decoded,
        # once the whole key is in, into the float32 array here ((array, chunk words)).
        self._decodes: dict[TensorKey, tuple[np.ndarray, int]] = {}
        # Per-call wire dtypes (`wire=`), one encoder each, without error feedback.
        self._call_encoders: dict[DType, WireEncoder] = {}
        self._closed = False
        self._stepped = False  # something of a step was sent or asked for (start_at is too late)
        self._state_server: StateServer | None = None

    @classmethod
    def connect(
        cls,
        address: str,
        node_id: str = "",
        gpu_count: int = 0,
        device_type: str = "cpu",
        timeout: float | Timeouts | None = None,
        *,
        backend: str | None = None,
        tls: TlsFiles | None = None,
        auth_token: str | None = None,
        server_name: str = "",
        committed_step: int | None = None,
        fingerprint: Mapping[str, str] | None = None,
        rank: int | None = None,
        wire_dtype: str | DType = "float32",
        error_feedback: bool = False,
        transport: str | None = None,
        shm_arena_mib: float = DEFAULT_SHM_ARENA_MIB,
        host_groups: bool | None = None,
        host_id: str | None = None,
        peer_memory: bool = False,
    ) -> Self:
        """Reaches the coordinator at HOST:PORT, joins (waiting for the whole world) and opens
        the gradient stream. `timeout` is seconds for every wait, or a `Timeouts`. `tls` turns on
        TLS (its `ca` verifies the coordinator; `cert` and `key` are this worker's for mutual
        TLS); `auth_token` is sent on every call (None: $GRADSERVER_AUTH_TOKEN, as the CLI reads it;
        "": none); `server_name` overrides the name the
        coordinator's certificate is checked against. `committed_step` (steps this worker has
        applied) is given when rejoining a restarted coordinator; `resume_step` then says where
        every worker resumes. `fingerprint` maps each setting that must agree across the job's
        workers to its value: the coordinator refuses a joiner whose map differs from the
        first joiner's, naming the fields. `rank` asks for that worker id (a torch rank) instead
        of the lowest free one: a rank out of range or already taken is refused, naming it.
        `wire_dtype` (float32, bfloat16, float16, int8, int4) is what gradients travel as: arrays
        are still given and returned as float32, rounded once (16-bit) or block-quantized (int8,
        int4: summed by the coordinator, which answers one quantized result) before sending;
        `error_feedback` (not float32) adds each key slot's rounding error to its next gradient.
        Every worker of a job must use the same wire dtype (the coordinator fails a step whose
        workers differ).
        `transport` is "auto" (default, or $GRADSERVER_TRANSPORT): shared memory when the
        coordinator proves it is on this host, else gRPC; "grpc"; or "shm", which raises when
        shared memory is not available (also with a 16-bit wire or partitioned coordinators, which
        are for networks). `shm_arena_mib` bounds this worker's input arena. `host_groups` (default
        on, or $GRADSERVER_HOST_GROUPS): workers that share a host other than the coordinator's
        sum their gradients there, so each chunk crosses that host's link once
        (docs/PROTOCOL.md "Host groups"); `host_id` overrides what this worker says it shares a
        host with (tests emulate hosts so). `peer_memory`: point-to-point messages (`send_to`,
        `receive_from`) to workers on this host that asked for it too go through shared memory
        instead of the coordinator. `device_type` ("cpu",
        "cuda") is what the coordinator logs; `backend` is its deprecated name (a
        DeprecationWarning), from when "backend" also meant the torch.distributed backend."""
        if backend is not None:
            warnings.warn(
                "WorkerClient.connect(backend=...) is deprecated and goes in the next release: "
                "use device_type=...",
                DeprecationWarning,
                stacklevel=2,
            )
            device_type = backend
        timeouts = Timeouts.of(timeout)
        choice = transports.transport_choice(transport)
        try:
            encoder = wire_encoder(parse_wire_dtype(wire_dtype), error_feedback=error_feedback)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        parse_address(address, what="coordinator address")
        node_id = node_id or socket.gethostname()
        token = environment_value("auth_token") if auth_token is None else auth_token
        metadata = bearer_metadata(token)
        request = JoinRequestIn(
            node_id,
            gpu_count,
            device_type,
            codec.PROTOCOL_VERSION,
            committed_step,
            dict(fingerprint or {}),
            rank=rank,
            shared_memory=transports.shm_intended(choice, encoder.dtype),
            wire_dtype=encoder.dtype,
            host_id=transports.host_identity(host_groups, host_id),
            peer_host_id=transports.peer_host_identity(peer_memory),
        )

        def join(at: str, request: JoinRequestIn) -> tuple[grpc.Channel, JoinAccepted]:
            return join_at(at, request, timeouts, tls, server_name, metadata)

        def join_partition(index: int, at: str) -> tuple[grpc.Channel, JoinAccepted]:
            # Every other coordinator partition is joined as the worker id partition 0 gave, with
            # the chunk size partition 0 chose, which the others adopt.
            again = dataclasses.replace(
                request,
                rank=accepted.worker_id,
                partition_index=index,
                job_chunk_bytes=accepted.chunk_bytes,
                job_host_group=accepted.host_group,
            )
            return join(at, again)

        channel, accepted = join(address, request)
        link = transports.open_link(
            channel,
            accepted,
            timeouts,
            metadata,
            join_partition,
            choice=choice,
            wire_dtype=encoder.dtype,
            shm_arena_mib=shm_arena_mib,
        )
        try:
            mailbox = transports.open_mailbox(link, accepted, timeouts)
        except BaseException:
            link.close()
            raise
        client = cls(link, encoder, timeouts, address, mailbox)
        try:
            link.control.confirm_open(timeouts.connect)
        except BaseException:
            client.close()
            raise
        return client

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
    def host_group(self) -> tuple[int, ...]:
        """The worker ids of the host group this worker sums with (empty: none)."""
        return self._link.host_group

    @property
    def transport(self) -> str:
        """How gradients move: "shm" (same-host shared memory) or "grpc"."""
        return self._link.transport

    def allocate(self, num_elements: int) -> np.ndarray:
        """A zeroed float32 array of `num_elements` to build gradients in. Where the transport
        can send from memory it owns (shared memory), the array lies there, so sending it (or a
        slice) copies nothing; keep its contents unchanged until the average of what was sent
        from it has been received. Otherwise (or when that memory has no room left) it is a plain
        array."""
        if (
            isinstance(num_elements, bool)
            or not isinstance(num_elements, (int, np.integer))
            or num_elements < 0
        ):
            raise InvalidArgumentError(
                f"allocate (gradient_buffer) needs a non-negative element count, got {num_elements!r}"
            )
        array = self._link.allocate(int(num_elements))
        if array is None:
            return np.zeros(int(num_elements), dtype=np.float32)
        array[:] = 0.0
        return array

    def gradient_buffer(self, num_elements: int) -> np.ndarray:
        """The former name of `allocate`."""
        return self.allocate(num_elements)

    # --- any key ------------------------------------------------------------------------------

    def send(
        self,
        key: TensorKey,
        array: Any,
        *,
        into: Any = None,
        component_sizes: tuple[int, ...] | list[int] = (),
        stats: SampleStats | None = None,
        exact: bool = False,
        wire: str | None = None,
    ) -> None:
        """Contributes `array` (float32: numpy, CPU or CUDA torch, or a sequence) to `key`'s
        reduction. Block keys carry their 9 `component_sizes`, whole-model keys this worker's
        `stats`. With `into` the result is written there (see `send_block_gradient`). Returns once
        every chunk is queued for the transport; `receive(key.kind)` returns the result.
        `exact`: sent and averaged as float32 whatever the client's wire dtype, for values a
        16-bit wire must not round (integers carried as float32, counts); every worker must
        say the same for a key. `wire`: this key's wire dtype by name (e.g. "int8"), whatever
        the client's, without error feedback; every worker must say the same for a key.
        A collective key of a kind that moves bytes (ALL_GATHER, BROADCAST, ALL_TO_ALL) takes an
        array of any dtype and sends its raw bytes (a BROADCAST's non-root ranks send none, only
        their length); its result is uint8 (`into`: any dtype of the result's size in bytes)."""
        self._check_step(key.step)
        if key.kind is KeyKind.COLLECTIVE and key.collective_kind in BYTE_KINDS:
            self._send_bytes(key, as_byte_array(array, what=str(key)), into=into)
            return
        sizes = tuple(int(s) for s in component_sizes)
        if key.kind is KeyKind.BLOCK and (len(sizes) != BLOCK_GRAD_COMPONENTS or any(s < 0 for s in sizes)):
            raise InvalidArgumentError(
                f"{key}: need {BLOCK_GRAD_COMPONENTS} non-negative component_sizes, got {list(sizes)}",
                step=key.step,
                key=str(key),
            )
        flat = as_float32_array(array, what=str(key))
        if key.kind is KeyKind.BLOCK and flat.size != sum(sizes):
            raise InvalidArgumentError(
                f"{key}: data length {flat.size} != sum(component_sizes) {sum(sizes)}",
                step=key.step,
                key=str(key),
            )
        self._send_tensor(key, flat, sizes, stats, into=into, exact=exact, wire=wire)

    def receive(self, kind: KeyKind, timeout: float | None = None) -> AveragedTensor:
        """The result of the oldest key of `kind` this worker sent and has not received yet: the
        `into` buffer it was sent with, else an array of the client's that it reuses for the same
        key slot only after every reference to it is gone (see the class docstring)."""
        key, result = self._receive(kind, timeout)
        return AveragedTensor(
            key=key,
            gradients=result.array,
            component_sizes=result.component_sizes,
            num_contributors=result.num_contributors,
            stats=result.stats,
        )

    def collective(
        self,
        key: TensorKey,
        array: Any,
        *,
        into: Any = None,
        timeout: float | None = None,
        exact: bool = False,
        wire: str | None = None,
    ) -> np.ndarray:
        """Runs the collective `key` to its end and returns its result: what `send(key, array,
        into=into)` then `receive(COLLECTIVE, timeout)` give, in one call. When every worker of
        the job reaches the coordinator through this host's shared memory, it goes through the
        coordinator's collective lane (docs/PROTOCOL.md): no gRPC message, about 30-100 µs of
        control instead of a millisecond. Every worker must run its collectives in the same
        order, and none may be sent with `send` and not yet received. `exact`, `wire`: as
        `send`'s (a quantized key goes to the coordinator, never through the lane, whose
        rounds sum float32)."""
        self._check_step(key.step)
        if key.kind is not KeyKind.COLLECTIVE:
            raise InvalidArgumentError(
                f"collective() takes collective keys, got {key}", step=key.step, key=str(key)
            )
        lane = self._link.lane()
        quantized = self._encoder_for(key, exact, wire).dtype in QUANTIZED_DTYPES
        if lane is not None and not quantized and not self._sent[KeyKind.COLLECTIVE]:
            result = self._run_in_lane(lane, key, array, into, timeout)
            if result is not None:
                return result
        self.send(key, array, into=into, exact=exact, wire=wire)
        return self.receive(KeyKind.COLLECTIVE, timeout).gradients

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
        are unspecified. The other `send_*` methods take `into` too. Without `into`, the receive
        returns an array of the client's, reused for this block at a later step only once
        nothing holds it any more (see the class docstring): keep it, or a view of it, and it
        stays as it is."""
        self._check_step(step)
        if not 0 <= block_idx < num_blocks:
            raise InvalidArgumentError(
                f"step {step}: block_idx {block_idx} is out of range for num_blocks {num_blocks}",
                step=step,
            )
        key = TensorKey.block(step, block_idx, num_blocks)
        self.send(key, gradients, into=into, component_sizes=component_sizes)

    def receive_averaged_block(self, timeout: float | None = None) -> AveragedBlock:
        """The average of the oldest block this worker sent and has not received yet."""
        result = self.receive(KeyKind.BLOCK, timeout)
        return AveragedBlock(
            step=result.key.step,
            block_idx=result.key.index,
            num_blocks=result.key.num_blocks,
            gradients=result.gradients,
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
        self.send(key, gradients, into=into)

    def receive_averaged_non_block(self, timeout: float | None = None) -> AveragedNonBlock:
        result = self.receive(KeyKind.NON_BLOCK, timeout)
        return AveragedNonBlock(
            step=result.key.step,
            component=NonBlockComponent(result.key.index),
            gradients=result.gradients,
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
        self.send(key, gradients, into=into, stats=SampleStats(float(loss), int(correct), int(total)))

    def receive_averaged(self, timeout: float | None = None) -> AveragedGradients:
        result = self.receive(KeyKind.WHOLE_MODEL, timeout)
        stats = result.stats or SampleStats(float("nan"), 0, 0)
        return AveragedGradients(
            step=result.key.step,
            gradients=result.gradients,
            global_loss=stats.loss,
            correct=stats.correct,
            total=stats.total,
            num_contributors=result.num_contributors,
        )

    # --- barrier, sample ranges, heartbeat ----------------------------------------------------

    def barrier(self, step: int, name: str = "", timeout: float | None = None) -> None:
        """Returns when every worker has reached barrier `name` of `step`."""
        self._check_step(step)
        self._link.control.barrier(step, name, timeout)

    # --- live recovery --------------------------------------------------------------------------

    @property
    def recovery_step(self) -> int | None:
        """Set when this worker joined a running job (it took a departed worker's place): the
        step it takes part from, whose state it must first take with `recover` (None: it joined
        as the job began)."""
        return self._accepted.recovery_step

    def start_at(self, step: int) -> None:
        """Takes part from `step` instead of `recovery_step` (not earlier, and at most
        `START_AT_WINDOW` steps past the step this worker joined with), before this worker sends
        anything: what waits for it in earlier steps completes without it, and `recover` then
        takes the state at `step`. The members of a replica group that join one job per shard at
        once (HSDP) agree on the latest of their recovery steps and all start there.

        Checks here what the coordinator checks (server/message_rules.py), so a request it would
        refuse raises at once instead of leaving this worker waiting for a state no donor reaches:
        `FailedPreconditionError` without a plan to move (joined as the job began, or rejoined a
        restarted coordinator, where every member resumes together), with partitioned
        coordinators, or once this worker sent anything; `InvalidArgumentError` for a step outside
        the plan's range."""
        self._check_step(step, takes_part=False)
        planned = self._accepted.recovery_step
        if planned is None:
            raise FailedPreconditionError(
                f"worker {self.worker_id} joined as the job began: it takes part in every step",
                worker_id=self.worker_id,
            )
        # The plan as joined: an earlier start_at may have moved `planned`, never the range.
        given = self._link.accepted.recovery_step
        if given is not None and given == self._accepted.resume_step:
            raise FailedPreconditionError(
                f"worker {self.worker_id} rejoined a restarted coordinator: every member resumes at step "
                f"{given} together, and start_at moves only the first step of a worker that took a "
                "departed one's place in a running job",
                worker_id=self.worker_id,
            )
        if step < planned:
            raise InvalidArgumentError(
                f"worker {self.worker_id} takes part from step {planned}: it cannot start at step {step}",
                worker_id=self.worker_id,
            )
        latest = (planned if given is None else given) + START_AT_WINDOW
        if step > latest:
            raise InvalidArgumentError(
                f"worker {self.worker_id} takes part from step {planned}: start_at moves it to step {latest} "
                f"at the latest ({START_AT_WINDOW} steps past the step it joined with), not to step {step}",
                worker_id=self.worker_id,
            )
        if self._accepted.partition_map:
            raise FailedPreconditionError(
                f"worker {self.worker_id}: start_at needs one coordinator, not partitioned ones",
                worker_id=self.worker_id,
            )
        if self._stepped:
            raise FailedPreconditionError(
                f"worker {self.worker_id} already took part in a step: start_at comes before it "
                "sends anything",
                worker_id=self.worker_id,
            )
        if step == planned:
            return
        self._link.control.send(StartAtIn(self.worker_id, step))
        self._accepted = dataclasses.replace(self._accepted, recovery_step=step)

    def recover(
        self,
        timeout: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        *,
        at: tuple[int, tuple[int, ...]] | None = None,
    ) -> RecoveredState:
        """Takes the job's state at the boundary of `recovery_step` from a live member (the
        coordinator names them, in order), checked byte for byte before it is returned (docs/
        PROTOCOL.md "Live recovery"). `timeout`: seconds each donor has to answer and to send
        each tensor (default: the receive timeout). `at` (step, donors): that step's state from
        those members instead, for members of a job that began anew who agreed among themselves
        which of them hold the latest state (gradserver.torch.ft after its coordinator restarted).
        Raises `AbortedError` naming each donor and why when none could give it."""
        wait = self.timeouts.receive if timeout is None else timeout
        if at is not None:
            return recover(self._mailbox, at[0], at[1], wait, progress)
        step = self._accepted.recovery_step
        if step is None:
            raise FailedPreconditionError(
                f"worker {self.worker_id} joined as the job began: there is no state to recover",
                worker_id=self.worker_id,
            )
        return recover(self._mailbox, step, self._accepted.donors, wait, progress)

    def offer_state(self, snapshot: Callable[[], StateSnapshot], timeout: float | None = None) -> None:
        """Serves this worker's state to workers that join the running job: `snapshot()`
        returns it (steps applied, tensors by name, extra bytes) and is called on a thread of the
        client's while the state is not being updated (wrap each update in `updating_state()`).
        `timeout`: how long a request waits for this worker to reach the step it asks for
        (default: the receive timeout). Once per client."""
        if self._closed:
            raise UnavailableError("this WorkerClient is closed")
        if self._state_server is not None:
            raise FailedPreconditionError(f"worker {self.worker_id} already offers its state")
        wait = self.timeouts.receive if timeout is None else timeout
        self._state_server = StateServer(self._mailbox, snapshot, wait)

    def updating_state(self) -> contextlib.AbstractContextManager[None]:
        """Wrap every change of the offered state (the optimizer step and the step count): it
        waits while a joining worker reads the state. Nothing to wait for without `offer_state`."""
        server = self._state_server
        return server.updating() if server is not None else contextlib.nullcontext()

    def check_state(self, step: int, digest: int, timeout: float | None = None) -> None:
        """A barrier that compares every worker's `state_digest` at the boundary of `step`:
        returns when the majority holds this worker's digest; a worker whose digest differs is
        evicted by the coordinator (its calls then fail naming both digests), and without a
        majority the step fails for everyone. Every worker checks at the same steps."""
        self._check_step(step)
        if isinstance(digest, bool) or not isinstance(digest, (int, np.integer)) or not 0 <= digest < 2**64:
            raise InvalidArgumentError(
                f"step {step}: a state digest is a 64-bit unsigned integer, got {digest!r}"
            )
        self._link.control.barrier(step, _STATE_BARRIER, timeout, digest=int(digest))

    def replacements(self) -> list[tuple[int, int]]:
        """(worker id, first step) of each worker that took a departed one's place while this
        one was a member (the latest 64), as the coordinator announced them."""
        return self._mailbox.joins()

    def request_sample_ranges(self, step: int, dataset_size: int, batch_size: int) -> None:
        """Asks which samples this worker trains on at `step`; see `receive_sample_ranges`."""
        self._check_step(step)
        if dataset_size < 1 or batch_size < 1:
            raise InvalidArgumentError(
                f"step {step}: dataset_size and batch_size must be positive, got "
                f"{dataset_size} and {batch_size}",
                step=step,
            )
        self._link.control.send(SampleRangeRequestIn(self.worker_id, step, dataset_size, batch_size))

    def receive_sample_ranges(self, timeout: float | None = None) -> SampleRangeAssignment:
        answer = self._link.control.wait_samples(timeout)
        return SampleRangeAssignment(answer.step, answer.worker_id, answer.ranges)

    def get_sample_ranges(self, step: int, dataset_size: int, batch_size: int) -> SampleRangeAssignment:
        self.request_sample_ranges(step, dataset_size, batch_size)
        return self.receive_sample_ranges()

    def send_heartbeat(self) -> None:
        """Sends one heartbeat now (a background thread already sends them periodically)."""
        self._link.control.send(HeartbeatIn(self.worker_id, 0))

    # --- lifecycle ----------------------------------------------------------------------------

    # --- point-to-point -------------------------------------------------------------------------

    def send_to(self, peer: int, data: np.ndarray, *, tag: int = 0) -> PeerSend:
        """Starts sending `data` (its raw bytes, any dtype; read until the send is complete, so
        keep it unchanged meanwhile) to worker `peer`, matched there by `tag`; returns at once.
        `PeerSend.wait(timeout)` returns once it is delivered (in the receiver's shared-memory
        ring, or written to its stream by the coordinator) or raises why not (the receiver left, the job
        failed). Messages to one worker with one tag arrive in the order sent (docs/PROTOCOL.md
        "Point-to-point")."""
        if self._closed:
            raise UnavailableError("this WorkerClient is closed")
        return self._mailbox.send(int(peer), _own_tag(tag), np.asarray(data))

    def receive_from(
        self, peer: int | None = None, *, tag: int = 0, into: np.ndarray | None = None
    ) -> PeerReceive:
        """Posts a receive of the next message with `tag` from worker `peer` (None: from any
        worker); returns at once. `PeerReceive.wait(timeout)` returns its raw bytes (written
        into `into` when given: the message must fill it exactly) and sets `sender`. Receives
        are matched in the order they were posted."""
        if self._closed:
            raise UnavailableError("this WorkerClient is closed")
        return self._mailbox.receive(None if peer is None else int(peer), _own_tag(tag), into)

    def close(self) -> None:
        """Leaves the job and closes the connection. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._mailbox.close()
        if self._state_server is not None:
            self._state_server.close()
        self._link.close()
        with self._pool_lock:
            self._pool.clear()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------

    def _check_step(self, step: int, *, takes_part: bool = True) -> None:
        """Refuses a closed client and a bad step; `takes_part`: the call sends or asks for
        something of the step (after which `start_at` is too late)."""
        if self._closed:
            raise UnavailableError("this WorkerClient is closed")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative integer, got {step!r}")
        self._stepped = self._stepped or takes_part

    def _send_tensor(
        self,
        key: TensorKey,
        array: np.ndarray,
        sizes: tuple[int, ...],
        stats: SampleStats | None = None,
        *,
        into: Any = None,
        exact: bool = False,
        wire: str | None = None,
    ) -> None:
        self._check_size(key, int(array.size), "elements")
        total = self._result_length(key, int(array.size))
        assert total is not None  # only ALL_TO_ALL has no length before its result, and it moves bytes
        encoder = self._encoder_for(key, exact, wire)
        if encoder.dtype in QUANTIZED_DTYPES:
            self._send_quantized(key, array, sizes, stats, encoder, into=into)
            return
        if into is not None:
            result = as_result_buffer(into, total, what=str(key))
        elif total == array.size and (placed := self._link.result_buffer(total)) is not None:
            result = placed  # averaged there (shared memory), not copied out
        else:
            result = self._result_for(key, total, np.float32)
        self._link.raise_if_broken()
        payload = encoder.encode(key, array)
        header = ChunkHeader(encoder.dtype, int(array.size), sizes)
        self._link.expect(key, sizes, total, encoder.dtype, array=result)
        self._send_chunks(key, header, payload, stats)

    def _encoder_for(self, key: TensorKey, exact: bool, wire: str | None) -> WireEncoder:
        """What `key` is sent with: float32 when `exact`, the dtype `wire` names, else the
        client's wire dtype (with its error feedback)."""
        if exact:
            return _FLOAT32_WIRE
        if wire is None:
            return self._encoder
        try:
            dtype = parse_wire_dtype(wire)
        except ValueError as exc:
            raise InvalidArgumentError(f"{key}: {exc}", step=key.step, key=str(key)) from None
        if dtype is self._encoder.dtype and not self._encoder.error_feedback:
            return self._encoder
        encoder = self._call_encoders.get(dtype)
        if encoder is None:
            encoder = self._call_encoders[dtype] = wire_encoder(dtype)
        return encoder

    def _send_quantized(
        self,
        key: TensorKey,
        array: np.ndarray,
        sizes: tuple[int, ...],
        stats: SampleStats | None,
        encoder: WireEncoder,
        *,
        into: Any = None,
    ) -> None:
        """`key` as block-quantized records laid out in this job's chunks (common/quantized_wire.py):
        the coordinator sums them and answers words of the same layout, decoded when the key is
        received. Refused where the sum would not be the coordinator's: a REDUCE_SCATTER, and a
        key this worker's host group would sum first."""
        dtype = encoder.dtype
        problem = None
        if not collective_rules.quantized_sum_exact(key):
            problem = collective_rules.quantized_problem(key, dtype)
        elif self._link.host_group and collective_rules.summed_on_hosts(key):
            problem = (
                f"{key.describe()} cannot carry {dtype.name}: this worker sums in host group "
                f"{list(self._link.host_group)}, whose partial sums would be requantized; turn host "
                "groups off (host_groups=False, GRADSERVER_HOST_GROUPS=0) or send float32"
            )
        if problem is not None:
            raise InvalidArgumentError(f"{key}: {problem}", step=key.step, key=str(key))
        chunk_words = self.chunk_bytes // 4
        result = (
            as_result_buffer(into, int(array.size), what=str(key))
            if into is not None
            else self._result_for(key, int(array.size), np.float32)
        )
        self._link.raise_if_broken()
        try:
            words = pack(encoder.encode(key, array), dtype, chunk_words)
        except ValueError as exc:
            raise InvalidArgumentError(f"{key}: {exc}", step=key.step, key=str(key)) from None
        header = ChunkHeader(dtype, int(words.size), sizes)
        self._link.expect(key, sizes, int(words.size), dtype, array=np.empty(words.size, dtype="<u4"))
        self._decodes[key] = (result, chunk_words)
        try:
            self._send_chunks(key, header, words, stats)
        except BaseException:
            self._decodes.pop(key, None)
            raise

    def _send_bytes(self, key: TensorKey, data: np.ndarray, *, into: Any = None) -> None:
        """A contribution to a collective that moves bytes (ALL_GATHER, BROADCAST, ALL_TO_ALL):
        raw bytes, never rounded to the wire dtype. A BROADCAST's non-root ranks send one
        header-only chunk that only says how many bytes they expect."""
        nbytes = int(data.size)
        self._check_size(key, nbytes, "bytes")
        total = self._result_length(key, nbytes)
        if into is not None:
            result: np.ndarray | None = as_byte_buffer(into, total, what=str(key))
        else:
            # An ALL_TO_ALL's length comes with its result: the link allocates it then.
            result = None if total is None else self._result_for(key, total, np.uint8)
        self._link.raise_if_broken()
        header = ChunkHeader(DType.BYTES, nbytes, ())
        self._link.expect(key, (), total, DType.BYTES, array=result)
        if key.collective_kind is CollectiveKind.BROADCAST and key.root != self.worker_id:
            data = data[:0]
        self._send_chunks(key, header, data, None)

    def _result_for(self, key: TensorKey, length: int, dtype: type[np.generic]) -> np.ndarray:
        """The array `key`'s result is assembled in when the caller gave no `into`: the one its
        key slot's earlier result was returned in, when it has this size and dtype and the pool
        holds the only reference to it (see the class docstring), else a new one that takes its
        place in the pool."""
        slot = key.slot
        with self._pool_lock:
            if _held_by_pool_only(self._pool, slot):
                array = self._pool[slot]
                if array.size == length and array.dtype == dtype:
                    return array
            array = np.empty(length, dtype=dtype)
            self._pool[slot] = array
            return array

    def _run_in_lane(
        self, lane: LaneClient, key: TensorKey, array: Any, into: Any, timeout: float | None
    ) -> np.ndarray | None:
        """`key` through the collective lane: its result (float32 for REDUCE and REDUCE_SCATTER,
        uint8 for the kinds that move bytes), or None when the lane is not open for this job."""
        if key.collective_kind is CollectiveKind.REDUCE_SCATTER and key.split_bytes:
            return self._uneven_in_lane(lane, key, array, into, timeout)
        moves_bytes = key.collective_kind in BYTE_KINDS
        dtype = _U8 if moves_bytes else _F32
        # Arrays already as the lane takes them (the torch backend's) skip the conversions: a
        # small collective's whole budget is tens of microseconds.
        if _ready(array, dtype):
            data = array
        elif moves_bytes:
            data = as_byte_array(array, what=str(key))
        else:
            data = as_float32_array(array, what=str(key))
        size = int(data.size)
        self._check_size(key, size, "bytes" if moves_bytes else "elements")
        total = self._result_length(key, size)
        result: np.ndarray | None = None
        if into is not None:
            if _ready(into, dtype, writable=True) and (total is None or into.size == total):
                result = into
            elif moves_bytes:
                result = as_byte_buffer(into, total, what=str(key))
            else:
                assert total is not None
                result = as_result_buffer(into, total, what=str(key))
        elif total is not None:  # an ALL_TO_ALL's size is known only in the lane, which allocates it
            result = np.empty(total, dtype)
        self._link.raise_if_broken()
        deadline = time.monotonic() + (self.timeouts.receive if timeout is None else timeout)
        raw = lane.run(
            key,
            _bytes_view(data),
            None if result is None else _bytes_view(result),
            deadline,
            self._link.raise_if_broken,
        )
        if raw is None:
            return None
        return raw if result is None else result

    def _uneven_in_lane(
        self, lane: LaneClient, key: TensorKey, array: Any, into: Any, timeout: float | None
    ) -> np.ndarray | None:
        """A REDUCE_SCATTER with uneven parts (`split_bytes`) through the lane: a REDUCE of the
        same contributions (the very bytes the parts are cut from; every worker of a host reads
        the lane's output anyway), then this worker's part."""
        data = array if _ready(array, _F32) else as_float32_array(array, what=str(key))
        mine = self._result_length(key, int(data.size))
        assert mine is not None
        whole = dataclasses.replace(key, collective_kind=CollectiveKind.REDUCE, split_bytes=())
        reduced = self._run_in_lane(lane, whole, data, None, timeout)
        if reduced is None:
            return None
        start = sum(key.split_bytes[: self.worker_id]) // 4
        part = reduced[start : start + mine]
        if into is None:
            return part.copy()
        result = into if _ready(into, _F32, writable=True) and into.size == mine else None
        if result is None:
            result = as_result_buffer(into, mine, what=str(key))
        result[:] = part
        return result

    def _check_size(self, key: TensorKey, size: int, unit: str) -> None:
        """Refuses, naming the key, a contribution beyond the coordinator's element limit (a
        BYTES element is one byte)."""
        limit = self._accepted.max_tensor_elements
        if size > limit:
            of_limit = f"{limit} elements" if unit == "bytes" else f"{limit}"
            raise InvalidArgumentError(
                f"{key}: {size} {unit} exceed the coordinator's limit of {of_limit}",
                step=key.step,
                key=str(key),
            )

    def _send_chunks(
        self, key: TensorKey, header: ChunkHeader, payload: np.ndarray, stats: SampleStats | None
    ) -> None:
        try:
            # Chunks cut at the same element offsets whatever the dtype: the coordinator's chunk
            # size is in float32 elements, so a 16-bit chunk carries half the bytes (a BYTES one a
            # quarter).
            for offset, length in chunk_spans(int(payload.size), self.chunk_bytes // 4):
                self._link.send_chunk(key, header, offset, payload[offset : offset + length], stats)
        except BaseException:
            self._link.forget(key)
            raise
        self._sent[key.kind].append(key)

    def _result_length(self, key: TensorKey, size: int) -> int | None:
        """How many elements (bytes for BYTES) `key`'s result holds when this worker sends `size`;
        None for an ALL_TO_ALL, whose result says. Refuses, naming the key, a collective whose
        shape cannot fit the job's workers (the coordinator would fail the operation later)."""
        problem = collective_rules.shape_problem(key, size, self.total_workers)
        if problem:
            raise InvalidArgumentError(f"{key}: {problem}", step=key.step, key=str(key))
        return collective_rules.result_length(key, size, self.total_workers, self.worker_id)

    def _receive(self, kind: KeyKind, timeout: float | None) -> tuple[TensorKey, transports.PendingResult]:
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
            result = self._link.wait_result(key, timeout)
        except BaseException:
            # A local timeout (or a broken stream) leaves the key first in line: a later receive
            # keeps waiting for it. An error about the key settles it, and its pooled result
            # array (whose contents the failure left unspecified) is let go.
            if not self._link.awaiting(key):
                self._settle(sent, key)
            raise
        sent.popleft()
        decode = self._decodes.pop(key, None)
        if decode is not None:
            target, chunk_words = decode
            target[:] = decode_words(result.array, result.dtype, chunk_words, target.size)
            result.array = target
        return key, result

    def _settle(self, sent: collections.deque[TensorKey], key: TensorKey) -> None:
        """Takes `key` out of line after its receive raised. When its whole step failed, this
        kind's other keys of that step go too: the caller has been told the step is void, and
        they must not stand before the next step's keys (each kind reports a failed step once)."""
        with self._pool_lock:
            for stale in [k for k in sent if k == key or k.step == key.step]:
                self._pool.pop(stale.slot, None)
                self._decodes.pop(stale, None)
        if not self._link.step_failed(key.step):
            sent.remove(key)
            return
        for stale in [k for k in sent if k.step == key.step]:
            sent.remove(stale)
            self._link.forget(stale)


def _references(pool: dict[tuple[KeyKind, int], np.ndarray], slot: tuple[KeyKind, int]) -> int:
    """How many references the array pooled for `slot` has, counting this function's own two
    (its local name and the argument of getrefcount)."""
    array = pool.get(slot)
    return sys.getrefcount(array)


# What `_references` counts for an array that only the pool holds, measured the same way, so the
# check follows the interpreter's own counting.
_POOL_ONLY = _references({(KeyKind.BLOCK, 0): np.empty(1, np.float32)}, (KeyKind.BLOCK, 0))


def _held_by_pool_only(pool: dict[tuple[KeyKind, int], np.ndarray], slot: tuple[KeyKind, int]) -> bool:
    """Whether the array pooled for `slot` is referenced by nothing but the pool: no caller, no
    view (a view holds its base), no buffer export (memoryview, torch.from_numpy), no weak
    reference (it could be turned back into a reference), no link still filling it."""
    array = pool.get(slot)
    if array is None or weakref.getweakrefcount(array):
        return False
    del array
    return _references(pool, slot) == _POOL_ONLY


def _bytes_view(array: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array, as a flat uint8 view of the same memory."""
    return array.reshape(-1).view(np.uint8)


_F32 = np.dtype("<f4")
_U8 = np.dtype(np.uint8)


def _ready(array: Any, dtype: np.dtype[Any], *, writable: bool = False) -> bool:
    """Whether `array` is a 1-D C-contiguous numpy array of `dtype` (writable, if asked)."""
    return (
        type(array) is np.ndarray
        and array.dtype == dtype
        and array.ndim == 1
        and array.flags.c_contiguous
        and (not writable or array.flags.writeable)
    )


# What an `exact` key is sent with: float32, whatever the client's wire dtype.
_FLOAT32_WIRE = WireEncoder()
_STATE_BARRIER = "gradserver.state"


def _own_tag(tag: int) -> int:
    """A program's point-to-point tag, refused when gradserver reserves it (live recovery)."""
    value = int(tag)
    if value in RESERVED_TAGS:
        raise InvalidArgumentError(
            f"tag {value} is reserved for gradserver's own messages "
            f"({RESERVED_TAGS.start}..{RESERVED_TAGS.stop - 1}); use another"
        )
    return value
