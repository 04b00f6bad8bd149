"""A plain DDP training script for a model gradserver does not define: a small CNN with BatchNorm
on synthetic images generated here. Only the backend string differs between

    torchrun --nproc-per-node 2 examples/ddp_cnn.py --backend gloo
    torchrun --nproc-per-node 2 examples/ddp_cnn.py --backend gradserver
    gradserver run --workers 2 -- python examples/ddp_cnn.py --backend gradserver

("gradserver" is registered by the installed package when torch is imported; with
TORCH_DEVICE_BACKEND_AUTOLOAD=0, `import gradserver.torch` first). It prints the loss every
`--log-every` steps and, on rank 0, the training throughput (median samples/s over the steps after
the first few); every rank ends with its RESULT line (examples/_result.py), whose parameter digest
is the same on every rank of a correct run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _result import end_process_group, print_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel

WARMUP_STEPS = 3


class SmallCnn(nn.Module):
    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.features = nn.Sequential(
            block(3, width),
            block(width, width),
            nn.MaxPool2d(2),
            block(width, 2 * width),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def synthetic_batch(
    generator: torch.Generator, batch: int, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class shifts the mean of one colour channel, so the loss can fall."""
    labels = torch.randint(0, classes, (batch,), generator=generator)
    images = torch.randn(batch, 3, 16, 16, generator=generator)
    images[:, labels % 3] += (labels.float() / classes).view(-1, 1, 1, 1)
    return images, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gradserver", help="gloo or gradserver")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    model = DistributedDataParallel(SmallCnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(1000 + rank)
    step_times = []
    losses = []
    for step in range(args.steps):
        started = time.perf_counter()
        images, labels = synthetic_batch(generator, args.batch_size, 10)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        step_times.append(time.perf_counter() - started)
        losses.append(loss.item())
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
    dist.barrier()
    if rank == 0:
        measured = step_times[WARMUP_STEPS:] or step_times
        samples_per_s = args.batch_size * world / statistics.median(measured)
        print(f"backend {args.backend} world {world}: {samples_per_s:.1f} samples/s (median)", flush=True)
    print_result(rank, args.backend, losses, model.module.named_parameters())
    end_process_group()


if __name__ == "__main__":
    main()
