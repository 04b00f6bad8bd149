"""DiLoCo's exchange over an `ft.Replica`: each exchange is one fault-tolerant step of the job.

Exchange S (one fragment at its send step) is step S of the replica's coordinator: a SUM
collective of [wΔ, w, counts] over the replicas that take part (the coordinator runs with
`--on-worker-loss continue`), so Σ wᵢΔᵢ / Σ wᵢ is the average over the contributors weighted by
what each counted, then the step's commit barrier. A step that failed (a replica lost after part
of the sum used it) is discarded by every replica; a lost coordinator is rejoined as `ft.Replica`
does, and the exchange is run again in its new job. The result is in when `sum` returns: the
exchange does not overlap the inner steps (a replica that joins takes the state at an exchange,
which a donor then holds still for it; landed averages not yet due are part of that state).

The state a joining replica takes at exchange S (`StateSnapshot` step S) is the donor's as it
sends S: model, inner optimizer, and DiLoCo's outer state (global weights, every fragment's outer
optimizer, kept quantization error, landed averages, the inner step), checked byte for byte.
A donor offers it only while it is held at that exchange (between its payload and its result,
and the result of S waits for the joiner's part): at any other time it offers step S-1, so a
request waits for the boundary instead of reading a state that the inner steps are changing.
The coordinator's gather needs every rank, so int8 and int4 payloads are summed by the
coordinator instead (`quantized_sum`): the replica sends its compensated wΔ as block-quantized
records and [w, counts] as an exact float32 SUM, two keys of the same step, and gets one
quantized sum back (one payload up, one down). bf16 travels dequantized as float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gradserver.common.errors import (
    FailedPreconditionError,
    GradServerError,
    InvalidArgumentError,
    StepFailed,
)
from gradserver.common.messages import KeyKind, ReduceOp, TensorKey

from ._outer_exchange import OuterState, Resumed

if TYPE_CHECKING:
    from .ft import Replica

log = logging.getLogger("gradserver.torch.ft")

_OUTER_GROUP = 3  # the collective group of the outer steps' sums (ft.py uses 1 and 2)
_OUTER_EXTRA_GROUP = 4  # [w, counts] of a quantized sum, exact float32, in the same step


@dataclasses.dataclass(frozen=True)
class _Landed:
    """An exchange whose result is in (None: discarded by every replica)."""

    result: torch.Tensor | None

    def wait(self) -> torch.Tensor | None:
        return self.result


class FtExchange:
    """Exchanges as steps of `replica`'s job (see the module's docstring)."""

    gathers = False
    heals = True
    sums_quantized = True

    def __init__(self, replica: Replica) -> None:
        if replica.replica_group is not None:
            raise InvalidArgumentError(
                "ft.Replica.diloco: not with replica_group (outer steps between HSDP replica groups "
                "are not fault tolerant yet)"
            )
        self.replica = replica
        self.replicas = replica.client.total_workers
        self.rank = replica.client.worker_id
        self._state: OuterState | None = None
        self._boundary = False  # held at an exchange: its state is what a joiner takes

    def check_identical(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Not checked here: the replicas that begin the job must start from the same weights (a
        seeded initialisation, as for `ft.Replica.ddp`); a replica that joins takes a live one's."""

    def gather(self, piece: torch.Tensor) -> _Landed:
        raise FailedPreconditionError("an ft exchange has no gather: quantized payloads are summed")

    def sum(self, vector: torch.Tensor) -> _Landed:
        """Exchange `vector` as the replica's next step: its SUM over the replicas that took part,
        or None when every replica discards the step. Raises `Resumed` when this replica took a
        live one's state as it rejoined a restarted coordinator."""
        return self._exchange([(vector, None)])

    def quantized_sum(self, values: torch.Tensor, extra: torch.Tensor, wire: str) -> _Landed:
        """`sum` of [values, extra], `values` travelling as `wire` ("int8", "int4") records that
        the coordinator sums and requantizes once, `extra` as exact float32: the landed vector
        holds the decoded sum, then the sum of `extra`."""
        return self._exchange([(values, wire), (extra, None)])

    def _exchange(self, parts: list[tuple[torch.Tensor, str | None]]) -> _Landed:
        """The parts (each with its wire dtype, None: exact float32), one collective group each,
        as the replica's next step."""
        replica = self.replica
        groups = (_OUTER_GROUP, _OUTER_EXTRA_GROUP)
        while True:
            step = replica.step
            # Copies: a retry sends them again.
            arrays = [vector.detach().float().cpu().numpy().copy() for vector, _ in parts]
            error: GradServerError | None = None
            contributors = 0
            try:
                for group, array, (_, wire) in zip(groups, arrays, parts, strict=False):
                    key = TensorKey.collective(step, group, ReduceOp.SUM)
                    replica.client.send(
                        key, array, into=array, wire=wire, exact=wire is None and len(parts) > 1
                    )
                contributors = replica.client.receive(KeyKind.COLLECTIVE).num_contributors
                for _ in parts[1:]:
                    replica.client.receive(KeyKind.COLLECTIVE)
                replica.client.barrier(step, "commit")
            except GradServerError as exc:
                error = exc
            if error is not None and replica._rejoins(error):
                healed = replica.healed
                replica._rejoin(step, error)
                if replica.healed is not healed:
                    raise Resumed
                continue  # every replica is at this exchange again, in the new coordinator's job
            if error is not None and not isinstance(error, StepFailed):
                raise error  # the coordinator is gone, or this replica was refused
            if error is None and contributors < replica.min_replicas:
                raise FailedPreconditionError(
                    f"outer step {step} was averaged over {contributors} replicas, fewer than "
                    f"min_replicas {replica.min_replicas}: the job stops"
                )
            # The step number and the boundary change together: a joining replica reads them as one.
            with replica.client.updating_state():
                replica.step = step + 1
                self._boundary = False
                if error is None:
                    replica.committed += 1
                    replica.contributors = contributors
            if error is not None:
                log.warning("outer step %d discarded on every replica: %s", step, error.message)
                return _Landed(None)
            return _Landed(torch.from_numpy(np.concatenate(arrays)).to(parts[0][0].device))

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
    def at_boundary(self) -> Iterator[None]:
        self._boundary = True
        try:
            yield
        finally:
            if self._boundary:
                with self.replica.client.updating_state():
                    self._boundary = False

    def offered_step(self) -> int:
        """The boundary this replica's state is at: its next exchange while it is held there."""
        return self.replica.step if self._boundary else self.replica.step - 1

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
