"""What a round of the collective lane is: checked, planned and reduced alike on both sides.

`plan_round` (pure) takes every worker's descriptor of a round (docs/PROTOCOL.md, "The collective
lane") and answers either a `RoundPlan` (whose round it is to reduce, if anything, and the bytes
each worker moves) or a `RoundProblem` (who disagreed or sent something impossible, as the gRPC
path's table would word it). `RoundPlanner` reads the descriptors from the arena and remembers
plans by shape; `reduce_round` reduces a round's input slots with the `Averager`. The
coordinator's lane thread (`server/lane.py`) uses all three for its rounds, and every worker
(`worker/transports/lane.py`) for the peer rounds it reduces itself: the same checks, wording and
bytes on both sides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .averaging import Averager, NonFiniteContribution, SumOverflow
from .errors import Status
from .lane import (
    Descriptor,
    LaneMemory,
    own_rounds,
    peer_operation,
    posted_length,
    round_span,
    splits_offsets,
)
from .messages import CollectiveKind, ReduceOp, TensorKey


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """A consistent round: `reduce_bytes` of every input slot to reduce into the output slot (0:
    nothing to reduce), and the payload bytes each worker posted and reads (for the counters).
    It does not depend on the operation's number, so rounds of the same shape share one."""

    reduce_bytes: int
    divide: bool
    finite_only: bool
    received: tuple[int, ...]
    sent: tuple[int, ...]
    # A peer round: every worker reads (and reduces) it from the others' input slots itself; the
    # coordinator only checks and counts it (`peer_operation`).
    peer: bool = True
    # A REDUCE_SCATTER round's pieces: bytes per worker in the slot, and where each piece starts
    # in its part (to name an element of the whole operation in an error).
    piece_bytes: int = 0
    part_bytes: int = 0
    offset: int = 0

    def element(self, index: int) -> int:
        """The operation's element number of float32 element `index` of the reduced slot."""
        if not self.piece_bytes:
            return self.offset // 4 + index
        per_piece = self.piece_bytes // 4
        piece, within = divmod(index, per_piece)
        return piece * (self.part_bytes // 4) + self.offset // 4 + within


@dataclasses.dataclass(frozen=True)
class RoundProblem:
    """Why a round cannot be served: `culprit` (None: nobody in particular) hears `culprit_status`,
    the others `status`."""

    message: str
    culprit: int | None
    status: Status = Status.ABORTED
    culprit_status: Status = Status.INVALID_ARGUMENT


def key_of(d: Descriptor) -> TensorKey:
    """The collective key a descriptor belongs to (how errors name the operation)."""
    return TensorKey.collective(
        d.sequence,
        d.group,
        d.op,
        propagate_non_finite=d.propagate_non_finite,
        kind=d.kind,
        root=d.root,
        split_bytes=d.splits,
    )


def plan_round(descriptors: Sequence[Descriptor], slot_bytes: int) -> RoundPlan | RoundProblem:
    """The plan for one round whose descriptors (one per worker, in worker-id order) were posted."""
    world = len(descriptors)
    first = descriptors[0]
    key = key_of(first)
    for w, d in enumerate(descriptors[1:], start=1):
        if (d.sequence, d.group, d.kind) != (first.sequence, first.group, first.kind):
            return _disagree(w, f"worker {w} issued {key_of(d)} where worker 0 issued {key}")
        if d.index != first.index:
            return _disagree(
                w, f"{key}: it is worker {w}'s lane operation {d.index}, worker 0's {first.index}"
            )
        if d.kind in (CollectiveKind.REDUCE, CollectiveKind.REDUCE_SCATTER) and (d.op, d.flags) != (
            first.op,
            first.flags,
        ):
            return _disagree(w, f"worker {w} asked for {key_of(d)} where worker 0 asked for {key}")
        if d.root != first.root:
            return _disagree(w, f"{key}: worker {w} named root {d.root}, worker 0 root {first.root}")
        if d.part != first.part:
            return _disagree(w, f"{key}: worker {w} is at round {d.part}, worker 0 at round {first.part}")
        if d.kind is not CollectiveKind.ALL_TO_ALL and d.total != first.total:
            return _disagree(
                w,
                f"{key}: worker {w} contributed {d.total} bytes, worker 0 {first.total}; every "
                "worker must send as many",
            )
    problem = _shape_problem(descriptors, slot_bytes, key)
    if problem is not None:
        return problem
    kind = first.kind
    received = tuple(d.length for d in descriptors)
    peer = peer_operation(kind, first.total, world)
    if kind is CollectiveKind.REDUCE:
        return RoundPlan(
            first.length,
            first.op is ReduceOp.AVG,
            not first.propagate_non_finite,
            received,
            (first.length,) * world,
            peer,
            offset=first.offset,
        )
    if kind is CollectiveKind.REDUCE_SCATTER:
        piece = first.length // world
        return RoundPlan(
            first.length,
            first.op is ReduceOp.AVG,
            not first.propagate_non_finite,
            received,
            (piece,) * world,
            peer,
            piece_bytes=piece,
            part_bytes=first.total // world,
            offset=first.offset,
        )
    if kind is CollectiveKind.ALL_GATHER:
        return RoundPlan(0, False, False, received, (sum(received),) * world)
    if kind is CollectiveKind.BROADCAST:
        return RoundPlan(0, False, False, received, (descriptors[first.root].length,) * world)
    return RoundPlan(0, False, False, received, _all_to_all_sent(descriptors, slot_bytes))


def _disagree(worker: int, message: str) -> RoundProblem:
    return RoundProblem(message, worker)


def _shape_problem(descriptors: Sequence[Descriptor], slot_bytes: int, key: TensorKey) -> RoundProblem | None:
    """A descriptor whose sizes cannot be what a worker of this version posts."""
    world = len(descriptors)
    first = descriptors[0]
    kind = first.kind
    if kind is not CollectiveKind.BROADCAST and first.root:
        return RoundProblem(f"{key}: root {first.root} is only for BROADCAST, not {kind.name}", 0)
    if kind is CollectiveKind.BROADCAST and not 0 <= first.root < world:
        return RoundProblem(f"{key}: root {first.root} is out of range for {world} workers", 0)
    if kind in (CollectiveKind.REDUCE, CollectiveKind.REDUCE_SCATTER) and first.total % 4:
        return RoundProblem(f"{key}: {first.total} bytes are not whole float32 elements", 0)
    if kind is CollectiveKind.REDUCE_SCATTER and first.total % (4 * world):
        return RoundProblem(
            f"{key}: {first.total // 4} elements do not split into {world} equal parts, one per worker", 0
        )
    rounds = max(own_rounds(kind, d.total, world, slot_bytes) for d in descriptors)
    if first.part >= rounds:
        return RoundProblem(f"{key}: round {first.part} of an operation of {rounds}", 0)
    for w, d in enumerate(descriptors):
        if kind is CollectiveKind.ALL_TO_ALL and (len(d.splits) != world or sum(d.splits) != d.total):
            return RoundProblem(
                f"{key}: worker {w}'s split_bytes {list(d.splits)} must hold one entry per worker "
                f"({world}) and sum to the {d.total} bytes it sends",
                w,
            )
        offset, length = round_span(kind, d.total, world, slot_bytes, d.part)
        want = posted_length(kind, length, world, root=w == d.root)
        if (d.offset, d.length) != (offset, want):
            return RoundProblem(
                f"{key}: worker {w} posted bytes [{d.offset}, +{d.length}) for round {d.part}, "
                f"expected [{offset}, +{want})",
                w,
            )
    return None


def _all_to_all_sent(descriptors: Sequence[Descriptor], slot_bytes: int) -> tuple[int, ...]:
    """Bytes of this round that reach each worker: what of each sender's round lies in its piece."""
    world = len(descriptors)
    sent = [0] * world
    for d in descriptors:
        start, end = d.offset, d.offset + d.length
        for receiver, piece_start in enumerate(splits_offsets(d.splits)):
            piece_end = piece_start + d.splits[receiver]
            sent[receiver] += max(0, min(end, piece_end) - max(start, piece_start))
    return tuple(sent)


_PLANS_KEPT = 4096  # round shapes whose plans are remembered (a job has a few dozen)


class RoundPlanner:
    """Plans the rounds of one lane arena, remembering plans by shape: a training loop issues
    the same few collectives over and over, and reading and checking every descriptor afresh
    would cost more than a small round itself."""

    def __init__(self, memory: LaneMemory) -> None:
        self._memory = memory
        self._plans: dict[tuple[bytes, ...], RoundPlan] = {}

    def plan(self, g: int) -> RoundPlan | RoundProblem:
        """Round `g`'s plan (every worker has posted it)."""
        memory, world = self._memory, self._memory.layout.world
        identity = memory.identity(0, g)
        shape = tuple(memory.raw_descriptor(w, g) for w in range(world))
        same_operation = all(memory.identity(w, g) == identity for w in range(1, world))
        cached = self._plans.get(shape) if same_operation else None
        if cached is not None:
            return cached
        try:
            descriptors = [memory.read_descriptor(w, g) for w in range(world)]
        except ValueError as exc:
            return RoundProblem(
                f"collective lane round {g}: {exc}", None, culprit_status=Status.INVALID_ARGUMENT
            )
        plan = plan_round(descriptors, memory.layout.slot_bytes)
        # ALL_TO_ALL plans depend on the split sizes, which the shape leaves out.
        if isinstance(plan, RoundPlan) and descriptors[0].kind is not CollectiveKind.ALL_TO_ALL:
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            self._plans[shape] = plan
        return plan


def reduce_round(
    averager: Averager, memory: LaneMemory, g: int, plan: RoundPlan, out: np.ndarray
) -> RoundProblem | None:
    """Reduces the `plan.reduce_bytes` of every worker's input slot of round `g` into `out`
    (uint8, as long), in worker order, as the gRPC path's table does; a non-finite value or an
    overflowing sum the operation does not let through is the problem returned, named alike by
    every side that reduces it."""
    world, nbytes = memory.layout.world, plan.reduce_bytes
    inputs = [memory.input_slot(w, g, nbytes) for w in range(world)]
    try:
        if world == 1:
            out[:] = inputs[0]
        else:
            averager.average(
                [i.data for i in inputs], divide=plan.divide, out=out.data, finite_only=plan.finite_only
            )
    except NonFiniteContribution as exc:
        key = key_of(memory.read_descriptor(0, g))
        return RoundProblem(
            f"worker {exc.position} sent a non-finite value (NaN or Inf) in {key} at element "
            f"{plan.element(exc.element)}; the step is halted",
            exc.position,
        )
    except SumOverflow as exc:
        key = key_of(memory.read_descriptor(0, g))
        what = "average" if plan.divide else "sum"
        return RoundProblem(
            f"the {what} of {key} overflows float32 at element {plan.element(exc.element)}; "
            "the step is halted",
            None,
            culprit_status=Status.ABORTED,
        )
    return None
