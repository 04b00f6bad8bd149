"""Outer steps for torch scripts over slow links (DiLoCo, Streaming DiLoCo).

    from gradserver.torch import diloco

    with diloco.DiLoCo(model, inner_optimizer, sync_every=50, quantize="int8") as outer:
        for batch in batches:
            loss_fn(model(batch.inputs), batch.targets).backward()
            outer.count(batch.tokens)           # optional: weights this replica's share
            inner_optimizer.step()              # every 50th step is also an outer step
            inner_optimizer.zero_grad()
    # leaving the block flushed: the model is the global weights, holding every inner step

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
the error it kept from the previous exchange (error feedback). int8 and int4 (with the default
block of 64) over a "gradserver" group or `ft`: each replica sends wᵢΔᵢ plus its kept error as
records that the coordinator decodes, sums in float64 in rank order and requantizes once, and
[wᵢ, counts] as an exact SUM beside them: one payload up and one down, every replica decoding the
same bytes; over `ft`, bf16 too (bfloat16 values summed in float64, rounded once to bfloat16).
Otherwise (bf16 over a group, another block size, a gloo group) the payloads are all-gathered as
bytes, and every replica decodes them and sums wᵢ·decode(payloadᵢ) in rank order in float32: the
same operations on the same bytes, so the same bits, one payload up and N down. `sent_bytes` and
`received_bytes` count them; `exchange_times` says how long the exchanges held the training thread
(sending, waiting) and what share of the ones it waited for ran beside its inner steps.

Streaming (`fragments` F > 1, `delay` τ > 0, Liu et al. 2025): the parameters are cut, in model
order, into F fragments of about equal size; fragment f is exchanged at inner step
⌊(f+1)·H/F⌋ of each period, its exchange runs while the next τ inner steps do, and it is applied
τ steps after it was sent. The mixing rule when fragment f's outer step lands:
local ← keep_local · local + (1 - keep_local) · global (keep_local = 0: the local weights become
the global ones, plain DiLoCo; the paper's alpha is keep_local, 0.5 with τ > 0). Each fragment has its
own outer optimizer and error feedback. At the end (`flush`, which leaving the `with` block
calls): every fragment not exchanged at the last inner step is exchanged once more, so the final
global weights hold every inner step; the model then holds them. How those exchanges apply is
the `flush` rule: "outer" (default) an outer step; "mean" global ← global - Δ̄, the replicas'
mean weights, leaving the outer optimizer's state alone (neither measured better everywhere:
docs/slow-links.md).

Every replica must take the same number of inner steps with the same settings; replicas must
start from the same parameters (both checked at construction: the error names the first
parameter that differs, or says the settings do).

Checkpoints: `state_dict()` (each replica its own, beside its model's and inner optimizer's) and
`load_state_dict()` before the first inner step; a resumed run ends as one that never stopped.
Over `ft` too, on the replicas that begin a job (a replacement takes a live replica's state).

Fault tolerant (`ft.Replica(model, inner_optimizer).diloco(sync_every=...)`, `_ft_exchange`):
each exchange is one fault-tolerant step of the coordinator, summed over the replicas that take
part; a lost replica costs its current inner phase, and its replacement takes a live replica's
state at an exchange and joins there (docs/fault-tolerance.md). With a `delay` the exchange runs
while the next inner steps do, as over a process group (a replacement then takes a copy of the
state made at the exchange). The coordinator's gather needs every rank, so there bf16, int8 and
int4 payloads are all summed by the coordinator, one payload each way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from gradserver.common.errors import FailedPreconditionError, InternalError, InvalidArgumentError
from gradserver.common.messages import DType
from gradserver.common.quantized_wire import VALUES_PER_RECORD, record_bytes, records_for

from ._exchange_times import ExchangeTimes
from ._outer_exchange import POSITION, SETTINGS, Landing, OuterExchange, Resumed, local_part
from ._pg_exchange import ProcessGroupExchange
from ._quantize import BLOCK, ErrorFeedback, check_format, decode, encoded_size

__all__ = ["DiLoCo", "ExchangeTimes", "nesterov_outer_optimizer"]

log = logging.getLogger("gradserver.torch.diloco")

OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
# The formats whose records the coordinator sums (common/quantized_wire.py), by wire dtype.
_WIRE_FORMATS = {"int8": DType.INT8_BLOCK64, "int4": DType.INT4_BLOCK64}
_HEADER = 8  # a quantized payload's header: its weight and its count of non-finite values (float32)
# How `flush` applies its exchanges: an outer step (the default), or the replicas' mean weights.
FLUSH_RULES = ("outer", "mean")
# The settings a state saved before they existed was made with.
_SETTINGS_BEFORE = {"flush": "outer"}


def nesterov_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD, Nesterov momentum 0.9, learning rate 0.7."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclasses.dataclass
class _Exchange:
    """A fragment's average on its way (`landing`) or in (`result`): applied at inner step `due`."""

    due: int
    landing: Landing | None
    result: torch.Tensor | None
    own_weight: float
    summed: bool  # the result is the SUM of [wΔ, w, counts]; else every replica's payload gathered
    before: _BeforeSend | None = None  # put back if every replica discards it (an exchange that heals)
    sending_s: float = 0.0  # the call that sent it took this long (`exchange_times`)
    sent: float = 0.0  # and returned then (time.perf_counter)


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
    sent_at_step: int = 0  # the inner step of its last exchange that was not discarded
    pending: _Exchange | None = None


@dataclasses.dataclass(frozen=True)
class _BeforeSend:
    """What a fragment's exchange changed when it was sent: put back when every replica discards
    it, so that what it carried is sent next time."""

    counted_at_send: float
    residual: torch.Tensor | None
    sent_at_step: int


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
        flush: str = "outer",
        exchange: OuterExchange | None = None,
    ) -> None:
        """`sync_every` (H): inner steps per period. `outer_optimizer`: makes an optimizer of a
        list of tensors (the global weights of one fragment). `group`: the process group of the
        replicas (one rank from each; default the default group). `quantize`: None (float32),
        "bf16", "int8" or "int4"; `block`: values per scale of int8 and int4. `fragments`,
        `delay`, `keep_local`: streaming (the module's docstring). `flush`: how `flush` applies
        its exchanges, "outer" (an outer step) or "mean" (the replicas' mean weights). `exchange`:
        what carries the payloads instead of `group` (`ft.Replica.diloco` passes its own). Every
        replica must pass the same settings (checked with the parameters)."""
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
        if flush not in FLUSH_RULES:
            raise InvalidArgumentError(f"flush must be 'outer' or 'mean', got {flush!r}")
        if exchange is not None and group is not None:
            raise InvalidArgumentError("DiLoCo takes a group or an exchange, not both")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.group = group
        self.quantize = quantize
        self.block = block
        self.delay = delay
        self.keep_local = keep_local
        self.flush_rule = flush
        self.exchange: OuterExchange = ProcessGroupExchange(group) if exchange is None else exchange
        self.replicas = self.exchange.replicas
        self.rank = self.exchange.rank
        self.inner_step = 0
        self.outer_steps = 0  # fragment outer steps applied
        self.discarded = 0  # exchanges every replica discarded (a replica lost in one: ft only)
        self.sent_bytes = 0  # collective payload bytes this replica sent, and received
        self.received_bytes = 0
        # How long the exchanges held the training thread, and how much ran beside inner steps.
        self.exchange_times = ExchangeTimes()
        self._counted = 0.0
        self._counts = False  # whether `count` was ever called: else every weight is 1
        self._sending = 0  # the fragment whose exchange is (or was last) sent
        self._joined_at = -1  # the inner step this replica joined a running job at (ft)
        self._flushing = False  # inside `flush` (a replica joining then takes part in the rest)
        self._hook: RemovableHandle | None = None
        self._fragments = [
            self._fragment(part, (index + 1) * sync_every // fragments, outer_optimizer)
            for index, part in enumerate(_split(params, fragments))
        ]
        self.exchange.check_identical([(SETTINGS, self._settings_tensor()), *params])
        if self.exchange.attach(self):
            # It took a live replica's state at that one's exchange (in a step, or in the
            # donor's final flush): it takes part from there.
            self._run_from(self._joined(), resumed=True)

    def _fragment(
        self, params: list[tuple[str, torch.Tensor]], send_at: int, outer_optimizer: OuterOptimizer
    ) -> _Fragment:
        with torch.no_grad():
            global_weights = [local_part(p).detach().clone() for _, p in params]
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

    def steps(self, total: int) -> Iterator[int]:
        """The inner steps to run, from where this replica is (one that joined a running job
        starts past 0) to `total`: use the step as the data position."""
        while self.inner_step < total:
            yield self.inner_step

    def step(self) -> None:
        """Ends an inner step (the inner optimizer's step hook calls it inside `with`): sends the
        fragments due now and applies the exchanges that are due."""
        self.inner_step += 1
        self._run_from(0, resumed=False)

    def _run_from(self, first: int, *, resumed: bool) -> None:
        """The fragments' part of an inner step, or of the final flush while `_flushing`, from
        fragment `first`; `resumed`: this replica just took a live one's state at fragment
        `first`'s exchange, which it sends now. A state taken in the donor's flush (the donor
        ahead) makes this replica finish that flush."""
        while True:
            try:
                if self._flushing:
                    self._flush_fragments(first, resumed=resumed)
                else:
                    self._fragments_from(first, resumed=resumed)
                break
            except Resumed:  # healed while it rejoined a lost coordinator: the donor's exchange now
                first, resumed = self._joined(), True
        if self._flushing:
            self._flushing = False
            self._model_from_global()

    def _fragments_from(self, first: int, *, resumed: bool) -> None:
        in_period = self.inner_step % self.sync_every or self.sync_every
        for index in range(first, len(self._fragments)):
            fragment = self._fragments[index]
            # A resumed fragment's due exchange was applied by the donor before its state was taken.
            due = fragment.pending is not None and fragment.pending.due == self.inner_step
            if due and not (resumed and index == first):
                self._apply(fragment)
            if fragment.send_at == in_period:
                self._sending = index
                self._send(fragment)
                if self.delay == 0 and fragment.pending is not None:
                    self._apply(fragment)

    def flush(self) -> None:
        """An outer step, now, of every fragment not exchanged at this inner step, applied at
        once (no delay): call it on every replica after the last inner step. With fragments, the
        ones exchanged earlier in the last period would otherwise leave out the inner steps taken
        since; afterwards the global weights hold every inner step, and the model's parameters
        are the global weights (whatever `keep_local`), the same on every replica. It costs one
        more exchange of those fragments; without fragments, after a period's last step, nothing
        is sent. A second call sends nothing (but what was discarded: ft). Leaving a `with`
        block normally calls it."""
        self._flushing = True
        try:
            self._run_from(0, resumed=False)
        finally:
            self._flushing = False  # also when it failed: later steps are steps again

    def _model_from_global(self) -> None:
        """The model's parameters (this rank's shards) become the global weights."""
        with torch.no_grad():
            for fragment in self._fragments:
                for weight, param in zip(fragment.global_weights, fragment.params, strict=True):
                    local_part(param).copy_(weight)

    def _flush_fragments(self, first: int, *, resumed: bool) -> None:
        for index in range(first, len(self._fragments)):
            fragment = self._fragments[index]
            # What is on its way lands first; a resumed fragment's was applied by the donor.
            if fragment.pending is not None and not (resumed and index == first):
                self._apply(fragment)
            if fragment.sent_at_step < self.inner_step or (resumed and index == first):
                self._sending = index
                self._send(fragment)
                if fragment.pending is not None:
                    self._apply(fragment, mean=self.flush_rule == "mean")

    def close(self) -> None:
        """Applies the exchanges still on their way (every replica has the same ones) and
        removes the inner optimizer's hook. Safe to call more than once."""
        self._unhook()
        self._outside_a_step(self._apply_pending)

    def _apply_pending(self) -> None:
        for fragment in self._fragments:
            if fragment.pending is not None:
                self._apply(fragment)

    def _outside_a_step(self, wait: Callable[[], None]) -> None:
        """Runs `wait` (it waits for exchanges on their way) outside `step`: when this replica
        took a live one's state meanwhile (it rejoined a restarted coordinator behind the
        others), it first does what `step` would at that state's exchange, then runs `wait` again."""
        while True:
            try:
                wait()
                return
            except Resumed:
                self._run_from(self._joined(), resumed=True)

    def __enter__(self) -> DiLoCo:
        def after_inner_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.step()

        self._hook = self.inner_optimizer.register_step_post_hook(after_inner_step)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        """Leaving the block normally flushes (`flush`: the model becomes the global weights,
        holding every inner step) and closes; after an error only the hook is removed (the
        exchanges in flight may be what failed: they are left alone)."""
        if error is not None:
            self._unhook()
            return
        try:
            self.flush()
        except BaseException:
            self._unhook()
            raise
        self.close()

    def _unhook(self) -> None:
        if self._hook is not None:
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
        if self.inner_step == self._joined_at:
            weight = 0.0  # it joined at this exchange: it has trained nothing to contribute yet
        else:
            weight = self._counted - fragment.counted_at_send if self._counts else 1.0
        fragment.counted_at_send = self._counted
        return weight

    def _overlaps(self) -> bool:
        """Whether the exchange being sent runs while inner steps do (its result is due later)."""
        return self.delay > 0 and not self._flushing

    def _send(self, fragment: _Fragment) -> None:
        if self.exchange.heals:
            # One exchange on its way at a time, and the state a joining replica takes at this
            # one's boundary holds every earlier result.
            self._settle_all()
        before = _BeforeSend(
            fragment.counted_at_send,
            None if fragment.feedback is None else fragment.feedback.residual,
            fragment.sent_at_step,
        )
        fragment.sent_at_step = self.inner_step
        weight = self._weight(fragment)
        with torch.no_grad():
            delta = torch.cat(
                [
                    (g.float() - local_part(p).detach().float()).reshape(-1)
                    for g, p in zip(fragment.global_weights, fragment.params, strict=True)
                ]
            )
        nonfinite = int((~torch.isfinite(delta)).sum())
        if nonfinite:
            delta.zero_()  # sent as zeros; the count in the payload fails the exchange everywhere
        feedback = fragment.feedback
        if feedback is not None and self._sums_quantized(feedback):
            self._send_quantized_sum(fragment, feedback, delta, weight, nonfinite, before)
            return
        summed = feedback is None or not self.exchange.gathers
        if fragment.feedback is None:
            payload = self._summed_payload(delta, weight, nonfinite)
        elif summed:
            values = self._dequantized(fragment.feedback, delta, nonfinite)
            payload = self._summed_payload(values, weight, nonfinite)
        else:
            payload = self._quantized_payload(fragment.feedback, delta, weight, nonfinite)
        send = self.exchange.sum if summed else self.exchange.gather
        self._dispatch(fragment, lambda: send(payload), weight, summed, before)
        if summed:
            self.sent_bytes += payload.numel() * 4
            self.received_bytes += payload.numel() * 4
        else:
            self.sent_bytes += payload.numel()
            self.received_bytes += self.replicas * payload.numel()

    def _dispatch(
        self,
        fragment: _Fragment,
        send: Callable[[], Landing],
        weight: float,
        summed: bool,
        before: _BeforeSend,
    ) -> None:
        """Sends the fragment's exchange (`send`) at its boundary, timed (`exchange_times`), and
        keeps it pending until it is due."""
        began = time.perf_counter()
        with self.exchange.at_boundary(overlap=self._overlaps()):
            landing = send()
        sent = time.perf_counter()
        fragment.pending = _Exchange(
            self.inner_step + self.delay, landing, None, weight, summed, before, sent - began, sent
        )

    def _sums_quantized(self, feedback: ErrorFeedback) -> bool:
        """Whether the exchange sums this fragment's quantized payload on the coordinator (the
        wire's int8/int4 records hold 64 values a scale: other blocks travel as before)."""
        return feedback.format in self.exchange.summed_formats and (
            feedback.format == "bf16" or feedback.block == VALUES_PER_RECORD
        )

    def _send_quantized_sum(
        self,
        fragment: _Fragment,
        feedback: ErrorFeedback,
        delta: torch.Tensor,
        weight: float,
        nonfinite: int,
        before: _BeforeSend,
    ) -> None:
        """wΔ plus the kept error as records (bf16: bfloat16 values) the coordinator sums and
        requantizes once (one payload up, one down), [w, counts] as an exact SUM beside it. The
        error kept is what was to be sent less the decoding of what was (the coordinator's numpy
        encoder gives the torch codec's records for the same values, and the client rounds to
        bfloat16 as torch does)."""
        values = delta * weight if weight != 1.0 else delta
        compensated = values if feedback.residual is None or nonfinite else values + feedback.residual
        if not nonfinite:
            feedback.encode(values)  # keeps compensated - decode(records of compensated)
        extra = self._summed_payload(delta[:0], weight, nonfinite)
        send = self.exchange.quantized_sum
        # The landed vector is [Σ records decoded, Σ w, counts]: averaged as a float32 sum.
        self._dispatch(fragment, lambda: send(compensated, extra, feedback.format), weight, True, before)
        if feedback.format == "bf16":
            value_bytes = 2 * delta.numel()
        else:
            value_bytes = records_for(delta.numel()) * record_bytes(_WIRE_FORMATS[feedback.format])
        wire_bytes = value_bytes + 4 * extra.numel()
        self.sent_bytes += wire_bytes
        self.received_bytes += wire_bytes

    def _settle_all(self) -> None:
        for fragment in self._fragments:
            self._settle(fragment)

    def _settle(self, fragment: _Fragment) -> None:
        """Waits for the fragment's exchange on its way, if any: its result stays pending until
        due; an exchange every replica discarded (ft) leaves nothing pending, and what it
        carried is sent next time."""
        pending = fragment.pending
        if pending is None or pending.landing is None:
            return
        waiting = time.perf_counter()
        result = pending.landing.wait()
        done = time.perf_counter()
        self.exchange_times.add(pending.sending_s, waiting - pending.sent, done - waiting)
        if result is not None:
            fragment.pending = dataclasses.replace(pending, landing=None, result=result)
            return
        fragment.pending = None
        before = pending.before
        assert before is not None  # kept for every exchange sent
        fragment.counted_at_send = before.counted_at_send
        fragment.sent_at_step = before.sent_at_step
        if fragment.feedback is not None:
            fragment.feedback.residual = before.residual
        self.discarded += 1
        log.warning(
            "outer step of parameters %s.. sent at inner step %d discarded on every replica",
            fragment.names[0],
            pending.due - self.delay,
        )

    def _summed_payload(self, delta: torch.Tensor, weight: float, nonfinite: int) -> torch.Tensor:
        """[w·Δ, w, one slot per replica: this one's count of non-finite values]: summed by the
        coordinator, it holds Σ wᵢΔᵢ, Σ wᵢ and every replica's count."""
        extra = torch.zeros(1 + self.replicas, dtype=torch.float32, device=delta.device)
        extra[0] = weight
        extra[1 + self.rank] = nonfinite
        return torch.cat([delta * weight if weight != 1.0 else delta, extra])

    @staticmethod
    def _dequantized(feedback: ErrorFeedback, delta: torch.Tensor, nonfinite: int) -> torch.Tensor:
        """What the quantized payload of Δ + the kept error decodes to (the error it left kept):
        summed as float32 by an exchange that offers no gather."""
        if nonfinite:
            return delta
        payload = feedback.encode(delta)
        return decode(payload, feedback.format, delta.numel(), feedback.block)

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
        buffer = exchange.result
        assert buffer is not None  # settled: a discarded exchange is not pending
        if exchange.summed:
            total_weight = float(buffer[numel])
            _refuse_nonfinite([int(c) for c in buffer[numel + 1 :].tolist()], fragment, self.inner_step)
            summed = buffer[:numel]
        else:
            assert fragment.feedback is not None
            pieces = buffer.view(self.replicas, -1)
            headers = pieces[:, :_HEADER].clone().view(torch.float32).cpu()
            _refuse_nonfinite([int(c) for c in headers[:, 1].tolist()], fragment, self.inner_step)
            size = encoded_size(fragment.feedback.format, numel, fragment.feedback.block)
            summed = torch.zeros(numel, dtype=torch.float32, device=buffer.device)
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

    def _apply(self, fragment: _Fragment, *, mean: bool = False) -> None:
        """The fragment's outer step with its exchange's average (none: every replica discarded
        it); `mean` (a flush's exchange with flush="mean"): global ← global - Δ̄, the replicas'
        mean weights, leaving the outer optimizer's state alone."""
        self._settle(fragment)
        exchange = fragment.pending
        if exchange is None:
            return
        fragment.pending = None
        average = self._average(fragment, exchange)
        with torch.no_grad():
            offset = 0
            for weight in fragment.global_weights:
                piece = average[offset : offset + weight.numel()].view_as(weight).to(weight.dtype)
                if mean:
                    weight.sub_(piece)
                else:
                    weight.grad = piece
                offset += weight.numel()
            if not mean:
                fragment.outer.step()
            for weight, param in zip(fragment.global_weights, fragment.params, strict=True):
                weight.grad = None
                local = local_part(param)
                if self.keep_local == 0.0:
                    local.copy_(weight)
                else:
                    local.mul_(self.keep_local).add_(weight, alpha=1.0 - self.keep_local)
        self.outer_steps += 1

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This replica's outer state, to save beside its model's and inner optimizer's (each
        replica its own: the kept quantization error and what it counted are its own; with a
        sharded model, this rank's shards): the settings it was made with, the global weights,
        every fragment's outer optimizer, kept error and average not yet applied, and where the
        loop is. Exchanges still on their way are waited for first (every replica sent them at
        the same inner step). References, as torch's `state_dict`: save it before the next step."""
        self._outside_a_step(self._settle_all)
        return {
            "settings": self._settings(),
            "parameters": [fragment.names for fragment in self._fragments],
            "tensors": self.outer_tensors(),
            "extra": {
                **self.outer_extra(),
                "counted": self._counted,
                "counted_at_send": [fragment.counted_at_send for fragment in self._fragments],
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from what `state_dict` gave on this replica: call it on every replica, before
        the first inner step, after loading the model's and the inner optimizer's state. Refuses
        a state saved with other settings, naming the first that differs, and checks that every
        replica loaded the same outer state (the same inner step and global weights): every
        replica raises the same error naming what differs."""
        if self._joined_at >= 0:
            raise FailedPreconditionError(
                "DiLoCo.load_state_dict: this replica joined the running job and took a live "
                "replica's state; load checkpoints only on the replicas that begin a job "
                "(ft: when `job.healed` is None)"
            )
        if self.inner_step or any(fragment.pending is not None for fragment in self._fragments):
            raise FailedPreconditionError(
                f"DiLoCo.load_state_dict: this replica is at inner step {self.inner_step}; load a "
                "checkpoint before the first inner step"
            )
        self._check_settings(
            state["settings"],
            "DiLoCo.load_state_dict: the state was saved",
            "resume with the settings it was saved with",
        )
        for index, fragment in enumerate(self._fragments):
            if state["parameters"][index] != fragment.names:
                raise FailedPreconditionError(
                    f"DiLoCo.load_state_dict: fragment {index} of the saved state holds parameters "
                    f"{_names(state['parameters'][index])}, this model's {_names(fragment.names)}: "
                    "resume the model it was saved with"
                )
        extra = state["extra"]
        self.load_outer(state["tensors"], extra)
        self._counted = float(extra["counted"])
        for fragment, counted in zip(self._fragments, extra["counted_at_send"], strict=True):
            fragment.counted_at_send = float(counted)
        # The position first: replicas that loaded different steps' states are told so, not
        # that their tensors differ (a state saved with an average on its way has one more).
        position = [self.inner_step, self.outer_steps, *(f.sent_at_step for f in self._fragments)]
        self.exchange.check_identical([(POSITION, torch.tensor(position, dtype=torch.int64))])
        self.exchange.check_identical(
            [
                (name, tensor)
                for name, tensor in self.outer_tensors().items()
                if not name.endswith("/residual")
            ]
        )

    def _settings(self) -> dict[str, Any]:
        """What a saved state must have been made with to be loaded here."""
        return {
            "sync_every": self.sync_every,
            "fragments": len(self._fragments),
            "delay": self.delay,
            "keep_local": self.keep_local,
            "quantize": self.quantize,
            "block": self.block,
            "replicas": self.replicas,
            "flush": self.flush_rule,
        }

    def _check_settings(self, saved: dict[str, Any], what: str, advice: str) -> None:
        """Refuses a state made with other settings than this DiLoCo's, naming the first that
        differs (`what`: where the state came from, the message's start; `advice`: its end)."""
        for name, value in self._settings().items():
            theirs = saved.get(name, _SETTINGS_BEFORE.get(name))
            if theirs != value:
                raise FailedPreconditionError(
                    f"{what} with {name}={theirs!r}, this DiLoCo has {name}={value!r}: {advice}"
                )

    def _settings_tensor(self) -> torch.Tensor:
        """A digest of `_settings()` (what a checkpoint must match), for the check at the start
        that every replica runs with the same ones: a setting added there is checked too."""
        text = json.dumps(self._settings(), sort_keys=True).encode()
        return torch.tensor(list(hashlib.blake2b(text, digest_size=8).digest()), dtype=torch.uint8)

    # --- the state a joining replica takes (ft) -------------------------------------------------

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        """Every fragment's global weights, outer optimizer state, kept quantization error and
        landed average not yet applied, by name (`outer/F/...`), no copies."""
        tensors: dict[str, torch.Tensor] = {}
        for index, fragment in enumerate(self._fragments):
            for name, weight in zip(fragment.names, fragment.global_weights, strict=True):
                tensors[f"outer/{index}/global/{name}"] = weight
            for param, state in fragment.outer.state_dict()["state"].items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"outer/{index}/optimizer/{param}/{key}"] = value
            if fragment.feedback is not None and fragment.feedback.residual is not None:
                tensors[f"outer/{index}/residual"] = fragment.feedback.residual
            if fragment.pending is not None and fragment.pending.result is not None:
                tensors[f"outer/{index}/pending"] = fragment.pending.result
        return tensors

    def outer_extra(self) -> dict[str, Any]:
        """The rest of the outer state: where the loop is and the optimizers' other values.
        Taken with no exchange on its way (`_settle`): its result is not state yet."""
        if any(f.pending is not None and f.pending.landing is not None for f in self._fragments):
            raise InternalError("DiLoCo's outer state was read with an exchange on its way")
        return {
            "inner_step": self.inner_step,
            "outer_steps": self.outer_steps,
            "discarded": self.discarded,
            "sending": self._sending,
            "flushing": self._flushing,
            "settings": self._settings(),
            "sent_at": [fragment.sent_at_step for fragment in self._fragments],
            "counts": self._counts,
            "optimizers": [
                {
                    f"{param}/{key}": value
                    for param, state in fragment.outer.state_dict()["state"].items()
                    for key, value in state.items()
                    if not isinstance(value, torch.Tensor)
                }
                for fragment in self._fragments
            ],
            "pending": {
                str(index): [fragment.pending.due, fragment.pending.own_weight, fragment.pending.summed]
                for index, fragment in enumerate(self._fragments)
                if fragment.pending is not None
            },
        }

    def load_outer(self, tensors: dict[str, Any], extra: dict[str, Any]) -> None:
        """Takes what `outer_tensors` and `outer_extra` gave on another replica, as it was."""
        if "settings" in extra:  # not in states saved before it was
            self._check_settings(
                extra["settings"],
                "the outer state taken was made",
                "every replica must run with the same settings",
            )
        if len(extra["optimizers"]) != len(self._fragments):
            raise FailedPreconditionError(
                f"the state taken has {len(extra['optimizers'])} fragments, this replica "
                f"{len(self._fragments)}: every replica must run with the same settings"
            )
        for index, fragment in enumerate(self._fragments):
            prefix = f"outer/{index}/"
            with torch.no_grad():
                for name, weight in zip(fragment.names, fragment.global_weights, strict=True):
                    weight.copy_(torch.as_tensor(tensors[f"{prefix}global/{name}"]))
            state: dict[int, dict[str, Any]] = {}
            for name, value in tensors.items():
                if name.startswith(f"{prefix}optimizer/"):
                    param, key = name.removeprefix(f"{prefix}optimizer/").split("/", 1)
                    state.setdefault(int(param), {})[key] = torch.as_tensor(value).clone()
            for name, value in extra["optimizers"][index].items():
                param, key = name.split("/", 1)
                state.setdefault(int(param), {})[key] = value
            fragment.outer.load_state_dict(
                {"state": state, "param_groups": fragment.outer.state_dict()["param_groups"]}
            )
            if fragment.feedback is not None:
                residual = tensors.get(f"{prefix}residual")
                fragment.feedback.residual = None if residual is None else torch.as_tensor(residual).clone()
            pending = extra["pending"].get(str(index))
            fragment.pending = None
            if pending is not None:
                result = torch.as_tensor(tensors[f"{prefix}pending"]).clone()
                due, own, summed = int(pending[0]), float(pending[1]), bool(pending[2])
                fragment.pending = _Exchange(due, None, result, own, summed)
        self.inner_step = int(extra["inner_step"])
        self.outer_steps = int(extra["outer_steps"])
        self.discarded = int(extra.get("discarded", 0))  # not in states saved before it was
        self._sending = int(extra["sending"])
        self._flushing = bool(extra["flushing"])
        for fragment, sent_at in zip(self._fragments, extra["sent_at"], strict=True):
            fragment.sent_at_step = int(sent_at)
        self._counts = bool(extra["counts"])

    def _joined(self) -> int:
        """After a live replica's state was taken (and checked): this replica begins its inner
        phase from the global weights, with no error kept and nothing counted (what the donor
        trained since its last exchange, and the error it kept, are the donor's to send), and
        weighs 0 in the exchange it joins at. The fragment whose exchange it joins at."""
        self._model_from_global()
        for fragment in self._fragments:
            if fragment.feedback is not None:
                fragment.feedback.residual = None
            fragment.counted_at_send = 0.0
        self._counted = 0.0
        self._joined_at = self.inner_step
        return self._sending


def _split(params: list[tuple[str, torch.Tensor]], parts: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`params` in model order cut into `parts` runs of about equal element counts (none empty)."""
    sizes = [local_part(p).numel() for _, p in params]
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


def _names(names: list[str]) -> str:
    return f"{names[0]}..{names[-1]} ({len(names)})"


def _refuse_nonfinite(counts: list[int], fragment: _Fragment, inner_step: int) -> None:
    bad = {replica: count for replica, count in enumerate(counts) if count}
    if bad:
        raise FailedPreconditionError(
            f"outer step at inner step {inner_step}: the pseudo-gradient of parameters "
            f"{fragment.names[0]}..{fragment.names[-1]} holds NaN or Inf on replicas "
            + ", ".join(f"{replica} ({count} values)" for replica, count in bad.items())
        )
