"""Fault-tolerant data parallelism for torch programs: a lost rank does not end the job.

    from gradserver.torch import ft

    job = ft.Replica(model, optimizer)          # joins; heals from a live rank when the job runs
    ddp = job.ddp()                             # DistributedDataParallel averaging across replicas
    for step in job.steps(1000):                # the step is also the data position
        optimizer.zero_grad()
        loss_fn(ddp(inputs(step)), targets(step)).backward()
        job.commit()                            # the optimizer steps only if every participant did

Each rank is one replica of the model. Gradients are averaged, bucket by bucket as DDP produces
them, over the ranks that take part in the step (a DDP communication hook sending each bucket as
one REDUCE collective of the coordinator), so a step a rank was lost in completes with the others
and is averaged over them. `commit()` passes the step's commit barrier before the optimizer steps:
a step whose averages could not be made from one set of ranks fails for everyone, and then every
rank discards it (no replica applies a step another did not). A rank started again with the same
command joins the running job in the lost rank's place, takes the model, the optimizer state and
the step from a live rank (gradserver.worker.recovery: checked byte for byte) and takes part from
the next step. The coordinator must run with `--on-worker-loss continue` (`gradserver run
--restart-lost K` starts it so, and restarts lost ranks).

Over slow links, `job.diloco(sync_every=H, ...)` runs outer steps (DiLoCo) instead: each
fragment's exchange is one fault-tolerant step, and a replacement joins at the next exchange
(`_ft_exchange`, docs/fault-tolerance.md).

No torch.distributed process group is needed: DDP runs over a private group of one (its start-up
broadcasts are local), and every cross-rank byte goes through gradserver. Settings come from the
environment as for the torch backend (GRADSERVER_COORDINATOR, GRADSERVER_AUTH_TOKEN, TLS; RANK
asks for that worker id).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gradserver.common.errors import (
    ConnectionLost,
    FailedPreconditionError,
    GradServerError,
    InvalidArgumentError,
    JobEnded,
    StepFailed,
    Timeout,
    UnavailableError,
)
from gradserver.common.messages import KeyKind, ReduceOp, TensorKey
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts
from gradserver.worker import (
    RecoveredState,
    StateSnapshot,
    WorkerClient,
    decode_extra,
    encode_extra,
    state_digest,
)

from ._outer_exchange import local_part
from ._settings import launcher_rank, rank_settings, replica_group_index

if TYPE_CHECKING:
    from ._ft_exchange import FtExchange
    from .diloco import DiLoCo

__all__ = ["Replica", "load_state", "state_tensors"]

log = logging.getLogger("gradserver.torch.ft")

_GRADIENTS_GROUP = 1  # the collective group of the steps' gradients
_POSITIONS_GROUP = 2  # the collective of where each rank is, when a restarted coordinator's job begins
_POSITION_SPLIT = 2**20  # a position as two float32 values, each exact
_NO_COUNT = 2**31  # `_agree`: no step was averaged (it failed), so no count to agree on
_BACKOFF_S = (0.2, 5.0)  # first and longest wait between tries to rejoin a lost coordinator


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The replicated state by name, no copies: the model's (`model/NAME`) and the optimizer's
    tensors (`optimizer/PARAM/NAME`); of a sharded model (FSDP2), this rank's shards. Call it on
    the training thread: `model.state_dict()` reshards an FSDP2 model."""
    return _model_tensors(model.state_dict()) | _optimizer_tensors(optimizer)


def _model_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model/{k}": local_part(v.detach()) for k, v in state.items()}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"optimizer/{index}/{name}": local_part(value)
        for index, state in optimizer.state_dict()["state"].items()
        for name, value in state.items()
        if isinstance(value, torch.Tensor)
    }


def _optimizer_extra(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        f"{index}/{name}": value
        for index, state in optimizer.state_dict()["state"].items()
        for name, value in state.items()
        if not isinstance(value, torch.Tensor)
    }


def load_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Any],
    other: dict[str, Any] | None = None,
) -> None:
    """Loads what `state_tensors` (and `other`: the optimizer's non-tensor values) gave on
    another replica; a sharded model takes them into its shards in place."""
    current = model.state_dict()
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    if any(isinstance(v, DTensor) for v in current.values()):
        missing = sorted(set(current) - set(weights))
        if missing:
            raise FailedPreconditionError(f"the state taken has no {', '.join(missing)}")
        with torch.no_grad():
            for name, target in current.items():
                local_part(target).copy_(torch.as_tensor(weights[name]))
    else:
        model.load_state_dict(weights)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer/"):
            _, index, key = name.split("/", 2)
            state.setdefault(int(index), {})[key] = _like_param(value.clone(), params[int(index)])
    for name, value in (other or {}).items():
        index, key = name.split("/", 1)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


def _like_param(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor shaped as its parameter's shard, sharded as the parameter is (a
    sharded parameter's moments are DTensors); anything else (AdamW's step) as it is."""
    if isinstance(param, DTensor) and value.shape == param.to_local().shape:
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return value


def _private_group() -> dist.ProcessGroup:
    """A process group of this process alone: DDP's start-up collectives stay local."""
    from torch._C._distributed_c10d import HashStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    store = HashStore()
    group = dist.ProcessGroup(store, 0, 1)
    backend = ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=60))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class Replica:
    """This rank's replica of a fault-tolerant data-parallel job."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        coordinator: str | None = None,
        min_replicas: int = 1,
        timeout: float | Timeouts | None = None,
        replica_group: dist.ProcessGroup | None = None,
        reconnect_timeout: float | None = None,
    ) -> None:
        """Joins the job's coordinator (`coordinator`, default GRADSERVER_COORDINATOR) and, when
        the job is already running, takes the state of a live replica into `model` and
        `optimizer`. `min_replicas`: a step averaged over fewer ranks stops the job with an
        error naming how many took part.

        `replica_group` (HSDP): the process group of the ranks that together hold one replica
        of a sharded model (FSDP2 over them). Each rank then joins the job of its shard (its
        coordinator: one per shard index, each with one member per replica group), replica groups
        are lost and restarted whole, and a step is applied by a replica group only when every
        one of its shards committed it.

        `reconnect_timeout` (default GRADSERVER_FT_RECONNECT_TIMEOUT, 60 s): how long a rank that
        lost its coordinator (killed, its machine gone) tries to rejoin one at the same address,
        restarted as `gradserver run --restart-lost` does (0: the loss ends the rank). The ranks
        then agree where they are: a rank that did not apply the step the coordinator released
        to another before it died takes that one's state (checked byte for byte), and all go on
        from there. Not with `replica_group`: there a lost coordinator ends the ranks."""
        if min_replicas < 1:
            raise InvalidArgumentError(f"min_replicas must be at least 1, got {min_replicas}")
        self.reconnect_timeout = (
            rank_settings().ft_reconnect_timeout if reconnect_timeout is None else reconnect_timeout
        )
        if self.reconnect_timeout < 0:
            raise InvalidArgumentError(
                f"reconnect_timeout must not be negative, got {self.reconnect_timeout:g}"
            )
        self._address, self._timeouts = coordinator, timeout
        self.model = model
        self.optimizer = optimizer
        self.replica_group = replica_group
        self._hooked = False  # ddp(): DDP's hook averages; otherwise commit() does
        # The model's parameters and buffers themselves, taken here on the training thread: the
        # state server reads them on its own thread, at any point of a step, and there
        # `model.state_dict()` would reshard an FSDP2 model under its running forward or backward
        # (freeing the gathered parameters that backward then reads). Like the gradient places
        # below, this holds while the model keeps its parameter objects (FSDP2 keeps its sharded
        # ones; its lazy init swaps only their local tensors, which are read at each use).
        self._model_state = model.state_dict(keep_vars=True)
        self.min_replicas = min_replicas
        self.step = 0
        self.committed = 0  # steps applied
        self.contributors: int | None = None  # ranks the last step was averaged over
        self.healed: RecoveredState | None = None  # the state taken when it joined a running job
        self._outer: FtExchange | None = None  # outer steps (`diloco`): their state is part of the replica's
        # A healed state with outer steps' state, loaded and checked once `diloco` builds them.
        self._healed_outer: tuple[RecoveredState, dict[str, Any]] | None = None
        self._error: GradServerError | None = None
        self._pending: queue.Queue[list[tuple[torch.futures.Future[torch.Tensor], Any]] | None] = (
            queue.Queue()
        )
        # Every gradient's place in one flat float32 vector, in parameter order.
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._places: dict[int, tuple[int, int]] = {}
        offset = 0
        for param in self._params:
            size = local_part(param).numel()
            self._places[id(param)] = (offset, size)
            offset += size
        self._flat = torch.zeros(offset, dtype=torch.float32)
        self._filled = 0
        self._waiting: list[tuple[torch.futures.Future[torch.Tensor], Any]] = []
        self.client = self._connect(coordinator, timeout, replica_group is not None)
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="gradserver-ft", daemon=True)
        self._receiver.start()
        # A script that ends without close() (the five lines above, a `return` from main) still
        # leaves with a goodbye at a clean exit: its coordinator tells a finished rank from a lost
        # one by that, and a job whose ranks all finished is not kept open for a rejoin.
        atexit.register(self.close)
        try:
            if self._line_up() is not None:
                self._heal()
            self.client.offer_state(self._snapshot)
        except BaseException:
            self.close()  # a failed heal leaves neither a member nor a thread behind
            raise

    # --- the loop -------------------------------------------------------------------------------

    def ddp(self, **options: Any) -> torch.nn.parallel.DistributedDataParallel:
        """`DistributedDataParallel(model)` whose gradients are averaged across the replicas
        that take part in each step (`options` go to DDP; not `process_group`)."""
        if "process_group" in options:
            raise InvalidArgumentError("ft.Replica.ddp chooses its own process_group")
        if self._outer is not None:
            raise FailedPreconditionError("ft.Replica.ddp: this replica already runs outer steps (diloco)")
        wrapped = torch.nn.parallel.DistributedDataParallel(
            self.model, process_group=_private_group(), **options
        )

        # DDP compares the annotation of `bucket` with the class itself, which a postponed
        # (string) annotation never equals: so none.
        def hook(state: object, bucket):  # type: ignore[no-untyped-def]
            return self._hook(bucket)

        wrapped.register_comm_hook(None, hook)
        self._hooked = True
        return wrapped

    def diloco(self, **options: Any) -> DiLoCo:
        """Outer steps (DiLoCo, `gradserver.torch.diloco`) over this job instead of a step per
        batch: the model trains alone with the optimizer given here (the inner one), and each
        exchange of a fragment's pseudo-gradient is one fault-tolerant step, averaged over the
        replicas that take part. A replica that joins the running job takes a live one's state
        (outer state included) at an exchange and takes part from there. `options` go to
        `DiLoCo` (sync_every, fragments, delay, keep_local, quantize, block, flush, outer_optimizer);
        use it as `with job.diloco(sync_every=H) as outer:` and `for step in outer.steps(N):`."""
        from ._ft_exchange import FtExchange
        from .diloco import DiLoCo

        for taken in ("group", "exchange"):
            if taken in options:
                raise InvalidArgumentError(f"ft.Replica.diloco chooses its own {taken}")
        if self._hooked:
            raise FailedPreconditionError("ft.Replica.diloco: this replica already averages through ddp()")
        if self._outer is not None:
            raise FailedPreconditionError("ft.Replica.diloco: this replica already runs outer steps")
        return DiLoCo(self.model, self.optimizer, exchange=FtExchange(self), **options)

    def steps(self, total: int) -> Iterator[int]:
        """The steps to run, from where this replica is (a healed one starts past 0) to `total`."""
        while self.step < total:
            # A backward that raised (the script's error) leaves nothing behind for this step.
            self._error, self._filled, self._waiting = None, 0, []
            yield self.step

    def commit(self) -> bool:
        """Ends the step: when every rank taking part finished it, the optimizer steps (True);
        when the step failed (a rank was lost after part of an average used it), every rank
        discards it (False). Either way the next step follows."""
        step = self.step
        error = self._error
        if error is None and not self._hooked:
            error = self._average()
        if error is None:
            try:
                self.client.barrier(step, "commit")
            except GradServerError as exc:
                error = exc
        error, contributors = self._agree(step, error, self.contributors if error is None else None)
        if error is not None and self._rejoins(error):
            self._rejoin(step, error)
            return False
        if error is not None and not isinstance(error, StepFailed):
            raise error  # the coordinator is gone, or this rank was refused: nothing to go on with
        if error is None and contributors is not None and contributors < self.min_replicas:
            raise FailedPreconditionError(
                f"step {step} was averaged over {contributors} replicas, fewer than "
                f"min_replicas {self.min_replicas}: the job stops"
            )
        # The step number and the state change together: a rank joining reads them as one.
        with self.client.updating_state():
            if error is None:
                self.optimizer.step()
                self.committed += 1
            self.step = step + 1
        if error is not None:
            log.warning("step %d discarded on every rank: %s", step, error.message)
            self.optimizer.zero_grad(set_to_none=True)
            return False
        return True

    def close(self) -> None:
        """Leaves the job (with a goodbye); also at the interpreter's exit. Safe to call more
        than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._pending.put(None)
        self.client.close()
        self._receiver.join(5.0)

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- averaging --------------------------------------------------------------------------------

    def _average(self) -> GradServerError | None:
        """Averages every gradient (this rank's shards of them) across the replicas taking part,
        in place, as one REDUCE of the step; None, or why it failed. A parameter without a
        gradient contributes zeros and gets the average, as every replica must."""
        flat = self._flat
        with torch.no_grad():
            for param in self._params:
                start, size = self._places[id(param)]
                if param.grad is None:
                    flat[start : start + size].zero_()
                else:
                    flat[start : start + size].copy_(local_part(param.grad).reshape(-1))
        array = flat.numpy()
        try:
            self.client.send(
                TensorKey.collective(self.step, _GRADIENTS_GROUP, ReduceOp.AVG), array, into=array
            )
            self.contributors = self.client.receive(KeyKind.COLLECTIVE).num_contributors
        except GradServerError as exc:
            return exc
        with torch.no_grad():
            for param in self._params:
                start, size = self._places[id(param)]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                local_part(param.grad).copy_(flat[start : start + size].view_as(local_part(param.grad)))
        return None

    def _agree(
        self, step: int, error: GradServerError | None, contributors: int | None
    ) -> tuple[GradServerError | None, int | None]:
        """With a replica group: the group applies the step only if every shard committed it, and
        goes on only if none lost its coordinator (all ranks of the group decide alike); the
        contributors are the fewest any shard's step was averaged over (each shard's job counts
        its own: a group lost between two shards' sums counts in one only), so `min_replicas`
        stops every rank of the group or none."""
        if self.replica_group is None:
            return error, contributors
        mine = 0 if error is None else 1 if isinstance(error, StepFailed) else 2
        votes = torch.tensor(
            [mine, -(_NO_COUNT if contributors is None else contributors)], dtype=torch.int64
        )
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.replica_group)
        worst, fewest = int(votes[0]), -int(votes[1])
        agreed = None if fewest == _NO_COUNT else fewest
        if worst == mine:
            return error, agreed
        if worst == 1:
            return StepFailed(f"step {step} failed on another shard of this replica group", step=step), agreed
        return FailedPreconditionError(
            f"step {step}: another shard of this replica group lost its coordinator", step=step
        ), agreed

    def _line_up(self) -> int | None:
        """The step this rank takes part from when it joined a running job (None: it began the
        job). The ranks of a replica group join their shards' jobs at once, each at the next step
        its job had not begun: they all start at the latest of those (`WorkerClient.start_at`)."""
        planned = self.client.recovery_step
        if self.replica_group is None:
            return planned
        latest = torch.tensor([-1 if planned is None else planned])
        newcomers = torch.tensor([0 if planned is None else 1])
        dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=self.replica_group)
        dist.all_reduce(newcomers, op=dist.ReduceOp.SUM, group=self.replica_group)
        size = dist.get_world_size(self.replica_group)
        if 0 < int(newcomers) < size:
            raise FailedPreconditionError(
                f"{int(newcomers)} of the {size} ranks of this replica group joined a running job and the "
                "others began it: a replica group is restarted whole"
            )
        if planned is None:
            return None
        self.client.start_at(int(latest))
        return int(latest)

    def _hook(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """One DDP bucket: its gradients go to their places in one flat vector of the whole
        model, in parameter order (DDP lays buckets out differently in its first iteration than
        later, and a replica that joins is in its first while the others are not); the last
        bucket of the step sends the vector as one REDUCE (average) of the step, and the
        receiver thread hands the average back to every bucket of the step."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        flat = self._flat
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            start, size = self._places[id(param)]
            flat[start : start + size].copy_(grad.reshape(-1))
            self._filled += size
        self._waiting.append((future, bucket))
        if self._filled < flat.numel():
            return future
        waiting, self._waiting, self._filled = self._waiting, [], 0
        if self._error is None:
            array = flat.numpy()
            try:
                self.client.send(
                    TensorKey.collective(self.step, _GRADIENTS_GROUP, ReduceOp.AVG), array, into=array
                )
            except GradServerError as exc:
                self._error = exc
        if self._error is not None:
            for waiter, done in waiting:
                waiter.set_result(done.buffer())  # the step is discarded: its gradients do not matter
            return future
        self._pending.put(waiting)
        return future

    def _receive(self) -> None:
        while (waiting := self._pending.get()) is not None:
            try:
                result = self.client.receive(KeyKind.COLLECTIVE)
                self.contributors = result.num_contributors
                for _, bucket in waiting:
                    for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                        start, size = self._places[id(param)]
                        grad.copy_(self._flat[start : start + size].view_as(grad))
            except GradServerError as exc:
                self._error = exc
            for waiter, bucket in waiting:
                waiter.set_result(bucket.buffer())

    # --- a lost coordinator ---------------------------------------------------------------------

    def _rejoins(self, error: GradServerError) -> bool:
        """Whether `error` is the coordinator lost (not shut down on purpose), and this replica
        tries to rejoin it."""
        lost = isinstance(error, ConnectionLost) and not isinstance(error, JobEnded)
        return lost and self.reconnect_timeout > 0 and self.replica_group is None

    def _rejoin(self, step: int, lost: GradServerError) -> None:
        """The coordinator was lost in `step`, which this replica has not applied: joins it again
        and lines up with the others. In a job that ran on without this rank (the coordinator
        lived, only this rank was cut off) it heals as a newcomer; in a new job (the coordinator
        was restarted) the ranks compare where they are and the ones behind take the state of
        one ahead, which applied the step the old coordinator released before it died."""
        rank = self.client.worker_id
        log.warning(
            "rank %d lost the coordinator in step %d (%s): rejoining it for up to %g s",
            rank,
            step,
            lost.message,
            self.reconnect_timeout,
        )
        self.client.close()
        self.client = self._reconnect(rank, step, lost)
        self.optimizer.zero_grad(set_to_none=True)
        if self.client.recovery_step is not None:
            self._heal()
            self.client.offer_state(self._snapshot)
            return
        # Offered before this rank tells where it is, so a rank behind that hears it finds the
        # state served.
        self.client.offer_state(self._snapshot)
        positions = self._positions(step)
        latest = max(positions.values())
        if step < latest:
            self._heal(at=(latest, tuple(w for w, p in sorted(positions.items()) if p == latest)))
        log.warning(
            "rank %d rejoined the restarted coordinator; the job goes on from step %d", rank, self.step
        )

    def _reconnect(self, rank: int, step: int, lost: GradServerError) -> WorkerClient:
        deadline = time.monotonic() + self.reconnect_timeout
        delay = _BACKOFF_S[0]
        while True:
            try:
                return self._connect(self._address, self._timeouts, False)
            except (ConnectionLost, Timeout) as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise UnavailableError(
                        f"rank {rank} lost the coordinator in step {step} ({lost.message}), and it did "
                        f"not come back within {self.reconnect_timeout:g} s: {exc.message}",
                        step=step,
                    ) from exc
                time.sleep(min(left, random.uniform(0.0, delay)))  # full jitter: no stampede
                delay = min(2 * delay, _BACKOFF_S[1])

    def _positions(self, step: int) -> dict[int, int]:
        """Every rank's step (the boundary its state is at) in the restarted coordinator's new
        job, by worker id: one SUM collective in which each rank fills its own place."""
        world, me = self.client.total_workers, self.client.worker_id
        places = np.zeros(2 * world, dtype=np.float32)
        places[2 * me : 2 * me + 2] = divmod(step + 1, _POSITION_SPLIT)  # 0: no rank there
        self.client.send(TensorKey.collective(0, _POSITIONS_GROUP, ReduceOp.SUM), places, into=places)
        self.client.receive(KeyKind.COLLECTIVE)
        return {
            w: int(places[2 * w]) * _POSITION_SPLIT + int(places[2 * w + 1]) - 1
            for w in range(world)
            if places[2 * w] or places[2 * w + 1]
        }

    # --- state ----------------------------------------------------------------------------------

    def _snapshot(self) -> StateSnapshot:
        if self._outer is not None:
            # With outer steps, the state is whole only at an exchange's boundary (the inner
            # steps change it between them): anything else is never served. While the exchange
            # runs beside the inner steps, what is served is the copy made at its boundary.
            step = self._outer.offered_step()
            if step != self.step:
                return StateSnapshot(step, {})
            captured = self._outer.captured()
            return captured if captured is not None else self._outer_snapshot(copy=False)
        extra = {"step": self.step, "optimizer": _optimizer_extra(self.optimizer)}
        return StateSnapshot(self.step, self._state_tensors(), encode_extra(extra))

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """`state_tensors(model, optimizer)`, safe on any thread (see `_model_state`)."""
        return _model_tensors(self._model_state) | _optimizer_tensors(self.optimizer)

    def _outer_snapshot(self, *, copy: bool) -> StateSnapshot:
        """The state at the exchange this replica is at (model, inner optimizer, outer state);
        `copy`: tensors copied, for the inner steps to go on while it is served."""
        assert self._outer is not None
        extra = {
            "step": self.step,
            "optimizer": _optimizer_extra(self.optimizer),
            "outer": self._outer.extra(),
        }
        tensors = self._state_tensors() | self._outer.tensors()
        if copy:
            tensors = {name: tensor.detach().clone() for name, tensor in tensors.items()}
        return StateSnapshot(self.step, tensors, encode_extra(extra))

    def _heal(self, at: tuple[int, tuple[int, ...]] | None = None) -> None:
        """Takes a live replica's state: the job's at this rank's recovery step, or `at` (step,
        donors) as the ranks of a new job agreed."""
        got = self.healed = self.client.recover(at=at)
        extra = decode_extra(got.extra)
        outer = extra.get("outer")
        with self.client.updating_state():
            load_state(self.model, self.optimizer, got.tensors, dict(extra.get("optimizer", {})))
            self.step = got.step
            if outer is not None and self._outer is not None:
                self._outer.load(got.tensors, dict(outer))
        if outer is not None and self._outer is None:
            self._healed_outer = (got, dict(outer))  # `diloco` loads and checks it
        else:
            self._check_healed(got)
        who = "replica group" if self.replica_group is not None else "rank"
        log.warning(
            "%s %d joined the running job at step %d: took the state from %s %d (%d bytes, %.2f s)",
            who,
            self.client.worker_id,
            got.step,
            who,
            got.donor,
            got.nbytes,
            got.seconds,
        )

    def _check_healed(self, got: RecoveredState) -> None:
        """The state loaded is the donor's, byte for byte (its digest covers every tensor)."""
        tensors = self._state_tensors()
        if self._outer is not None:
            tensors |= self._outer.tensors()
        loaded = state_digest(tensors)
        if loaded != got.digest:
            raise FailedPreconditionError(
                f"the state taken from rank {got.donor} at step {got.step} loaded as digest "
                f"{loaded:#018x}, not its {got.digest:#018x}"
            )

    @staticmethod
    def _connect(coordinator: str | None, timeout: float | Timeouts | None, grouped: bool) -> WorkerClient:
        settings = rank_settings()
        address = coordinator or settings.coordinator
        if not address:
            raise InvalidArgumentError(
                "ft.Replica needs the coordinator's address: coordinator=... or GRADSERVER_COORDINATOR "
                "(gradserver run sets it)"
            )
        tls = TlsFiles.load(
            settings.tls_ca, settings.tls_client_cert, settings.tls_client_key, what="ft.Replica TLS"
        )
        return WorkerClient.connect(
            address,
            node_id=f"{os.uname().nodename}/pid{os.getpid()}",
            device_type="torch-ft",
            timeout=timeout,
            tls=tls,
            auth_token=settings.auth_token or None,
            server_name=settings.tls_server_name,
            # In a replica group, RANK is the rank within the group; the job's worker id is the
            # replica group's (GRADSERVER_REPLICA_GROUP, which `gradserver run` sets).
            rank=replica_group_index() if grouped else launcher_rank(),
        )
