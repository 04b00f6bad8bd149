"""Sub-groups and reduction ops of the torch backend beyond the default group's SUM.

A 2-D DeviceMesh (2, 2) of 4 ranks gives each rank two sub-groups (`dist.new_group` under the
hood): they work under `gradserver run` and with GRADSERVER_COORDINATOR naming a coordinator the
test started (the default group uses it, every sub-group its own embedded coordinator), with
results equal to gloo's. PREMUL_SUM (FSDP2's gradient divide factor; gloo refuses it) is NCCL's
sum of factor * x over the ranks, checked against that sum computed here. send and recv are
refused, saying why and what to use instead.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradserver.common.errors import DeadlineExceededError, InvalidArgumentError
from gradserver.torch._collective import CollectiveClient
from gradserver.torch.backend import ProcessGroupGradServer

from .helpers.processes import ProcessGroup
from .helpers.ranks import rank_results, spawn_and_join
from .helpers.server import TEST_TIMEOUTS, ServerThread

MESH_WORLD = 4

# One rank of a (2, 2) mesh: an all_reduce in each mesh dimension's group, and a broadcast from
# that group's last rank; writes what it got (JSON: floats round-trip exactly) to OUT/rankN.json.
MESH_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
backend, out = sys.argv[1], sys.argv[2]
dist.init_process_group(backend)
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
results = {}
for dim in ("replicate", "shard"):
    group = mesh.get_group(dim)
    ranks = dist.get_process_group_ranks(group)
    x = torch.tensor([0.1 * (rank + 1), 3.0 ** rank, -1.0 / (rank + 3)])
    dist.all_reduce(x, group=group)
    y = torch.tensor([rank + 0.5, -rank])
    dist.broadcast(y, src=ranks[-1], group=group)
    results[dim] = {"ranks": ranks, "sum": x.tolist(), "broadcast": y.tolist()}
dist.barrier()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
# Without the interpreter's shutdown, which gloo's worker threads may trip over (examples/_result.py).
sys.stdout.flush()
os._exit(0)
"""


def _mesh_results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(MESH_WORLD)]


def _torchrun(backend: str, out: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """MESH_SCRIPT under torchrun (4 local ranks) with `backend`."""
    out.mkdir()
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", str(MESH_WORLD)]
    result = subprocess.run(
        [*command, "--no-python", sys.executable, "-c", MESH_SCRIPT, backend, str(out)],
        cwd=out,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return _mesh_results(out)


@pytest.fixture(scope="module")
def gloo_mesh(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _torchrun("gloo", tmp_path_factory.mktemp("gloo") / "out", {})


def _assert_like_gloo(got: list[dict[str, Any]], gloo: list[dict[str, Any]]) -> None:
    # Both dimensions really are sub-groups of two ranks (not the world).
    assert [sorted(r["replicate"]["ranks"]) for r in gloo] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [sorted(r["shard"]["ranks"]) for r in gloo] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert got == gloo


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_2d_mesh_works_under_gradserver_run_like_gloo(
    processes: ProcessGroup, tmp_path: Path, gloo_mesh: list[dict[str, Any]]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    argv = ["--workers", str(MESH_WORLD), "--", sys.executable, "-c", MESH_SCRIPT, "gradserver", str(out)]
    proc = processes.gradserver("run", *argv, name="run")
    try:
        assert proc.wait(240) == 0, proc.output
    finally:
        proc.ensure_ended()
    _assert_like_gloo(_mesh_results(out), gloo_mesh)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_2d_mesh_works_with_gradserver_coordinator_set_like_gloo(
    processes: ProcessGroup, tmp_path: Path, gloo_mesh: list[dict[str, Any]]
) -> None:
    coordinator, address = processes.coordinator("--world-size", str(MESH_WORLD))
    got = _torchrun("gradserver", tmp_path / "out", {"GRADSERVER_COORDINATOR": address})
    _assert_like_gloo(got, gloo_mesh)
    # The default group joined the coordinator the test started (the sub-groups' are their own).
    coordinator.terminate()
    coordinator.wait(30)
    for rank in range(MESH_WORLD):
        assert f"worker {rank} joined" in coordinator.output, coordinator.output
    assert f"({MESH_WORLD} of {MESH_WORLD})" in coordinator.output, coordinator.output


# --- PREMUL_SUM --------------------------------------------------------------------------------

PREMUL_WORLD = 2
FACTOR = 1 / 3  # not a power of two: the multiplication rounds


def _inputs(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(8, dtype=torch.float64) * 0.37 + rank * 1.9 - 1.1).to(dtype)


def _premul_rank(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gradserver", init_method=f"file://{store}", rank=rank, world_size=PREMUL_WORLD)
    try:
        results: dict[str, torch.Tensor] = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            x = _inputs(rank, dtype)
            dist.all_reduce(x, op=dist._make_nccl_premul_sum(FACTOR))
            results[f"allreduce {dtype}"] = x
        y = _inputs(rank, torch.float32)
        dist.all_reduce(y, op=dist._make_nccl_premul_sum(torch.tensor([FACTOR])))
        results["allreduce tensor factor"] = y
        shard = torch.zeros(8 // PREMUL_WORLD)
        dist.reduce_scatter_tensor(shard, _inputs(rank, torch.float32), op=dist._make_nccl_premul_sum(FACTOR))
        results["reduce_scatter_tensor"] = shard
        try:
            dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0))
        except TypeError as exc:
            results["integer refused"] = torch.tensor(list(str(exc).encode()))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except Exception as exc:
        (Path(out_dir) / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def _premul_sum(dtype: torch.dtype) -> torch.Tensor:
    """NCCL's PREMUL_SUM: each rank's tensor times the factor (rounded to the dtype) in the dtype,
    then the sum as gradserver's SUM makes it: float64 in rank order, rounded once to float32
    (and from there to a half type); float64 summed in rank order."""
    factor = torch.tensor(FACTOR, dtype=dtype)
    parts = [(_inputs(r, dtype) * factor).double().numpy() for r in range(PREMUL_WORLD)]
    total = np.zeros_like(parts[0])
    for part in parts:
        total = total + part
    if dtype == torch.float64:
        return torch.from_numpy(total)
    return torch.from_numpy(total).float().to(dtype)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_premul_sum_multiplies_each_ranks_tensor_before_the_sum(tmp_path: Path) -> None:
    spawn_and_join(_premul_rank, [(r, str(tmp_path / "store"), str(tmp_path)) for r in range(PREMUL_WORLD)])
    results = rank_results(tmp_path, PREMUL_WORLD)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        expected = _premul_sum(dtype)
        for rank, got in enumerate(results):
            assert torch.equal(got[f"allreduce {dtype}"], expected), (dtype, rank, got, expected)
    expected32 = _premul_sum(torch.float32)
    # Not the same as the sum times the factor: the factor applies to each rank's tensor.
    assert not torch.equal(expected32, (sum(_inputs(r, torch.float64) for r in range(2)) * FACTOR).float())
    for rank, got in enumerate(results):
        assert torch.equal(got["allreduce tensor factor"], expected32), rank
        assert torch.equal(got["reduce_scatter_tensor"], expected32.chunk(PREMUL_WORLD)[rank]), rank
        refused = bytes(got["integer refused"].tolist()).decode()
        assert "PREMUL_SUM takes floating types" in refused and "torch.int32" in refused, refused


# --- send / recv -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_rank_sends_to_itself_and_a_peer_out_of_range_is_refused_naming_it(
    coordinator: Callable[..., ServerThread],
) -> None:
    client = CollectiveClient.connect_as_rank(coordinator(world_size=1).address, 0, timeout=TEST_TIMEOUTS)
    group = ProcessGroupGradServer(client)
    try:
        sent = group.send([torch.tensor([3.0, 4.0])], 0, 7)  # isend allows dst == self
        received = torch.zeros(2)
        work = group.recv([received], 0, 7)
        assert work.wait() and sent.wait()
        assert received.tolist() == [3.0, 4.0]
        for call, what in (
            (lambda: group.send([torch.ones(1)], 1), "send to worker 1"),
            (lambda: group.recv([torch.ones(1)], 1), "receive from worker 1"),
        ):
            with pytest.raises(InvalidArgumentError) as refused:
                call()
            assert f"worker 0: {what}: the job has workers 0..0" in str(refused.value), refused.value
        nothing = group.recv([torch.zeros(1)], 0, 8)
        started = time.monotonic()
        late = re.escape("recv from rank 0 (tag 8) did not complete within 0.3 s")
        with pytest.raises(DeadlineExceededError, match=late):
            nothing.wait(datetime.timedelta(seconds=0.3))
        assert time.monotonic() - started < 5
    finally:
        group.shutdown()
