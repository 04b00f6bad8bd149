"""A rank of a fault-tolerant DDP job (examples/ft_ddp.py's loop) that kills itself at one point
of one step, keyed by rank and step: fault injection for tests/test_torch_ft.py.

    python -m tests.helpers.ft_rank --steps 600 --die RANK:STEP:PHASE

PHASE is where in step STEP rank RANK gets SIGKILL: `forward` (before the model runs),
`averaging` (its gradients sent, their average not back: mid-collective), `commit` (before the
commit barrier) or `optimizer` (the step committed for every rank, not yet applied here). Only the
first incarnation dies: a restarted rank (it healed) runs to the end. Prints what examples/ft_ddp.py
prints.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch

from gradserver.torch import ft
from gradserver.worker import state_digest

PHASES = ("forward", "averaging", "commit", "optimizer")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--die", default="", help="RANK:STEP:PHASE")
    args = parser.parse_args()
    die_rank, die_step, phase = [*args.die.split(":"), "", "", ""][:3] if args.die else ["-1", "-1", ""]
    if phase and phase not in PHASES:
        parser.error(f"PHASE is one of {', '.join(PHASES)}")

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job = ft.Replica(model, optimizer)
    ddp = job.ddp()
    rank = job.client.worker_id
    if job.healed is not None:
        print(
            f"rank {rank}: joined the running job at step {job.step}, state from rank {job.healed.donor}",
            flush=True,
        )
    armed = job.healed is None and rank == int(die_rank)
    here = {"step": -1}

    def at(point: str) -> None:
        if armed and here["step"] == int(die_step) and phase == point:
            print(f"rank {rank}: dying in step {here['step']} at {point}", flush=True)
            _die()

    send, barrier, apply = job.client.send, job.client.barrier, optimizer.step

    def sent(*a: Any, **k: Any) -> None:
        send(*a, **k)
        at("averaging")

    def commit_barrier(*a: Any, **k: Any) -> None:
        at("commit")
        barrier(*a, **k)

    def applied(*a: Any, **k: Any) -> Any:
        at("optimizer")
        return apply(*a, **k)

    job.client.send = sent  # type: ignore[method-assign]
    job.client.barrier = commit_barrier  # type: ignore[method-assign]
    optimizer.step = applied  # type: ignore[method-assign]
    for step in job.steps(args.steps):
        here["step"] = step
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 16, generator=g)
        at("forward")
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        job.commit()
        if step % 100 == 0:
            print(
                f"rank {rank} step {step}: loss {loss.item():.4f}, averaged over {job.contributors}",
                flush=True,
            )
    digest = state_digest(ft.state_tensors(model, optimizer))
    print(
        f"rank {rank}: {args.steps} steps ({job.committed} applied here), digest {digest:#018x}", flush=True
    )
    job.close()


if __name__ == "__main__":
    main()
