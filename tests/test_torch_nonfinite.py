"""NaN and Inf through torch collectives: torch.distributed's semantics, as gloo's.

gloo passes NaN and Inf through an allreduce (every rank sees them) and an overflowing float32
sum gives Inf; `torch.amp.GradScaler` relies on that to skip a step and back off its scale. The
torch backend's collective keys carry `propagate_non_finite`, so the coordinator returns what the
float64 sum rounded once gives instead of failing the operation; the built-in trainer's keys keep
the NaN halt naming the worker, and torch users can opt into it (GRADSERVER_TORCH_CHECK_FINITE=1).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    ReduceOp,
    TensorKey,
)
from gradserver.server.reduction import ReductionTable

from .helpers.ranks import rank_errors, rank_results, spawn_and_join

pytestmark = pytest.mark.timeout(300)

CHUNK = 4
INF, NAN = float("inf"), float("nan")
# Per rank: +inf, -inf, nan, inf + -inf, a finite overflow of float32, and ordinary values.
INPUTS = [
    np.array([INF, 1.0, NAN, INF, 3e38, 1.5, -2.0, 0.25], np.float32),
    np.array([2.0, -INF, 1.0, -INF, 3e38, 2.5, 4.0, 0.5], np.float32),
]


def _reduce(op: ReduceOp, propagate: bool) -> list[Any]:
    table = ReductionTable(2, CHUNK, 10.0, lambda: 0.0)
    key = TensorKey.collective(0, 0, op, propagate_non_finite=propagate)
    out = []
    for worker, data in enumerate(INPUTS):
        header = ChunkHeader(DType.FLOAT32, data.size, ())
        for off in range(0, data.size, CHUNK):
            out += table.contribute(ChunkIn(worker, key, header, off, data[off : off + CHUNK].tobytes()))
    return [o.event for o in out]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_a_collective_that_propagates_non_finite_values_gives_what_float32_gives(op: ReduceOp) -> None:
    events = _reduce(op, propagate=True)
    assert not [e for e in events if isinstance(e, ErrorOut)]
    chunks = {e.offset: np.frombuffer(e.data, np.float32) for e in events if isinstance(e, AveragedChunkOut)}
    got = np.concatenate([chunks[off] for off in sorted(chunks)])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = INPUTS[0] + INPUTS[1]  # two inputs: float32's sum is the exact sum rounded once
        if op is ReduceOp.AVG:
            expected = (INPUTS[0].astype(np.float64) + INPUTS[1]) / 2
    np.testing.assert_array_equal(got, expected.astype(np.float32))
    assert np.isposinf(got[0]) and np.isneginf(got[1]) and np.isnan(got[2]) and np.isnan(got[3])
    assert np.isposinf(got[4]) == (op is ReduceOp.SUM)


def test_without_the_flag_a_non_finite_value_still_fails_the_operation_naming_the_worker() -> None:
    errors = [e for e in _reduce(ReduceOp.SUM, propagate=False) if isinstance(e, ErrorOut)]
    assert errors and errors[0].step_failed
    assert "worker 0 sent a non-finite value (NaN or Inf)" in errors[0].message


def test_collective_keys_that_disagree_on_the_flag_fail_the_operation_naming_it() -> None:
    table = ReductionTable(2, CHUNK, 10.0, lambda: 0.0)
    header = ChunkHeader(DType.FLOAT32, 2, ())
    data = np.ones(2, np.float32).tobytes()
    for worker, propagate in ((0, True), (1, False)):
        key = TensorKey.collective(0, 0, ReduceOp.SUM, propagate_non_finite=propagate)
        out = table.contribute(ChunkIn(worker, key, header, 0, data))
    errors = [o.event for o in out if isinstance(o.event, ErrorOut)]
    assert errors and "propagate_non_finite False" in errors[0].message and "worker 1" in errors[0].message


# --- real ranks, gradserver against gloo ----------------------------------------------------------


def _rank(rank: int, backend: str, store_path: str, out_dir: str, check: bool) -> None:
    import os

    import gradserver.torch  # noqa: F401 - registers "gradserver"

    if check:
        os.environ["GRADSERVER_TORCH_CHECK_FINITE"] = "1"
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=2)
    out = Path(out_dir)
    result: dict[str, Any] = {}
    try:
        for dtype, op in itertools.product(
            (torch.float32, torch.float16, torch.bfloat16, torch.float64),
            (dist.ReduceOp.SUM, dist.ReduceOp.AVG),
        ):
            values = torch.from_numpy(INPUTS[rank].copy())
            if dtype in (torch.float16, torch.bfloat16):
                values = torch.where(values.abs() > 1e30, torch.full_like(values, 60000.0), values)
            tensor = values.to(dtype)
            dist.all_reduce(tensor, op=op)
            result[f"{dtype}-{op}"] = tensor
        result["ddp"] = _ddp_with_an_inf(rank)
        result["scaler"] = _gradscaler(rank)
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
        return
    finally:
        dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")


def _ddp_with_an_inf(rank: int) -> torch.Tensor:
    """DDP where one rank's gradient holds an Inf at step 2: every rank's update sees it."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        generator = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(3, 4, generator=generator)
        if step == 2 and rank == 1:
            x[0, 0] = INF
        optimizer.zero_grad()
        model(x).sum().backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _gradscaler(rank: int) -> dict[str, Any]:
    """DDP + GradScaler under fp16 autocast with a scale that overflows: the scaler must see the
    Inf on every rank, skip those steps and back off."""
    torch.manual_seed(1)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    scales = []
    for step in range(8):
        generator = torch.Generator().manual_seed(100 + 10 * step + rank)
        x, y = torch.randn(4, 8, generator=generator) * 50, torch.randn(4, 2, generator=generator)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def _run(tmp: Path, backend: str, check: bool = False) -> list[dict[str, Any]]:
    tmp.mkdir()
    spawn_and_join(_rank, [(r, backend, str(tmp / "store"), str(tmp), check) for r in range(2)])
    errors = rank_errors(tmp)
    if errors:
        return [{"error": errors.get(f"rank{r}.error", "")} for r in range(2)]
    return rank_results(tmp, 2)


@pytest.mark.processes
def test_nan_and_inf_pass_through_collectives_ddp_and_gradscaler_exactly_as_with_gloo(tmp_path: Path) -> None:
    ours, gloo = _run(tmp_path / "gradserver", "gradserver"), _run(tmp_path / "gloo", "gloo")
    assert "error" not in ours[0] and "error" not in ours[1], ours
    for rank in range(2):
        for name, tensor in gloo[rank].items():
            if name == "scaler":
                assert ours[rank][name]["scales"] == tensor["scales"]
                torch.testing.assert_close(ours[rank][name]["params"], tensor["params"], rtol=0, atol=0)
            elif "AVG" in name:
                # gloo sums in the dtype, then divides: a mean within range whose sum is not comes
                # out Inf there; ours is the float64 sum divided, rounded once: finite.
                mine = ours[rank][name]
                overflowed = torch.isinf(tensor) & torch.isfinite(mine)
                assert (mine[overflowed].abs() > torch.finfo(mine.dtype).max / 2).all(), name
                torch.testing.assert_close(
                    mine[~overflowed], tensor[~overflowed], equal_nan=True, rtol=0, atol=0, msg=name
                )
            else:
                torch.testing.assert_close(ours[rank][name], tensor, equal_nan=True, rtol=0, atol=0, msg=name)
    assert ours[0]["scaler"]["scales"][0] < 2.0**24  # the scale did back off
    assert torch.isinf(ours[0][f"{torch.float32}-{dist.ReduceOp.SUM}"][0])


@pytest.mark.processes
def test_the_opt_in_check_refuses_a_non_finite_value_naming_the_worker(tmp_path: Path) -> None:
    ours = _run(tmp_path / "checked", "gradserver", check=True)
    assert "non-finite value (NaN or Inf)" in ours[0]["error"], ours
    assert "worker 0" in ours[0]["error"] and "rank 0: gradserver allreduce (operation 0)" in ours[0]["error"]
