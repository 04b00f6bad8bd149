"""Outer steps (DiLoCo) in the built-in trainer: `--outer-steps H [--fragments F]`.

One trainer step is one exchange: H/F inner steps (each its micro-batches, forward/backward,
local clipping, the inner AdamW step, no averaging), then the pseudo-gradient Δ = global - local
of one fragment's parameters goes through the engine under the same block / non-block keys a
step's gradients use, the average Δ̄ comes back, the fragment's outer optimizer (SGD, Nesterov
momentum) steps its global weights with Δ̄ as their gradient, and the local weights of that
fragment become the global ones. Fragment k is exchanged at trainer steps ≡ k (mod F), so every
H inner steps each fragment has had one outer step.

With `--outer-delay τ` (Streaming DiLoCo's overlap) the exchange is sent τ inner steps before
the step's last: the step runs H/F - τ inner steps, sends Δ, runs its last τ inner steps while
the average travels, then waits for it and applies it, and the fragment's local weights are
mixed with its new global ones, local ← a·local + (1 - a)·global (`--outer-keep-local a`, 0:
they become the global ones, dropping what the τ inner steps did to that fragment; the paper's
alpha, 0.5; the last step with inner steps and the flush's take the global ones, so the job ends
on them). The step still ends with its exchange applied, so nothing is on its way at a step's
boundary (a replacement, a checkpoint, a step run again after a rejoined coordinator see what
they see without it); the sends are τ inner steps earlier in every period than without it.

At the end, with F > 1, the fragments exchanged earlier in the last period would leave out the
inner steps taken since, and the model would be a mix of global and local weights. So F - 1 flush
steps follow the last inner step (`flush_step`): trainer steps without inner steps, each one more
exchange of the fragment its step number names by the same rule, which is every fragment but the
one exchanged at the last trainer step. By default (`--outer-flush mean`) a flush step applies
the average as it is, global ← global - Δ̄ (the mean of the workers' weights), not through the
outer optimizer, whose state it leaves alone; with `--outer-flush outer` it is an ordinary outer
step (the rule of gradserver.torch.diloco's flush: neither measured better everywhere). Either
way the fragment's local weights then become its global ones (no keep_local mixing), so
afterwards the model's parameters are the global weights, the same on every worker. With F = 1
there is nothing to flush.

Engine step numbers stay consecutive (one per exchange), so what the coordinator does per step
(the average over the workers that contributed, live recovery, rejoining a restarted
coordinator, state checks) happens per exchange, the flush's included. A worker that joins a
running job therefore takes part from the next exchange, a fragment boundary (in the flush: the
rest of the flush).

Replicated state (equal on every worker, what the state digest covers): the global weights and
each fragment's outer optimizer state. Per worker (served to a replacement, not compared): the
inner AdamW state, and with F > 1 or a keep_local above 0 the local weights. This
module does not import gradserver.torch (tests/test_layering.py): the little it needs of
gradserver.torch.diloco is written again here.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import InternalError, InvalidArgumentError

from .clipping import clip_by_global_norm_
from .engines import AveragingEngine, Key
from .model import TransformerLM, model_config
from .trainer import ADAMW_BETAS, ADAMW_EPS, DEFAULT_WEIGHT_DECAY, StepResult, optimizer_extra

# The DiLoCo paper's outer optimizer: SGD with Nesterov momentum 0.9 at lr 0.7.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
OUTER_OPTIMIZER = "SGD-Nesterov"
# How a flush step applies its average: as the workers' mean weights, or as an outer step.
FLUSH_RULES = ("mean", "outer")


@dataclasses.dataclass(frozen=True)
class OuterSettings:
    """`outer_steps` (H) inner steps per outer step of every fragment, `fragments` (F) parts of
    the model exchanged in turn, the outer optimizer's learning rate and momentum, the overlap
    (`delay`, τ), the mixing (`keep_local`, the paper's alpha) and how a flush step applies its
    average (`flush`, one of FLUSH_RULES)."""

    outer_steps: int
    fragments: int = 1
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    delay: int = 0  # τ: the inner steps that run while an exchange travels
    keep_local: float = 0.0  # how much of its local weights a fragment keeps when its average lands
    flush: str = "mean"  # "mean": global - the average; "outer": through the outer optimizer

    @property
    def inner_per_exchange(self) -> int:
        """Inner steps per trainer step (one exchange of one fragment)."""
        return self.outer_steps // self.fragments

    @property
    def flush_steps(self) -> int:
        """Trainer steps after the last inner step: one per fragment not exchanged at the last one."""
        return self.fragments - 1


def check_outer_settings(
    outer_steps: int,
    fragments: int,
    outer_lr: float,
    outer_momentum: float,
    *,
    steps: int,
    model: str,
    delay: int = 0,
    keep_local: float = 0.0,
    flush: str = "mean",
) -> None:
    """Raises naming the flag when the outer-step settings (0 outer steps: off) do not fit
    together or with `steps` (inner steps) and the model."""
    if outer_steps < 0:
        raise InvalidArgumentError(f"--outer-steps must be at least 1 (0: off), got {outer_steps}")
    if flush not in FLUSH_RULES:
        raise InvalidArgumentError(f"--outer-flush {flush!r} must be 'mean' or 'outer'")
    if not outer_steps:
        for flag, value, default in (
            ("--fragments", fragments, 1),
            ("--outer-lr", outer_lr, DEFAULT_OUTER_LR),
            ("--outer-momentum", outer_momentum, DEFAULT_OUTER_MOMENTUM),
            ("--outer-delay", delay, 0),
            ("--outer-keep-local", keep_local, 0.0),
            ("--outer-flush", flush, "mean"),
        ):
            if value != default:
                raise InvalidArgumentError(f"{flag} {value} needs --outer-steps")
        return
    if fragments < 1 or fragments > outer_steps or outer_steps % fragments:
        raise InvalidArgumentError(
            f"--fragments {fragments} must divide --outer-steps {outer_steps} (1..{outer_steps})"
        )
    config = model_config(model)
    units = config.num_layers + (2 if config.tied else 3)  # see `_units`
    if fragments > units:
        raise InvalidArgumentError(
            f"--fragments {fragments}: model {model} has {units} parts to cut (its blocks, the "
            "embedding, the final norm and the LM head), so at most that many fragments"
        )
    if not outer_lr > 0:
        raise InvalidArgumentError(f"--outer-lr must be positive, got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        raise InvalidArgumentError(f"--outer-momentum must be in [0, 1), got {outer_momentum}")
    per = outer_steps // fragments
    if not 0 <= delay < per:
        raise InvalidArgumentError(
            f"--outer-delay {delay} must be at least 0 and below the {per} inner steps of each "
            f"exchange (--outer-steps {outer_steps} / --fragments {fragments}): the exchange is sent "
            "that many inner steps before the step ends"
        )
    if not 0.0 <= keep_local <= 1.0:
        raise InvalidArgumentError(f"--outer-keep-local must be in [0, 1], got {keep_local}")
    if steps % per:
        raise InvalidArgumentError(
            f"--steps {steps} counts inner steps: it must be a multiple of the {per} inner steps "
            f"of each exchange (--outer-steps {outer_steps} / --fragments {fragments})"
        )


def _units(model: TransformerLM) -> list[tuple[Key, list[torch.nn.Parameter]]]:
    """The engine's keys in model order (embedding, blocks, final norm, LM head), each with its
    parameters in wire order. A fragment is a run of whole units: a key is one engine tensor."""
    non_block = model.non_block_parameters()
    units: list[tuple[Key, list[torch.nn.Parameter]]] = [
        (("non_block", int(NonBlockComponent.EMBEDDING)), [non_block[NonBlockComponent.EMBEDDING]])
    ]
    units += [(("block", b), list(block.components())) for b, block in enumerate(model.block_list())]
    units += [
        (("non_block", int(component)), [param])
        for component, param in non_block.items()
        if component != NonBlockComponent.EMBEDDING
    ]
    return units


def cut_fragments(sizes: Sequence[int], fragments: int) -> list[range]:
    """Consecutive runs of `sizes` (at least one each), cut where the running total is nearest
    to each k/F of the whole: F parts of about equal size."""
    if not 1 <= fragments <= len(sizes):
        raise InvalidArgumentError(f"cannot cut {len(sizes)} parts into {fragments} fragments")
    total = sum(sizes)
    cuts = [0]
    running = 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        k = len(cuts)
        if k == fragments:
            break
        left = len(sizes) - (i + 1)  # units after this cut
        must_cut = left == fragments - k
        if must_cut or abs(running - k * total / fragments) <= abs(
            running + sizes[i + 1] - k * total / fragments
        ):
            cuts.append(i + 1)
    cuts.append(len(sizes))
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


@dataclasses.dataclass
class _Unit:
    key: Key
    params: list[torch.nn.Parameter]
    globals: list[torch.Tensor]
    sizes: tuple[int, ...]
    buffer: torch.Tensor  # where Δ is written and sent from (on the host for a host engine)


@dataclasses.dataclass
class _Fragment:
    units: list[_Unit]
    optimizer: torch.optim.SGD


class OuterTrainer:
    """The trainer of `--outer-steps`: same interface as DistributedTrainer for train(), and
    `flush_step` for the steps after the last inner step. `trainer_steps`: the trainer steps with
    inner steps (TrainConfig.trainer_steps), after which the flush's steps come (None: no end is
    known, so no flush)."""

    def __init__(
        self,
        model: TransformerLM,
        engine: AveragingEngine,
        settings: OuterSettings,
        *,
        lr: float = 3e-3,
        weight_decay: float = DEFAULT_WEIGHT_DECAY,
        max_grad_norm: float | None = None,
        step: int = 0,
        keep_snapshot: bool = False,
        trainer_steps: int | None = None,
    ) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InvalidArgumentError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.model = model
        self.engine = engine
        self.settings = settings
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=weight_decay
        )
        self.max_grad_norm = max_grad_norm
        self.step = step
        self.keep_snapshot = keep_snapshot
        self.trainer_steps = trainer_steps
        self.device = next(model.parameters()).device
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._num_blocks = len(model.block_list())
        units = _units(model)
        allocate = engine.gradient_allocator()
        self.fragments: list[_Fragment] = []
        for run in cut_fragments([sum(p.numel() for p in params) for _, params in units], settings.fragments):
            built = [self._unit(*units[i], allocate) for i in run]
            momentum = settings.outer_momentum
            optimizer = torch.optim.SGD(
                [g for unit in built for g in unit.globals],
                lr=settings.outer_lr,
                momentum=momentum,
                nesterov=momentum > 0,  # torch refuses Nesterov without momentum
            )
            self.fragments.append(_Fragment(built, optimizer))
        # With keep_snapshot: the state before the step in flight, and before the last applied one.
        self._before_current: dict[str, Any] | None = None
        self._before_last: dict[str, Any] | None = None

    def _unit(self, key: Key, params: list[torch.nn.Parameter], allocate: Any) -> _Unit:
        elements = sum(p.numel() for p in params)
        if allocate is not None:
            buffer = allocate(elements)
        else:
            on = torch.device("cpu") if self.engine.needs_host else self.device
            buffer = torch.zeros(elements, dtype=torch.float32, device=on)
        globals_ = [p.detach().clone() for p in params]
        sizes = tuple(p.numel() for p in params) if key[0] == "block" else ()
        return _Unit(key, params, globals_, sizes, buffer)

    @property
    def inner_per_step(self) -> int:
        return self.settings.inner_per_exchange

    def fragment_at(self, step: int) -> int:
        return step % len(self.fragments)

    def _inner_steps_done(self) -> int:
        trained = self.step if self.trainer_steps is None else min(self.step, self.trainer_steps)
        return trained * self.inner_per_step

    @property
    def flushing(self) -> bool:
        """Whether the inner steps are over and the next step is one of the flush's."""
        return self.trainer_steps is not None and self.step >= self.trainer_steps

    # --- a trainer step: the inner steps, then one fragment's outer step ---------------------------

    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """`micro_batches` holds every inner step's micro-batches in order (an equal number each)."""
        per = self.inner_per_step
        if not micro_batches or len(micro_batches) % per:
            raise InvalidArgumentError(
                f"train_step needs the micro-batches of {per} inner steps (a multiple of {per}), "
                f"got {len(micro_batches)}"
            )
        if self.flushing:
            raise InvalidArgumentError(
                f"step {self.step}: the inner steps end before step {self.trainer_steps} "
                "(trainer_steps); the flush's steps take none (flush_step)"
            )
        return self._step_all_or_none(micro_batches)

    def flush_step(self) -> StepResult:
        """A step of the final flush: the exchange of fragment `fragment_at(step)` without inner
        steps, its average applied by the `flush` rule (global ← global - Δ̄, or an outer step; its
        result: no tokens, loss NaN, `flush` True). After the last one every fragment's local
        weights are its global weights."""
        end, count = self.trainer_steps, self.settings.flush_steps
        if end is None or not end <= self.step < end + count:
            raise InvalidArgumentError(
                f"step {self.step} is not a flush step: the flush is the {count} steps from "
                f"trainer_steps ({end}) on"
            )
        return self._step_all_or_none(())

    def _step_all_or_none(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        started = time.perf_counter()
        if self.keep_snapshot:
            self._before_current = self._copy_state()
        step = self.step
        try:
            return self._train_step(micro_batches, started)
        except BaseException:
            # A step that failed before it was applied is retried from where it began (after a
            # rejoined coordinator), not from where its inner steps left the weights.
            if self._before_current is not None and self.step == step:
                self._restore(self._before_current)
            raise

    def _train_step(
        self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], started: float
    ) -> StepResult:
        flush = not micro_batches
        fragment = self.fragments[self.fragment_at(self.step)]
        if flush:
            # Nothing was trained, so there is no loss to report (NaN); the engines want a finite
            # one (the coordinator refuses NaN), and 0 over 0 tokens weighs nothing in the average.
            loss_value, sent_loss, tokens, norm = math.nan, 0.0, 0, None
            self._send(fragment)
            sent = time.perf_counter()
        else:
            # The last τ inner steps run while the exchange travels (`--outer-delay`).
            micro_per_inner = len(micro_batches) // self.inner_per_step
            split = (self.inner_per_step - self.settings.delay) * micro_per_inner
            loss_sum, tokens, norm = self._inner_steps(micro_batches[:split], micro_per_inner)
            self._send(fragment)
            sent = time.perf_counter()
            if split < len(micro_batches):
                overlapped = self._inner_steps(micro_batches[split:], micro_per_inner)
                loss_sum, tokens, norm = loss_sum + overlapped[0], tokens + overlapped[1], overlapped[2]
            loss_value = sent_loss = loss_sum / len(micro_batches)  # the mean over the whole inner phase
        compute_done = time.perf_counter()
        averages = self._land(fragment, sent_loss, tokens)
        if self.keep_snapshot:
            self.engine.commit(self.step)
        comm_done = time.perf_counter()
        with self.engine.updating_state():
            self._outer_step(fragment, averages, flush=flush)
            self.step += 1
        self._before_last, self._before_current = self._before_current, None
        global_loss = self.engine.global_loss()  # also when unused: it ends the step's loss exchange
        return StepResult(
            step=self.step - 1,
            loss=loss_value,
            global_loss=math.nan if flush else global_loss,
            tokens=tokens,
            seconds=time.perf_counter() - started,
            compute_s=compute_done - started,
            comm_s=comm_done - compute_done,
            grad_norm=norm,
            contributors=self.engine.contributors,
            inner_steps=self._inner_steps_done(),
            outer_steps=self.step,
            fragment=self.fragment_at(self.step - 1),
            flush=flush,
            in_flight_s=compute_done - sent,
        )

    def _inner_steps(
        self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], micro_per_inner: int
    ) -> tuple[float, int, float | None]:
        """Runs inner steps of `micro_per_inner` micro-batches each; returns the sum of their
        losses, the tokens and the last gradient norm (None without clipping)."""
        per = len(micro_batches) // micro_per_inner
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        norm: torch.Tensor | None = None
        for inner in range(per):
            for inputs, targets in micro_batches[inner * micro_per_inner : (inner + 1) * micro_per_inner]:
                loss = self.model.loss(inputs.to(self.device), targets.to(self.device))
                (loss / micro_per_inner).backward()  # type: ignore[no-untyped-call]
                loss_sum += loss.detach()
                tokens += targets.numel()
            if self.max_grad_norm is not None:
                grads = [p.grad for p in self.model.parameters() if p.grad is not None]
                norm = clip_by_global_norm_(grads, self.max_grad_norm)
            # A joining worker may be reading this state (live recovery): not while it changes.
            with self.engine.updating_state():
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        return float(loss_sum), tokens, float(norm) if norm is not None else None

    def _send(self, fragment: _Fragment) -> None:
        """Starts the exchange of the fragment's pseudo-gradients global - local (`_land` waits
        for it); the averages land in the units' buffers, which nothing else touches meanwhile."""
        engine = self.engine
        engine.start_step(self.step)
        with torch.no_grad():
            for unit in fragment.units:
                delta = torch.cat(
                    [(g - p).reshape(-1) for g, p in zip(unit.globals, unit.params, strict=True)]
                )
                unit.buffer.copy_(delta)
                kind, index = unit.key
                if kind == "block":
                    engine.submit_block(index, self._num_blocks, unit.buffer, unit.sizes)
                else:
                    engine.submit_non_block(NonBlockComponent(index), unit.buffer)

    def _land(self, fragment: _Fragment, loss: float, tokens: int) -> list[torch.Tensor]:
        """Hands in the step's loss and waits for the exchange `_send` started: its averages
        in unit order."""
        engine = self.engine
        engine.submit_loss(loss, tokens)
        averages = engine.finish()
        if [key for key, _ in averages] != [unit.key for unit in fragment.units]:
            raise InternalError(
                f"step {self.step}: averages came back for {[k for k, _ in averages]}, "
                f"sent {[u.key for u in fragment.units]}"
            )
        return [average for _, average in averages]

    def _outer_step(self, fragment: _Fragment, averages: list[torch.Tensor], *, flush: bool) -> None:
        """The fragment's outer step with the averaged Δ̄. In the flush with the "mean" rule,
        global ← global - Δ̄ (the workers' mean weights) instead: its Δ covers only part of a
        period and no inner step follows, and the outer optimizer's lr and Nesterov momentum would
        carry the weights past that mean (measured: docs/slow-links.md, "In the built-in
        trainer"); the "outer" rule takes the outer step all the same, as the torch wrapper does."""
        as_mean = flush and self.settings.flush == "mean"
        with torch.no_grad():
            for unit, average in zip(fragment.units, averages, strict=True):
                flat = average.reshape(-1).to(self.device, torch.float32)
                if flat.numel() != unit.buffer.numel():
                    raise InternalError(
                        f"average of {unit.key} has {flat.numel()} elements, expected {unit.buffer.numel()}"
                    )
                for g, piece in zip(
                    unit.globals, torch.split(flat, [g.numel() for g in unit.globals]), strict=True
                ):
                    if as_mean:
                        g.sub_(piece.view(g.shape))
                    else:
                        g.grad = piece.view(g.shape).clone()
            if not as_mean:
                fragment.optimizer.step()
                fragment.optimizer.zero_grad(set_to_none=True)
            # The job ends on the global weights: the flush's fragments and the last step's.
            last = self.trainer_steps is not None and self.step + 1 >= self.trainer_steps
            keep = 0.0 if flush or last else self.settings.keep_local
            for unit in fragment.units:
                for g, p in zip(unit.globals, unit.params, strict=True):
                    if keep:
                        p.mul_(keep).add_(g, alpha=1.0 - keep)
                    else:
                        p.copy_(g)

    # --- the state: served to replacements, compared, checkpointed ---------------------------------

    def _global_items(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (self._names[id(p)], g)
            for fragment in self.fragments
            for unit in fragment.units
            for p, g in zip(unit.params, unit.globals, strict=True)
        ]

    def replicated_tensors(self) -> dict[str, torch.Tensor]:
        """What every worker holds bit for bit alike (`global/NAME`, `outer/FRAGMENT/INDEX/NAME`):
        what the state digest compares."""
        tensors = {f"global/{name}": g for name, g in self._global_items()}
        for k, fragment in enumerate(self.fragments):
            for index, state in fragment.optimizer.state_dict()["state"].items():
                for name, value in state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"outer/{k}/{index}/{name}"] = value
        return tensors

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The replicated tensors, this worker's inner optimizer state (`inner/PARAM/NAME`) and,
        with fragments or `keep_local`, its local weights (`local/NAME`). No copies: read them
        before the next step."""
        tensors = self.replicated_tensors()
        for index, state in self.optimizer.state_dict()["state"].items():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"inner/{index}/{name}"] = value
        if len(self.fragments) > 1 or self.settings.keep_local:
            tensors.update({f"local/{name}": p for name, p in self.model.named_parameters()})
        return tensors

    def state_extra(self) -> dict[str, Any]:
        return optimizer_extra(self.optimizer)

    def load_state(self, step: int, tensors: dict[str, Any], extra: dict[str, Any]) -> None:
        """Takes another worker's state (`state_tensors`, `state_extra` there) at `step`. With one
        fragment and no `keep_local` the local weights become the global ones: at a step's
        boundary they are equal, whatever inner step the donor was at while it served."""
        inner: dict[int, dict[str, Any]] = {}
        outer: list[dict[int, dict[str, Any]]] = [{} for _ in self.fragments]
        globals_: dict[str, torch.Tensor] = {}
        local: dict[str, torch.Tensor] = {}
        for name, value in tensors.items():
            kind, rest = name.split("/", 1)
            tensor = torch.as_tensor(value)
            if kind == "global":
                globals_[rest] = tensor
            elif kind == "local":
                local[rest] = tensor
            elif kind == "inner":
                index, key = rest.split("/", 1)
                inner.setdefault(int(index), {})[key] = tensor
            elif kind == "outer":
                k, index, key = rest.split("/", 2)
                outer[int(k)].setdefault(int(index), {})[key] = tensor
            else:
                raise InternalError(f"unknown state tensor {name!r}")
        for name, value in dict(extra.get("optimizer", {})).items():
            index, key = name.split("/", 1)
            inner.setdefault(int(index), {})[key] = value
        with self.engine.updating_state():
            self._load(globals_, local or None, inner, outer)
            rng = extra.get("torch_rng")
            if isinstance(rng, bytes):
                torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
            self.step = step

    def _load(
        self,
        globals_: dict[str, torch.Tensor],
        local: dict[str, torch.Tensor] | None,
        inner: dict[int, dict[str, Any]],
        outer: list[dict[int, dict[str, Any]]],
    ) -> None:
        items = self._global_items()
        missing = sorted({name for name, _ in items} - set(globals_))
        if missing:
            raise InternalError(f"the state lacks the global weights of {', '.join(missing)}")
        with torch.no_grad():
            for name, g in items:
                g.copy_(globals_[name])
            params = dict(self.model.named_parameters())
            for name, g in items:
                params[name].copy_(g if local is None else local[name])
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": inner, "param_groups": groups})
        for fragment, state in zip(self.fragments, outer, strict=True):
            groups = fragment.optimizer.state_dict()["param_groups"]
            fragment.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def outer_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the model (the local weights) and the inner optimizer."""
        return {
            "global": {name: g for name, g in self._global_items()},
            "optimizers": [fragment.optimizer.state_dict() for fragment in self.fragments],
        }

    def load_outer_state(self, state: dict[str, Any]) -> None:
        """Takes a checkpoint's `outer_state` (after the model and inner optimizer were loaded)."""
        optimizers = state.get("optimizers", [])
        if len(optimizers) != len(self.fragments):
            raise InvalidArgumentError(
                f"the checkpoint's outer state has {len(optimizers)} fragments, "
                f"this job {len(self.fragments)}"
            )
        with torch.no_grad():
            for name, g in self._global_items():
                g.copy_(state["global"][name])
        for fragment, saved in zip(self.fragments, optimizers, strict=True):
            fragment.optimizer.load_state_dict(saved)

    # --- all-or-none steps (rejoining a restarted coordinator) ------------------------------------

    def _copy_state(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "inner": copy.deepcopy(self.optimizer.state_dict()),
            "outer": copy.deepcopy(self.outer_state()),
            "step": self.step,
        }

    def _restore(self, saved: dict[str, Any]) -> None:
        with self.engine.updating_state():
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["inner"])
            self.load_outer_state(saved["outer"])
            self.step = saved["step"]

    def rollback(self) -> None:
        """Undoes the last applied step: weights, both optimizers' state, step count."""
        if self._before_last is None:
            raise InternalError("no snapshot to roll back to (keep_snapshot is off, or no step ran)")
        self._restore(self._before_last)
        self._before_last = None

    def close(self) -> None:
        return None
