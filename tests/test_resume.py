"""Resuming a job: each worker finds its own checkpoint by its node id whatever the order in which
the workers join again, and refuses another worker's checkpoint before it connects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradserver.train.checkpoint import load_checkpoint

from .helpers.processes import ManagedProcess, ProcessGroup
from .helpers.training import assert_identical, train_worker

pytestmark = pytest.mark.processes


def _start_in_order(
    processes: ProcessGroup, coord: ManagedProcess, address: str, order: list[str], out: Path, *flags: str
) -> dict[str, ManagedProcess]:
    """Workers named `order`, each with its own --out, joined in that order (each start waits
    until the coordinator has logged the previous worker's join)."""
    workers = {}
    for i, name in enumerate(order):
        workers[name] = train_worker(
            processes, address, name, "--node-id", name, "--out", str(out / name), *flags, steps=4
        )
        coord.wait_for(rf"worker {i} joined: node '{name}'", timeout=120)
    return workers


def test_reversed_restart_resumes_each_worker_from_its_own_checkpoint(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    coord, address = processes.coordinator("--world-size", "2", "--max-steps", "2")
    # The first run is cut off after 2 of 4 steps (--max-steps 2): a job that was interrupted,
    # with a checkpoint after every step.
    first = _start_in_order(processes, coord, address, ["a", "b"], tmp_path, "--checkpoint-every", "1")
    for w in first.values():
        w.wait(240)
    assert coord.wait(60) == 0, coord.output
    for name in ("a", "b"):
        ckpt = load_checkpoint(tmp_path / name / f"checkpoint-{name}.pt")
        assert (ckpt.node_id, ckpt.data_position) == (name, 2)
    coord2, address2 = processes.coordinator("--world-size", "2")
    second = _start_in_order(processes, coord2, address2, ["b", "a"], tmp_path, "--resume")
    for name, w in second.items():
        assert w.wait(240) == 0, w.output
        w.wait_for(rf"resumed {tmp_path / name}/checkpoint-{name}.pt at step 2", timeout=5)
    states = assert_identical([tmp_path / n / f"checkpoint-{n}.pt" for n in ("a", "b")])
    assert {(s.step, s.data_position) for s in states} == {(3, 4)}
    for name in ("a", "b"):
        steps = [
            json.loads(line)["step"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        assert steps == [0, 1, 2, 3], (name, steps)


def test_resume_refuses_another_workers_checkpoint(processes: ProcessGroup, tmp_path: Path) -> None:
    """b's directory holds only a's checkpoint: b refuses before it connects, never starting
    again at step 0."""
    _coord, address = processes.coordinator("--world-size", "1", "--max-steps", "1")
    a = train_worker(processes, address, "a", "--node-id", "a", "--out", str(tmp_path), steps=1)
    assert a.wait(240) == 0, a.output
    b = train_worker(processes, "127.0.0.1:9", "b", "--node-id", "b", "--out", str(tmp_path), "--resume")
    assert b.wait(120) == 2, b.output
    assert f"{tmp_path} has no checkpoint of node 'b' (checkpoint-b.pt) but has checkpoint-a.pt" in b.output
