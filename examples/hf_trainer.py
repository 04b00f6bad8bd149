"""Hugging Face `Trainer` on the gradserver backend: a tiny GPT-2 built from a `GPT2Config` (no
download) trained for a few steps on synthetic token ids.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --backend gloo
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --backend gradserver

`TrainingArguments(ddp_backend=...)` refuses backend names it does not know on CPU, so the script
creates the process group itself first; the Trainer then uses that group as it finds it. Each rank
prints one RESULT line (its losses and a digest of the parameters, see examples/_result.py).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from _result import end_process_group, print_result
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class TokenIds(Dataset[dict[str, torch.Tensor]]):
    """Synthetic sequences with a pattern (each token follows from the previous one), so the loss
    falls; the same on every rank: the Trainer's DistributedSampler gives each rank its part."""

    def __init__(self, samples: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1000)
        starts = torch.randint(0, vocab, (samples, 1), generator=generator)
        self.ids = (starts + 3 * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class LossLog(TrainerCallback):
    """Keeps every logged training loss (logging_steps=1: one per step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(
        self, args: object, state: object, control: object, logs: dict[str, float] | None = None, **kw: object
    ) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gradserver", help="gloo or gradserver")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # first: the Trainer then finds the group ready
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    log = LossLog()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
            dataloader_num_workers=0,
            ddp_find_unused_parameters=False,
        )
        data = TokenIds(args.steps * args.batch_size * world, 16, config.vocab_size)
        Trainer(model=model, args=training, train_dataset=data, callbacks=[log]).train()
    print_result(rank, args.backend, log.losses, model.named_parameters())
    end_process_group()


if __name__ == "__main__":
    main()
