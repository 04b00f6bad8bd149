"""Outer steps for torch scripts over slow links (DiLoCo, Streaming DiLoCo).

    from gradserver.torch import diloco

    with diloco.DiLoCo(model, inner_optimizer, sync_every=50, quantize="int8") as outer:
        for batch in batches:
            loss_fn(model(batch.inputs), batch.targets).backward()
            outer.count(batch.tokens)           # optional: weights this replica's share
            inner_optimizer.step()              # every 50th step is also an outer step
            inner_optimizer.zero_grad()

Each replica (a process, or a DDP/FSDP2 group of them: pass the outer `group`) trains alone with
its inner optimizer. Every `sync_every` (H) inner steps the wrapper computes the pseudo-gradient
Δ = global weights - local weights, averages it across the replicas of `group` (torch.distributed,
the "gradserver" backend), and an outer optimizer (default SGD, Nesterov, momentum 0.9, lr 0.7, as
in Douillard et al. 2023) steps the global weights with it. Every replica applies the same average
to the same global weights with the same optimizer state, so the global weights are bit-identical
everywhere after every outer step; the local weights then become the global ones.

The average is weighted: Δ̄ = Σ wᵢ Δᵢ / Σ wᵢ with wᵢ what replica i passed to `count` since its
last exchange of that fragment (tokens or samples it processed), or 1 for every replica that
never calls `count`. Unquantized, the payload [wᵢ Δᵢ, wᵢ] is one SUM all_reduce, which the
coordinator sums in rank order in float64 and rounds once (the same bytes on every replica).
Quantized (`quantize` "bf16", "int8" or "int4", `_quantize`), each replica encodes its own Δᵢ plus
the error it kept from the previous exchange (error feedback), the payloads are all-gathered as
bytes, and every replica decodes them and sums wᵢ·decode(payloadᵢ) in rank order in float32:
the same operations on the same bytes, so the same bits. Wire bytes per replica and exchange:
one payload up, N down (`sent_bytes`, `received_bytes` count them).

Streaming (`fragments` F > 1, `delay` τ > 0, Liu et al. 2025): the parameters are cut, in model
order, into F fragments of about equal size; fragment f is exchanged at inner step
⌊(f+1)·H/F⌋ of each period, its exchange runs while the next τ inner steps do, and it is applied
τ steps after it was sent. The mixing rule when fragment f's outer step lands:
local ← keep_local · local + (1 - keep_local) · global (keep_local = 0: the local weights become
the global ones, plain DiLoCo; the paper's alpha is keep_local, 0.5 with τ > 0). Each fragment has its
own outer optimizer and error feedback.

Every replica must take the same number of inner steps; replicas must start from the same
parameters (checked at construction: the error names the first parameter that differs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from gradserver.common.errors import FailedPreconditionError, InvalidArgumentError

from ._quantize import BLOCK, ErrorFeedback, check_format, decode, encoded_size

__all__ = ["DiLoCo", "nesterov_outer_optimizer"]

OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
# torch 2.13 renamed all_gather_into_tensor (which it warns about); older ones have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_HEADER = 8  # a quantized payload's header: its weight and its count of non-finite values (float32)


def nesterov_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD, Nesterov momentum 0.9, learning rate 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _local(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) value; a plain tensor as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


@dataclasses.dataclass
class _Exchange:
    """A fragment's average on its way: applied at inner step `due`."""

    due: int
    work: dist.Work | None
    buffer: torch.Tensor  # the SUM all_reduce's vector, or every replica's payload gathered
    own_weight: float


@dataclasses.dataclass
class _Fragment:
    """Parameters exchanged together, with their global weights and outer optimizer."""

    names: list[str]
    params: list[torch.Tensor]
    global_weights: list[torch.Tensor]
    outer: torch.optim.Optimizer
    send_at: int  # its inner step within each period, 1..H
    numel: int
    feedback: ErrorFeedback | None
    counted_at_send: float = 0.0
    pending: _Exchange | None = None


class DiLoCo:
    """Outer steps over `group` for one replica's `model` (see the module's docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_optimizer: OuterOptimizer = nesterov_outer_optimizer,
        group: dist.ProcessGroup | None = None,
        quantize: str | None = None,
        block: int = BLOCK,
        fragments: int = 1,
        delay: int = 0,
        keep_local: float = 0.0,
    ) -> None:
        """`sync_every` (H): inner steps per period. `outer_optimizer`: makes an optimizer of a
        list of tensors (the global weights of one fragment). `group`: the process group of the
        replicas (one rank from each; default the default group). `quantize`: None (float32),
        "bf16", "int8" or "int4"; `block`: values per scale of int8 and int4. `fragments`,
        `delay`, `keep_local`: streaming (the module's docstring)."""
        if sync_every < 1:
            raise InvalidArgumentError(f"sync_every must be at least 1 inner step, got {sync_every}")
        if quantize is not None:
            try:
                check_format(quantize, block)
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
        params: list[tuple[str, torch.Tensor]] = [
            (name, p) for name, p in model.named_parameters() if p.requires_grad
        ]
        if not params:
            raise InvalidArgumentError("the model has no parameters that require gradients")
        if not 1 <= fragments <= min(sync_every, len(params)):
            raise InvalidArgumentError(
                f"fragments must be between 1 and min(sync_every, parameters) = "
                f"{min(sync_every, len(params))}, got {fragments}"
            )
        if not 0 <= delay < sync_every:
            raise InvalidArgumentError(
                f"delay must be between 0 and sync_every - 1 = {sync_every - 1} inner steps, got {delay}"
            )
        if not 0.0 <= keep_local <= 1.0:
            raise InvalidArgumentError(f"keep_local must be between 0 and 1, got {keep_local}")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.group = group
        self.quantize = quantize
        self.block = block
        self.delay = delay
        self.keep_local = keep_local
        self.replicas = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.inner_step = 0
        self.outer_steps = 0  # fragment outer steps applied
        self.sent_bytes = 0  # collective payload bytes this replica sent, and received
        self.received_bytes = 0
        self._counted = 0.0
        self._counts = False  # whether `count` was ever called: else every weight is 1
        self._hook: RemovableHandle | None = None
        _check_identical(params, group, self.rank, self.replicas)
        self._fragments = [
            self._fragment(part, (index + 1) * sync_every // fragments, outer_optimizer)
            for index, part in enumerate(_split(params, fragments))
        ]

    def _fragment(
        self, params: list[tuple[str, torch.Tensor]], send_at: int, outer_optimizer: OuterOptimizer
    ) -> _Fragment:
        with torch.no_grad():
            global_weights = [_local(p).detach().clone() for _, p in params]
        return _Fragment(
            names=[name for name, _ in params],
            params=[p for _, p in params],
            global_weights=global_weights,
            outer=outer_optimizer(global_weights),
            send_at=send_at,
            numel=sum(g.numel() for g in global_weights),
            feedback=None if self.quantize is None else ErrorFeedback(self.quantize, self.block),
        )

    # --- the loop -------------------------------------------------------------------------------

    def count(self, amount: float) -> None:
        """Adds `amount` (tokens or samples this replica processed) to its weight in the next
        exchange of each fragment. A replica that never calls it weighs 1 in every exchange."""
        if not amount >= 0:
            raise InvalidArgumentError(f"count takes a non-negative amount, got {amount}")
        self._counts = True
        self._counted += float(amount)

    def step(self) -> None:
        """Ends an inner step (the inner optimizer's step hook calls it inside `with`): sends the
        fragments due now and applies the exchanges that are due."""
        self.inner_step += 1
        in_period = self.inner_step % self.sync_every or self.sync_every
        for fragment in self._fragments:
            if fragment.pending is not None and fragment.pending.due == self.inner_step:
                self._apply(fragment)
            if fragment.send_at == in_period:
                self._send(fragment)
                if self.delay == 0:
                    self._apply(fragment)

    def close(self) -> None:
        """Applies the exchanges still on their way (every replica has the same ones) and
        removes the inner optimizer's hook. Safe to call more than once."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for fragment in self._fragments:
            if fragment.pending is not None:
                self._apply(fragment)

    def __enter__(self) -> DiLoCo:
        def after_inner_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.step()

        self._hook = self.inner_optimizer.register_step_post_hook(after_inner_step)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is None:
            self.close()
        elif self._hook is not None:  # the exchanges in flight may be what failed: leave them
            self._hook.remove()
            self._hook = None

    def global_tensors(self) -> dict[str, torch.Tensor]:
        """This replica's copy of the global weights by parameter name (this rank's shards of a
        sharded model): bit-identical on every replica after each outer step. No copies."""
        return {
            name: weight
            for fragment in self._fragments
            for name, weight in zip(fragment.names, fragment.global_weights, strict=True)
        }

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """The outer optimizer of each fragment, in model order."""
        return [fragment.outer for fragment in self._fragments]

    # --- exchanges ------------------------------------------------------------------------------

    def _weight(self, fragment: _Fragment) -> float:
        weight = self._counted - fragment.counted_at_send if self._counts else 1.0
        fragment.counted_at_send = self._counted
        return weight

    def _send(self, fragment: _Fragment) -> None:
        weight = self._weight(fragment)
        with torch.no_grad():
            delta = torch.cat(
                [
                    (g.float() - _local(p).detach().float()).reshape(-1)
                    for g, p in zip(fragment.global_weights, fragment.params, strict=True)
                ]
            )
        nonfinite = int((~torch.isfinite(delta)).sum())
        if nonfinite:
            delta.zero_()  # sent as zeros; the count in the payload fails the exchange everywhere
        if fragment.feedback is None:
            buffer = self._summed_payload(delta, weight, nonfinite)
            work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self.sent_bytes += buffer.numel() * 4
            self.received_bytes += buffer.numel() * 4
        else:
            mine = self._quantized_payload(fragment.feedback, delta, weight, nonfinite)
            buffer = torch.empty(self.replicas * mine.numel(), dtype=torch.uint8, device=mine.device)
            work = _all_gather_single(buffer, mine, group=self.group, async_op=True)
            self.sent_bytes += mine.numel()
            self.received_bytes += buffer.numel()
        fragment.pending = _Exchange(self.inner_step + self.delay, work, buffer, weight)

    def _summed_payload(self, delta: torch.Tensor, weight: float, nonfinite: int) -> torch.Tensor:
        """[w·Δ, w, one slot per replica: this one's count of non-finite values]: summed by the
        coordinator, it holds Σ wᵢΔᵢ, Σ wᵢ and every replica's count."""
        extra = torch.zeros(1 + self.replicas, dtype=torch.float32, device=delta.device)
        extra[0] = weight
        extra[1 + self.rank] = nonfinite
        return torch.cat([delta * weight if weight != 1.0 else delta, extra])

    def _quantized_payload(
        self, feedback: ErrorFeedback, delta: torch.Tensor, weight: float, nonfinite: int
    ) -> torch.Tensor:
        """[weight, count of non-finite values] as float32 bytes, then the encoded Δ + error,
        padded to a multiple of 8 bytes so that every replica's piece stays aligned."""
        header = torch.tensor([weight, float(nonfinite)], dtype=torch.float32, device=delta.device)
        if nonfinite:
            encoded = torch.zeros(
                encoded_size(feedback.format, delta.numel(), feedback.block),
                dtype=torch.uint8,
                device=delta.device,
            )
        else:
            encoded = feedback.encode(delta)
        padding = -(_HEADER + encoded.numel()) % 8
        return torch.cat(
            [header.view(torch.uint8), encoded, torch.zeros(padding, dtype=torch.uint8, device=delta.device)]
        )

    def _average(self, fragment: _Fragment, exchange: _Exchange) -> torch.Tensor:
        """Σ wᵢΔᵢ / Σ wᵢ from the exchange's result, the same bits on every replica."""
        numel = fragment.numel
        if fragment.feedback is None:
            buffer = exchange.buffer
            total_weight = float(buffer[numel])
            _refuse_nonfinite([int(c) for c in buffer[numel + 1 :].tolist()], fragment, self.inner_step)
            summed = buffer[:numel]
        else:
            pieces = exchange.buffer.view(self.replicas, -1)
            headers = pieces[:, :_HEADER].clone().view(torch.float32).cpu()
            _refuse_nonfinite([int(c) for c in headers[:, 1].tolist()], fragment, self.inner_step)
            size = encoded_size(fragment.feedback.format, numel, fragment.feedback.block)
            summed = torch.zeros(numel, dtype=torch.float32, device=exchange.buffer.device)
            total_weight = 0.0
            for replica in range(self.replicas):  # rank order: the same sum everywhere
                weight = float(headers[replica, 0])
                total_weight += weight
                if weight:
                    values = decode(
                        pieces[replica, _HEADER : _HEADER + size],
                        fragment.feedback.format,
                        numel,
                        fragment.feedback.block,
                    )
                    summed.add_(values.mul_(weight))
        if total_weight <= 0:
            raise FailedPreconditionError(
                f"outer step at inner step {self.inner_step}: no replica counted anything since the last "
                f"exchange of parameters {fragment.names[0]}..: nothing to weigh the average by"
            )
        return summed if total_weight == 1.0 else summed / total_weight

    def _apply(self, fragment: _Fragment) -> None:
        exchange = fragment.pending
        assert exchange is not None
        fragment.pending = None
        if exchange.work is not None:
            exchange.work.wait()
        average = self._average(fragment, exchange)
        with torch.no_grad():
            offset = 0
            for weight in fragment.global_weights:
                weight.grad = average[offset : offset + weight.numel()].view_as(weight).to(weight.dtype)
                offset += weight.numel()
            fragment.outer.step()
            for weight, param in zip(fragment.global_weights, fragment.params, strict=True):
                weight.grad = None
                local = _local(param)
                if self.keep_local == 0.0:
                    local.copy_(weight)
                else:
                    local.mul_(self.keep_local).add_(weight, alpha=1.0 - self.keep_local)
        self.outer_steps += 1


def _split(params: list[tuple[str, torch.Tensor]], parts: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`params` in model order cut into `parts` runs of about equal element counts (none empty)."""
    sizes = [_local(p).numel() for _, p in params]
    total = sum(sizes)
    start, seen = 0, 0
    for part in range(parts):
        end = start + 1
        seen += sizes[start]
        target = total * (part + 1) / parts
        # Take parameters while it brings the run closer to its share and leaves one for each later run.
        while end < len(params) - (parts - part - 1) and abs(seen + sizes[end] - target) <= abs(
            seen - target
        ):
            seen += sizes[end]
            end += 1
        if part == parts - 1:
            seen += sum(sizes[end:])
            end = len(params)
        yield params[start:end]
        start = end


def _structure_digest(params: list[tuple[str, torch.Tensor]]) -> int:
    text = ";".join(f"{name}:{p.dtype}:{tuple(_local(p).shape)}" for name, p in params)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _check_identical(
    params: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, rank: int, replicas: int
) -> None:
    """Refuses replicas whose parameters differ (names, shapes, dtypes or any byte), naming the
    first parameter that does and the replicas whose copy differs from replica 0's; every replica
    raises the same error."""
    structures = _gather(
        torch.tensor([_structure_digest(params), len(params)], dtype=torch.int64), group, replicas
    )
    differing = [r for r in range(replicas) if not torch.equal(structures[r], structures[0])]
    if differing:
        raise FailedPreconditionError(
            f"replica {rank}: the models differ in their parameters' names, shapes or dtypes: replicas "
            f"{differing} against replica 0 ({len(params)} parameters here)"
        )
    digests = torch.tensor(
        [
            zlib.crc32(_local(p).detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            for _, p in params
        ],
        dtype=torch.int64,
    )
    gathered = _gather(digests, group, replicas)
    for index, (name, _) in enumerate(params):
        differing = [r for r in range(replicas) if gathered[r, index] != gathered[0, index]]
        if differing:
            raise FailedPreconditionError(
                f"replica {rank}: parameter {name!r} differs across replicas at the start (replicas "
                f"{differing} against replica 0): every replica must start from the same weights "
                "(seed the model's initialisation, or load one checkpoint)"
            )


def _gather(values: torch.Tensor, group: dist.ProcessGroup | None, replicas: int) -> torch.Tensor:
    out = torch.empty(replicas * values.numel(), dtype=values.dtype)
    _all_gather_single(out, values, group=group)
    return out.view(replicas, -1)


def _refuse_nonfinite(counts: list[int], fragment: _Fragment, inner_step: int) -> None:
    bad = {replica: count for replica, count in enumerate(counts) if count}
    if bad:
        raise FailedPreconditionError(
            f"outer step at inner step {inner_step}: the pseudo-gradient of parameters "
            f"{fragment.names[0]}..{fragment.names[-1]} holds NaN or Inf on replicas "
            + ", ".join(f"{replica} ({count} values)" for replica, count in bad.items())
        )
