"""Checkpoints: model, optimizer, step and data position, saved with torch.save and loaded with
`weights_only=True`, so loading a checkpoint from elsewhere cannot run code.

Format 2 also records who wrote it (the node id, or `rank{r}` where ranks are fixed) and the job
fingerprint, so a resume can refuse another worker's checkpoint or another job's. Format 1 files
(without them) still load, with both left empty. A job with outer steps (train/outer_steps.py) adds
`outer`: the global weights and each fragment's outer optimizer state; without it the key is absent
and `outer_state` loads empty."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradserver.common.errors import InvalidArgumentError

from .model import ModelConfig, TransformerLM


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    step: int
    data_position: int
    model_config: ModelConfig
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    node_id: str = ""
    fingerprint: Mapping[str, str] = dataclasses.field(default_factory=dict)
    outer_state: dict[str, Any] = dataclasses.field(default_factory=dict)


FORMATS = (1, 2)


def save_checkpoint(
    path: str | Path,
    model: TransformerLM,
    optimizer: torch.optim.Optimizer,
    step: int,
    data_position: int,
    *,
    node_id: str = "",
    fingerprint: Mapping[str, str] | None = None,
    outer_state: Mapping[str, Any] | None = None,
) -> None:
    """Writes atomically (a temporary file renamed over the target)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": 2,
        "step": step,
        "data_position": data_position,
        "model_config": dataclasses.asdict(model.config),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "node_id": node_id,
        "fingerprint": dict(fingerprint or {}),
    }
    if outer_state is not None:
        payload["outer"] = dict(outer_state)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> Checkpoint:
    try:
        # mmap: checking a checkpoint before connecting (then loading it again) reads little.
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise InvalidArgumentError(f"no checkpoint at {path}") from None
    except Exception as exc:
        raise InvalidArgumentError(f"{path} is not a readable gradserver checkpoint: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") not in FORMATS:
        raise InvalidArgumentError(f"{path} is not a gradserver checkpoint (format 1 or 2)")
    return Checkpoint(
        step=int(payload["step"]),
        data_position=int(payload["data_position"]),
        model_config=ModelConfig(**payload["model_config"]),
        model_state=payload["model"],
        optimizer_state=payload["optimizer"],
        node_id=str(payload.get("node_id", "")),
        fingerprint={str(k): str(v) for k, v in payload.get("fingerprint", {}).items()},
        outer_state=dict(payload.get("outer", {})),
    )
