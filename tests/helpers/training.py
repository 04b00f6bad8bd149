"""Training helpers for tests: start `gradserver worker --job train` processes, compare their
checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from gradserver.worker.checkpoint import Checkpoint, load_checkpoint

from .processes import ManagedProcess, ProcessGroup


def train_workers(
    processes: ProcessGroup, address: str, count: int, out: Path, *extra: str, steps: int, batch: int = 2
) -> list[ManagedProcess]:
    """`count` training worker processes (tiny model, one torch thread each) writing to `out`."""
    return [
        processes.gradserver(
            "worker",
            "--job",
            "train",
            "--coordinator",
            address,
            "--model",
            "tiny",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--out",
            str(out),
            *extra,
            name=f"w{i}",
            env={"OMP_NUM_THREADS": "1"},
        )
        for i in range(count)
    ]


def assert_identical_checkpoints(out: Path, ranks: int) -> list[Checkpoint]:
    """Every rank's checkpoint holds bit-identical weights (C-DDP-001); returns them."""
    states = [load_checkpoint(out / f"checkpoint-rank{r}.pt") for r in range(ranks)]
    for name, tensor in states[0].model_state.items():
        for rank, other in enumerate(states[1:], start=1):
            assert torch.equal(tensor, other.model_state[name]), (
                f"{name} differs between rank 0 and rank {rank}"
            )
    return states
