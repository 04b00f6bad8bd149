"""DistributedTrainer: data-parallel training steps over any AveragingEngine.

One step:
1. forward/backward over the micro-batches; post-accumulate-grad hooks add each parameter's
   gradient into the PerBlockGradientAccumulator in place on the device and free `.grad`;
2. in the last micro-batch, as soon as a block's nine gradients are final, the block is
   pre-averaged by the local micro-batch count and submitted, so communication overlaps the rest
   of backward (blocks go out in reverse order, as backward produces them); then the LM head,
   final norm and embedding;
3. the averages come back into the accumulator, become the parameters' `.grad`, are optionally
   clipped by global norm (on the device, after the average, so every worker clips identically),
   and the optimizer (AdamW) steps.

For a engine that needs host data, device gradients are copied to reusable pinned buffers
without blocking, and a sender thread waits for each copy's CUDA event before handing it on, so
the training thread never synchronises inside the micro-batch loop.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import InternalError, InvalidArgumentError

from .clipping import clip_by_global_norm_
from .engines import AveragingEngine
from .gradient_buffers import PerBlockGradientAccumulator
from .model import TransformerLM

# AdamW's settings besides the learning rate; part of the job fingerprint, so named here.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
DEFAULT_WEIGHT_DECAY = 0.0


@dataclasses.dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    global_loss: float
    tokens: int
    seconds: float
    compute_s: float
    comm_s: float
    grad_norm: float | None
    # How many workers this step's averages came from (None: the engine does not say).
    contributors: int | None = None
    # With --outer-steps only (None otherwise): inner steps and exchanges (outer steps of one
    # fragment each) done after this step, the fragment this step exchanged, and whether the step
    # was one of the final flush's (no inner steps, so no tokens and a NaN loss).
    inner_steps: int | None = None
    outer_steps: int | None = None
    fragment: int | None = None
    flush: bool | None = None
    # With --outer-steps: seconds from the exchange's send to the end of the inner steps that ran
    # beside it (--outer-delay; 0 without), after which `comm_s` waited for its averages.
    in_flight_s: float | None = None


# StepResult fields that exist only with --outer-steps: left out of a step's metrics without it.
OUTER_FIELDS = ("inner_steps", "outer_steps", "fragment", "flush", "in_flight_s")


class Trainer(Protocol):
    """What train() needs of a trainer: DistributedTrainer, or OuterTrainer (train/outer_steps.py)."""

    model: TransformerLM
    optimizer: torch.optim.Optimizer
    step: int

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult: ...

    def rollback(self) -> None: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def replicated_tensors(self) -> dict[str, torch.Tensor]: ...

    def state_extra(self) -> dict[str, Any]: ...

    def load_state(self, step: int, tensors: dict[str, Any], extra: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _read_later(value: torch.Tensor) -> Callable[[], float]:
    """Reads a 0-d tensor's value when called. On a GPU the value is copied to pinned memory
    now, and reading waits for that copy alone, not for the work queued after it (the optimizer
    step): reporting the gradient norm never drains the stream."""
    if value.device.type != "cuda":
        return lambda: float(value)
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record()

    def read() -> float:
        copied.synchronize()
        return float(host)

    return read


def optimizer_extra(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A trainer's state besides tensors: `optimizer`'s non-tensor per-parameter values and the
    RNG state."""
    other = {
        f"{index}/{name}": value
        for index, state in optimizer.state_dict()["state"].items()
        for name, value in state.items()
        if not isinstance(value, torch.Tensor)
    }
    return {"optimizer": other, "torch_rng": bytes(torch.get_rng_state().numpy().tobytes())}


def _pair(component: NonBlockComponent, data: torch.Tensor) -> tuple[NonBlockComponent, torch.Tensor]:
    return component, data


class _Sender:
    """Hands staged gradients to the engine from a thread of its own, in submission order."""

    def __init__(self, engine: AveragingEngine) -> None:
        self.engine = engine
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gradserver-sender", daemon=True)
        self._thread.start()

    def put(self, item: tuple[Any, ...]) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, event, args = item
            try:
                if self._error is None:
                    if event is not None:
                        event.synchronize()
                    getattr(self.engine, kind)(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread
                self._error = exc
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def reset(self) -> None:
        """Forgets what a failed step left behind (its queued items, its error)."""
        self._queue.join()
        self._error = None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)


class DistributedTrainer:
    def __init__(
        self,
        model: TransformerLM,
        engine: AveragingEngine,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        lr: float = 3e-3,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        max_grad_norm: float | None = None,
        step: int = 0,
        keep_snapshot: bool = False,
    ) -> None:
        """`keep_snapshot` (for rejoining a restarted coordinator) makes steps all-or-none: every
        worker passes a commit round before applying a step, and the weights and optimizer state
        from before the last step are kept so `rollback()` can undo it."""
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidArgumentError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.model = model
        self.engine = engine
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=weight_decay
        )
        self.max_grad_norm = max_grad_norm
        self.step = step
        self.keep_snapshot = keep_snapshot
        self._snapshot: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        cfg = model.config
        self.device = next(model.parameters()).device
        sizes = tuple(p.numel() for p in model.block_list()[0].components())
        self.accumulator = PerBlockGradientAccumulator(
            cfg.num_layers,
            sizes,
            cfg.vocab,
            cfg.hidden,
            self.device,
            tied=cfg.tied,
            allocate=engine.gradient_allocator(),
        )
        self._non_block = model.non_block_parameters()
        self._route: dict[int, tuple[str, int, int]] = {}
        for b, block in enumerate(model.block_list()):
            for c, param in enumerate(block.components()):
                self._route[id(param)] = ("block", b, c)
        for component, param in self._non_block.items():
            self._route[id(param)] = ("non_block", int(component), 0)
        self._remaining: list[int] = []
        self._last_micro = False
        self._micro_count = 1
        self._sender = _Sender(engine) if engine.needs_host else None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
            for p in model.parameters()
        ]

    # --- hooks ----------------------------------------------------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        kind, index, component = self._route[id(param)]
        if kind == "block":
            target = self.accumulator.block_grads[index].components[component]
            target.add_(grad.reshape(-1))
            param.grad = None
            self._remaining[index] -= 1
            if self._remaining[index] == 0 and self._last_micro:
                self._submit_block(index)
        else:
            self.accumulator.accumulate_non_block(NonBlockComponent(index), grad)
            param.grad = None

    def _submit_block(self, index: int) -> None:
        grads = self.accumulator.block_grads[index]
        flat = grads.flatten()
        if self._micro_count > 1:
            flat.div_(self._micro_count)
        num_blocks, sizes = len(self.accumulator.block_grads), grads.component_sizes()
        self._hand_over("submit_block", ("block", index), flat, lambda data: (index, num_blocks, data, sizes))

    def _hand_over(
        self,
        method: str,
        key: tuple[str, int],
        flat: torch.Tensor,
        make_args: Callable[[torch.Tensor], tuple[Any, ...]],
    ) -> None:
        """Submits `flat` now, or stages it on the host for the sender thread."""
        if self._sender is None:
            getattr(self.engine, method)(*make_args(flat))
            return
        host = self.accumulator.to_host(key, flat)
        event = None
        if flat.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._sender.put((method, event, make_args(host)))

    # --- a step ---------------------------------------------------------------------------------

    def _on_device(self, batch: torch.Tensor) -> torch.Tensor:
        """`batch` on the training device. A host batch goes to a GPU through pinned memory without
        blocking: a plain `.to("cuda")` of pageable memory synchronises the stream, once per
        micro-batch and tensor."""
        if self.device.type != "cuda" or batch.device.type != "cpu":
            return batch.to(self.device)
        return batch.pin_memory().to(self.device, non_blocking=True)

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """One optimizer step over `micro_batches` (inputs, targets), averaged with every worker."""
        if not micro_batches:
            raise InvalidArgumentError("train_step needs at least one micro-batch")
        started = time.perf_counter()
        if self._sender is not None:
            self._sender.reset()
        self.accumulator.zero_all()
        self._micro_count = len(micro_batches)
        self.engine.start_step(self.step)
        num_blocks = len(self.model.blocks)
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for i, (inputs, targets) in enumerate(micro_batches):
            self._remaining = [9] * num_blocks
            self._last_micro = i == len(micro_batches) - 1
            loss = self.model.loss(self._on_device(inputs), self._on_device(targets))
            loss.backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach()
            tokens += targets.numel()
        self.accumulator.accumulated_count = len(micro_batches)
        for component, flat in self.accumulator.non_block.items():
            if self._micro_count > 1:
                flat.div_(self._micro_count)
            self._hand_over(
                "submit_non_block", ("non_block", int(component)), flat, functools.partial(_pair, component)
            )
        loss_value = float(loss_sum) / len(micro_batches)  # the step's one host sync
        if self._sender is not None:
            self._sender.put(("submit_loss", None, (loss_value, tokens)))
        else:
            self.engine.submit_loss(loss_value, tokens)
        compute_done = time.perf_counter()
        if self._sender is not None:
            self._sender.drain()
        self._apply(self.engine.finish())
        grad_norm: Callable[[], float] | None = None
        if self.max_grad_norm is not None:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = _read_later(clip_by_global_norm_(grads, self.max_grad_norm))
        if self.keep_snapshot:
            self._snapshot = (
                {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                copy.deepcopy(self.optimizer.state_dict()),
            )
            self.engine.commit(self.step)
        comm_done = time.perf_counter()
        # A worker joining the job may be reading this state (live recovery): wait for it.
        with self.engine.updating_state():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
        global_loss = self.engine.global_loss()
        result = StepResult(
            step=self.step - 1,
            loss=loss_value,
            global_loss=global_loss,
            tokens=tokens,
            seconds=time.perf_counter() - started,
            compute_s=compute_done - started,
            comm_s=comm_done - compute_done,
            grad_norm=grad_norm() if grad_norm is not None else None,
            contributors=self.engine.contributors,
        )
        return result

    def rollback(self) -> None:
        """Undoes the last applied step (weights, optimizer state, step count)."""
        if self._snapshot is None:
            raise InternalError("no snapshot to roll back to (keep_snapshot is off, or no step ran)")
        weights, optimizer_state = self._snapshot
        with self.engine.updating_state():
            self.model.load_state_dict(weights)
            self.optimizer.load_state_dict(optimizer_state)
            self._snapshot = None
            self.step -= 1

    # --- the replicated state (live recovery) -----------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the replicated state, by name: the model's (`model/NAME`) and the
        optimizer's (`optimizer/PARAM/NAME`). No copies: read them before the next step."""
        tensors = {f"model/{name}": t for name, t in self.model.state_dict().items()}
        for index, state in self.optimizer.state_dict()["state"].items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{index}/{name}"] = value
        return tensors

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """What every worker holds alike, which the state digest compares: all of the state."""
        return self.state_tensors()

    def state_extra(self) -> dict[str, Any]:
        """What the state holds besides tensors: the optimizer's other per-parameter values and
        the RNG state (not part of the digest: ranks may draw differently)."""
        return optimizer_extra(self.optimizer)

    def load_state(self, step: int, tensors: dict[str, Any], extra: dict[str, Any]) -> None:
        """Takes another replica's state (`state_tensors`, `state_extra` there) at `step`."""
        model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        optimizer: dict[int, dict[str, Any]] = {}
        for name, value in tensors.items():
            if name.startswith("optimizer/"):
                _, index, key = name.split("/", 2)
                optimizer.setdefault(int(index), {})[key] = value
        for name, value in dict(extra.get("optimizer", {})).items():
            index, key = name.split("/", 1)
            optimizer.setdefault(int(index), {})[key] = value
        with self.engine.updating_state():
            self.model.load_state_dict(model)
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": optimizer, "param_groups": groups})
            rng = extra.get("torch_rng")
            if isinstance(rng, bytes):
                torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
            self.step = step

    def _apply(self, averages: list[tuple[tuple[str, int], torch.Tensor]]) -> None:
        acc = self.accumulator
        for (kind, index), avg in averages:
            if kind == "block":
                target = acc.block_grads[index].flatten()
            else:
                target = acc.non_block[NonBlockComponent(index)]
            if avg.numel() != target.numel():
                raise InternalError(
                    f"average of {kind} {index} has {avg.numel()} elements, expected {target.numel()}"
                )
            if avg.data_ptr() != target.data_ptr():  # else averaged in place already
                target.copy_(avg.reshape(-1), non_blocking=True)
        for b, block in enumerate(self.model.block_list()):
            for param, grad in zip(block.components(), acc.block_grads[b].components, strict=True):
                param.grad = grad.view(param.shape)
        for component, param in self._non_block.items():
            param.grad = acc.non_block[component].view(param.shape)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        if self._sender is not None:
            self._sender.close()
