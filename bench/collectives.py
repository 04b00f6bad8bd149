"""Benchmark: time per collective of the "gradserver" torch.distributed backend vs gloo.

    python -m bench.collectives                        # N = 2 and 3, 4 B, 256 KiB and 16 MiB
    python -m bench.collectives --workers 2 --sizes 4 262144 --iterations 20
    python -m bench.collectives --machine-floor        # and this machine's all_reduce floor (bench.machine)

For every N, each backend runs in its own set of spawned ranks (a file store, the same tensors)
and times all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast of float32
tensors of each size: S bytes is what every rank contributes to the all-gather, receives from the
reduce-scatter (its input is N times that) and what the broadcast moves; and a point-to-point
round trip: rank 0 sends S bytes to rank 1 and receives them back (`send_recv`; the other ranks
only take part in the barrier), timed over 10 round trips in a row and divided by 10, so what the
last rank out of the barrier costs is not counted as the round trip's. Each call is timed on its own after a
barrier and a warm-up; rank 0 reports the median per operation. The backends run one after the
other for each N, so the ratios compare runs a few seconds apart on the same machine. The table
gives both medians and the ratio gradserver/gloo (below 1: gradserver is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from bench.machine import Machine

BACKENDS = ("gradserver", "gloo")
OPERATIONS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "send_recv")
DEFAULT_SIZES = (4, 256 * 1024, 1024 * 1024, 16 * 1024 * 1024)
_WARMUP = 2
_JOIN_S = 900.0


def _iterations(nbytes: int, requested: int) -> int:
    """Fewer repetitions for large messages, so a slow backend still ends in minutes."""
    if requested:
        return requested
    return 40 if nbytes <= 4096 else 15 if nbytes <= 1024 * 1024 else 5


def _one_call(name: str, world: int, rank: int, nbytes: int) -> tuple[Any, ...]:
    """The tensors of one call of `name` moving `nbytes` per rank."""
    elements = max(nbytes // 4, 1)
    if name == "all_gather_into_tensor":
        return (torch.empty(world * elements), torch.full((elements,), float(rank)))
    if name == "reduce_scatter_tensor":
        return (torch.empty(elements), torch.full((world * elements,), float(rank)))
    if name == "all_reduce":
        return (torch.full((elements,), float(rank)),)
    return (torch.full((elements,), float(rank)),)


def _run(name: str, tensors: tuple[Any, ...]) -> None:
    if name == "all_gather_into_tensor":
        dist.all_gather_into_tensor(*tensors)
    elif name == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(*tensors)
    elif name == "all_reduce":
        dist.all_reduce(tensors[0])
    elif name == "send_recv":
        _round_trip(tensors[0])
    else:
        dist.broadcast(tensors[0], src=0)


_ROUND_TRIPS = 10


def _round_trip(tensor: torch.Tensor) -> None:
    """Rank 0 sends `tensor` to rank 1, which sends it back, `_ROUND_TRIPS` times; the other
    ranks do nothing."""
    rank = dist.get_rank()
    for _ in range(_ROUND_TRIPS):
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)


def _rank(rank: int, world: int, backend: str, store: str, out: str, sizes: list[int], repeat: int) -> None:
    import gradserver.torch  # noqa: F401 - registers "gradserver"

    # torch calls the *_tensor collectives deprecated in favour of names older torch lacks.
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    medians: dict[str, float] = {}
    try:
        for name in OPERATIONS:
            for nbytes in sizes:
                tensors = _one_call(name, world, rank, nbytes)
                times = []
                for i in range(_WARMUP + _iterations(nbytes, repeat)):
                    dist.barrier()
                    start = time.perf_counter()
                    _run(name, tensors)
                    if i >= _WARMUP:
                        calls = _ROUND_TRIPS if name == "send_recv" else 1
                        times.append((time.perf_counter() - start) / calls)
                medians[f"{name} {nbytes}"] = statistics.median(times)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(medians))


def measure(backend: str, world: int, sizes: list[int], repeat: int) -> dict[str, float]:
    """Median seconds per (operation, size) on rank 0 of one run of `world` ranks."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gradserver-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        args = (world, backend, os.path.join(tmp, "store"), out, sizes, repeat)
        procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(_JOIN_S)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        if any(p.exitcode != 0 for p in procs) or not os.path.exists(out):
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"{backend} N={world}: a rank failed (exit codes {codes})")
        result: dict[str, float] = json.loads(Path(out).read_text())
        return result


def _size_name(nbytes: int) -> str:
    for unit, scale in (("MiB", 1024 * 1024), ("KiB", 1024)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _machine_floor_cells(machine: Machine, name: str, world: int, nbytes: int, seconds: float) -> str:
    """The `--machine-floor` columns of one row: bench.machine models all_reduce only."""
    if name != "all_reduce":
        return " - | - |"
    from bench.machine import all_reduce_floor_s

    floor = all_reduce_floor_s(nbytes, world, machine)
    return f" {floor * 1e3:.4f} | {seconds / floor:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3], help="world sizes to run")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="bytes per rank")
    parser.add_argument("--iterations", type=int, default=0, help="timed calls per size (0: by size)")
    parser.add_argument(
        "--machine-floor",
        action="store_true",
        help="measure this machine first (bench.machine) and show each all_reduce's floor "
        "(its copies and wakes over the collective lane) and gradserver/floor",
    )
    args = parser.parse_args()
    machine: Machine | None = None
    if args.machine_floor:
        from bench import machine as bench_machine

        # Measured before any rank runs, so that nothing of this bench competes with it.
        machine = bench_machine.measure()
        print(bench_machine.table(machine), end="\n\n", flush=True)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for world in args.workers:
        times = {backend: measure(backend, world, args.sizes, args.iterations) for backend in BACKENDS}
        for name in OPERATIONS:
            for nbytes in args.sizes:
                ours, gloo = (times[b][f"{name} {nbytes}"] for b in BACKENDS)
                rows.append((world, name, nbytes, ours, gloo))
        print(f"N={world} done", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    floor_header = " floor ms | gradserver/floor |" if machine else ""
    print("| N | operation | bytes per rank | gradserver ms | gloo ms | gradserver/gloo |" + floor_header)
    print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if machine else ""))
    for world, name, nbytes, ours, gloo in rows:
        cells = (str(world), name, _size_name(nbytes), f"{ours * 1e3:.3f}", f"{gloo * 1e3:.3f}")
        floor_cells = _machine_floor_cells(machine, name, world, nbytes, ours) if machine else ""
        print(f"| {' | '.join(cells)} | {ours / gloo:.2f} |" + floor_cells)


if __name__ == "__main__":
    main()
