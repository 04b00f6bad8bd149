"""Hugging Face Accelerate on the gradserver backend: a plain training loop with `Accelerator`,
on synthetic data.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --backend gloo
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --backend gradserver

`InitProcessGroupKwargs(backend=...)` refuses backend names it does not know on CPU, so the script
creates the process group itself first; `Accelerator()` then uses that group as it finds it. Each
rank prints one RESULT line (its losses and a digest of the parameters, see examples/_result.py).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _result import end_process_group, print_result
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gradserver", help="gloo or gradserver")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # first: Accelerator then finds the group ready
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # The same data set on every rank; the prepared loader gives each rank its part.
    generator = torch.Generator().manual_seed(1000)
    x = torch.randn(args.steps * args.batch_size * accelerator.num_processes, args.width, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), args.batch_size)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)

    losses = []
    for inputs, targets in data:
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    print_result(accelerator.process_index, args.backend, losses, model.named_parameters())
    end_process_group()


if __name__ == "__main__":
    main()
