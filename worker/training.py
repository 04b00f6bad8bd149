"""The training job: a model trained on the shipped corpus through any GradientBackend.

Every worker builds the same model from the same seed, takes its interleaved shard of each step's
global batch (from the coordinator for the remote backend), and runs DistributedTrainer steps.
With an output directory it appends one line per step to metrics.jsonl and saves a per-rank
checkpoint (`checkpoint-rank{r}.pt`) that `resume` continues from, data position included.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gradserver.common.errors import (
    CoordinatorShutdownError,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
)
from gradserver.common.logs import set_log_context

from .backends import GradientBackend
from .checkpoint import load_checkpoint, save_checkpoint
from .corpus import TokenWindows, corpus_bytes
from .metrics_log import open_metrics_log
from .model import TransformerLM, model_config
from .trainer import DistributedTrainer, StepResult

log = logging.getLogger("gradserver.worker")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "small"
    steps: int = 50
    batch_size: int = 8
    seq_len: int = 0
    accumulation_steps: int = 1
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    seed: int = 0
    out: str = ""
    resume: bool = False
    checkpoint_every: int = 0
    device: str = "auto"
    reconnect_timeout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "accumulation_steps"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.lr <= 0 or self.max_grad_norm < 0 or self.seq_len < 0 or self.checkpoint_every < 0:
            raise InvalidArgumentError(
                "--lr must be positive; --max-grad-norm, --seq-len, --checkpoint-every >= 0"
            )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgumentError(f"--device {name!r}: {exc}") from None


def _rejoin(trainer: DistributedTrainer, backend: GradientBackend, lost: UnavailableError) -> None:
    """Rejoins a (restarted) coordinator and lines this worker up with the others: a worker that
    applied one step more than the slowest undoes it, so the step in flight counts for all or
    none."""
    log.warning("coordinator lost (%s); rejoining", lost.message)
    resume = backend.reconnect(trainer.step)
    if resume is None or resume == trainer.step:
        return
    if resume == trainer.step - 1:
        trainer.rollback()
        log.warning("rolled back step %d: not every worker applied it", resume)
        return
    raise InternalError(f"cannot resume at step {resume}: this worker has applied {trainer.step} steps")


def checkpoint_path(out: str, rank: int) -> Path:
    return Path(out) / f"checkpoint-rank{rank}.pt"


def train(
    backend: GradientBackend,
    config: TrainConfig,
    on_step: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """Runs steps until `config.steps` (counting steps restored from a checkpoint)."""
    device = resolve_device(config.device)
    cfg = model_config(config.model)
    seq_len = config.seq_len or cfg.max_seq_len
    model = TransformerLM(cfg, seed=config.seed).to(device)
    reconnect = config.reconnect_timeout > 0 and backend.can_reconnect
    trainer = DistributedTrainer(
        model, backend, lr=config.lr, max_grad_norm=config.max_grad_norm or None, keep_snapshot=reconnect
    )
    data = TokenWindows(corpus_bytes(), seq_len)
    if config.resume and config.out and checkpoint_path(config.out, backend.rank).exists():
        ckpt = load_checkpoint(checkpoint_path(config.out, backend.rank))
        if ckpt.model_config != cfg:
            raise InvalidArgumentError(f"checkpoint is of model {ckpt.model_config.name}, not {cfg.name}")
        model.load_state_dict(ckpt.model_state)
        trainer.optimizer.load_state_dict(ckpt.optimizer_state)
        trainer.step = ckpt.data_position
    metrics = open_metrics_log(config.out)
    results = []
    per_worker = config.batch_size * config.accumulation_steps
    try:
        while trainer.step < config.steps:
            step = trainer.step
            set_log_context(step=step)
            try:
                indices = backend.shard(step, data.num_samples, per_worker)
                micro = [
                    data.batch(indices[i * config.batch_size : (i + 1) * config.batch_size])
                    for i in range(config.accumulation_steps)
                ]
                result = trainer.train_step(micro)
            except UnavailableError as exc:
                if not reconnect or isinstance(exc, CoordinatorShutdownError):
                    raise
                _rejoin(trainer, backend, exc)
                continue
            results.append(result)
            if metrics is not None:
                entry = {
                    "time": time.time(),
                    "worker_id": backend.rank,
                    "backend": backend.name,
                    "world_size": backend.world_size,
                    **dataclasses.asdict(result),
                    "tokens_per_s": result.tokens / result.seconds,
                }
                metrics.write(json.dumps(entry) + "\n")
            if on_step is not None:
                on_step(result)
            every = config.checkpoint_every
            if config.out and every and (step + 1) % every == 0:
                save_checkpoint(
                    checkpoint_path(config.out, backend.rank), model, trainer.optimizer, step, step + 1
                )
        if config.out and results:
            save_checkpoint(
                checkpoint_path(config.out, backend.rank),
                model,
                trainer.optimizer,
                trainer.step - 1,
                trainer.step,
            )
    finally:
        trainer.close()
        if metrics is not None:
            metrics.close()
    return results
