"""Check and benchmark: the torch.distributed backend "gradserver" on CUDA tensors (issue 52), two
ranks under torchrun sharing one GPU. scripts/gpu-check.sh runs each part on a GPU machine:

    torchrun --standalone --nproc-per-node 2 -m bench.torch_cuda --part collectives
    torchrun --standalone --nproc-per-node 2 -m bench.torch_cuda --part fsdp2
    torchrun --standalone --nproc-per-node 2 -m bench.torch_cuda --part sharded
    torchrun --standalone --nproc-per-node 2 -m bench.torch_cuda --part ddp

`collectives`: the group as torch sees it (`_device_types`, `_get_backend(cuda)`, a DeviceMesh,
`init_process_group(device_id=...)`), then every collective on CUDA tensors, exact against values
computed here: all_reduce (float32, bfloat16, int64, MAX, two async ones on one tensor),
all_reduce_coalesced, broadcast, all_gather, all_gather_into_tensor (FSDP's in place form too),
reduce_scatter, reduce_scatter_tensor, all_to_all, all_to_all_single (even and uneven), reduce,
gather, scatter, barrier, send/recv, isend/irecv, batch_isend_irecv, the object collectives and
the functional ones. Inputs are written by kernels on a side stream just before each call and
results read there after wait(): the copies must follow the caller's stream. Then the torch
profiler over one large all_reduce: its device->host copies must go to pinned memory.

`fsdp2`: fully_shard on a 2-layer MLP, 3 AdamW steps with gloo and with gradserver: losses and
parameters compared (gloo on the same device; where gloo cannot run FSDP2 on CUDA tensors, on the
host, then within a float tolerance).

`sharded`: what sharded recipes build on the group: DTensor redistribution (Shard(0) to
Replicate and to Shard(1), Partial to Replicate and to Shard(0)) against values computed here;
FSDP2 on 2-D meshes (HSDP: 2 x 1 and 1 x 2, replicate x shard), 3 AdamW steps against one model
trained on every rank's batches with their gradients averaged, on every rank (no collective);
DCP save of the HSDP model and load into one built with other weights, exactly.

`ddp`: DDP on a transformer encoder of ~27M parameters (6 layers, width 512, vocabulary 8192,
batch 8 x 256 per rank, bfloat16 autocast, AdamW) with gloo, with gradserver and with no
communication (each rank alone, the GPU's share of the work): median step time, the parameters
of the two backends after the same steps compared, and the torch profiler over two steps of each
backend: device<->host copies by kind (to/from Pinned or Pageable memory; count and device time)
and host time inside cudaMemcpyAsync and the synchronising calls.

Rank 0 prints one JSON line per result, each with a one-line "summary"; a rank exits 1 when a
check failed. `--device cpu` runs every part on the host (a trial of the plumbing on a machine
without a GPU: gloo is exact there; the profiler runs on a GPU only, there being no copies to see).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BACKEND = "gradserver"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _device(kind: str) -> torch.device:
    if kind != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _emit(result: dict[str, Any], device: torch.device) -> None:
    if _rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(json.dumps({"device": name, "torch": torch.__version__, **result}), flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class _Checks:
    """Named checks of one rank: exact comparisons, recorded (a wrong value does not stop the
    other collectives, which every rank must still issue in the same order)."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}
        self.passed: list[str] = []

    def close(self, name: str, got: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
        """`got` within `atol` of `expected` (sums whose order may differ from the reference's)."""
        worst = float((got.detach().cpu().double() - expected.detach().cpu().double()).abs().max())
        if worst <= atol:
            self.passed.append(name)
        else:
            self.failed[name] = f"max |difference| {worst:.3g} > {atol:g}"

    def equal(self, name: str, got: Any, expected: Any) -> None:
        if isinstance(got, torch.Tensor):
            got = got.detach().cpu().tolist()
        if isinstance(expected, torch.Tensor):
            expected = expected.detach().cpu().tolist()
        if got == expected:
            self.passed.append(name)
        else:
            self.failed[name] = f"got {str(got)[:200]}, expected {str(expected)[:200]}"


def _every_rank(checks: _Checks) -> tuple[list[str], dict[str, str]]:
    """Every rank's checks (a collective): rank 0's passed ones, and the failed ones of every
    rank, by rank and name."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"passed": checks.passed, "failed": checks.failed})
    failed = {
        f"rank {r}: {name}": why for r, seen in enumerate(every) for name, why in seen["failed"].items()
    }
    return every[0]["passed"], failed


# --- collectives -------------------------------------------------------------------------------


def _copy_kinds(prof: Any) -> dict[str, dict[str, float]]:
    """Device<->host copies the profiler saw, by kind ("Memcpy DtoH (Device -> Pinned)", ...):
    count and device milliseconds."""
    kinds: dict[str, dict[str, float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or "Memcpy" not in event.name:
            continue
        kind = kinds.setdefault(event.name, {"count": 0, "ms": 0.0})
        kind["count"] += 1
        kind["ms"] = round(kind["ms"] + event.time_range.elapsed_us() / 1e3, 3)
    return kinds


def _host_calls(prof: Any) -> dict[str, float]:
    """Host milliseconds in the CUDA runtime calls that copy or wait."""
    names = ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
    totals = dict.fromkeys(names, 0.0)
    for event in prof.key_averages():
        if event.key in totals:
            totals[event.key] += event.cpu_time_total / 1e3
    return {name: round(ms, 3) for name, ms in totals.items() if ms}


def _profiler(device: torch.device) -> Any:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)


def _run_collectives(device: torch.device, checks: _Checks) -> None:
    """Every collective once, on tensors of `device` written by kernels on a side stream."""
    import torch.distributed._functional_collectives as funcol

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    ranks = torch.arange(1, world + 1, dtype=torch.float64)

    def on(values: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # A kernel writes it on the caller's stream right before the call.
        return torch.as_tensor(values, dtype=dtype).to(device) * 1

    big = on(torch.full((1 << 20,), float(rank + 1)))
    dist.all_reduce(big)
    checks.equal("all_reduce SUM float32 4 MB", big.unique(), [float(ranks.sum())])

    avg = on(torch.arange(8.0) * (rank + 1))
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    checks.equal("all_reduce AVG float32", avg, torch.arange(8.0) * float(ranks.mean()))

    half = on(torch.arange(8.0) * (rank + 1), torch.bfloat16)
    dist.all_reduce(half, op=dist.ReduceOp.AVG)
    checks.equal("all_reduce AVG bfloat16", half.float(), torch.arange(8.0) * float(ranks.mean()))

    integers = on([rank, -rank, 1 << 40], torch.int64)
    dist.all_reduce(integers)
    total = sum(range(world))
    checks.equal("all_reduce SUM int64", integers, [total, -total, world << 40])

    largest = on([rank, -rank], torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    checks.equal("all_reduce MAX int64", largest, [world - 1, 0])

    # Two in flight on one tensor: the second must read what the first wrote back.
    twice = on(torch.ones(1 << 18))
    first = dist.all_reduce(twice, async_op=True)
    second = dist.all_reduce(twice, async_op=True)
    assert first is not None and second is not None
    first.wait()
    second.wait()
    checks.equal("two async all_reduce on one tensor", (twice + 0).unique(), [float(world * world)])

    a, b = on(torch.full((3,), rank + 1.0)), on(torch.full((5,), 10.0 * (rank + 1)))
    group.allreduce_coalesced([a, b]).wait()
    checks.equal(
        "all_reduce_coalesced",
        [a.tolist(), b.tolist()],
        [[float(ranks.sum())] * 3, [10.0 * float(ranks.sum())] * 5],
    )

    shared = on(torch.full((1000,), float(rank)))
    dist.broadcast(shared, src=world - 1)
    checks.equal("broadcast", shared.unique(), [float(world - 1)])

    mine = on([rank + 1.0, -(rank + 1.0)])
    listed = [torch.zeros(2, device=device) for _ in range(world)]
    dist.all_gather(listed, mine)
    checks.equal("all_gather", [t.tolist() for t in listed], [[r + 1.0, -(r + 1.0)] for r in range(world)])

    gathered = torch.zeros(2 * world, device=device)
    dist.all_gather_into_tensor(gathered, mine)
    checks.equal("all_gather_into_tensor", gathered, [v for r in range(world) for v in (r + 1.0, -(r + 1.0))])

    # FSDP2's form: the input is this rank's own piece of the output.
    output = torch.zeros(3 * world, device=device)
    own = output[3 * rank : 3 * rank + 3]
    own.copy_(torch.tensor([rank + 0.5, rank + 0.25, rank + 0.125], device=device))
    dist.all_gather_into_tensor(output, own)
    expected = [v for r in range(world) for v in (r + 0.5, r + 0.25, r + 0.125)]
    checks.equal("all_gather_into_tensor in place", output, expected)

    pieces = [on(torch.full((2,), float(j + 10 * (rank + 1)))) for j in range(world)]
    part = torch.zeros(2, device=device)
    dist.reduce_scatter(part, pieces)
    checks.equal("reduce_scatter", part, [rank * world + 10.0 * float(ranks.sum())] * 2)

    for op, name in ((dist.ReduceOp.SUM, "SUM"), (dist.ReduceOp.AVG, "AVG")):
        source = on(torch.arange(2.0 * world) * (rank + 1))
        part = torch.zeros(2, device=device)
        dist.reduce_scatter_tensor(part, source, op=op)
        factor = float(ranks.sum() if name == "SUM" else ranks.mean())
        checks.equal(f"reduce_scatter_tensor {name}", part, [(2.0 * rank + i) * factor for i in range(2)])

    sends = [on([100.0 * rank + j]) for j in range(world)]
    receives = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_to_all(receives, sends)
    checks.equal("all_to_all", [t.item() for t in receives], [100.0 * r + rank for r in range(world)])

    source = on(torch.arange(float(world)) + 100 * rank)
    received = torch.zeros(world, device=device)
    dist.all_to_all_single(received, source)
    checks.equal("all_to_all_single even", received, [100.0 * r + rank for r in range(world)])

    # Uneven: rank r sends r + j + 1 rows to rank j, each holding 100 r + j.
    send_rows = [rank + j + 1 for j in range(world)]
    recv_rows = [r + rank + 1 for r in range(world)]
    source = on(torch.cat([torch.full((n, 2), 100.0 * rank + j) for j, n in enumerate(send_rows)]))
    received = torch.zeros(sum(recv_rows), 2, device=device)
    dist.all_to_all_single(received, source, recv_rows, send_rows)
    expected_rows = torch.cat([torch.full((n, 2), 100.0 * r + rank) for r, n in enumerate(recv_rows)])
    checks.equal("all_to_all_single uneven", received, expected_rows)

    kept = on(torch.full((4,), rank + 2.0))
    dist.reduce(kept, dst=0)
    checks.equal(
        "reduce", kept, [float(sum(r + 2 for r in range(world)))] * 4 if rank == 0 else [rank + 2.0] * 4
    )

    collected = [torch.zeros(1, device=device) for _ in range(world)] if rank == world - 1 else None
    dist.gather(on([rank + 7.0]), collected, dst=world - 1)
    if collected is not None:
        checks.equal("gather", [t.item() for t in collected], [r + 7.0 for r in range(world)])

    handed = torch.zeros(2, device=device)
    chunks = [on([30.0 + r, -30.0 - r]) for r in range(world)] if rank == 0 else None
    dist.scatter(handed, chunks, src=0)
    checks.equal("scatter", handed, [30.0 + rank, -30.0 - rank])

    dist.barrier()
    checks.passed.append("barrier")

    # Point to point in a ring: blocking, then asynchronous, then batched.
    right, left = (rank + 1) % world, (rank - 1) % world
    message, inbox = on(torch.full((1000,), rank + 0.5)), torch.zeros(1000, device=device)
    if rank % 2 == 0:
        dist.send(message, right)
        dist.recv(inbox, left)
    else:
        dist.recv(inbox, left)
        dist.send(message, right)
    checks.equal("send/recv", (inbox + 0).unique(), [left + 0.5])

    inbox = torch.zeros(1000, device=device)
    outgoing = dist.isend(on(torch.full((1000,), rank + 0.75)), right)
    incoming = dist.irecv(inbox, left)
    assert outgoing is not None and incoming is not None
    outgoing.wait()
    incoming.wait()
    checks.equal("isend/irecv", (inbox + 0).unique(), [left + 0.75])

    inbox = torch.zeros(64, device=device, dtype=torch.bfloat16)
    ops = [
        dist.P2POp(dist.isend, on(torch.full((64,), rank + 1.5), torch.bfloat16), right),
        dist.P2POp(dist.irecv, inbox, left),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    checks.equal("batch_isend_irecv bfloat16", (inbox + 0).float().unique(), [left + 1.5])

    objects: list[Any] = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    checks.equal("all_gather_object", objects, [{"rank": r} for r in range(world)])
    handed_objects: list[Any] = [{"from": rank}]
    dist.broadcast_object_list(handed_objects, src=0, device=device)
    checks.equal("broadcast_object_list through the device", handed_objects, [{"from": 0}])

    # Functional collectives (DTensor's).
    ring = funcol.all_gather_tensor(on([rank + 1.0]), 0, group)
    checks.equal("funcol all_gather_tensor", funcol.wait_tensor(ring), [r + 1.0 for r in range(world)])
    summed = funcol.reduce_scatter_tensor(on(torch.ones(world) * (rank + 1)), "sum", 0, group)
    checks.equal("funcol reduce_scatter_tensor", funcol.wait_tensor(summed), [float(ranks.sum())])


def part_collectives(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    from torch.distributed.device_mesh import init_device_mesh

    device = _device(args.device)
    checks = _Checks()
    if device.type == "cuda":
        # What GPU scripts pass; torch asks the group's backend for that device then.
        try:
            dist.init_process_group(BACKEND, device_id=device)
            checks.passed.append("init_process_group(device_id=cuda)")
        except Exception as exc:  # recorded; the other checks still run
            checks.failed["init_process_group(device_id=cuda)"] = f"{type(exc).__name__}: {exc}"[:300]
    if not dist.is_initialized():
        dist.init_process_group(BACKEND)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        group = dist.group.WORLD
        assert group is not None
        checks.equal("backend", dist.get_backend(group), BACKEND)
        checks.equal("_device_types", [str(d) for d in group._device_types], ["cpu", "cuda"])
        checks.equal(
            "_get_backend(cuda) is the group", group._get_backend(torch.device("cuda")) is group, True
        )
        mesh = init_device_mesh(device.type, (world,))
        mesh_group = mesh.get_group()
        checks.equal(
            "DeviceMesh group _device_types", [str(d) for d in mesh_group._device_types], ["cpu", "cuda"]
        )
        through_mesh = torch.full((4,), rank + 1.0, device=device)
        dist.all_reduce(through_mesh, group=mesh_group)
        checks.equal("all_reduce through the DeviceMesh", through_mesh, [float(world * (world + 1) // 2)] * 4)

        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _run_collectives(device, checks)
        _sync(device)

        copies: dict[str, dict[str, float]] = {}
        if device.type == "cuda":
            x = torch.ones(4 << 20, device=device)  # 16 MB
            dist.all_reduce(x)
            _sync(device)
            with _profiler(device) as prof:
                dist.all_reduce(x)
                _sync(device)
            copies = _copy_kinds(prof)
            checks.equal(
                "all_reduce copies to the host go to pinned memory",
                sorted(k for k in copies if "DtoH" in k),
                ["Memcpy DtoH (Device -> Pinned)"],
            )
            checks.equal(
                "all_reduce copies back come from pinned memory",
                sorted(k for k in copies if "HtoD" in k),
                ["Memcpy HtoD (Pinned -> Device)"],
            )
        passed, failed = _every_rank(checks)
    finally:
        dist.destroy_process_group()
    ok = not failed
    summary = f"{len(passed)} checks exact on rank 0, {len(failed)} failed over {world} ranks"
    result = {"part": "torch-collectives", "ok": ok, "summary": summary, "passed": passed}
    result.update({"failed": failed, "copies_one_16mb_all_reduce": copies})
    return [result], ok


# --- sharded: DTensor, HSDP, DCP ---------------------------------------------------------------


def _redistributions(device: torch.device, checks: _Checks) -> None:
    """DTensor placements changed over a 1-D mesh: each an all_gather, all_to_all, all_reduce or
    reduce_scatter of the group's, checked against values computed here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    full = torch.arange(world * 4 * 2 * world, dtype=torch.float32, device=device).reshape(
        world * 4, 2 * world
    )
    rows = distribute_tensor(full, mesh, [Shard(0)])
    checks.equal("DTensor Shard(0) -> Replicate", rows.redistribute(mesh, [Replicate()]).to_local(), full)
    checks.equal(
        "DTensor Shard(0) -> Shard(1)",
        rows.redistribute(mesh, [Shard(1)]).to_local(),
        full.chunk(world, dim=1)[rank],
    )
    mine = torch.full((world * 2, 3), float(rank + 1), device=device)
    partial = DTensor.from_local(mine, mesh, [Partial()])
    total = float(world * (world + 1) // 2)
    checks.equal(
        "DTensor Partial -> Replicate",
        partial.redistribute(mesh, [Replicate()]).to_local(),
        torch.full_like(mine, total),
    )
    checks.equal(
        "DTensor Partial -> Shard(0)",
        partial.redistribute(mesh, [Shard(0)]).to_local(),
        torch.full((2, 3), total),
    )


def _sharded_model(device: torch.device, mesh: Any, seed: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)  # on the host: the same initial weights on every device
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(32, 16, generator=generator), torch.randn(32, 8, generator=generator))
        for _ in range(steps)
    ]


def _hsdp(device: torch.device, checks: _Checks, shape: tuple[int, int], steps: int) -> nn.Module:
    """FSDP2 on a 2-D mesh (replicate x shard), `steps` AdamW steps, against one model trained
    here on every rank's batches with their gradients averaged (no collective): close, and the
    same on every rank. Its model, for DCP."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    model = _sharded_model(device, mesh, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches(rank, steps):
        nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    every = [_batches(r, steps) for r in range(world)]
    for step in range(steps):
        grads = []
        for batches in every:
            x, y = batches[step]
            reference.zero_grad()
            nn.functional.mse_loss(reference(x.to(device)), y.to(device)).backward()
            grads.append([p.grad.clone() for p in reference.parameters() if p.grad is not None])
        for index, param in enumerate(reference.parameters()):
            param.grad = torch.stack([g[index] for g in grads]).mean(0)
        reference_optimizer.step()
    name = f"HSDP mesh {shape[0]}x{shape[1]} (replicate x shard), {steps} AdamW steps"
    ours = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    checks.close(
        f"{name}: like one model on every batch",
        ours,
        torch.cat([p.reshape(-1) for p in reference.parameters()]),
        1e-5,
    )
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, _digest({"params": ours}))
    checks.equal(f"{name}: the same on every rank", len(set(digests)), 1)
    return model


def _checkpoint(device: torch.device, checks: _Checks, model: nn.Module, shape: tuple[int, int]) -> None:
    """DCP save of a sharded model's state, then a load into one built with other weights: its
    parameters become the saved ones, exactly."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    directory: list[Any] = [tempfile.mkdtemp(prefix="gradserver-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    try:
        dcp.save({"model": model.state_dict()}, checkpoint_id=directory[0])
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        other = _sharded_model(device, mesh, 1)
        state = {"model": other.state_dict()}
        dcp.load(state, checkpoint_id=directory[0])
        other.load_state_dict(state["model"])
        saved = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
        loaded = torch.cat([p.full_tensor().reshape(-1) for p in other.parameters()])
        checks.equal(
            "DCP save and load of an FSDP2 model: the parameters saved", torch.equal(saved, loaded), True
        )
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(directory[0], ignore_errors=True)


def part_sharded(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    device = _device(args.device)
    checks = _Checks()
    dist.init_process_group(BACKEND)
    try:
        world = dist.get_world_size()
        _redistributions(device, checks)
        model = _hsdp(device, checks, (world, 1), 3)
        _hsdp(device, checks, (1, world), 3)
        _checkpoint(device, checks, model, (world, 1))
        passed, failed = _every_rank(checks)
    finally:
        dist.destroy_process_group()
    ok = not failed
    summary = f"{len(passed)} checks passed on rank 0, {len(failed)} failed over {world} ranks"
    result = {"part": "torch-sharded", "ok": ok, "summary": summary, "passed": passed, "failed": failed}
    return [result], ok


# --- FSDP2 -------------------------------------------------------------------------------------


def _fsdp2_run(backend: str, device: torch.device, steps: int) -> dict[str, Any]:
    """3 AdamW steps of a sharded 2-layer MLP: this rank's losses and the full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)  # on the host: the same initial weights on every device
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
        mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(steps):
            x = torch.randn(32, 16, generator=generator).to(device)
            y = torch.randn(32, 8, generator=generator).to(device)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}
        return {"losses": losses, "params": params}
    finally:
        dist.destroy_process_group()


def part_fsdp2(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    device = _device(args.device)
    steps = 3
    reference_device = device
    # gradserver first: a gloo run that hangs on CUDA tensors leaves this one's losses in the log.
    ours = _fsdp2_run(BACKEND, device, steps)
    _emit({"part": "torch-fsdp2", "variant": BACKEND, "losses_rank0": ours["losses"]}, device)
    try:
        gloo = _fsdp2_run("gloo", device, steps)
        note = f"gloo on {device.type}"
    except Exception as exc:  # gloo's own limits on CUDA tensors: compare on the host
        if dist.is_initialized():
            dist.destroy_process_group()
        reference_device = torch.device("cpu")
        gloo = _fsdp2_run("gloo", reference_device, steps)
        note = f"gloo on cpu (on {device.type}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    exact = ours["losses"] == gloo["losses"] and all(
        torch.equal(ours["params"][n], t) for n, t in gloo["params"].items()
    )
    tolerance = (
        {"rtol": 0.0, "atol": 0.0}
        if reference_device == device and device.type == "cpu"
        else {"rtol": 1e-4, "atol": 1e-5}
    )
    close = True
    try:
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(gloo["losses"]), **tolerance)
        for name, tensor in gloo["params"].items():
            torch.testing.assert_close(ours["params"][name], tensor, **tolerance)
    except AssertionError:
        close = False
    param_diff = max(float((ours["params"][n] - t).abs().max()) for n, t in gloo["params"].items())
    # Every rank holds the same full parameters (each all-gathered them).
    dist.init_process_group(BACKEND)
    try:
        digests: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(
            digests,
            {
                "params": _digest(ours["params"]),
                "close": close,
                "losses": ours["losses"],
                "gloo": gloo["losses"],
            },
        )
    finally:
        dist.destroy_process_group()
    same_on_every_rank = len({d["params"] for d in digests}) == 1
    ok = all(d["close"] for d in digests) and same_on_every_rank
    verdict = "equal to" if exact else "close to" if close else "DIFFER from"
    summary = (
        f"{steps} AdamW steps: losses {verdict} gloo's ({note}); max |param diff| {param_diff:.3g}; "
        f"parameters identical on every rank: {same_on_every_rank}"
    )
    result = {
        "part": "torch-fsdp2",
        "ok": ok,
        "summary": summary,
        "reference": note,
        "bit_identical_to_gloo": exact,
        "losses_by_rank": {r: {"gradserver": d["losses"], "gloo": d["gloo"]} for r, d in enumerate(digests)},
        "max_abs_param_diff": param_diff,
    }
    return [result], ok


# --- DDP -------------------------------------------------------------------------------------


class Encoder(nn.Module):
    """A transformer encoder over token ids, with a vocabulary head."""

    def __init__(self, vocab: int, width: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq, width)
        layer = nn.TransformerEncoderLayer(
            width, width // 64, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.encoder(self.embed(tokens) + self.position(positions))
        logits: torch.Tensor = self.head(self.norm(hidden))
        return logits


SIZES = {  # vocab, width, layers, batch, seq
    "27m": (8192, 512, 6, 8, 256),
    "tiny": (256, 64, 2, 2, 32),
}


def _ddp_run(backend: str | None, device: torch.device, size: str, warmup: int, steps: int) -> dict[str, Any]:
    """Trains with DDP over `backend` (None: each rank alone): step times, parameters, the
    profiler's view of two more steps (on a GPU), and the model."""
    from torch.nn.parallel import DistributedDataParallel

    vocab, width, layers, batch, seq = SIZES[size]
    torch.manual_seed(0)
    model: nn.Module = Encoder(vocab, width, layers, seq).to(device)
    if backend is not None:
        dist.init_process_group(backend)
        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1000 + _rank())
        data = [torch.randint(0, vocab, (batch, seq + 1), generator=generator) for _ in range(4)]
        if device.type == "cuda":  # so that the only pageable copies the profiler sees are the backend's
            data = [tokens.pin_memory() for tokens in data]

        def step(i: int) -> None:
            tokens = data[i % len(data)].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        seconds = []
        for i in range(warmup + steps):
            _sync(device)
            started = time.perf_counter()
            step(i)
            _sync(device)
            if i >= warmup:
                seconds.append(time.perf_counter() - started)
        copies: dict[str, dict[str, float]] = {}
        host_ms: dict[str, float] = {}
        # Only on a GPU: on the host there are no copies to see, and the profiler's stop while
        # DDP's callbacks still ran on the backend's threads is the likely end of a CPU trial
        # that died once in CI (glibc heap corruption right after profiler_stop; 600 profiled
        # rounds here did not repeat it).
        if device.type == "cuda":
            with _profiler(device) as prof:
                for i in range(2):
                    step(warmup + steps + i)
                _sync(device)
            copies, host_ms = _copy_kinds(prof), _host_calls(prof)
        module = model.module if isinstance(model, DistributedDataParallel) else model
        params = {name: p.detach().cpu() for name, p in module.named_parameters()}
        return {
            "model": model,
            "seconds": seconds,
            "params": params,
            "copies": copies,
            "host_ms": host_ms,
            "parameters": sum(p.numel() for p in params.values()),
        }
    finally:
        if backend is not None:
            dist.destroy_process_group()


def part_ddp(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    device = _device(args.device)
    size = args.size or ("27m" if device.type == "cuda" else "tiny")
    vocab, width, layers, batch, seq = SIZES[size]
    # Each run's model (and with it its DDP reducer's process group) is kept until the end. In
    # torch 2.13 a Work that gloo issues during backward holds the backward's Python context in
    # its thread state, and gloo's worker thread takes the GIL to release it after the Work ran;
    # a gloo group freed right after the last step (its reducer dropped, the GIL held) joins that
    # thread and both wait for ever (seen here in 4 of 15 CPU trials).
    runs: dict[str, dict[str, Any]] = {}
    # gradserver first, each variant's line as soon as it ran: a later one that hangs (gloo on
    # CUDA tensors) leaves this one's figures in the log.
    for name, backend in ((BACKEND, BACKEND), ("gloo", "gloo"), ("alone", None)):
        run = runs[name] = _ddp_run(backend, device, size, args.warmup, args.steps)
        median = statistics.median(run["seconds"])
        copies = ", ".join(
            f"{_short(kind)} x{int(v['count'])} {v['ms']:.1f} ms" for kind, v in run["copies"].items()
        )
        _emit(
            {
                "part": "torch-ddp",
                "variant": name,
                "model": f"encoder {layers} x {width}, vocabulary {vocab}, {run['parameters'] / 1e6:.1f}M",
                "batch": f"{batch} x {seq} per rank, bfloat16 autocast, AdamW",
                "median_step_s": round(median, 4),
                "step_s": [round(s, 4) for s in run["seconds"]],
                "copies_in_2_profiled_steps": run["copies"],
                "host_ms_in_2_profiled_steps": run["host_ms"],
                "summary": f"{name}: median step {median * 1e3:.1f} ms; copies: {copies or 'none seen'}",
            },
            device,
        )
    ours, gloo = runs[BACKEND], runs["gloo"]
    diff = max(float((ours["params"][n] - t).abs().max()) for n, t in gloo["params"].items())
    identical = all(torch.equal(ours["params"][n], t) for n, t in gloo["params"].items())
    dist.init_process_group(BACKEND)
    try:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, {"digest": _digest(ours["params"]), "diff": diff})
    finally:
        dist.destroy_process_group()
    same_on_every_rank = len({e["digest"] for e in every}) == 1
    worst = max(e["diff"] for e in every)
    pageable = {kind: seen for kind, seen in ours["copies"].items() if "Pageable" in kind}
    ok = same_on_every_rank and worst <= 1e-3 and (device.type != "cuda" or not pageable)
    medians = {name: statistics.median(run["seconds"]) for name, run in runs.items()}
    over = medians[BACKEND] / medians["gloo"]
    pageable_count = sum(int(seen["count"]) for seen in pageable.values())
    summary = (
        f"gradserver {medians[BACKEND] * 1e3:.1f} ms/step, gloo {medians['gloo'] * 1e3:.1f}, alone "
        f"{medians['alone'] * 1e3:.1f} ({over:.2f}x gloo's time); max |param diff| vs gloo {worst:.3g}; "
        f"pageable copies: {pageable_count}"
    )
    result = {
        "part": "torch-ddp",
        "variant": "compare",
        "ok": ok,
        "summary": summary,
        "gradserver_over_gloo": round(over, 3),
        "communication_s": {name: round(medians[name] - medians["alone"], 4) for name in (BACKEND, "gloo")},
        "max_abs_param_diff_vs_gloo": worst,
        "bit_identical_to_gloo": identical,
        "parameters_identical_on_every_rank": same_on_every_rank,
        "pageable_copies": pageable,
    }
    return [result], ok


def _short(kind: str) -> str:
    """'Memcpy DtoH (Device -> Pinned)' -> 'Device -> Pinned'."""
    return kind.rsplit("(", maxsplit=1)[-1].rstrip(")")


PARTS: dict[str, Callable[[argparse.Namespace], tuple[list[dict[str, Any]], bool]]] = {
    "collectives": part_collectives,
    "fsdp2": part_fsdp2,
    "ddp": part_ddp,
    "sharded": part_sharded,
}


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        # torch's deprecation notes for the collectives exercised on purpose (all_reduce_coalesced, ...)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=sorted(PARTS), required=True)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a trial of the plumbing"
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="", help="ddp: 27m on a GPU, tiny on the cpu"
    )
    parser.add_argument("--steps", type=int, default=12, help="ddp: timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="ddp: untimed steps first")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"bench.torch_cuda --part {args.part}: needs a CUDA device (torch {torch.__version__} sees none)"
        )
        return 2
    import gradserver.torch  # noqa: F401 - registers the backend where the entry point did not

    device = torch.device(args.device)
    with _quiet_warnings():
        try:
            results, ok = PARTS[args.part](args)
        except Exception as exc:
            _emit(
                {"part": f"torch-{args.part}", "ok": False, "summary": f"{type(exc).__name__}: {exc}"[:500]},
                device,
            )
            raise
    for result in results:
        _emit(result, device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
