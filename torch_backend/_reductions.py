"""How the process group reduces each (op, dtype): on the coordinator, or from an all-gather.

The coordinator reduces float32 exactly (SUM: a float64 sum in rank order rounded once to
float32; AVG: that sum divided by N, rounded once). Everything else is built on it, and every
rank computes the same bits:

- float32 SUM/AVG: one collective key, reduced by the coordinator (REDUCE for an allreduce,
  REDUCE_SCATTER for a reduce-scatter: the same bits for this rank's part). The widened and limb
  routes below go the same way.
- float16/bfloat16 SUM/AVG: widened to float32 (exact), reduced by the coordinator, rounded back
  to the dtype: two roundings (float64 -> float32 -> half). Identical on every rank; it can differ
  from a reduction done in the half type (gloo) in the last bit, and a result beyond the half
  type's range becomes inf, as it would there.
- integer SUM (at most 256 ranks): four 16-bit limbs per element, exact, wrapping like torch's
  integer sum.
- MIN, MAX, PRODUCT, BAND, BOR, BXOR, float64 SUM/AVG and integer SUM beyond 256 ranks: the
  raw bytes of every rank (an ALL_GATHER; for a reduce-scatter an ALL_TO_ALL of the pieces, each
  to the rank that keeps it), then a reduction in rank order. Exact for MIN, MAX and the bitwise
  ops; float64 sums and products are rounded in rank order, the same on every rank. The cost: an
  allreduce sends the tensor's bytes once and receives N times them; a reduce-scatter sends and
  receives them once.
- PREMUL_SUM(factor) (FSDP2's gradient divide factor; NCCL's semantics, gloo has none): each
  rank's tensor multiplied by the factor in its own dtype (the factor rounded to that dtype, as
  NCCL does), then summed as SUM is. Floating types only.
- Anything else (integer AVG, bool SUM, complex) is refused at the call: TypeError naming the
  dtype or NotImplementedError naming the op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from gradserver.common.messages import ReduceOp

Route = Literal["coordinator", "widened", "limbs", "gathered"]

_OP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
_WIRE_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG}
_HALF = (torch.float16, torch.bfloat16)
INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_REAL = (torch.float32, torch.float64, *_HALF, *INTEGER_DTYPES)
# An integer travels as four 16-bit limbs of its 64-bit two's complement; a sum of up to 256
# limbs stays below 2**24, so float32 holds it exactly.
_LIMBS = 4
MAX_LIMB_RANKS = 256

_LOCAL: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "SUM": torch.add,
    "AVG": torch.add,
    "PRODUCT": torch.mul,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


class Plan(NamedTuple):
    """How one allreduce (or reduce_scatter) runs."""

    route: Route
    op: str  # torch's name of the op as reduced: SUM, AVG, MIN, ... (PREMUL_SUM is a SUM)
    wire_op: ReduceOp  # the coordinator's op, for the coordinator and widened routes
    # PREMUL_SUM's factor (a number or a one-element tensor), applied by `premultiplied`.
    factor: float | torch.Tensor | None = None


def _names_by_type() -> dict[Any, str]:
    names = {}
    for name in _OP_NAMES:
        kind = getattr(dist.ReduceOp, name, None)
        if kind is not None:
            names[kind] = name
    return names


_NAMES_BY_TYPE = _names_by_type()


def op_name(op: Any) -> str:
    """torch's name of a ReduceOp (or RedOpType)."""
    try:  # a dict look-up first: this runs for every collective
        name = _NAMES_BY_TYPE.get(getattr(op, "op", op))
    except TypeError:
        name = None
    if name is not None:
        return name
    for name in _OP_NAMES:
        try:
            if op == getattr(dist.ReduceOp, name):
                return name
        except (AttributeError, TypeError):
            continue
    return str(op)


def plan_reduction(what: str, op: Any, dtypes: Sequence[torch.dtype], size: int) -> Plan:
    """The route for `op` over tensors of `dtypes` in a group of `size`; raises
    NotImplementedError naming an op it does not support, TypeError naming a dtype."""
    name = op_name(op if op is not None else dist.ReduceOp.SUM)
    if len(dtypes) == 1 and dtypes[0] == torch.float32:  # the common call, decided first
        plan = _FLOAT32_PLANS.get(name)
        if plan is not None:
            return plan
    if name == "PREMUL_SUM":
        return _premul_plan(what, op, dtypes, size)
    if name not in _LOCAL:
        raise NotImplementedError(
            f"gradserver {what} supports SUM, AVG, PREMUL_SUM, PRODUCT, MIN, MAX, BAND, BOR and BXOR, "
            f"not {name}"
        )
    kinds = set(dtypes)
    if len(kinds) > 1:
        raise TypeError(
            f"gradserver {what}: tensors of one call must share a dtype, got {sorted(map(str, kinds))}"
        )
    dtype = kinds.pop() if kinds else torch.float32
    wire = _WIRE_OPS.get(name, ReduceOp.SUM)
    if name in ("SUM", "AVG"):
        if dtype == torch.float32:
            return Plan("coordinator", name, wire)
        if dtype in _HALF:
            return Plan("widened", name, wire)
        if dtype in INTEGER_DTYPES and name == "SUM":
            return Plan("limbs" if size <= MAX_LIMB_RANKS else "gathered", name, wire)
        if dtype == torch.float64:
            return Plan("gathered", name, wire)
    elif name in ("MIN", "MAX", "PRODUCT"):
        if dtype in _REAL or dtype == torch.bool:
            return Plan("gathered", name, wire)
    elif dtype in INTEGER_DTYPES or dtype == torch.bool:  # the bitwise ops
        return Plan("gathered", name, wire)
    raise TypeError(
        f"gradserver {what}: dtype {dtype} with {name} is not supported (SUM and AVG take floating "
        "types, SUM integers too; MIN, MAX and PRODUCT real types and bool; BAND, BOR and BXOR "
        "integers and bool)"
    )


_FLOAT32_PLANS = {name: Plan("coordinator", name, _WIRE_OPS[name]) for name in ("SUM", "AVG")}


def _premul_plan(what: str, op: Any, dtypes: Sequence[torch.dtype], size: int) -> Plan:
    """PREMUL_SUM: a SUM of floating tensors, each multiplied by the op's factor first."""
    # torch keeps the factor in C++; its pickled state is the only way Python reads it back.
    _, factor = op.__getstate__()
    if not isinstance(factor, float | int | torch.Tensor):
        raise TypeError(f"gradserver {what}: PREMUL_SUM without a factor (got {factor!r})")
    if isinstance(factor, torch.Tensor) and factor.numel() != 1:
        raise ValueError(
            f"gradserver {what}: PREMUL_SUM's factor must be one number, got a tensor of shape "
            f"{tuple(factor.shape)}"
        )
    floating = [d for d in dtypes if d.is_floating_point]
    if len(floating) != len(dtypes):
        raise TypeError(
            f"gradserver {what}: PREMUL_SUM takes floating types, not {sorted(map(str, set(dtypes)))}"
        )
    plan = plan_reduction(what, dist.ReduceOp.SUM, dtypes, size)
    return plan._replace(factor=factor)


def premultiplied(flat: torch.Tensor, plan: Plan) -> torch.Tensor:
    """`flat` times the plan's PREMUL_SUM factor, rounded to its dtype (a new tensor), or `flat`
    itself for every other op."""
    if plan.factor is None:
        return flat
    factor = plan.factor
    if isinstance(factor, torch.Tensor):
        return flat * factor.detach().to("cpu", flat.dtype).reshape(())
    return flat * torch.tensor(factor, dtype=flat.dtype)


def reduce_in_rank_order(parts: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Every rank's tensor reduced in rank order: the same bits on every rank."""
    combine = _LOCAL[op]
    result = parts[0].clone()
    for part in parts[1:]:
        result = combine(result, part)
    if op == "AVG":
        result = result / len(parts)
    return result


def to_limbs(values: np.ndarray) -> np.ndarray:
    unsigned = values.astype(np.int64).view(np.uint64)
    limbs = [(unsigned >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(_LIMBS)]
    return np.stack(limbs, axis=1).astype(np.float32).reshape(-1)


def from_limbs(sums: np.ndarray) -> np.ndarray:
    limbs = sums.reshape(-1, _LIMBS).astype(np.uint64)
    total = np.zeros(limbs.shape[0], np.uint64)
    for k in range(_LIMBS):
        total += limbs[:, k] << np.uint64(16 * k)  # wraps modulo 2**64, like the integer sum
    return total.view(np.int64)
