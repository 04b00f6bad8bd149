"""Checkpoints: model, optimizer, step and data position, saved with torch.save and loaded with
`weights_only=True`, so loading a checkpoint from elsewhere cannot run code."""

from __future__ import annotations

import dataclasses
import os
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


def save_checkpoint(
    path: str | Path, model: TransformerLM, optimizer: torch.optim.Optimizer, step: int, data_position: int
) -> None:
    """Writes atomically (a temporary file renamed over the target)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": 1,
        "step": step,
        "data_position": data_position,
        "model_config": dataclasses.asdict(model.config),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> Checkpoint:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InvalidArgumentError(f"no checkpoint at {path}") from None
    except Exception as exc:
        raise InvalidArgumentError(f"{path} is not a readable gradserver checkpoint: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != 1:
        raise InvalidArgumentError(f"{path} is not a gradserver checkpoint (format 1)")
    return Checkpoint(
        step=int(payload["step"]),
        data_position=int(payload["data_position"]),
        model_config=ModelConfig(**payload["model_config"]),
        model_state=payload["model"],
        optimizer_state=payload["optimizer"],
    )
