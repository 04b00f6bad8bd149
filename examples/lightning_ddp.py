"""PyTorch Lightning's DDP on the gradserver backend: a small regression model trained by a
`Trainer` with `DDPStrategy(process_group_backend="gradserver")`, on synthetic data. Lightning
reads torchrun's environment, so only the backend string differs between

    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --backend gloo
    torchrun --standalone --nproc-per-node 2 examples/lightning_ddp.py --backend gradserver

Each rank prints one RESULT line (its losses and a digest of the parameters, see
examples/_result.py).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import lightning as L
import torch
from _result import end_process_group, print_result
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def synthetic_data(samples: int, width: int) -> TensorDataset:
    """The same data set on every rank; Lightning's DistributedSampler gives each rank its part."""
    generator = torch.Generator().manual_seed(1000)
    x = torch.randn(samples, width, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gradserver", help="gloo or gradserver")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--devices", type=int, default=2, help="ranks on this node (torchrun's)")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial parameters on every rank
    model = Regression(args.width)
    data = DataLoader(
        synthetic_data(args.steps * args.batch_size * args.devices, args.width), args.batch_size
    )
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=DDPStrategy(process_group_backend=args.backend),
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(model, data)
    print_result(trainer.global_rank, args.backend, model.losses, model.named_parameters())
    end_process_group()  # Lightning leaves the group to the script


if __name__ == "__main__":
    main()
