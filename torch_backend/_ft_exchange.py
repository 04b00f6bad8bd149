"""DiLoCo's exchange over an `ft.Replica`: each exchange is one fault-tolerant step of the job.

Each exchange (one fragment at its send step) is the next step S of the replica's coordinator
(the job's first step checks that the replicas start from the same parameters, and a resumed
job's next two that they loaded the same checkpoint step: `check_identical`): a SUM
collective of [wΔ, w, counts] over the replicas that take part (the coordinator runs with
`--on-worker-loss continue`), so Σ wᵢΔᵢ / Σ wᵢ is the average over the contributors weighted by
what each counted, then the step's commit barrier. A step that failed (a replica lost after part
of the sum used it) is discarded by every replica; a lost coordinator is rejoined as `ft.Replica`
does, and the exchange is run again in its new job. Without a delay the result is in when `sum`
returns; with one (`at_boundary(overlap=True)`) the step runs on a thread of its own while the
next inner steps do, and the training thread resolves it when it waits for the result (a rejoin
or a heal changes the model, so only that thread does them). One exchange is on its way at a
time: DiLoCo waits for it before it sends the next.

The state a joining replica takes at exchange S (`StateSnapshot` step S) is the donor's as it
sends S: model, inner optimizer, and DiLoCo's outer state (global weights, every fragment's outer
optimizer, kept quantization error, landed averages, the inner step), checked byte for byte.
A donor offers it only from its payload until its result is in (and the result of S waits for
the joiner's part): held still at the exchange, or, while the exchange overlaps the inner steps,
as a copy made at its boundary (the model, the inner optimizer and the outer state: memory for
about three more copies of the model's parameters with AdamW, for that while). At any other time
it offers step S-1, so a request waits for the boundary instead of reading a state that the inner
steps are changing. The coordinator's gather needs every rank, so int8 and int4 payloads are
summed by the coordinator instead (`quantized_sum`): the replica sends its compensated wΔ as
block-quantized records (bf16: bfloat16 values) and [w, counts] as an exact float32 SUM, two keys
of the same step, and gets one quantized sum back (one payload up, one down).

With HSDP replica groups (`ft.Replica(replica_group=)`) each rank exchanges its own shards in its
shard's job, and the ranks of a group agree on every exchange's outcome (`Replica._agree`, on the
training thread) before any applies it: each shard's job decides alike for all its members, so
every group applies the same exchanges of every shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradserver.common.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    GradServerError,
    InternalError,
    StepFailed,
)
from gradserver.common.messages import KeyKind, ReduceOp, TensorKey
from gradserver.worker import StateSnapshot

from ._outer_exchange import Landing, OuterState, Resumed, mismatch, parameter_digests, structure_digest

if TYPE_CHECKING:
    from .ft import Replica

log = logging.getLogger("gradserver.torch.ft")

_OUTER_GROUP = 3  # the collective group of the outer steps' sums (ft.py uses 1 and 2)
_OUTER_EXTRA_GROUP = 4  # [w, counts] of a quantized sum, exact float32, in the same step
_GROUPS = (_OUTER_GROUP, _OUTER_EXTRA_GROUP)
_WIRE_DTYPES = {"bf16": "bfloat16"}  # the client's name of a quantization format, where it differs


@dataclasses.dataclass(frozen=True)
class _Landed:
    """An exchange whose result is in (None: discarded by every replica)."""

    result: torch.Tensor | None

    def wait(self) -> torch.Tensor | None:
        return self.result


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """One try of an exchange's step: the arrays sent (the sums landed in them), how many
    replicas each part's sum was over, or the error that stopped it."""

    step: int
    arrays: list[np.ndarray]
    contributors: list[int]
    error: GradServerError | None


_JOIN_SLACK_S = 10.0


class _InFlight:
    """An exchange whose step runs on a thread of its own (`at_boundary(overlap=True)`); the
    training thread resolves it in `wait` (a rejoin or a heal changes the model, so only that
    thread may do them). Every wait of the step's own (send, receive, barrier) has the client's
    deadline, so the thread ends."""

    def __init__(self, exchange: FtExchange, parts: list[tuple[torch.Tensor, str | None]]) -> None:
        self._exchange = exchange
        self._parts = parts
        self._step = exchange.replica.step
        self._attempt: _Attempt | None = None
        self._outcome: _Landed | None = None
        self._thread = threading.Thread(target=self._run, name="gradserver-outer-exchange", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._attempt = self._exchange._attempt(self._step, self._parts)

    def wait(self) -> torch.Tensor | None:
        if self._outcome is None:
            # The step's own deadlines end the thread; this one is for a wait they do not cover.
            timeouts = self._exchange.replica.client.timeouts
            bound = len(self._parts) * (timeouts.send + timeouts.receive) + timeouts.receive + _JOIN_SLACK_S
            self._thread.join(bound)
            if self._thread.is_alive():
                raise DeadlineExceededError(
                    f"outer step {self._step}: its exchange did not end within {bound:g} s (the sum "
                    "of its sends', sums' and commit's deadlines)"
                )
            assert self._attempt is not None  # _attempt returns its errors: it does not raise
            self._outcome = _Landed(self._exchange._resolve(self._parts, self._attempt))
        return self._outcome.result


class FtExchange:
    """Exchanges as steps of `replica`'s job (see the module's docstring)."""

    gathers = False
    heals = True
    summed_formats = frozenset({"bf16", "int8", "int4"})

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.replicas = replica.client.total_workers
        self.rank = replica.client.worker_id
        self._state: OuterState | None = None
        self._boundary = False  # at an exchange's boundary: its state is what a joiner takes
        self._overlap = False  # the exchange being sent runs in the background
        self._captured: StateSnapshot | None = None  # the boundary's state, copied (overlap)
        self._in_flight: _InFlight | None = None

    def check_identical(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Refuses replicas whose parameters differ (names, shapes, dtypes or any byte), naming
        the first that does; every replica raises the same error. One step of the job: the SUM
        of each digest byte b and of b² over the n replicas that take part, which are all equal
        where n·Σb² = (Σb)² (exact in float32: b < 256, n ≤ 256). Nothing to check on a replica
        that joined the running job: it took a live one's state, checked byte for byte."""
        replica = self.replica
        if replica.healed is not None:
            return
        if self.replicas > 256:
            log.warning("the start is not checked with more than 256 replicas (the sums would round)")
            return
        words = [structure_digest(params), len(params), *parameter_digests(params)]
        digest = np.frombuffer(np.array(words, dtype="<u8").tobytes(), dtype=np.uint8).astype(np.float32)
        summed = self._exchange([(torch.from_numpy(np.concatenate([digest, digest * digest])), None)]).wait()
        if summed is None:
            raise FailedPreconditionError(
                f"replica {self.rank}: the check that the replicas hold the same parameters was "
                "discarded (a replica was lost in it): start the job again"
            )
        n = replica.contributors or 0
        sums = summed[: digest.size].double().view(len(words), 8)
        squares = summed[digest.size :].double().view(len(words), 8)
        differs = (n * squares != sums * sums).any(dim=1).tolist()
        if differs[0] or differs[1]:
            raise FailedPreconditionError(
                f"replica {self.rank}: the models differ in their parameters' names, shapes or dtypes "
                f"across the {n} replicas that took part ({len(params)} parameters here)"
            )
        for (name, _), differ in zip(params, differs[2:], strict=True):
            if differ:
                among = f"across the {n} replicas that took part"
                raise FailedPreconditionError(mismatch(self.rank, name, among))

    def gather(self, piece: torch.Tensor) -> Landing:
        raise FailedPreconditionError("an ft exchange has no gather: quantized payloads are summed")

    def sum(self, vector: torch.Tensor) -> Landing:
        """Exchange `vector` as the replica's next step: its SUM over the replicas that took part,
        or None when every replica discards the step. `Resumed` (from here, or from the landing's
        `wait` when it overlaps) when this replica took a live one's state as it rejoined a
        restarted coordinator."""
        return self._exchange([(vector, None)])

    def quantized_sum(self, values: torch.Tensor, extra: torch.Tensor, wire: str) -> Landing:
        """`sum` of [values, extra], `values` travelling as `wire` ("int8", "int4" records that
        the coordinator sums and requantizes once; "bf16" values it sums in float64 and rounds
        once to bfloat16), `extra` as exact float32: the landed vector holds the decoded sum,
        then the sum of `extra`."""
        return self._exchange([(values, _WIRE_DTYPES.get(wire, wire)), (extra, None)])

    def _exchange(self, parts: list[tuple[torch.Tensor, str | None]]) -> Landing:
        """The parts (each with its wire dtype, None: exact float32), one collective group each,
        as the replica's next step: on its own thread when it overlaps, else now."""
        if self._in_flight is not None:
            raise InternalError(
                f"outer step {self.replica.step} sent while the one before is on its way (DiLoCo "
                "waits for it first)"
            )
        if self._overlap:
            self._in_flight = _InFlight(self, parts)
            return self._in_flight
        return _Landed(self._resolve(parts, self._attempt(self.replica.step, parts)))

    def _attempt(self, step: int, parts: list[tuple[torch.Tensor, str | None]]) -> _Attempt:
        """Sends the parts as `step` and waits for their sums and the commit barrier; returns
        what happened instead of raising (it may run on the exchange's thread)."""
        client = self.replica.client
        # Copies: the sums land in them, and a retry sends the parts again.
        arrays = [vector.detach().float().cpu().numpy().copy() for vector, _ in parts]
        try:
            for group, array, (_, wire) in zip(_GROUPS, arrays, parts, strict=False):
                key = TensorKey.collective(step, group, ReduceOp.SUM)
                client.send(key, array, into=array, wire=wire, exact=wire is None and len(parts) > 1)
            contributors = [client.receive(KeyKind.COLLECTIVE).num_contributors for _ in parts]
            client.barrier(step, "commit")
        except GradServerError as exc:
            return _Attempt(step, arrays, [], exc)
        return _Attempt(step, arrays, contributors, None)

    def _resolve(
        self, parts: list[tuple[torch.Tensor, str | None]], attempt: _Attempt
    ) -> torch.Tensor | None:
        """What the exchange gave (None: every replica discards it), from its first attempt: a
        lost coordinator is rejoined and the step run again in its new job; the replica's step
        moves past it and the boundary ends. On the training thread."""
        replica = self.replica
        try:
            while True:
                step, error = attempt.step, attempt.error
                if error is not None and replica._rejoins(error):
                    healed = replica.healed
                    replica._rejoin(step, error)
                    if replica.healed is not healed:
                        raise Resumed
                    # Every replica is at this exchange again, in the new coordinator's job.
                    attempt = self._attempt(replica.step, parts)
                    continue
                # A replica lost between the parts of a quantized sum counts in the first (a
                # complete contribution stays counted) and not in [w, counts]: Σ wᵢΔᵢ / Σ wᵢ
                # would mix them. Every replica gets the same counts, so every one discards it.
                if error is None and len(set(attempt.contributors)) > 1:
                    counts = " and ".join(map(str, attempt.contributors))
                    error = StepFailed(
                        f"its parts were summed over {counts} replicas (one was lost between them)", step=step
                    )
                counted = attempt.contributors[0] if error is None else None
                # HSDP: each shard's job sums its own; the replica group goes on alike.
                error, fewest = replica._agree(step, error, counted)
                if error is not None and not isinstance(error, StepFailed):
                    raise error  # the coordinator is gone, or this replica was refused
                if error is None and (fewest or 0) < replica.min_replicas:
                    raise FailedPreconditionError(
                        f"outer step {step} was averaged over {fewest} replicas, fewer "
                        f"than min_replicas {replica.min_replicas}: the job stops"
                    )
                # The step number and the boundary change together: a joining replica reads them as one.
                with replica.client.updating_state():
                    replica.step = step + 1
                    self._release()
                    if error is None:  # applied; a StepFailed one is discarded
                        replica.committed += 1
                        replica.contributors = counted  # this shard's own (the start check's n)
                if error is not None:
                    log.warning("outer step %d discarded on every replica: %s", step, error.message)
                    return None
                device = parts[0][0].device
                return torch.from_numpy(np.concatenate(attempt.arrays)).to(device)
        finally:
            if self._boundary or self._in_flight is not None:  # left by an error: nothing to offer
                with replica.client.updating_state():
                    self._release()

    def _release(self) -> None:
        self._boundary = False
        self._captured = None
        self._in_flight = None

    # --- the state a joining replica takes ------------------------------------------------------

    def attach(self, state: OuterState) -> bool:
        self._state = state
        replica = self.replica
        replica._outer = self
        healed = replica._healed_outer
        if healed is None:
            return False
        replica._healed_outer = None
        got, extra = healed
        with replica.client.updating_state():
            state.load_outer(_outer_part(got.tensors), extra)
        replica._check_healed(got)
        return True

    @contextlib.contextmanager
    def at_boundary(self, *, overlap: bool) -> Iterator[None]:
        """The state is at an exchange's boundary from here until its result is in: with
        `overlap` a copy of it is made now, for the inner steps go on while the exchange runs."""
        with self.replica.client.updating_state():
            self._boundary = True
            self._captured = self.replica._outer_snapshot(copy=True) if overlap else None
        self._overlap = overlap
        try:
            yield
        except BaseException:
            with self.replica.client.updating_state():
                self._release()
            raise
        finally:
            self._overlap = False

    def offered_step(self) -> int:
        """The boundary this replica's state is at: its next exchange while it is held there."""
        return self.replica.step if self._boundary else self.replica.step - 1

    def captured(self) -> StateSnapshot | None:
        """The state copied at the boundary of the exchange on its way (None: not overlapping,
        the live state is held still)."""
        return self._captured

    def tensors(self) -> dict[str, torch.Tensor]:
        assert self._state is not None
        return self._state.outer_tensors()

    def extra(self) -> dict[str, Any]:
        assert self._state is not None
        return self._state.outer_extra()

    def load(self, tensors: dict[str, Any], extra: dict[str, Any]) -> None:
        assert self._state is not None
        self._state.load_outer(_outer_part(tensors), extra)


def _outer_part(tensors: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in tensors.items() if name.startswith("outer/")}
