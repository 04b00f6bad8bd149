"""Training over slow links: each rank trains alone and the ranks meet every `--sync-every` steps.

    gradserver run --workers 2 -- python examples/diloco.py --sync-every 20 --quantize int8

Each rank is a replica: its inner optimizer (AdamW) steps on its own data; every 20th step is
also an outer step (gradserver.torch.diloco): the pseudo-gradients (global - local weights),
int8-quantized with error feedback, are averaged across the replicas (weighted by the samples each
counted) and an outer optimizer (SGD, Nesterov) steps the global weights, bit-identical on every
rank. One exchange every 20 steps, at about a quarter of float32's bytes: 80x fewer bytes than
averaging every step's gradients. Every rank ends with its RESULT line (examples/_result.py):
the digest of the global weights, the same on every rank.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _result import end_process_group, print_result

from gradserver.torch import diloco


def samples(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, (x.sum(dim=1, keepdim=True) / 4).sin()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--quantize", choices=["bf16", "int8", "int4"], default=None)
    parser.add_argument("--fragments", type=int, default=1, help="streaming: parts synced in turn")
    parser.add_argument("--delay", type=int, default=0, help="streaming: inner steps an exchange overlaps")
    parser.add_argument("--keep-local", type=float, default=0.0, help="streaming: the mixing rule's alpha")
    args = parser.parse_args()

    dist.init_process_group("gradserver")
    rank = dist.get_rank()
    torch.manual_seed(0)  # every replica starts from the same weights (checked)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    losses = []
    with diloco.DiLoCo(
        model,
        optimizer,
        sync_every=args.sync_every,
        quantize=args.quantize,
        fragments=args.fragments,
        delay=args.delay,
        keep_local=args.keep_local,
    ) as outer:
        for step in range(args.steps):
            x, y = samples(step, rank)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            outer.count(len(x))  # this replica's weight in the next outer average
            optimizer.step()  # every sync_every-th step is also an outer step
            optimizer.zero_grad()
            losses.append(loss.item())
            if (step + 1) % 100 == 0:
                print(f"rank {rank} step {step + 1}: loss {loss.item():.4f}", flush=True)
    print(
        f"rank {rank}: {outer.outer_steps} outer steps, {outer.sent_bytes} bytes sent, "
        f"{outer.received_bytes} received; the exchanges held it {outer.exchange_times.exposed_s:.3f} s",
        flush=True,
    )
    print_result(rank, "gradserver", losses, outer.global_tensors().items())
    end_process_group()


if __name__ == "__main__":
    main()
