"""Fault-tolerant DDP: a rank lost mid-job is restarted alone and heals from a live rank.

    gradserver run --workers 3 --restart-lost 2 -- python examples/ft_ddp.py --steps 2000

Kill any rank (SIGKILL): the others go on (those steps are averaged over the ranks that took part),
`gradserver run` starts it again with its command, and it takes the model, the optimizer state and
the step from a live rank before it takes part again. Every rank prints the digest of its final
state: they are equal. Against torchft: no lighthouse to run, no process-group wrapper to pick;
the five lines below (`ft.Replica`, `job.ddp()`, `job.steps()`, `job.commit()`, `job.close()`).
The data position is the step: each rank reads the samples of (step, rank), so a healed rank
goes on where the job is.
"""

from __future__ import annotations

import argparse

import torch

from gradserver.torch import ft
from gradserver.worker import state_digest


def samples(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()

    torch.manual_seed(0)  # every rank builds the same model
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
    for step in job.steps(args.steps):
        optimizer.zero_grad()
        x, y = samples(step, rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
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
