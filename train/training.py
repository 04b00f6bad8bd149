"""The training job: a model trained on the shipped corpus through any AveragingEngine.

Every worker builds the same model from the same seed, takes its interleaved sample ranges of each step's
global batch (from the coordinator for the remote engine), and runs DistributedTrainer steps.
With an output directory it appends one line per step to metrics.jsonl and saves a checkpoint
per worker identity (`checkpoint-{node_id}.pt`, or `checkpoint-rank{r}.pt` without a node id)
that `resume` continues from, data position included. A resume finds the checkpoint by that
identity, never by join order, and refuses rather than silently starting again at step 0: a
checkpoint of another identity or of another job (fingerprint) is an error naming what differs.
With `outer_steps` (DiLoCo) an OuterTrainer (train/outer_steps.py) runs the steps instead: each is
H/F inner steps and one exchange, `steps` counts inner steps, and the checkpoint adds the outer state.
With F > 1 fragments, F - 1 flush steps follow the last inner step (`TrainConfig.flush_steps`): an
exchange each, of every fragment not exchanged at the last step, applied as the workers' mean
weights, so the model ends as the global weights. They are steps like the others (engine step
numbers, metrics lines, state checks, checkpoints, rejoining, live recovery) but take no data:
their metrics lines say `"flush": true`, with 0 tokens and no loss.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from gradserver.common.errors import (
    ConnectionLost,
    InternalError,
    InvalidArgumentError,
    JobEnded,
)
from gradserver.common.logs import set_log_context
from gradserver.worker import StateSnapshot, decode_extra, encode_extra, state_digest

from .checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from .corpus import TokenWindows, corpus_bytes
from .engines import AveragingEngine
from .fingerprint import RESUMABLE_CHANGES, differences, training_fingerprint, with_current_names
from .metrics_log import open_metrics_log
from .model import TransformerLM, model_config
from .outer_steps import (
    DEFAULT_OUTER_LR,
    DEFAULT_OUTER_MOMENTUM,
    OuterSettings,
    OuterTrainer,
    check_outer_settings,
)
from .trainer import OUTER_FIELDS, DistributedTrainer, StepResult, Trainer

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
    node_id: str = ""
    check_state_every: int = 0
    # Outer steps (train/outer_steps.py; 0: off): then `steps` counts inner steps, and
    # checkpoint_every and check_state_every count trainer steps (exchanges, the flush's too).
    outer_steps: int = 0
    fragments: int = 1
    outer_lr: float = DEFAULT_OUTER_LR
    outer_momentum: float = DEFAULT_OUTER_MOMENTUM
    outer_delay: int = 0
    outer_keep_local: float = 0.0
    outer_flush: str = "mean"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "accumulation_steps"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if (
            self.lr <= 0
            or self.max_grad_norm < 0
            or self.seq_len < 0
            or self.checkpoint_every < 0
            or self.check_state_every < 0
        ):
            raise InvalidArgumentError(
                "--lr must be positive; --max-grad-norm, --seq-len, --checkpoint-every, "
                "--check-state-every >= 0"
            )
        if self.node_id and not _IDENTITY.fullmatch(self.node_id):
            raise InvalidArgumentError(
                f"--node-id {self.node_id!r} names checkpoint files: use letters, digits, '.', '_', '-'"
            )
        if self.resume and not self.out:
            raise InvalidArgumentError("--resume needs --out, the directory that holds the checkpoint")
        check_outer_settings(
            self.outer_steps,
            self.fragments,
            self.outer_lr,
            self.outer_momentum,
            steps=self.steps,
            model=self.model,
            delay=self.outer_delay,
            keep_local=self.outer_keep_local,
            flush=self.outer_flush,
        )

    @property
    def outer(self) -> OuterSettings | None:
        if not self.outer_steps:
            return None
        return OuterSettings(
            self.outer_steps,
            self.fragments,
            self.outer_lr,
            self.outer_momentum,
            self.outer_delay,
            self.outer_keep_local,
            self.outer_flush,
        )

    @property
    def inner_per_step(self) -> int:
        """Inner steps per trainer step: H / F with outer steps, else 1."""
        outer = self.outer
        return outer.inner_per_exchange if outer is not None else 1

    @property
    def trainer_steps(self) -> int:
        """Trainer steps with inner steps (each an engine step, an exchange): `steps` / inner
        steps per step."""
        return self.steps // self.inner_per_step

    @property
    def flush_steps(self) -> int:
        """Steps after the last inner step (OuterSettings.flush_steps; none without fragments)."""
        outer = self.outer
        return outer.flush_steps if outer is not None else 0

    @property
    def total_steps(self) -> int:
        """Engine steps the job runs (a coordinator's --max-steps): the trainer steps, then the
        flush's."""
        return self.trainer_steps + self.flush_steps


_IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def prepare_training() -> None:
    """Does the slow first-time work of a training process (torch's optimizers import their
    compiler support on first use: ~0.9 s here) before it joins: a worker that joins a running
    job keeps the others waiting from its Join until its first contribution."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not _DEVICE.fullmatch(name):
        raise InvalidArgumentError(f"--device {name!r} must be cpu, cuda, cuda:N or auto")
    return torch.device(name)


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def _rejoin(trainer: Trainer, engine: AveragingEngine, lost: ConnectionLost) -> None:
    """Rejoins a (restarted) coordinator and lines this worker up with the others: a worker that
    applied one step more than the slowest undoes it, so the step in flight counts for all or
    none."""
    log.warning("coordinator lost (%s); rejoining", lost.message)
    resume = engine.reconnect(trainer.step)
    if resume is None or resume == trainer.step:
        return
    if resume == trainer.step - 1:
        trainer.rollback()
        log.warning("rolled back step %d: not every worker applied it", resume)
        return
    raise InternalError(f"cannot resume at step {resume}: this worker has applied {trainer.step} steps")


def _snapshot(trainer: Trainer) -> StateSnapshot:
    return StateSnapshot(trainer.step, trainer.state_tensors(), encode_extra(trainer.state_extra()))


def _recover(trainer: Trainer, engine: AveragingEngine, stale: Checkpoint | None) -> None:
    """Takes the state of a live replica (weights, optimizer state, step and so the data
    position, RNG state), checks that what was loaded is bit for bit what the donor holds."""
    step = engine.recovery_step
    if stale is not None:
        log.warning(
            "joined a running job at step %s: its checkpoint of step %d is not used; the state "
            "comes from a live worker",
            step,
            stale.data_position,
        )
    got = engine.recover()
    trainer.load_state(got.step, got.tensors, decode_extra(got.extra))
    loaded = state_digest(trainer.state_tensors())
    if loaded != got.digest:
        raise InternalError(
            f"the state taken from worker {got.donor} at step {got.step} loaded as digest "
            f"{loaded:#018x}, not its {got.digest:#018x}"
        )
    log.warning(
        "joined the running job at step %d: took the state from worker %d (%d bytes in %.2f s, "
        "digest %#018x)",
        got.step,
        got.donor,
        got.nbytes,
        got.seconds,
        got.digest,
    )


def _state_check_due(
    step: int, config: TrainConfig, engine: AveragingEngine, recovery_step: int | None
) -> bool:
    """Whether every worker compares state digests at this step's boundary: every
    --check-state-every steps, and the step after a replacement's first (every member has heard
    of it by then; the replacement knows its own)."""
    every = config.check_state_every
    if every and step % every == 0:
        return True
    if recovery_step is not None and step == recovery_step + 1:
        return True
    return step in engine.state_checks()


def _metrics_entry(result: StepResult, engine: AveragingEngine) -> dict[str, object]:
    """A step's metrics.jsonl line. A flush step trained nothing: its line leaves its NaN losses
    out (NaN is not JSON, and loss.png skips a line without a global loss)."""
    left_out = ("loss", "global_loss") if result.flush else ()
    return {
        "time": time.time(),
        "worker_id": engine.rank,
        "engine": engine.name,
        "world_size": engine.world_size,
        **{
            k: v
            for k, v in dataclasses.asdict(result).items()
            if (v is not None or k not in OUTER_FIELDS) and k not in left_out
        },
        "tokens_per_s": result.tokens / result.seconds,
    }


def checkpoint_identity(config: TrainConfig, rank: int) -> str:
    """Whose checkpoint: the node id when given, else the rank (stable only where ranks are
    fixed by configuration, not by join order)."""
    return config.node_id or f"rank{rank}"


def checkpoint_path(out: str, identity: str) -> Path:
    return Path(out) / f"checkpoint-{identity}.pt"


def find_resume_checkpoint(
    config: TrainConfig, identity: str, fingerprint: Mapping[str, str]
) -> Checkpoint | None:
    """The checkpoint `--resume` continues from, checked against this worker and job; None when
    --out holds no checkpoint at all. Raises naming the file and what is wrong otherwise."""
    path = checkpoint_path(config.out, identity)
    if not path.exists():
        others = sorted(p.name for p in Path(config.out).glob("checkpoint-*.pt"))
        if others:
            raise InvalidArgumentError(
                f"--resume: {config.out} has no checkpoint of node {identity!r} ({path.name}) but has "
                f"{', '.join(others)}: start this worker with the --node-id that wrote its checkpoint"
            )
        log.warning("--resume: no checkpoint in %s yet; starting at step 0", config.out)
        return None
    ckpt = load_checkpoint(path)
    if ckpt.node_id and ckpt.node_id != identity:
        raise InvalidArgumentError(f"{path} was written by node {ckpt.node_id!r}, not {identity!r}")
    if ckpt.fingerprint:
        changed = differences(with_current_names(ckpt.fingerprint), fingerprint, ignore=RESUMABLE_CHANGES)
        if changed:
            raise InvalidArgumentError(f"{path} is from a different job: {'; '.join(changed)} (checkpoint)")
    cfg = model_config(config.model)
    if ckpt.model_config != cfg:
        raise InvalidArgumentError(f"{path} is of model {ckpt.model_config.name}, not {cfg.name}")
    _check_flush_resume(path, ckpt, config)
    return ckpt


def _check_flush_resume(path: Path, ckpt: Checkpoint, config: TrainConfig) -> None:
    """Refuses to continue a job to another step count from within or after its final flush:
    inner steps would then come after flush steps, and step numbers (so data positions and
    `inner_steps`) assume every inner step comes first. Before the flush the count may change."""
    saved = ckpt.fingerprint.get("steps")
    if not config.flush_steps or saved is None or int(saved) == config.steps:
        return
    ended = int(saved) // config.inner_per_step
    if ckpt.data_position > ended:
        raise InvalidArgumentError(
            f"--resume: {path} was saved in the final flush of a job of --steps {saved} (at step "
            f"{ckpt.data_position}, after its {ended} trainer steps): it can only finish that job "
            f"(--steps {saved}), not continue to --steps {config.steps}"
        )


def train(
    engine: AveragingEngine,
    config: TrainConfig,
    on_step: Callable[[StepResult], None] | None = None,
) -> list[StepResult]:
    """Runs trainer steps until `config.total_steps` (counting steps restored from a checkpoint):
    `config.steps`, or with outer steps `config.steps` inner steps and then the flush's steps."""
    device = resolve_device(config.device)
    cfg = model_config(config.model)
    seq_len = config.seq_len or cfg.max_seq_len
    model = TransformerLM(cfg, seed=config.seed).to(device)
    reconnect = config.reconnect_timeout > 0 and engine.can_reconnect
    outer = config.outer
    trainer: Trainer
    if outer is not None:
        trainer = OuterTrainer(
            model,
            engine,
            outer,
            lr=config.lr,
            max_grad_norm=config.max_grad_norm or None,
            keep_snapshot=reconnect,
            trainer_steps=config.trainer_steps,
        )
    else:
        trainer = DistributedTrainer(
            model, engine, lr=config.lr, max_grad_norm=config.max_grad_norm or None, keep_snapshot=reconnect
        )
    data = TokenWindows(corpus_bytes(), seq_len)
    identity = checkpoint_identity(config, engine.rank)
    fingerprint = training_fingerprint(config, engine=engine.name)
    ckpt = find_resume_checkpoint(config, identity, fingerprint) if config.resume else None
    recovery_step = engine.recovery_step
    if recovery_step is not None:
        # Joined a running job: the live replicas' state, never a checkpoint that may be stale.
        _recover(trainer, engine, ckpt)
    elif ckpt is not None:
        model.load_state_dict(ckpt.model_state)
        trainer.optimizer.load_state_dict(ckpt.optimizer_state)
        trainer.step = ckpt.data_position
        if isinstance(trainer, OuterTrainer):
            trainer.load_outer_state(ckpt.outer_state)
        log.info("resumed %s at step %d", checkpoint_path(config.out, identity), trainer.step)
    engine.offer_state(lambda: _snapshot(trainer))

    def save(step: int, data_position: int) -> None:
        save_checkpoint(
            checkpoint_path(config.out, identity),
            model,
            trainer.optimizer,
            step,
            data_position,
            node_id=identity,
            fingerprint=fingerprint,
            outer_state=trainer.outer_state() if isinstance(trainer, OuterTrainer) else None,
        )

    metrics = open_metrics_log(config.out)
    results = []
    per_worker = config.batch_size * config.accumulation_steps
    # With outer steps a trainer step takes H / F inner steps' batches, asked for at once: one
    # request per engine step, and consecutive steps still walk the data set without overlap.
    per_step = per_worker * config.inner_per_step
    micro_per_step = config.accumulation_steps * config.inner_per_step
    try:
        # One loop for the flush's steps too: a worker that resumes or joins within the flush
        # takes part in the rest of it, and each gets the same rejoining, checks and checkpoints.
        while trainer.step < config.total_steps:
            step = trainer.step
            set_log_context(step=step)
            try:
                if _state_check_due(step, config, engine, recovery_step):
                    engine.check_state(step, state_digest(trainer.replicated_tensors()))
                if isinstance(trainer, OuterTrainer) and trainer.flushing:
                    if step == config.trainer_steps:
                        log.info(
                            "inner steps done; flush steps %d..%d: the workers' mean weights for "
                            "every fragment not exchanged at step %d",
                            step,
                            config.total_steps - 1,
                            step - 1,
                        )
                    result = trainer.flush_step()
                else:
                    indices = engine.sample_indices(step, data.num_samples, per_step)
                    micro = [
                        data.batch(indices[i * config.batch_size : (i + 1) * config.batch_size])
                        for i in range(micro_per_step)
                    ]
                    result = trainer.train_step(micro)
            # By meaning: only a lost coordinator is worth rejoining; the end of the job, a failed
            # step (every worker sees the same one) or a refusal ends training with its error.
            except ConnectionLost as exc:
                if not reconnect or isinstance(exc, JobEnded):
                    raise
                _rejoin(trainer, engine, exc)
                continue
            results.append(result)
            if metrics is not None:
                metrics.write(json.dumps(_metrics_entry(result, engine)) + "\n")
            if on_step is not None:
                on_step(result)
            every = config.checkpoint_every
            if config.out and every and (step + 1) % every == 0:
                save(step, step + 1)
        if config.out and results:
            save(trainer.step - 1, trainer.step)
    finally:
        trainer.close()
        if metrics is not None:
            metrics.close()
    return results
