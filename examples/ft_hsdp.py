"""Fault-tolerant HSDP: replica groups of FSDP2-sharded ranks; when a rank is lost its whole
replica group is restarted and heals, shard by shard, from a live replica group.

    gradserver run --workers 4 --replica-group-size 2 --restart-lost 2 -- python examples/ft_hsdp.py

Each replica group (here 2 ranks) shards the model with FSDP2 over its own process group; the
replica groups average their shards' gradients through gradserver, one job (and coordinator) per
shard index, which `gradserver run` starts. Kill any rank: the other replica groups go on, run
restarts the lost rank's group, and its ranks take their shards' state from a live group before
they take part again. Every rank prints the digest of its shard's final state: the ranks of one
shard index print the same. The data position is the step: each rank reads the samples of
(step, its global rank).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradserver.torch import ft
from gradserver.worker import state_digest


def samples(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # this replica group's ranks (run gives each group its own)
    shard, shards = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (shards,))
    torch.manual_seed(0)  # every replica builds the same model
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    job = ft.Replica(model, optimizer, replica_group=dist.group.WORLD)
    group = job.client.worker_id  # this replica group's index: its worker id in its shard's job
    name = f"replica group {group} shard {shard}"
    if job.healed is not None:
        print(
            f"{name}: joined the running job at step {job.step}, state from group {job.healed.donor}",
            flush=True,
        )
    for step in job.steps(args.steps):
        optimizer.zero_grad()
        x, y = samples(step, group * shards + shard)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        job.commit()
        if step % 100 == 0:
            print(f"{name} step {step}: loss {loss.item():.4f}, averaged over {job.contributors}", flush=True)
    digest = state_digest(ft.state_tensors(model, optimizer))
    print(f"{name}: {args.steps} steps ({job.committed} applied here), digest {digest:#018x}", flush=True)
    job.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
