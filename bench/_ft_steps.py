"""One rank of bench/ft.py: the same small DDP training, fault-tolerant or plain, timing each step.

    gradserver run --workers 3 -- python -m bench._ft_steps --mode ft --steps 300 --width 512

`--mode ft`: `gradserver.torch.ft.Replica` (its DDP hook, a commit barrier per step); `ddp`: plain
DDP on the "gradserver" backend; `gloo`: plain DDP on gloo. Rank 0 prints one line,
`STEP_TIMES [...]` (seconds per step, in order); with ft every rank also prints its final state
digest (`rank R: digest 0x...`), so a run can be checked for one state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradserver.torch import ft
from gradserver.worker import state_digest


def model_of(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh(),
        torch.nn.Linear(width, 1),
    )  # fmt: skip


def samples(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 64, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("ft", "ddp", "gloo"), required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--progress-every", type=int, default=0, help="rank 0 prints its step this often")
    args = parser.parse_args()
    model = model_of(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times: list[float] = []
    if args.mode == "ft":
        job = ft.Replica(model, optimizer)
        ddp, rank = job.ddp(), job.client.worker_id
        steps, apply = job.steps(args.steps), job.commit
    else:
        dist.init_process_group("gradserver" if args.mode == "ddp" else "gloo")
        ddp, rank = DistributedDataParallel(model), dist.get_rank()
        steps, apply = iter(range(args.steps)), optimizer.step
    for step in steps:
        started = time.perf_counter()
        optimizer.zero_grad()
        x, y = samples(step, rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        apply()
        times.append(time.perf_counter() - started)
        if args.progress_every and rank == 0 and step % args.progress_every == 0:
            print(f"rank 0 at step {step}", flush=True)
    if args.mode == "ft":
        print(f"rank {rank}: digest {state_digest(ft.state_tensors(model, optimizer)):#018x}", flush=True)
        job.close()
    else:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print("STEP_TIMES " + json.dumps(times), flush=True)
    # Without the interpreter's shutdown, which gloo's worker threads can trip over
    # (examples/_result.py, end_process_group).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
