"""The reducing collectives of the process group: allreduce, reduce_scatter (list, single-tensor
and coalesced forms), reduce, and barrier (an empty SUM).

Where the coordinator can reduce (`_reductions.plan_reduction`: float32 SUM and AVG, the half
types widened, integers as 16-bit limbs) it is one REDUCE key (an allreduce: float64 sums in rank
order rounded once to float32, so SUM and AVG are bit-identical on every rank and independent of
arrival order) or one REDUCE_SCATTER (each rank sends its input once and receives only its part,
the bytes an allreduce would give there; a reduce's root's part is all of it, via `split_bytes`,
so the root alone receives the result). The ops the coordinator cannot reduce go as raw bytes:
an ALL_GATHER (an ALL_TO_ALL of the pieces for a reduce-scatter) reduced in rank order by every
rank that keeps a part; a reduce of such an op is an allreduce the root keeps.

The most frequent call, an allreduce of one small contiguous float32 host tensor with SUM or AVG,
takes a shorter path to the same key (`_small_allreduce`): for a 4-byte tensor the layers between
the call and the collective lane cost more than the lane itself (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradserver.common.messages import CollectiveKind, ReduceOp, TensorKey

from ._arguments import check_pieces, equal_pieces, pieces_of_each, root_of
from ._group_core import DEFAULT_GROUP, GroupCore
from ._reductions import Plan, from_limbs, plan_reduction, premultiplied, reduce_in_rank_order, to_limbs
from ._staging import Staging
from ._tensor_bytes import bytes_of, flatten, host_bytes, host_view, overlaps, same_memory, scatter_into


class ReduceCollectives(GroupCore):
    """allreduce, reduce_scatter in every form, reduce and barrier, on `GroupCore`'s calls."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = (
            opts.reduceOp
            if isinstance(opts, dist.AllreduceOptions | dist.AllreduceCoalescedOptions)
            else opts
        )
        plan = plan_reduction("allreduce", op, [t.dtype for t in tensors], self.size())
        if plan.route == "coordinator" and plan.factor is None and self._small_on_host(tensors):
            return self._small_allreduce(tensors[0], plan.wire_op)
        staging = self._staging("allreduce", tensors)
        hosts = staging.updates(tensors)

        def run(sequence: int) -> None:
            scatter_into(hosts, self._reduce(sequence, flatten(hosts), plan, in_place=True))

        return self._operations.submit("allreduce", staging, run, tensors)

    def _small_allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> dist.Work:
        """The common small call (one contiguous float32 host tensor, SUM or AVG): the same
        REDUCE key, in place, as the general path sends, with the layers a 4-byte call would
        spend most of its time in left out (no staging, no flattening, the client's collective
        called directly). It is queued like every other operation, so it keeps its place among
        queued async ones."""
        propagate = not self._check_finite

        def run(sequence: int) -> None:
            payload = host_view(tensor)
            key = TensorKey.collective(
                sequence, DEFAULT_GROUP, op, propagate_non_finite=propagate, kind=CollectiveKind.REDUCE
            )
            self._client.collective(key, payload, into=payload, timeout=self._timeout_s)

        return self._operations.submit_host("allreduce", run, [tensor])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """One REDUCE_SCATTER of every input: this rank's contribution holds its pieces grouped
        by destination rank (piece r of every input, for each r in turn), so the part the
        coordinator returns to rank r is its outputs, in order."""
        check_pieces("reduce_scatter", output_tensors, input_tensors, self.size())
        staging = self._staging("reduce_scatter", [*output_tensors, *itertools.chain(*input_tensors)])
        inputs = [staging.reads(group) for group in input_tensors]
        outputs = staging.writes(output_tensors)
        by_rank = [group[r] for r in range(self.size()) for group in inputs]
        return self._reduce_scatter("reduce_scatter", staging, outputs, by_rank, opts, output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """`reduce_scatter_tensor`: rank r gets the reduction of every rank's piece r of `input`
        (its pieces already lie in rank order: `input` is sent as it is)."""
        equal_pieces("reduce_scatter_tensor", input, self.size(), like=output)
        staging = self._staging("reduce_scatter_tensor", [input, output])
        host_input, host_output = staging.read(input), staging.write(output)
        what = "reduce_scatter_tensor"
        return self._reduce_scatter(what, staging, [host_output], [host_input], opts, [output])

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """`reduce_scatter_tensor` of several tensors at once (functional collectives, FSDP2)."""
        what = "reduce_scatter_tensor_coalesced"
        pieces_of_each(what, inputs, outputs, self.size())
        staging = self._staging(what, [*inputs, *outputs])
        host_inputs, host_outputs = staging.reads(inputs), staging.writes(outputs)
        pieces = pieces_of_each(what, host_inputs, host_outputs, self.size())
        by_rank = [group[r] for r in range(self.size()) for group in pieces]
        return self._reduce_scatter(what, staging, host_outputs, by_rank, opts, outputs)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Only the root gets the reduction (the other ranks' tensors are left as they were): a
        REDUCE_SCATTER whose root's part is all of it and every other part empty, so the result's
        bytes (an allreduce's) go to the root alone. The ops the coordinator cannot reduce (MAX,
        PRODUCT, ...): an allreduce of raw bytes whose result the root keeps."""
        root = root_of("reduce", opts, self.size())
        plan = plan_reduction("reduce", opts.reduceOp, [t.dtype for t in tensors], self.size())
        is_root = self.rank() == root
        if plan.route not in ("coordinator", "widened", "limbs"):
            targets = tensors if is_root else [t.clone() for t in tensors]
            return self.allreduce(targets, opts.reduceOp)
        staging = self._staging("reduce", tensors)
        hosts = staging.updates(tensors) if is_root else staging.reads(tensors)

        def run(sequence: int) -> None:
            result = self._reduce(sequence, flatten(hosts), plan, root=root)
            if is_root:
                scatter_into(hosts, result)

        return self._operations.submit("reduce", staging, run, tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        def run(sequence: int) -> None:
            self._exchange(sequence, np.zeros(0, np.float32), ReduceOp.SUM)

        return self._operations.submit("barrier", self._staging("barrier", []), run, [torch.zeros(0)])

    def _reduce_scatter(
        self,
        what: str,
        staging: Staging,
        outputs: list[torch.Tensor],
        in_rank_order: list[torch.Tensor],
        opts: Any,
        result: list[torch.Tensor],
    ) -> dist.Work:
        """Reduces `in_rank_order` (host tensors: what goes to rank 0, then rank 1, ...) over the
        group; this rank's part lands in `outputs` (host tensors; `result`, the caller's, are the
        Work's)."""
        op = opts.reduceOp if isinstance(opts, dist.ReduceScatterOptions) else opts
        plan = plan_reduction(what, op, [t.dtype for t in [*in_rank_order, *outputs]], self.size())

        def run(sequence: int) -> None:
            # Pieces of the part stream in as the coordinator reduces each chunk, which every
            # rank has sent by then: the output takes them directly unless it lies in the input
            # elsewhere than in this rank's own part (whose bytes were sent before they arrive).
            flat = flatten(in_rank_order)
            own = flat.chunk(self.size())[self.rank()] if flat.numel() else flat
            into = None
            if len(outputs) == 1 and (not overlaps(flat, outputs[0]) or same_memory(outputs[0], own)):
                into = host_bytes(outputs[0])
            mine = self._reduce(sequence, flat, plan, scatter=True, into=into)
            scatter_into(outputs, mine)

        return self._operations.submit(what, staging, run, result)

    def _reduce(
        self,
        sequence: int,
        flat: torch.Tensor,
        plan: Plan,
        *,
        in_place: bool = False,
        scatter: bool = False,
        into: np.ndarray | None = None,
        root: int | None = None,
    ) -> torch.Tensor:
        """`flat` (a 1-D host tensor) reduced over the group as `plan` says, in its dtype: all of
        it, or with `scatter` this rank's part (its `1/size` of `flat`, in rank order). With
        `in_place` (an allreduce, whose tensors take the result anyway) a float32 result is
        written into `flat` itself, which may be the caller's tensor; `into` (the bytes of the
        float32 result's destination) does the same for a scatter: no result is allocated. With
        `root` (a reduce; the coordinator's routes only) the result goes to that rank alone: a
        REDUCE_SCATTER whose root's part is everything (the others get an empty tensor)."""
        kind = CollectiveKind.REDUCE_SCATTER if scatter or root is not None else CollectiveKind.REDUCE
        flat = premultiplied(flat, plan)  # PREMUL_SUM's factor, on this rank's contribution
        in_place = in_place or root == self.rank()

        def exchange(
            payload: np.ndarray, op: ReduceOp, into: np.ndarray | None = None, exact: bool = False
        ) -> np.ndarray:
            splits = () if root is None else tuple(payload.size * 4 * (r == root) for r in range(self.size()))
            return self._exchange(
                sequence, payload, op, kind=kind, into=into, split_bytes=splits, exact=exact
            )

        if plan.route == "coordinator":
            payload = host_view(flat)
            target = payload if in_place else None if into is None else into.view(np.float32)
            result = exchange(payload, plan.wire_op, target)
            return flat if in_place else torch.from_numpy(result)
        if plan.route == "widened":
            widened = exchange(flat.float().numpy(), plan.wire_op)
            return torch.from_numpy(widened).to(flat.dtype)
        if plan.route == "limbs":
            # Sums of 16-bit limbs need float32's 24 bits: never rounded to a 16-bit wire.
            limbs = exchange(to_limbs(host_view(flat)), ReduceOp.SUM, exact=True)
            return torch.from_numpy(from_limbs(limbs))
        size, mine = self.size(), bytes_of(flat)
        if scatter:
            # Piece j of every rank goes to rank j, which reduces the pieces in rank order.
            piece = mine.size // size
            rows = self._all_to_all(sequence, mine, (piece,) * size).reshape(size, piece)
        else:
            rows = self._gather_rows(sequence, mine)
        parts = [torch.from_numpy(row.copy()).view(flat.dtype) for row in rows]
        return reduce_in_rank_order(parts, plan.op)
