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

With `--outer-steps H` the replica groups train alone (each inner step averaged over the group's
shards by FSDP2) and exchange pseudo-gradients every H steps (DiLoCo over `ft`: `job.diloco`),
each shard's in its own job: a restarted group takes its shards' global weights and outer state
from a live group at that group's next exchange. The digest is then that of the global weights.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from gradserver.torch import ft
from gradserver.torch.diloco import DiLoCo
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
    parser.add_argument("--outer-steps", type=int, default=0, help="H: DiLoCo every H steps (0: none)")
    parser.add_argument("--fragments", type=int, default=1, help="with --outer-steps: streaming")
    parser.add_argument("--delay", type=int, default=0, help="with --outer-steps: overlapped steps")
    parser.add_argument("--quantize", choices=["bf16", "int8", "int4"], default=None)
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
    rank = group * shards + shard
    if args.outer_steps:
        outer = job.diloco(
            sync_every=args.outer_steps, fragments=args.fragments, delay=args.delay, quantize=args.quantize
        )
        steps, digest = with_outer_steps(job, outer, name, rank, args.steps)
    else:
        steps, digest = every_step(job, name, rank, args.steps)
    print(f"{name}: {steps} steps ({job.committed} applied here), digest {digest:#018x}", flush=True)
    job.close()
    dist.destroy_process_group()


def every_step(job: ft.Replica, name: str, rank: int, steps: int) -> tuple[int, int]:
    """Each step's gradients averaged over the replica groups (FSDP2's inside the group)."""
    if job.healed is not None:
        print(
            f"{name}: joined the running job at step {job.step}, state from group {job.healed.donor}",
            flush=True,
        )
    for step in job.steps(steps):
        job.optimizer.zero_grad()
        x, y = samples(step, rank)
        loss = nn.functional.mse_loss(job.model(x), y)
        loss.backward()
        job.commit()
        if step % 100 == 0:
            print(f"{name} step {step}: loss {loss.item():.4f}, averaged over {job.contributors}", flush=True)
    return steps, state_digest(ft.state_tensors(job.model, job.optimizer))


def with_outer_steps(job: ft.Replica, outer: DiLoCo, name: str, rank: int, steps: int) -> tuple[int, int]:
    """DiLoCo between the replica groups: each exchange is a step of the shard's job."""
    if job.healed is not None:
        print(
            f"{name}: joined the running job at step {job.healed.step} (inner step {outer.inner_step}), "
            f"state from group {job.healed.donor}",
            flush=True,
        )
    with outer:
        for step in outer.steps(steps):  # the inner step is the data position
            job.optimizer.zero_grad()
            x, y = samples(step, rank)
            loss = nn.functional.mse_loss(job.model(x), y)
            loss.backward()
            outer.count(len(x))
            applied = outer.outer_steps
            job.optimizer.step()  # every H-th step is also an outer step
            if outer.outer_steps > applied and outer.outer_steps % 5 == 0:
                print(
                    f"{name} outer {outer.outer_steps} at inner step {outer.inner_step}: loss "
                    f"{loss.item():.4f}, averaged over {job.contributors}",
                    flush=True,
                )
    return outer.inner_step, state_digest(outer.global_tensors())


if __name__ == "__main__":
    main()
