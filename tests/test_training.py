"""Distributed training through the coordinator: equivalence with a bigger batch, bit-identical
weights across worker processes (C-DDP-001), a falling loss, and resuming from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradserver.train.checkpoint import load_checkpoint
from gradserver.train.engines import CoordinatorEngine, LocalEngine, LocalHub
from gradserver.train.training import TrainConfig, train

from .helpers.server import connect_all, run_each
from .helpers.training import assert_identical_checkpoints, train_workers


def _train_remote(
    coordinator, world: int, batch: int, steps: int, tmp: Path
) -> list[dict[str, torch.Tensor]]:
    server = coordinator(world_size=world)
    clients = connect_all(server.address, world)
    config = TrainConfig(
        model="tiny", steps=steps, batch_size=batch, lr=1e-2, max_grad_norm=1.0, out=str(tmp)
    )
    try:
        run_each(clients, lambda c: train(CoordinatorEngine(c), config), timeout=300)
    finally:
        for c in clients:
            c.close()
    return [load_checkpoint(tmp / f"checkpoint-rank{r}.pt").model_state for r in range(world)]


def test_two_workers_match_one_worker_with_twice_the_batch(coordinator, tmp_path: Path) -> None:
    one = _train_remote(coordinator, 1, 8, 4, tmp_path / "one")
    two = _train_remote(coordinator, 2, 4, 4, tmp_path / "two")
    for name, weight in one[0].items():
        torch.testing.assert_close(
            two[0][name], weight, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
    for name in one[0]:
        assert torch.equal(two[0][name], two[1][name]), name


@pytest.mark.processes
def test_three_worker_processes_end_with_bit_identical_weights(processes, tmp_path: Path) -> None:
    """C-DDP-001, through the real CLIs."""
    coord, address = processes.coordinator("--world-size", "3", "--max-steps", "4")
    workers = train_workers(processes, address, 3, tmp_path, steps=4)
    for w in workers:
        assert w.wait(240) == 0, w.output
    assert coord.wait(60) == 0, coord.output
    states = assert_identical_checkpoints(tmp_path, 3)
    assert {s.step for s in states} == {3}
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted((e["worker_id"], e["step"]) for e in lines) == [(w, s) for w in range(3) for s in range(4)]
    by_step = {}
    for e in lines:
        by_step.setdefault(e["step"], set()).add(e["global_loss"])
    assert all(len(v) == 1 for v in by_step.values()), "every worker sees the same global loss"


def _train_local(world: int, config: TrainConfig) -> list:
    hub = LocalHub(world)
    results: dict[int, list] = {}

    import threading

    def worker(rank: int) -> None:
        results[rank] = train(LocalEngine(hub, rank), config)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(results) == world
    return results[0]


def test_loss_falls_on_the_shipped_corpus() -> None:
    results = _train_local(2, TrainConfig(model="tiny", steps=40, batch_size=8, lr=1e-2))
    first = sum(r.global_loss for r in results[:5]) / 5
    last = sum(r.global_loss for r in results[-5:]) / 5
    # Untrained, the loss is about ln(256) = 5.55 (uniform over bytes).
    assert results[0].global_loss > 5.0 and last < first - 1.0, (results[0].global_loss, first, last)


def test_resume_continues_the_same_loss_curve(tmp_path: Path) -> None:
    base = dict(model="tiny", batch_size=4, lr=1e-2, max_grad_norm=1.0)
    straight = _train_local(2, TrainConfig(steps=6, out=str(tmp_path / "straight"), **base))
    _train_local(2, TrainConfig(steps=3, out=str(tmp_path / "resumed"), **base))
    ckpt = load_checkpoint(tmp_path / "resumed" / "checkpoint-rank0.pt")
    assert (ckpt.step, ckpt.data_position) == (2, 3)
    resumed = _train_local(2, TrainConfig(steps=6, out=str(tmp_path / "resumed"), resume=True, **base))
    assert [r.step for r in resumed] == [3, 4, 5]
    for a, b in zip(straight[3:], resumed, strict=True):
        assert a.global_loss == pytest.approx(b.global_loss, rel=1e-6, abs=1e-6)
    final_a = load_checkpoint(tmp_path / "straight" / "checkpoint-rank0.pt").model_state
    final_b = load_checkpoint(tmp_path / "resumed" / "checkpoint-rank0.pt").model_state
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_equals_a_bigger_micro_batch() -> None:
    big = _train_local(1, TrainConfig(model="tiny", steps=3, batch_size=8, lr=1e-2))
    accumulated = _train_local(
        1, TrainConfig(model="tiny", steps=3, batch_size=4, accumulation_steps=2, lr=1e-2)
    )
    for a, b in zip(big, accumulated, strict=True):
        assert a.global_loss == pytest.approx(b.global_loss, rel=1e-4)


def test_checkpoints_load_without_pickle(tmp_path: Path) -> None:
    bad = tmp_path / "evil.pt"

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"format": 1, "payload": Evil()}, bad)
    from gradserver.common.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="not a readable gradserver checkpoint"):
        load_checkpoint(bad)


@pytest.mark.processes
@pytest.mark.parametrize("engine", ["remote", "gloo"])
def test_launch_trains_and_leaves_metrics_checkpoints_and_a_plot(
    processes, tmp_path: Path, engine: str
) -> None:
    launch = processes.gradserver(
        "launch",
        "--workers",
        "2",
        "--model",
        "tiny",
        "--steps",
        "5",
        "--engine",
        engine,
        "--out",
        str(tmp_path),
        "--no-progress",
        name="launch",
    )
    assert launch.wait(240) == 0, launch.output
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 10
    assert all(json.loads(line)["engine"] in ("remote", "torch.distributed") for line in lines)
    # Launched workers are named local-0..N-1 with either engine; checkpoints follow the name.
    assert (tmp_path / "checkpoint-local-0.pt").exists() and (tmp_path / "checkpoint-local-1.pt").exists()
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "plot in" in launch.output


def test_a_checkpoint_records_its_node_and_job_and_resume_checks_both(tmp_path: Path) -> None:
    from gradserver.common.errors import InvalidArgumentError
    from gradserver.train.fingerprint import training_fingerprint
    from gradserver.train.training import find_resume_checkpoint

    base = dict(model="tiny", batch_size=2, lr=1e-2, out=str(tmp_path), node_id="a")
    _train_local(1, TrainConfig(steps=1, **base))
    ckpt = load_checkpoint(tmp_path / "checkpoint-a.pt")
    job = training_fingerprint(TrainConfig(steps=1, **base), engine="local")
    assert ckpt.node_id == "a" and dict(ckpt.fingerprint) == job

    more_steps = TrainConfig(steps=5, resume=True, **base)
    resumed = find_resume_checkpoint(more_steps, "a", training_fingerprint(more_steps, engine="local"))
    assert resumed is not None and resumed.data_position == 1
    other_lr = TrainConfig(steps=5, resume=True, **{**base, "lr": 0.02})
    with pytest.raises(InvalidArgumentError, match=r"from a different job: lr 0.02 != 0.01 \(checkpoint\)"):
        find_resume_checkpoint(other_lr, "a", training_fingerprint(other_lr, engine="local"))
    (tmp_path / "checkpoint-a.pt").rename(tmp_path / "checkpoint-b.pt")
    with pytest.raises(InvalidArgumentError, match=r"checkpoint-b\.pt was written by node 'a', not 'b'"):
        find_resume_checkpoint(more_steps, "b", job)
    with pytest.raises(InvalidArgumentError, match=r"no checkpoint of node 'a'.*but has checkpoint-b\.pt"):
        find_resume_checkpoint(more_steps, "a", job)


def test_a_checkpoint_whose_fingerprint_still_says_backend_resumes_as_one_that_says_engine(
    tmp_path: Path,
) -> None:
    """The fingerprint's "backend" field is "engine" now: a checkpoint written before the rename
    still resumes, and still refuses another engine's job."""
    from gradserver.common.errors import InvalidArgumentError
    from gradserver.train.fingerprint import training_fingerprint
    from gradserver.train.training import find_resume_checkpoint

    base = dict(model="tiny", batch_size=2, lr=1e-2, out=str(tmp_path), node_id="a")
    _train_local(1, TrainConfig(steps=1, **base))
    path = tmp_path / "checkpoint-a.pt"
    payload = torch.load(path, weights_only=True)
    fingerprint = payload["fingerprint"]
    fingerprint["backend"] = fingerprint.pop("engine")
    torch.save(payload, path)

    more_steps = TrainConfig(steps=5, resume=True, **base)
    resumed = find_resume_checkpoint(more_steps, "a", training_fingerprint(more_steps, engine="local"))
    assert resumed is not None and resumed.data_position == 1
    with pytest.raises(
        InvalidArgumentError, match=r"from a different job: engine remote != local \(checkpoint\)"
    ):
        find_resume_checkpoint(more_steps, "a", training_fingerprint(more_steps, engine="remote"))
