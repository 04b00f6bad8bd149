"""DiLoCo's exchange over a torch.distributed process group (the "gradserver" backend).

A SUM payload is one async SUM all_reduce. A quantized one is, on a "gradserver" group, int8 or
int4 records the coordinator sums and requantizes once (`quantized_allreduce`, one payload up and
one down) beside an async SUM of its [weight, counts]; on any other group (gloo) an async
all_gather of every replica's bytes. All are waited for only when the outer step is due, so the
exchange runs while the inner steps do. A lost rank fails the collective and ends the job (for
outer steps that survive one: `_ft_exchange`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from gradserver.common.errors import FailedPreconditionError

from ._outer_exchange import OuterState, mismatch, nothing_held, parameter_digests, structure_digest
from ._quantized_collectives import QuantizedCollectives

# torch 2.13 renamed all_gather_into_tensor (which it warns about); older ones have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass
class _Collective:
    """A collective in flight and the buffer its result lands in."""

    work: dist.Work
    buffer: torch.Tensor

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


@dataclasses.dataclass
class _Parts:
    """Collectives in flight whose results, concatenated, are the exchange's."""

    parts: list[_Collective]

    def wait(self) -> torch.Tensor:
        return torch.cat([part.wait() for part in self.parts])


class ProcessGroupExchange:
    """Exchanges over `group` (None: the default group), one rank per replica."""

    gathers = True
    heals = False

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        process_group = group if group is not None else dist.group.WORLD
        # A "gradserver" group's coordinator sums int8/int4 records; other backends gather.
        self._quantized = process_group if isinstance(process_group, QuantizedCollectives) else None
        self.summed_formats = frozenset({"int8", "int4"}) if self._quantized is not None else frozenset()

    def check_identical(self, params: list[tuple[str, torch.Tensor]]) -> None:
        _check_identical(params, self.group, self.rank, self.replicas)

    def sum(self, vector: torch.Tensor) -> _Collective:
        work = dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Collective(work, vector)

    def quantized_sum(self, values: torch.Tensor, extra: torch.Tensor, wire: str) -> _Parts:
        if self._quantized is None:
            raise FailedPreconditionError(
                "this process group is not a gradserver one: it sums no quantized records (they are gathered)"
            )
        values = values.contiguous()
        records = _Collective(self._quantized.quantized_allreduce(values, wire), values)
        extra_sum = self.sum(extra.contiguous())
        return _Parts([records, extra_sum])

    def gather(self, piece: torch.Tensor) -> _Collective:
        buffer = torch.empty(self.replicas * piece.numel(), dtype=torch.uint8, device=piece.device)
        work = _all_gather_single(buffer, piece, group=self.group, async_op=True)
        return _Collective(work, buffer)

    def attach(self, state: OuterState) -> bool:
        """Nothing to carry: a lost rank ends the job, no replica joins one."""
        return False

    def at_boundary(self, *, overlap: bool) -> contextlib.AbstractContextManager[None]:
        return nothing_held(overlap=overlap)


def _check_identical(
    params: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None, rank: int, replicas: int
) -> None:
    """Refuses replicas whose parameters differ (names, shapes, dtypes or any byte), naming the
    first parameter that does and the replicas whose copy differs from replica 0's; every replica
    raises the same error."""
    structures = _gather(
        torch.tensor([structure_digest(params), len(params)], dtype=torch.int64), group, replicas
    )
    differing = [r for r in range(replicas) if not torch.equal(structures[r], structures[0])]
    if differing:
        raise FailedPreconditionError(
            f"replica {rank}: the models differ in their parameters' names, shapes or dtypes: replicas "
            f"{differing} against replica 0 ({len(params)} parameters here)"
        )
    digests = torch.tensor(parameter_digests(params), dtype=torch.int64)
    gathered = _gather(digests, group, replicas)
    for index, (name, _) in enumerate(params):
        differing = [r for r in range(replicas) if gathered[r, index] != gathered[0, index]]
        if differing:
            among = f"across replicas at the start (replicas {differing} against replica 0)"
            raise FailedPreconditionError(mismatch(rank, name, among))


def _gather(values: torch.Tensor, group: dist.ProcessGroup | None, replicas: int) -> torch.Tensor:
    out = torch.empty(replicas * values.numel(), dtype=values.dtype)
    _all_gather_single(out, values, group=group)
    return out.view(replicas, -1)
