"""Outer steps (DiLoCo) in the built-in trainer (`--outer-steps H`, `--fragments F`): the
arithmetic against a reference, replicas bit-identical after every exchange, a falling loss,
resuming, the fingerprint, the refusals, and a worker killed mid-run under `gradserver run
--restart-lost 1` whose replacement heals from a live one."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from gradserver.common.errors import DeadlineExceededError
from gradserver.common.sample_ranges import step_sample_ranges
from gradserver.train.checkpoint import load_checkpoint
from gradserver.train.clipping import clip_by_global_norm_
from gradserver.train.corpus import TokenWindows, corpus_bytes
from gradserver.train.engines import LocalEngine, LocalHub
from gradserver.train.fingerprint import differences, training_fingerprint
from gradserver.train.model import TransformerLM, model_config
from gradserver.train.outer_steps import OuterSettings, OuterTrainer, cut_fragments
from gradserver.train.trainer import ADAMW_BETAS, ADAMW_EPS, StepResult
from gradserver.train.training import TrainConfig, train
from gradserver.worker import state_digest

from .helpers.processes import ManagedProcess, ProcessGroup, descendants

T = TypeVar("T")


def _in_threads(world: int, run: Callable[[LocalEngine], T]) -> list[T]:
    """`run(engine)` for every rank of one LocalHub, each in its own thread; results by rank."""
    hub = LocalHub(world, timeout=120.0)
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            results[rank] = run(LocalEngine(hub, rank))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    if errors:
        raise errors[0]
    assert len(results) == world, "a worker thread did not finish"
    return [results[r] for r in range(world)]


def _train_threads(world: int, config: TrainConfig) -> list[list[StepResult]]:
    return _in_threads(world, lambda engine: train(engine, config))


def test_one_inner_step_per_outer_step_at_lr_1_without_momentum_averages_the_weights(tmp_path: Path) -> None:
    """H = 1, outer lr 1, momentum 0: global - (global - mean of the locals) = the mean of the
    locals, so the job must be local AdamW steps (each worker its own optimizer state) with the
    weights averaged after each one, as computed here without the trainer."""
    world, steps, batch = 2, 3, 2
    config = TrainConfig(
        model="tiny",
        steps=steps,
        batch_size=batch,
        lr=1e-2,
        max_grad_norm=1.0,
        out=str(tmp_path),
        outer_steps=1,
        outer_lr=1.0,
        outer_momentum=0.0,
    )
    _train_threads(world, config)
    got = load_checkpoint(tmp_path / "checkpoint-rank0.pt").model_state

    cfg = model_config("tiny")
    data = TokenWindows(corpus_bytes(), cfg.max_seq_len)
    models = [TransformerLM(cfg, seed=0) for _ in range(world)]
    optimizers = [
        torch.optim.AdamW(m.parameters(), lr=1e-2, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0)
        for m in models
    ]
    local_only = TransformerLM(cfg, seed=0)  # rank 0 without averaging: the test must tell them apart
    local_optimizer = torch.optim.AdamW(local_only.parameters(), lr=1e-2, betas=ADAMW_BETAS, eps=ADAMW_EPS)
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            ranges = step_sample_ranges(step, rank, world, data.num_samples, batch)
            inputs, targets = data.batch([i for r in ranges for i in r.indices()])
            for m, o in [(model, optimizer)] + ([(local_only, local_optimizer)] if rank == 0 else []):
                m.loss(inputs, targets).backward()
                clip_by_global_norm_([p.grad for p in m.parameters()], 1.0)
                o.step()
                o.zero_grad(set_to_none=True)
        with torch.no_grad():
            for params in zip(*(m.parameters() for m in models), strict=True):
                mean = (sum(p.double() for p in params) / world).float()
                for p in params:
                    p.copy_(mean)
    expected = models[0].state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    apart = max((local_only.state_dict()[n] - v).abs().max().item() for n, v in expected.items())
    assert apart > 1e-4, apart


def _batches(data: TokenWindows, engine: LocalEngine, step: int, per: int, batch: int) -> list:
    indices = engine.sample_indices(step, data.num_samples, per * batch)
    return [data.batch(indices[i * batch : (i + 1) * batch]) for i in range(per)]


@pytest.mark.parametrize(("outer_steps", "fragments"), [(2, 1), (4, 2)])
def test_replicas_hold_bit_identical_global_state_after_every_exchange(
    outer_steps: int, fragments: int
) -> None:
    """Digests of the replicated state (global weights, outer momentum) after every exchange, on
    3 workers: equal across workers, and changing from one exchange to the next. With one fragment
    the local weights are the global ones after every exchange too."""
    world, exchanges = 3, 6
    settings = OuterSettings(outer_steps, fragments)
    cfg = model_config("tiny")
    data = TokenWindows(corpus_bytes(), cfg.max_seq_len)

    def run(engine: LocalEngine) -> list[tuple[int, int]]:
        trainer = OuterTrainer(TransformerLM(cfg, seed=0), engine, settings, lr=1e-2, max_grad_norm=1.0)
        digests = []
        for step in range(exchanges):
            trainer.train_step(_batches(data, engine, step, settings.inner_per_exchange, 2))
            model = {name: p for name, p in trainer.model.named_parameters()}
            digests.append((state_digest(trainer.replicated_tensors()), state_digest(model)))
        return digests

    per_rank = _in_threads(world, run)
    replicated = [[d for d, _ in rank] for rank in per_rank]
    assert replicated[1] == replicated[0] and replicated[2] == replicated[0], replicated
    assert len(set(replicated[0])) == exchanges, replicated[0]
    local = [[m for _, m in rank] for rank in per_rank]
    if fragments == 1:
        assert local[1] == local[0] and local[2] == local[0], local
    else:  # the fragments not exchanged yet hold each worker's own progress
        assert local[1] != local[0], local


def test_fragments_are_runs_of_whole_parts_of_about_equal_size() -> None:
    assert cut_fragments([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert cut_fragments([16384, 36992, 36992, 64, 16384], 2) == [range(0, 2), range(2, 5)]
    assert cut_fragments([1, 1, 100], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert cut_fragments([5, 5, 5], 1) == [range(0, 3)]
    generator = random.Random(51)
    for _ in range(2000):
        sizes = [generator.randint(1, 100) for _ in range(generator.randint(1, 12))]
        fragments = generator.randint(1, len(sizes))
        runs = cut_fragments(sizes, fragments)
        assert len(runs) == fragments and all(runs), (sizes, fragments, runs)
        assert [i for run in runs for i in run] == list(range(len(sizes))), (sizes, fragments, runs)


def _whole_state(trainer: OuterTrainer) -> int:
    return state_digest(
        {**trainer.state_tensors(), **{f"model/{k}": v for k, v in trainer.model.state_dict().items()}}
    )


def test_a_failed_exchange_leaves_the_state_as_before_and_rollback_undoes_an_applied_one() -> None:
    """All-or-none steps (rejoining a restarted coordinator): an exchange that fails after the
    inner steps ran goes back to the weights and optimizer states of the step's start; rollback()
    undoes an applied step, and the step taken again gives the same state."""
    cfg = model_config("tiny")
    data = TokenWindows(corpus_bytes(), cfg.max_seq_len)
    alone = LocalEngine(LocalHub(2, timeout=0.5), 0)  # the other rank never comes: finish() times out
    trainer = OuterTrainer(TransformerLM(cfg, seed=0), alone, OuterSettings(2), lr=1e-2, keep_snapshot=True)
    before = _whole_state(trainer)
    with pytest.raises(DeadlineExceededError):
        trainer.train_step(_batches(data, alone, 0, 2, 2))
    assert (trainer.step, _whole_state(trainer)) == (0, before)

    engine = LocalEngine(LocalHub(1), 0)
    trainer = OuterTrainer(TransformerLM(cfg, seed=0), engine, OuterSettings(2), lr=1e-2, keep_snapshot=True)
    trainer.train_step(_batches(data, engine, 0, 2, 2))
    first = _whole_state(trainer)
    trainer.train_step(_batches(data, engine, 1, 2, 2))
    second = _whole_state(trainer)
    assert second != first
    trainer.rollback()
    assert (trainer.step, _whole_state(trainer)) == (1, first)
    trainer.train_step(_batches(data, engine, 1, 2, 2))
    assert (trainer.step, _whole_state(trainer)) == (2, second)


def test_loss_falls_with_outer_steps_on_the_shipped_corpus() -> None:
    config = TrainConfig(model="tiny", steps=48, batch_size=4, lr=1e-2, outer_steps=4)
    results = _train_threads(2, config)[0]
    assert [r.step for r in results] == list(range(12))
    assert [r.inner_steps for r in results] == [4 * (s + 1) for s in range(12)]
    assert all(r.tokens == 4 * 4 * 64 for r in results), results[0].tokens
    first, last = results[0].global_loss, sum(r.global_loss for r in results[-3:]) / 3
    # Untrained, the loss is about ln(256) = 5.55; the first step's is the mean over its 4 inner steps.
    assert first > 4.0 and last < first - 1.0, (first, last)


def test_resume_continues_bit_identically(tmp_path: Path) -> None:
    """A checkpoint holds the global weights, both optimizers' state and the step: resuming
    continues exactly as the uninterrupted job (fragments, so local and global weights differ)."""
    base = dict(model="tiny", batch_size=2, lr=1e-2, outer_steps=4, fragments=2, outer_momentum=0.9)
    straight = _train_threads(2, TrainConfig(steps=16, out=str(tmp_path / "a"), **base))[0]
    _train_threads(2, TrainConfig(steps=8, out=str(tmp_path / "b"), **base))
    ckpt = load_checkpoint(tmp_path / "b" / "checkpoint-rank0.pt")
    assert ckpt.data_position == 4 and set(ckpt.outer_state) == {"global", "optimizers"}
    resumed = _train_threads(2, TrainConfig(steps=16, out=str(tmp_path / "b"), resume=True, **base))[0]
    assert [r.step for r in resumed] == [4, 5, 6, 7]
    assert [r.global_loss for r in resumed] == [r.global_loss for r in straight[4:]]
    a, b = (load_checkpoint(tmp_path / d / "checkpoint-rank0.pt") for d in ("a", "b"))
    for name, value in a.model_state.items():
        assert torch.equal(b.model_state[name], value), name
    for name, value in a.outer_state["global"].items():
        assert torch.equal(b.outer_state["global"][name], value), name


def test_the_fingerprint_records_the_outer_settings_and_only_with_them() -> None:
    plain = training_fingerprint(TrainConfig(model="tiny", steps=8), engine="remote")
    assert not [k for k in plain if "outer" in k or k == "fragments"]
    four = training_fingerprint(TrainConfig(model="tiny", steps=8, outer_steps=4), engine="remote")
    assert {k: four[k] for k in ("outer_steps", "fragments", "outer_lr", "outer_momentum")} == {
        "outer_steps": "4",
        "fragments": "1",
        "outer_lr": "0.7",
        "outer_momentum": "0.9",
    }
    two = training_fingerprint(
        TrainConfig(model="tiny", steps=8, outer_steps=4, fragments=2), engine="remote"
    )
    assert differences(four, two) == ["fragments 2 != 1"]
    assert "outer_steps <unset> != 4" in differences(four, plain)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"outer_steps": -1}, "--outer-steps must be at least 1 (0: off), got -1"),
        ({"outer_steps": 4, "fragments": 3}, "--fragments 3 must divide --outer-steps 4"),
        ({"outer_steps": 2, "fragments": 4}, "--fragments 4 must divide --outer-steps 2"),
        ({"outer_steps": 8, "fragments": 8}, "--fragments 8: model tiny has 5 parts"),
        ({"outer_steps": 4, "steps": 10}, "--steps 10 counts inner steps: it must be a multiple of the 4"),
        ({"outer_steps": 4, "fragments": 2, "steps": 9}, "multiple of the 2 inner steps"),
        ({"outer_steps": 4, "outer_lr": 0.0}, "--outer-lr must be positive"),
        ({"outer_steps": 4, "outer_momentum": 1.0}, "--outer-momentum must be in [0, 1)"),
        ({"fragments": 2}, "--fragments 2 needs --outer-steps"),
        ({"outer_lr": 0.5}, "--outer-lr 0.5 needs --outer-steps"),
    ],
)
def test_bad_outer_settings_are_refused(settings: dict, message: str) -> None:
    from gradserver.common.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        TrainConfig(**{"model": "tiny", "steps": 8, **settings})


@pytest.mark.processes
def test_launch_refuses_steps_that_are_not_whole_exchanges(processes: ProcessGroup) -> None:
    launch = processes.gradserver(
        "launch", "--workers", "2", "--steps", "10", "--outer-steps", "4", "--no-progress", name="launch"
    )
    assert launch.wait(60) == 2, launch.output
    lines = [line for line in launch.lines if line.strip()]
    assert len(lines) == 1 and "--steps 10 counts inner steps" in lines[0], launch.output


def _worker_flags(steps: int, out: Path, *extra: str) -> list[str]:
    return [
        "worker",
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--steps",
        str(steps),
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.processes
def test_a_worker_with_other_outer_settings_is_refused_naming_them(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    coord, address = processes.coordinator("--world-size", "2")
    first = processes.gradserver(
        *_worker_flags(8, tmp_path / "a", "--outer-steps", "4"), "--coordinator", address, name="a"
    )
    coord.wait_for(r"worker 0 joined", timeout=60)
    other = processes.gradserver(
        *_worker_flags(8, tmp_path / "b", "--outer-steps", "2"), "--coordinator", address, name="b"
    )
    assert other.wait(60) != 0, other.output
    assert re.search(r"outer_steps 2 != 4", other.output), other.output
    first.terminate()


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _run(processes: ProcessGroup, out: Path, steps: int, *flags: str, name: str) -> ManagedProcess:
    """`gradserver run` of 3 training workers with --outer-steps 4; `flags` are run's, and with
    --restart-lost the workers compare state digests after every exchange."""
    checks = ("--check-state-every", "1") if "--restart-lost" in flags else ()
    return processes.gradserver(
        "run",
        "--workers",
        "3",
        *flags,
        "--",
        sys.executable,
        "-m",
        "gradserver.cli",
        *_worker_flags(steps, out, "--outer-steps", "4", *checks),
        name=name,
        env={"OMP_NUM_THREADS": "1"},
    )


@pytest.mark.processes
@pytest.mark.timeout(400)  # two runs of 200 exchanges: 155-175 s at load 14 on 2 cores
def test_a_worker_killed_mid_run_is_replaced_and_the_job_ends_as_without_the_fault(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """`gradserver run --restart-lost 1`, 3 workers, --outer-steps 4, state digests compared after
    every exchange: rank 1 is killed after exchange 20; its replacement takes a live worker's
    state at the next exchange, every checkpoint ends bit-identical and the final loss is within
    a few percent of a fault-free run's."""
    steps = 800  # 200 exchanges: the others still run when the replacement has started
    faulty = _run(processes, tmp_path / "faulty", steps, "--restart-lost", "1", name="faulty")
    faulty.wait_for(r"^\[rank 1\] .*step 20: loss", timeout=90)
    pid = int(faulty.wait_for(r"^\[launch\] started rank 1 \(pid (\d+)\)", timeout=5).group(1))
    assert pid in descendants(faulty.proc.pid), descendants(faulty.proc.pid)
    os.kill(pid, signal.SIGKILL)
    faulty.wait_for(r"^run: rank 1 was killed by SIGKILL; starting it again", timeout=30)
    took = faulty.wait_for(r"^\[rank 1\] .*worker (\d+): took the state of step (\d+) from worker (\d+)", 90)
    healed_at = int(took.group(2))
    assert faulty.wait(180) == 0, faulty.output[-4000:]
    clean = _run(processes, tmp_path / "clean", steps, name="clean")
    assert clean.wait(180) == 0, clean.output[-4000:]

    for out in (tmp_path / "faulty", tmp_path / "clean"):
        states = [load_checkpoint(p) for p in sorted(out.glob("checkpoint-*.pt"))]
        assert len(states) == 3, out
        for other in states[1:]:
            for name, value in states[0].model_state.items():
                assert torch.equal(other.model_state[name], value), (out, name)
            for name, value in states[0].outer_state["global"].items():
                assert torch.equal(other.outer_state["global"][name], value), (out, name)
        assert {s.data_position for s in states} == {steps // 4}

    def final_loss(out: Path) -> float:
        by_step = {m["step"]: m["global_loss"] for m in _metrics(out)}
        last = [by_step[s] for s in range(steps // 4 - 40, steps // 4)]
        return sum(last) / len(last)

    lost = [m for m in _metrics(tmp_path / "faulty") if m["step"] < healed_at and m["contributors"] == 2]
    assert lost, "no exchange went on without the killed worker"
    a, b = final_loss(tmp_path / "faulty"), final_loss(tmp_path / "clean")
    assert abs(a - b) < 0.03 * b, (a, b)


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_workers_rejoin_a_restarted_coordinator_and_end_bit_identical(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The coordinator is killed mid-run and started again on its port: the workers (with
    --reconnect-timeout) rejoin it, the exchange in flight counts for all or none, and they end
    with bit-identical weights, global weights and outer momentum."""
    first, address = processes.coordinator("--world-size", "2", "--heartbeat-timeout", "5")
    flags = ("--outer-steps", "4", "--fragments", "2", "--reconnect-timeout", "60", "--coordinator", address)
    workers = [
        processes.gradserver(*_worker_flags(48, tmp_path, *flags), name=f"w{i}", env={"OMP_NUM_THREADS": "1"})
        for i in range(2)
    ]
    for w in workers:
        w.wait_for(r"worker \d step 4:", timeout=120)
    first.kill()
    first.wait(30)
    port = address.rsplit(":", 1)[1]
    processes.gradserver(
        "coordinator",
        "--bind",
        f"127.0.0.1:{port}",
        "--world-size",
        "2",
        "--heartbeat-timeout",
        "5",
        name="second",
    )
    for w in workers:
        assert w.wait(240) == 0, w.output
        assert "rejoining" in w.output, w.output
    a, b = (load_checkpoint(p) for p in sorted(tmp_path.glob("checkpoint-*.pt")))
    assert a.data_position == b.data_position == 24
    for name, value in a.outer_state["global"].items():
        assert torch.equal(b.outer_state["global"][name], value), name
    for saved_a, saved_b in zip(a.outer_state["optimizers"], b.outer_state["optimizers"], strict=True):
        for index, state in saved_a["state"].items():
            assert torch.equal(saved_b["state"][index]["momentum_buffer"], state["momentum_buffer"]), index


@pytest.mark.processes
@pytest.mark.timeout(300)
@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_outer_steps_on_a_quantized_wire_with_error_feedback_end_bit_identical(
    processes: ProcessGroup, tmp_path: Path, wire: str
) -> None:
    """--outer-steps 4 --wire-dtype int8|int4 --error-feedback: each exchange's pseudo-gradients
    travel as block-quantized records that the coordinator sums and requantizes once; every
    worker applies the same bytes, so the checkpoints end with the same weights and global
    weights, and the loss still falls."""
    steps = 64
    run = processes.gradserver(
        "run",
        "--workers",
        "2",
        "--",
        sys.executable,
        "-m",
        "gradserver.cli",
        *_worker_flags(steps, tmp_path, "--outer-steps", "4", "--wire-dtype", wire, "--error-feedback"),
        name=f"quantized-{wire}",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert run.wait(240) == 0, run.output[-4000:]
    states = [load_checkpoint(p) for p in sorted(tmp_path.glob("checkpoint-*.pt"))]
    assert len(states) == 2
    for name, value in states[0].model_state.items():
        assert torch.equal(states[1].model_state[name], value), name
    for name, value in states[0].outer_state["global"].items():
        assert torch.equal(states[1].outer_state["global"][name], value), name
    by_step = {m["step"]: m["global_loss"] for m in _metrics(tmp_path)}  # every worker's lines
    losses = [by_step[s] for s in sorted(by_step)]
    assert len(losses) == steps // 4
    assert sum(losses[-4:]) < 0.8 * sum(losses[:4]), losses
