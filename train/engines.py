"""Gradient all-reduce engines behind one interface, so one trainer can switch and compare them.

- `CoordinatorEngine`: the gradserver coordinator, through a WorkerClient (gRPC).
- `LocalEngine`: several workers in one process (threads, e.g. one per GPU) through an in-process
  hub that averages in rank order in float64, like the coordinator.
- `TorchDistributedEngine`: `torch.distributed` all_reduce (gloo on CPU, NCCL on CUDA).

A step: `start_step(step)`, `submit_block` / `submit_non_block` as gradients become final (in
any order; blocks usually in reverse), then `finish()` returns every average in submission order.
`submit_loss` hands in this worker's loss before `finish`, and `global_loss` returns the average
weighted by sample counts after it, so the exchange overlaps the step.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from gradserver.common.sample_ranges import step_sample_ranges
from gradserver.worker import AveragedBlock, AveragedNonBlock, RecoveredState, StateSnapshot, WorkerClient

Key = tuple[str, int]  # ("block", idx) or ("non_block", component)


@dataclasses.dataclass
class _Submitted:
    key: Key
    tensor: torch.Tensor


class AveragingEngine(abc.ABC):
    """One worker's view of an all-reduce engine."""

    name: str = "abstract"
    #: whether submitted tensors must be on the host (the trainer stages device tensors)
    needs_host: bool = True
    rank: int
    world_size: int

    def __init__(self) -> None:
        self._step = 0
        self._submitted: list[_Submitted] = []

    def start_step(self, step: int) -> None:
        self._step = step
        self._submitted = []

    def submit_block(
        self, block_idx: int, num_blocks: int, flat: torch.Tensor, sizes: tuple[int, ...]
    ) -> None:
        """Starts averaging one block's flat gradient (already pre-averaged locally)."""
        self._submit(("block", block_idx), flat, num_blocks, sizes)

    def submit_non_block(self, component: NonBlockComponent, flat: torch.Tensor) -> None:
        self._submit(("non_block", int(component)), flat, 0, ())

    @abc.abstractmethod
    def _submit(self, key: Key, flat: torch.Tensor, num_blocks: int, sizes: tuple[int, ...]) -> None:
        """Starts averaging `flat` under `key`; records it for `finish`."""

    @abc.abstractmethod
    def finish(self) -> list[tuple[Key, torch.Tensor]]:
        """Waits for every average of this step, in submission order."""

    @abc.abstractmethod
    def submit_loss(self, loss: float, samples: int) -> None:
        """This worker's mean loss over `samples` for this step."""

    @abc.abstractmethod
    def global_loss(self) -> float:
        """Σ loss·samples / Σ samples over all workers, for this step (after `finish`)."""

    def commit(self, step: int) -> None:
        """Returns once every worker holds all averages of `step`, so they apply it all or none.
        Engines that cannot lose their coordinator need no such round."""
        return None

    @property
    def can_reconnect(self) -> bool:
        return False

    def reconnect(self, committed_step: int) -> int | None:
        """Joins a restarted coordinator; returns the step every worker resumes from."""
        raise InternalError(f"the {self.name} engine cannot reconnect")

    # --- live recovery (docs/RELIABILITY.md "Live recovery"); engines without a coordinator
    # have no running job to join and nobody to compare states with.

    @property
    def recovery_step(self) -> int | None:
        """The step this worker takes part from when it joined a running job (None: it did not)."""
        return None

    def recover(self) -> RecoveredState:
        raise InternalError(f"the {self.name} engine has no running job to recover from")

    def offer_state(self, snapshot: Callable[[], StateSnapshot]) -> None:
        """Serves this worker's state (as `snapshot()` returns it) to workers that join."""
        return None

    def updating_state(self) -> contextlib.AbstractContextManager[None]:
        """Wraps every change of the offered state."""
        return contextlib.nullcontext()

    def check_state(self, step: int, digest: int) -> None:
        """Compares this worker's state digest with the others' at the boundary of `step`."""
        return None

    def state_checks(self) -> set[int]:
        """Steps (besides the periodic ones) at whose boundary every worker checks its state:
        the step after each replacement's first."""
        return set()

    @property
    def contributors(self) -> int | None:
        """How many workers the last step's averages came from (None: not reported)."""
        return None

    def sample_indices(self, step: int, dataset_size: int, batch_size: int) -> list[int]:
        """The sample indices this worker trains on at `step` (interleaved, like the coordinator)."""
        ranges = step_sample_ranges(step, self.rank, self.world_size, dataset_size, batch_size)
        return [i for r in ranges for i in r.indices()]

    def gradient_allocator(self) -> Callable[[int], torch.Tensor] | None:
        """Makes the trainer's zeroed float32 accumulators where this engine sends them from
        without a copy, or None when it has no such memory (then torch.zeros serves)."""
        return None

    def close(self) -> None:
        return None


class CoordinatorEngine(AveragingEngine):
    """The coordinator, through a WorkerClient. With `connect` (a function that joins again,
    given the steps this worker has applied) and `reconnect_timeout`, a lost coordinator is
    rejoined with exponential backoff and full jitter."""

    name = "remote"

    def __init__(
        self,
        client: WorkerClient,
        connect: Callable[[int], WorkerClient] | None = None,
        reconnect_timeout: float = 0.0,
    ) -> None:
        super().__init__()
        self.client = client
        self._connect = connect
        self.reconnect_timeout = reconnect_timeout
        self.rank = client.worker_id
        self.world_size = client.total_workers
        self._requested: int | None = None
        self._snapshot: Callable[[], StateSnapshot] | None = None
        self._contributors: int | None = None

    def gradient_allocator(self) -> Callable[[int], torch.Tensor] | None:
        """Accumulators in the client's shared memory when it uses it, so backward writes
        straight into what is sent (no copy on the way out)."""
        if self.client.transport != "shm":
            return None
        allocate = self.client.allocate

        def make(elements: int) -> torch.Tensor:
            return torch.from_numpy(allocate(elements))

        return make

    def _submit(self, key: Key, flat: torch.Tensor, num_blocks: int, sizes: tuple[int, ...]) -> None:
        # Averaged into `flat` itself, as all_reduce does: on shared memory, with `flat` in the
        # client's arena (`gradient_allocator`), the coordinator writes it there and nothing is
        # copied; otherwise it lands in `flat` directly instead of in a result array first.
        if key[0] == "block":
            self.client.send_block_gradient(self._step, key[1], num_blocks, flat, sizes, into=flat)
        else:
            self.client.send_non_block_gradient(self._step, key[1], flat, into=flat)
        self._submitted.append(_Submitted(key, flat))

    def finish(self) -> list[tuple[Key, torch.Tensor]]:
        out: list[tuple[Key, torch.Tensor]] = []
        contributors: set[int] = set()
        for item in self._submitted:
            result: AveragedBlock | AveragedNonBlock
            if item.key[0] == "block":
                result = self.client.receive_averaged_block()
            else:
                result = self.client.receive_averaged_non_block()
            contributors.add(result.num_contributors)
            out.append((item.key, torch.from_numpy(result.gradients)))
        self._contributors = min(contributors, default=None)
        return out

    @property
    def contributors(self) -> int | None:
        return self._contributors

    @property
    def recovery_step(self) -> int | None:
        return self.client.recovery_step

    def recover(self) -> RecoveredState:
        return self.client.recover()

    def offer_state(self, snapshot: Callable[[], StateSnapshot]) -> None:
        self._snapshot = snapshot
        self.client.offer_state(snapshot)

    def updating_state(self) -> contextlib.AbstractContextManager[None]:
        return self.client.updating_state()

    def check_state(self, step: int, digest: int) -> None:
        self.client.check_state(step, digest)

    def state_checks(self) -> set[int]:
        return {first + 1 for _, first in self.client.replacements()}

    def commit(self, step: int) -> None:
        self.client.barrier(step, "commit")

    @property
    def can_reconnect(self) -> bool:
        return self._connect is not None and self.reconnect_timeout > 0

    def reconnect(self, committed_step: int) -> int | None:
        if self._connect is None:
            return super().reconnect(committed_step)
        with contextlib.suppress(Exception):
            self.client.close()
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.2
        while True:
            try:
                self.client = self._connect(committed_step)
                break
            # RESOURCE_EXHAUSTED: the coordinator still holds this worker's old place until its
            # heartbeat timeout frees it.
            except (
                UnavailableError,
                DeadlineExceededError,
                FailedPreconditionError,
                ResourceExhaustedError,
            ) as exc:
                if time.monotonic() + delay > deadline:
                    raise UnavailableError(
                        f"could not rejoin a coordinator within {self.reconnect_timeout:g} s: {exc.message}"
                    ) from exc
                time.sleep(random.uniform(0, delay))  # full jitter: workers do not stampede
                delay = min(delay * 2, 5.0)
        self.rank = self.client.worker_id
        self.world_size = self.client.total_workers
        self._requested = None
        if self._snapshot is not None:
            self.client.offer_state(self._snapshot)
        return self.client.resume_step

    def submit_loss(self, loss: float, samples: int) -> None:
        self.client.send_gradients(self._step, np.zeros(0, np.float32), loss, 0, samples)

    def global_loss(self) -> float:
        return self.client.receive_averaged().global_loss

    def sample_indices(self, step: int, dataset_size: int, batch_size: int) -> list[int]:
        """Asks the coordinator, and asks for the next step's sample ranges at once, so that the answer
        is already here when the next step starts."""
        if self._requested is None or self._requested < step:
            self.client.request_sample_ranges(step, dataset_size, batch_size)
        self.client.request_sample_ranges(step + 1, dataset_size, batch_size)
        self._requested = step + 1
        answer = self.client.receive_sample_ranges()
        if answer.step != step:
            raise InternalError(f"asked for the sample ranges of step {step}, got step {answer.step}")
        return answer.indices()


class LocalHub:
    """Meeting point of the LocalEngines of one process: averages each key when every rank has
    submitted it, summing in rank order in float64 (the coordinator's arithmetic)."""

    def __init__(self, world_size: int, timeout: float = 300.0) -> None:
        if world_size < 1:
            raise InvalidArgumentError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._parts: dict[tuple[int, Any], list[torch.Tensor | None]] = {}
        self._results: dict[tuple[int, Any], torch.Tensor] = {}
        self._readers: dict[tuple[int, Any], int] = {}

    def contribute(self, step: int, key: Any, rank: int, tensor: torch.Tensor) -> None:
        with self._cond:
            parts = self._parts.setdefault((step, key), [None] * self.world_size)
            if parts[rank] is not None:
                raise InvalidArgumentError(f"rank {rank} contributed step {step} {key} twice")
            parts[rank] = tensor.detach().to("cpu", torch.float32).reshape(-1).clone()
            ready = [p for p in parts if p is not None]
            if len(ready) == self.world_size:
                total = torch.zeros(ready[0].numel(), dtype=torch.float64)
                for part in ready:  # rank order
                    total += part
                self._results[(step, key)] = (total / self.world_size).to(torch.float32)
                del self._parts[(step, key)]
                self._readers[(step, key)] = self.world_size
                self._cond.notify_all()

    def result(self, step: int, key: Any) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while (step, key) not in self._results:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError(f"local all-reduce of step {step} {key} timed out")
                self._cond.wait(remaining)
            result = self._results[(step, key)]
            self._readers[(step, key)] -= 1
            if self._readers[(step, key)] == 0:
                del self._results[(step, key)], self._readers[(step, key)]
            return result


class LocalEngine(AveragingEngine):
    name = "local"
    needs_host = False

    def __init__(self, hub: LocalHub, rank: int) -> None:
        super().__init__()
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self._loss = 0.0

    def _submit(self, key: Key, flat: torch.Tensor, num_blocks: int, sizes: tuple[int, ...]) -> None:
        self.hub.contribute(self._step, key, self.rank, flat)
        self._submitted.append(_Submitted(key, flat))

    def finish(self) -> list[tuple[Key, torch.Tensor]]:
        return [(item.key, self.hub.result(self._step, item.key)) for item in self._submitted]

    def submit_loss(self, loss: float, samples: int) -> None:
        self._loss = loss
        self.hub.contribute(self._step, "loss", self.rank, torch.tensor([loss * samples, float(samples)]))

    def global_loss(self) -> float:
        total = self.hub.result(self._step, "loss") * self.world_size
        return float(total[0] / total[1]) if total[1] else self._loss


class TorchDistributedEngine(AveragingEngine):
    """torch.distributed all_reduce (SUM, then divide), launched asynchronously per tensor."""

    name = "torch.distributed"
    needs_host = False

    def __init__(self, device: torch.device | str | None = None) -> None:
        """`device`: where the loss is reduced when a step submitted no gradient (default: the
        current CUDA device on an NCCL group, else the CPU); otherwise the gradients' device."""
        import torch.distributed as dist

        super().__init__()
        if not dist.is_initialized():
            raise InvalidArgumentError("torch.distributed is not initialised (init_process_group first)")
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._works: list[Any] = []
        self._loss = 0.0
        self.device = torch.device(device) if device is not None else self._default_device()
        self._pair = torch.zeros(2, dtype=torch.float64)
        self._loss_work: Any = None

    def _default_device(self) -> torch.device:
        if "nccl" in str(self._dist.get_backend()) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def start_step(self, step: int) -> None:
        super().start_step(step)
        self._works = []

    def _submit(self, key: Key, flat: torch.Tensor, num_blocks: int, sizes: tuple[int, ...]) -> None:
        buffer = flat.clone()
        self._works.append(self._dist.all_reduce(buffer, async_op=True))
        self._submitted.append(_Submitted(key, buffer))

    def finish(self) -> list[tuple[Key, torch.Tensor]]:
        for work in self._works:
            work.wait()
        return [(item.key, item.tensor.div_(self.world_size)) for item in self._submitted]

    def submit_loss(self, loss: float, samples: int) -> None:
        self._loss = loss
        # On the gradients' device: NCCL reduces only device tensors, and a CPU tensor on an
        # NCCL group fails the step. float64 where the device has it (NCCL does), else float32.
        device = self._loss_device()
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self._pair = torch.tensor([loss * samples, float(samples)], dtype=dtype, device=device)
        self._loss_work = self._dist.all_reduce(self._pair, async_op=True)

    def _loss_device(self) -> torch.device:
        if self._submitted:
            return self._submitted[-1].tensor.device
        return self.device

    def global_loss(self) -> float:
        self._loss_work.wait()
        return float(self._pair[0] / self._pair[1]) if self._pair[1] else self._loss

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
