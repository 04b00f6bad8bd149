"""Pipeline parallelism (torch.distributed.pipelining) on the gradserver backend: a small
transformer-ish model split into 2 stages by hand, trained with Schedule1F1B on synthetic data.
Only the backend string differs between

    torchrun --standalone --nproc-per-node 2 examples/pipeline.py --backend gloo
    torchrun --standalone --nproc-per-node 2 examples/pipeline.py --backend gradserver
    torchrun --standalone --nproc-per-node 4 examples/pipeline.py --backend gradserver
    gradserver run --workers 2 -- python examples/pipeline.py --backend gradserver

The stages pass activations forward and gradients back with send/recv (isend/irecv and
batch_isend_irecv). With 4 ranks (any multiple of `--stages`) the pipelines are also data
parallel: a (replicas x stages) DeviceMesh, each replica on its own data, gradients averaged over
the replicas of a stage (all_reduce AVG on that mesh dimension's sub-group) before the optimizer
step. Each rank prints one RESULT line (see examples/_result.py): its pipeline's losses (the last
stage's, one per step) and a digest of the whole trained model, gathered from its pipeline's
stages, so every rank of a run prints the same digest.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
from _result import end_process_group, print_result
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B


class Block(nn.Module):
    """Pre-norm residual MLP: a transformer block without attention."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def full_model(features: int, width: int, depth: int) -> nn.Sequential:
    """Input projection, `depth` blocks, a 1-output head."""
    return nn.Sequential(
        nn.Linear(features, width), *(Block(width) for _ in range(depth)), nn.Linear(width, 1)
    )


def stage_module(model: nn.Sequential, stage: int, stages: int, depth: int) -> nn.Sequential:
    """The layers of `stage`: an equal share of the blocks, plus the input projection on the first
    stage and the head on the last. Children keep their index in the full model as their name, so
    the stages' parameter names put together are the full model's."""
    per = depth // stages
    indices = list(range(1 + stage * per, 1 + (stage + 1) * per))
    if stage == 0:
        indices.insert(0, 0)
    if stage == stages - 1:
        indices.append(depth + 1)
    return nn.Sequential(OrderedDict((str(i), model[i]) for i in indices))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gradserver", help="gloo or gradserver")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages; the world size a multiple")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="per pipeline, split into microbatches")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4, help="blocks; a multiple of --stages")
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--seq", type=int, default=6, help="tokens per sample")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # torchrun's (or `gradserver run`'s) environment
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.stages or args.depth % args.stages:
        raise SystemExit(
            f"world size {world} and --depth {args.depth} must be multiples of --stages {args.stages}"
        )
    replicas = world // args.stages
    if replicas > 1:
        # Rank r is stage r % stages of replica r // stages: a pipeline's stages are neighbours.
        mesh = init_device_mesh("cpu", (replicas, args.stages), mesh_dim_names=("dp", "pp"))
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        stage, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    else:
        pp_group, dp_group, stage, replica = None, None, rank, 0
    last = stage == args.stages - 1

    torch.manual_seed(0)  # the same full model on every rank; each keeps its stage's layers
    module = stage_module(full_model(args.features, args.width, args.depth), stage, args.stages, args.depth)
    pipeline_stage = PipelineStage(module, stage, args.stages, torch.device("cpu"), group=pp_group)
    schedule = Schedule1F1B(pipeline_stage, n_microbatches=args.microbatches, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.003)

    generator = torch.Generator().manual_seed(1000 + replica)  # each replica its own data
    losses: list[float] = []
    for _ in range(args.steps):
        # Every stage draws the batch so the generators stay in step; the first stage feeds the
        # inputs, the last the targets.
        x = torch.randn(args.batch_size, args.seq, args.features, generator=generator)
        y = x.sum(dim=2, keepdim=True).sin()
        optimizer.zero_grad()
        if stage == 0:
            schedule.step(x)
        elif last:
            microbatch_losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=microbatch_losses)
            losses.append(torch.stack(microbatch_losses).mean().item())
        else:
            schedule.step()
        if dp_group is not None:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp_group)
        optimizer.step()

    # Every rank reports its pipeline's losses and its whole model (the stages' parameters).
    shared: list[list[float]] = [losses]
    dist.broadcast_object_list(shared, group=pp_group, group_src=args.stages - 1)
    stage_params = {name: p.detach() for name, p in module.named_parameters()}
    gathered: list[Any] = [None] * args.stages
    dist.all_gather_object(gathered, stage_params, group=pp_group)
    full = [item for params in gathered for item in params.items()]
    print_result(rank, args.backend, shared[0], full)
    end_process_group()


if __name__ == "__main__":
    main()
