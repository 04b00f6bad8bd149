"""FSDP2 on the gradserver backend: `fully_shard` on a small MLP stack, AdamW, `clip_grad_norm_`,
synthetic data. Only the backend string differs between

    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py --backend gloo
    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py --backend gradserver
    torchrun --standalone --nproc-per-node 4 examples/fsdp2.py --backend gradserver --mesh 2 2

`--mesh R S` trains HSDP on a 2-D mesh (R replicas x S shards, R*S ranks): parameters are sharded
over S ranks and their gradients averaged across the R replicas. Each rank prints one RESULT line
(its losses and a digest of the full parameters, see examples/_result.py).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _result import end_process_group, print_result
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def mlp_stack(width: int, depth: int) -> nn.Sequential:
    """`depth` residual-free blocks of Linear + GELU: each one becomes its own FSDP unit."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gradserver", help="gloo or gradserver")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--mesh", type=int, nargs="+", default=None, help="mesh shape; default: (world,)")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = tuple(args.mesh) if args.mesh else (world,)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)

    torch.manual_seed(0)  # the same initial parameters on every rank
    model = mlp_stack(args.width, args.depth)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    losses = []
    for _ in range(args.steps):
        x = torch.randn(args.batch_size, args.width, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())

    full = [
        (name, p.full_tensor() if isinstance(p, DTensor) else p.detach())
        for name, p in model.named_parameters()
    ]
    print_result(rank, args.backend, losses, full)
    end_process_group()


if __name__ == "__main__":
    main()
