"""Ray Train on the gradserver backend: `TorchTrainer` with `TorchConfig(backend="gradserver")`
trains a small DDP model on synthetic data in N Ray workers of a local Ray instance.

    python examples/ray_train.py --backend gloo
    python examples/ray_train.py --backend gradserver

Ray creates the process group in each worker itself (rank 0's embedded gradserver coordinator is
published through the torch store, as under torchrun). Each worker prints one RESULT line (its
losses and a digest of the parameters, see examples/_result.py); Ray relays it with a prefix.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import ray
import torch
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

EXAMPLES = Path(__file__).resolve().parent


def train_loop(config: dict[str, Any]) -> None:
    import torch.distributed as dist
    from _result import print_result
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    width, batch = config["width"], config["batch_size"]
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    losses = []
    for _ in range(config["steps"]):
        x = torch.randn(batch, width, generator=generator)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print_result(rank, config["backend"], losses, model.module.named_parameters())
    # Leave together (examples/_result.py, end_process_group); Ray ends the group and the process.
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gradserver", help="gloo or gradserver")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8, help="per worker")
    args = parser.parse_args()

    # The workers import examples/_result.py; RAY_DEDUP_LOGS=0 keeps every worker's RESULT line.
    path = os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=args.workers, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={**vars(args)},
            torch_config=TorchConfig(backend=args.backend),
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
