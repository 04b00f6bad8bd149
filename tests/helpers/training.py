"""Training helpers for tests: start `gradserver worker` training processes, compare their
checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from gradserver.train.checkpoint import Checkpoint, load_checkpoint

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
    """`ranks` checkpoints in `out` (whatever their workers' names) hold bit-identical weights
    (C-DDP-001); returns them."""
    paths = sorted(out.glob("checkpoint-*.pt"))
    assert len(paths) == ranks, [p.name for p in paths]
    return assert_identical(paths)


def assert_identical(paths: list[Path]) -> list[Checkpoint]:
    """The checkpoints at `paths` hold bit-identical weights; returns them."""
    states = [load_checkpoint(p) for p in paths]
    for name, tensor in states[0].model_state.items():
        for path, other in zip(paths[1:], states[1:], strict=True):
            assert torch.equal(tensor, other.model_state[name]), f"{name} differs: {paths[0]} vs {path}"
    return states


def tiny_training(steps: int) -> tuple[str, ...]:
    """The flags of a quick training job that `launch` and `worker` share: the tiny model, batches
    of 2, `steps` steps."""
    return ("--model", "tiny", "--batch-size", "2", "--steps", str(steps))


def train_worker(
    processes: ProcessGroup,
    address: str,
    name: str,
    *flags: str,
    steps: int = 2,
    threads: str | None = "1",
) -> ManagedProcess:
    """A tiny training worker; `threads` is its OMP_NUM_THREADS (None: unset, the worker chooses)."""
    return processes.gradserver(
        "worker",
        "--coordinator",
        address,
        *tiny_training(steps),
        *flags,
        name=name,
        env={"OMP_NUM_THREADS": threads},
    )
