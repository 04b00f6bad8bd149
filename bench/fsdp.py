"""Benchmark: FSDP2 training step time of the "gradserver" torch.distributed backend vs gloo.

    python -m bench.fsdp                         # N = 2 and 4, ~21M parameters, 8 steps (3 warm-up)
    python -m bench.fsdp --workers 2 --steps 10 --rounds 2 --json

Every run is `torchrun --standalone --nproc-per-node N -m bench.fsdp --role rank ...`: a stack of
transformer-style MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d, residual), each block
and the whole model `fully_shard`ed on a 1-D mesh of N ranks, AdamW and `clip_grad_norm_`, on
synthetic data; only `--backend` differs. Every FSDP2 step all-gathers each block's parameters in
the forward and again in the backward and reduce-scatters its gradients, so the model is made big
enough (`--width`, `--depth`) that communication matters. A step's time is the slowest rank's
(each rank times its step; rank 0 gathers them); a run reports the median over the steps after
warm-up. The backends alternate within each round so that a change in the machine's load hits
both; the table gives the median over rounds and the ratio gradserver/gloo (below 1: faster).
gradserver runs with its default embedded coordinator (rank 0's child process on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("gradserver", "gloo")
RESULT_PREFIX = "FSDP-BENCH "


def _model(width: int, depth: int) -> Any:
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.head = nn.Linear(width, 1)

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Stack()


def _rank(args: argparse.Namespace) -> None:
    """One rank of one run (under torchrun): trains, and rank 0 prints the per-step times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    # The ranks share the machine's cores, as in bench.ddp.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _model(args.width, args.depth)
    parameters = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1000 + rank)
    times: list[float] = []
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, args.width, generator=generator)
        dist.barrier()  # every step starts together, so a step's time is not the previous one's skew
        started = time.perf_counter()
        loss = (model(x) - x.sum(dim=1, keepdim=True).sin()).square().mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - started)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        slowest = [max(per_rank[step] for per_rank in gathered) for step in range(args.steps)]
        line = {"backend": args.backend, "world": world, "parameters": parameters, "step_s": slowest}
        print(RESULT_PREFIX + json.dumps(line), flush=True)
    dist.destroy_process_group()


def run_once(args: argparse.Namespace, backend: str, workers: int) -> dict[str, Any]:
    """One torchrun of `workers` ranks; its rank 0's result line."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(workers), "-m", "bench.fsdp"]
    cmd += ["--role", "rank", "--backend", backend, "--steps", str(args.steps)]
    cmd += ["--width", str(args.width), "--depth", str(args.depth), "--batch-size", str(args.batch_size)]
    # -m resolves bench.fsdp from the working directory: the repository root.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.timeout, check=False, cwd=ROOT, env=env
    )
    for line in result.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            parsed: dict[str, Any] = json.loads(line.removeprefix(RESULT_PREFIX))
            parsed["clean_exit"] = result.returncode == 0
            return parsed
    output = result.stdout[-2000:] + result.stderr[-3000:]
    raise RuntimeError(
        f"bench.fsdp: {backend} N={workers} printed no result (exit {result.returncode}):\n{output}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", default="driver", choices=["driver", "rank"], help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="gradserver", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    parser.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    parser.add_argument("--width", type=int, default=512, help="model width d (blocks are d->4d->d)")
    parser.add_argument("--depth", type=int, default=10, help="blocks, each its own FSDP unit")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--rounds", type=int, default=1, help="runs per backend and N, alternating")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--json", action="store_true", help="one JSON line per row after the table")
    args = parser.parse_args()
    if args.role == "rank":
        _rank(args)
        return
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for workers in args.workers:
        medians: dict[str, list[float]] = {b: [] for b in BACKENDS}
        parameters = 0
        for round_ in range(args.rounds):
            order = BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]
            for backend in order:
                result = run_once(args, backend, workers)
                parameters = result["parameters"]
                median = statistics.median(result["step_s"][args.warmup :])
                medians[backend].append(median)
                note = "" if result["clean_exit"] else " (then exited non-zero after training)"
                print(f"N={workers} round {round_} {backend}: {median:.3f} s/step{note}", flush=True)
        ours, gloo = (statistics.median(medians[b]) for b in BACKENDS)
        rows.append(
            {
                "workers": workers,
                "parameters": parameters,
                "gradserver_step_s": ours,
                "gloo_step_s": gloo,
                "ratio": ours / gloo,
                "runs_step_s": medians,
            }
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print("| N | parameters | gradserver s/step | gloo s/step | gradserver/gloo | runs (gradserver; gloo) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        runs = "; ".join(", ".join(f"{s:.3f}" for s in row["runs_step_s"][b]) for b in BACKENDS)
        print(
            f"| {row['workers']} | {row['parameters'] / 1e6:.1f}M | {row['gradserver_step_s']:.3f} "
            f"| {row['gloo_step_s']:.3f} | {row['ratio']:.2f} | {runs} |"
        )
    if args.json:
        for row in rows:
            print(json.dumps(row))


if __name__ == "__main__":
    main()
