"""The job fingerprint: every setting that must be equal across a job's workers, as strings.

A worker sends it at Join; the coordinator takes the first joiner's map as the job's and refuses
a joiner whose map differs, naming each differing field with both values. Checkpoints record it
too, so `--resume` refuses a checkpoint of a different job. Values are plain `str()` of the
setting (floats as Python prints them), so the coordinator can show them without decoding.

This module does not import torch at import time: the synthetic job never loads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from gradserver.common import codec
from gradserver.common.components import NonBlockComponent

if TYPE_CHECKING:
    from .synthetic import ModelShape
    from .training import TrainConfig

# The default wire dtype; the worker CLI puts its --wire-dtype (and --error-feedback) in the map.
WIRE_DTYPE = "float32"

# Fields that were renamed, old -> new: a checkpoint written before the rename still resumes.
RENAMED_FIELDS = {"backend": "engine"}

# Fields a resumed worker may change from its checkpoint's job: it continues to a new step count.
RESUMABLE_CHANGES = frozenset({"steps", "check_state_every"})


def _text(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(_text(v) for v in value)
    return str(value)


def _common(job: str, engine: str) -> dict[str, str]:
    return {
        "job": job,
        "engine": engine,
        "protocol_version": str(codec.PROTOCOL_VERSION),
        "wire_dtype": WIRE_DTYPE,
    }


def with_current_names(fingerprint: Mapping[str, str]) -> dict[str, str]:
    """`fingerprint` (a checkpoint's, possibly older than a rename) under today's field names."""
    return {RENAMED_FIELDS.get(name, name): value for name, value in fingerprint.items()}


def training_fingerprint(config: TrainConfig, *, engine: str) -> dict[str, str]:
    """The fingerprint of a training job: model (every field), seed, optimizer, clipping, batch,
    accumulation, sequence length, data set (name, size, digest), steps and step mode, and the
    outer-step settings of a job that has them."""
    from .corpus import CORPUS_NAME, corpus_bytes, corpus_digest
    from .model import model_config
    from .trainer import ADAMW_BETAS, ADAMW_EPS, DEFAULT_WEIGHT_DECAY

    model = model_config(config.model)
    seq_len = config.seq_len or model.max_seq_len
    data_bytes = len(corpus_bytes())
    fingerprint = _common("train", engine)
    for field in dataclasses.fields(model):
        fingerprint[f"model.{field.name}"] = _text(getattr(model, field.name))
    fingerprint.update(
        {
            "seed": _text(config.seed),
            "steps": _text(config.steps),
            "batch_size": _text(config.batch_size),
            "accumulation_steps": _text(config.accumulation_steps),
            "seq_len": _text(seq_len),
            "optimizer": "AdamW",
            "lr": _text(config.lr),
            "betas": _text(ADAMW_BETAS),
            "eps": _text(ADAMW_EPS),
            "weight_decay": _text(DEFAULT_WEIGHT_DECAY),
            "max_grad_norm": _text(config.max_grad_norm),
            "data.name": CORPUS_NAME,
            "data.bytes": _text(data_bytes),
            "data.sha256": corpus_digest(),
            "data.samples": _text((data_bytes - 1) // seq_len),
            # Rejoin mode adds a commit round to every step: all workers must do it or none.
            "all_or_none_steps": _text(config.reconnect_timeout > 0),
            # Every worker meets at the same state-check barriers.
            "check_state_every": _text(config.check_state_every),
        }
    )
    if config.outer_steps:
        # Only with outer steps, so that every other job's fingerprint (and checkpoint) is as before.
        from .outer_steps import OUTER_OPTIMIZER

        fingerprint.update(
            {
                "outer_steps": _text(config.outer_steps),
                "fragments": _text(config.fragments),
                "outer_optimizer": OUTER_OPTIMIZER,
                "outer_lr": _text(config.outer_lr),
                "outer_momentum": _text(config.outer_momentum),
            }
        )
        # Only when set, so that the jobs from before they existed keep their fingerprints.
        if config.outer_delay:
            fingerprint["outer_delay"] = _text(config.outer_delay)
        if config.outer_keep_local:
            fingerprint["outer_keep_local"] = _text(config.outer_keep_local)
        if config.outer_flush != "mean":
            fingerprint["outer_flush"] = config.outer_flush
    return fingerprint


def synthetic_fingerprint(
    shape: ModelShape, non_block: Iterable[NonBlockComponent], *, steps: int, seed: int
) -> dict[str, str]:
    """The fingerprint of a synthetic exchange: the shape, the tensors sent, steps and seed
    (the reference check assumes every worker draws from the same seeds)."""
    fingerprint = _common("synthetic", "remote")
    for field in dataclasses.fields(shape):
        fingerprint[f"shape.{field.name}"] = _text(getattr(shape, field.name))
    fingerprint.update(
        {
            "non_block": ",".join(c.name.lower() for c in non_block),
            "steps": _text(steps),
            "seed": _text(seed),
        }
    )
    return fingerprint


def differences(
    expected: Mapping[str, str], got: Mapping[str, str], *, ignore: Iterable[str] = ()
) -> list[str]:
    """`field got != expected` for each field that differs (missing shows as '<unset>')."""
    skipped = set(ignore)
    out = []
    for name in sorted((set(expected) | set(got)) - skipped):
        a, b = got.get(name, "<unset>"), expected.get(name, "<unset>")
        if a != b:
            out.append(f"{name} {a} != {b}")
    return out
