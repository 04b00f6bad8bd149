"""Outer steps (DiLoCo) in the built-in trainer (`--outer-steps H`, `--fragments F`): the
arithmetic against a reference, replicas bit-identical after every exchange, a falling loss,
resuming, the fingerprint, the refusals, a worker killed mid-run under `gradserver run
--restart-lost 1` whose replacement heals from a live one, and the final flush of F > 1 (the mean
weights of the fragments exchanged earlier in the last period; resumed, joined, launched)."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import random
import re
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from gradserver.common.errors import DeadlineExceededError, InvalidArgumentError
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


def _plain_outer_sgd(tmp_path: Path, steps: int, batch: int, **outer: Any) -> TrainConfig:
    """The tiny model's job with an outer SGD of lr 1 and no momentum (the outer step is then
    global - mean Δ, computable by hand), clipping at 1, checkpoints in `tmp_path`."""
    return TrainConfig(
        model="tiny",
        steps=steps,
        batch_size=batch,
        lr=1e-2,
        max_grad_norm=1.0,
        out=str(tmp_path),
        outer_lr=1.0,
        outer_momentum=0.0,
        **outer,
    )


def _reference_replicas(
    world: int,
) -> tuple[TokenWindows, list[TransformerLM], list[torch.optim.Optimizer]]:
    """The shipped corpus and `world` tiny models with the trainer's inner AdamW, built as the
    trainer builds them, for computing a job's result without it."""
    cfg = model_config("tiny")
    models = [TransformerLM(cfg, seed=0) for _ in range(world)]
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.AdamW(m.parameters(), lr=1e-2, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0)
        for m in models
    ]
    return TokenWindows(corpus_bytes(), cfg.max_seq_len), models, optimizers


def test_one_inner_step_per_outer_step_at_lr_1_without_momentum_averages_the_weights(tmp_path: Path) -> None:
    """H = 1, outer lr 1, momentum 0: global - (global - mean of the locals) = the mean of the
    locals, so the job must be local AdamW steps (each worker its own optimizer state) with the
    weights averaged after each one, as computed here without the trainer."""
    world, steps, batch = 2, 3, 2
    _train_threads(world, _plain_outer_sgd(tmp_path, steps, batch, outer_steps=1))
    got = load_checkpoint(tmp_path / "checkpoint-rank0.pt").model_state

    cfg = model_config("tiny")
    data, models, optimizers = _reference_replicas(world)
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


def test_with_a_delay_the_exchange_is_sent_before_the_last_inner_steps_and_mixed_in_after(
    tmp_path: Path,
) -> None:
    """H = 3, τ = 1, keep_local 0.5, outer lr 1 without momentum: each step runs 2 inner steps, sends
    Δ = global - local, runs its third inner step while Δ travels, then global ← global - mean Δ
    (the mean of the locals as they were sent) and local ← 0.5·local + 0.5·global; the last step
    ends on the global weights. Computed here without the trainer."""
    world, steps, batch, per, tau, keep = 2, 6, 2, 3, 1, 0.5
    config = _plain_outer_sgd(tmp_path, steps, batch, outer_steps=per, outer_delay=tau, outer_keep_local=keep)
    results = _train_threads(world, config)
    got = load_checkpoint(tmp_path / "checkpoint-rank0.pt")
    # The exchange was in flight during the step's last inner step: a part of its computing time.
    assert all(0 < r.in_flight_s < r.compute_s for rank in results for r in rank if r.in_flight_s is not None)
    assert all(r.in_flight_s is not None for rank in results for r in rank)

    data, models, optimizers = _reference_replicas(world)
    global_weights = [p.detach().clone() for p in models[0].parameters()]

    def inner(rank: int, step: int, which: range) -> None:
        ranges = step_sample_ranges(step, rank, world, data.num_samples, per * batch)
        indices = [i for r in ranges for i in r.indices()]
        for k in which:
            model, optimizer = models[rank], optimizers[rank]
            model.loss(*data.batch(indices[k * batch : (k + 1) * batch])).backward()
            clip_by_global_norm_([p.grad for p in model.parameters()], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    for step in range(steps // per):
        sent = []
        for rank in range(world):
            inner(rank, step, range(per - tau))
            sent.append([p.detach().clone() for p in models[rank].parameters()])
            inner(rank, step, range(per - tau, per))
        last = step == steps // per - 1
        with torch.no_grad():
            for i, g in enumerate(global_weights):
                deltas = [g - sent[rank][i] for rank in range(world)]
                g.sub_((sum(d.double() for d in deltas) / world).float())
                for model in models:
                    p = list(model.parameters())[i]
                    p.copy_(g) if last else p.mul_(keep).add_(g, alpha=1.0 - keep)
    names = [name for name, _ in models[0].named_parameters()]
    for name, g in zip(names, global_weights, strict=True):
        close = {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(
            got.outer_state["global"][name], g, **close, msg=lambda m, n=name: f"{n}: {m}"
        )
        torch.testing.assert_close(got.model_state[name], g, **close, msg=lambda m, n=name: f"{n}: {m}")


def _batches(data: TokenWindows, engine: LocalEngine, step: int, per: int, batch: int) -> list:
    indices = engine.sample_indices(step, data.num_samples, per * batch)
    return [data.batch(indices[i * batch : (i + 1) * batch]) for i in range(per)]


@pytest.mark.parametrize(
    ("outer_steps", "fragments", "delay", "keep_local"), [(2, 1, 0, 0.0), (4, 2, 0, 0.0), (6, 2, 2, 0.5)]
)
def test_replicas_hold_bit_identical_global_state_after_every_exchange(
    outer_steps: int, fragments: int, delay: int, keep_local: float
) -> None:
    """Digests of the replicated state (global weights, outer momentum) after every exchange, on
    3 workers: equal across workers, and changing from one exchange to the next. With one fragment
    (and no keep_local) the local weights are the global ones after every exchange too. Also with
    each exchange overlapping the step's last 2 inner steps and mixed in at keep_local 0.5."""
    world, exchanges = 3, 6
    settings = OuterSettings(outer_steps, fragments, delay=delay, keep_local=keep_local)
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
    if fragments == 1 and not keep_local:
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
    assert not any(r.flush for r in results)  # one fragment: nothing to flush
    assert all(r.tokens == 4 * 4 * 64 for r in results), results[0].tokens
    first, last = results[0].global_loss, sum(r.global_loss for r in results[-3:]) / 3
    # Untrained, the loss is about ln(256) = 5.55; the first step's is the mean over its 4 inner steps.
    assert first > 4.0 and last < first - 1.0, (first, last)


def test_resume_continues_bit_identically(tmp_path: Path) -> None:
    """A checkpoint holds the global weights, both optimizers' state and the step: resuming
    continues exactly as the uninterrupted job (fragments, so local and global weights differ)."""
    base = dict(model="tiny", batch_size=2, lr=1e-2, outer_steps=4, fragments=2, outer_momentum=0.9)
    straight = _train_threads(2, TrainConfig(steps=16, out=str(tmp_path / "a"), **base))[0]
    interrupted = TrainConfig(steps=16, out=str(tmp_path / "b"), checkpoint_every=2, **base)
    with pytest.raises(_Interrupted):  # after step 4, whose checkpoint is not written
        _in_threads(2, lambda engine: train(engine, interrupted, _stop_after(4)))
    ckpt = load_checkpoint(tmp_path / "b" / "checkpoint-rank0.pt")
    assert ckpt.data_position == 4 and set(ckpt.outer_state) == {"global", "optimizers"}
    resumed = _train_threads(2, TrainConfig(steps=16, out=str(tmp_path / "b"), resume=True, **base))[0]
    assert [r.step for r in resumed] == [4, 5, 6, 7, 8]  # 8: the flush
    assert [r.global_loss for r in resumed[:-1]] == [r.global_loss for r in straight[4:8]]
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
    overlapped = training_fingerprint(
        TrainConfig(model="tiny", steps=8, outer_steps=4, outer_delay=1, outer_keep_local=0.5),
        engine="remote",
    )
    assert differences(four, overlapped) == ["outer_delay 1 != <unset>", "outer_keep_local 0.5 != <unset>"]
    assert "outer_flush" not in four and "outer_flush" not in two
    flushed = training_fingerprint(
        TrainConfig(model="tiny", steps=8, outer_steps=4, fragments=2, outer_flush="outer"), engine="remote"
    )
    assert flushed["outer_flush"] == "outer"
    assert differences(two, flushed) == ["outer_flush outer != <unset>"]
    mean = TrainConfig(model="tiny", steps=8, outer_steps=4, fragments=2, outer_flush="mean")
    assert training_fingerprint(mean, engine="remote") == two


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
        (
            {"outer_steps": 4, "fragments": 2, "outer_delay": 2},
            "--outer-delay 2 must be at least 0 and below the 2",
        ),
        ({"outer_steps": 4, "outer_delay": -1}, "--outer-delay -1 must be at least 0"),
        ({"outer_steps": 4, "outer_keep_local": 1.5}, "--outer-keep-local must be in [0, 1], got 1.5"),
        ({"outer_delay": 1}, "--outer-delay 1 needs --outer-steps"),
        ({"fragments": 2}, "--fragments 2 needs --outer-steps"),
        ({"outer_lr": 0.5}, "--outer-lr 0.5 needs --outer-steps"),
        ({"outer_steps": 4, "outer_flush": "sideways"}, "--outer-flush 'sideways' must be 'mean' or 'outer'"),
        ({"outer_flush": "outer"}, "--outer-flush outer needs --outer-steps"),
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
    processes.restart_coordinator(first, address, "--world-size", "2", "--heartbeat-timeout", "5")
    for w in workers:
        assert w.wait(240) == 0, w.output
        assert "rejoining" in w.output, w.output
    a, b = (load_checkpoint(p) for p in sorted(tmp_path.glob("checkpoint-*.pt")))
    assert a.data_position == b.data_position == 25  # 24 trainer steps, 1 flush step
    _assert_model_is_the_global_weights([a, b])
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


# --- the final flush (F > 1): the mean weights of every fragment not exchanged at the last step ----


class _Interrupted(Exception):
    """Raised by an on_step callback: the job stops there, as if the worker had been killed."""


def _stop_after(step: int) -> Callable[[StepResult], None]:
    def on_step(result: StepResult) -> None:
        if result.step == step:
            raise _Interrupted(step)

    return on_step


def _assert_model_is_the_global_weights(states: list) -> None:
    """Each checkpoint's model (its local weights) is its global weights, and the same on all."""
    for state in states:
        assert set(state.model_state) == set(state.outer_state["global"])
        for name, value in state.outer_state["global"].items():
            assert torch.equal(state.model_state[name], value), name
    for other in states[1:]:
        for name, value in states[0].model_state.items():
            assert torch.equal(other.model_state[name], value), name


def _run_through_the_flush(world: int, trainer_steps: int, settings: OuterSettings) -> list[dict]:
    """OuterTrainer alone on `world` workers of a LocalHub: `trainer_steps` trainer steps, then the
    flush's two steps (F = 3). Per rank: the global and local weights and each fragment's outer
    momentum before and after the flush, the flush's results and each fragment's parameter names."""
    cfg = model_config("tiny")
    data = TokenWindows(corpus_bytes(), cfg.max_seq_len)

    def run(engine: LocalEngine) -> dict:
        trainer = OuterTrainer(
            TransformerLM(cfg, seed=0), engine, settings, lr=1e-2, trainer_steps=trainer_steps
        )
        for step in range(trainer_steps):
            trainer.train_step(_batches(data, engine, step, settings.inner_per_exchange, 2))
        with pytest.raises(InvalidArgumentError, match="the flush's steps take none"):
            trainer.train_step(_batches(data, engine, trainer_steps, settings.inner_per_exchange, 2))

        def snapshot() -> dict:
            return {
                "global": {k: v.clone() for k, v in trainer._global_items()},
                "local": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
                "momentum": [
                    [s["momentum_buffer"].clone() for s in f.optimizer.state_dict()["state"].values()]
                    for f in trainer.fragments
                ],
            }

        before = snapshot()
        flushed = [trainer.flush_step(), trainer.flush_step()]
        with pytest.raises(InvalidArgumentError, match="is not a flush step"):
            trainer.flush_step()
        names = [[trainer._names[id(p)] for u in f.units for p in u.params] for f in trainer.fragments]
        return {"before": before, "after": snapshot(), "results": flushed, "names": names}

    return _in_threads(world, run)


def _assert_every_model_is_the_same_global_weights(runs: list[dict]) -> None:
    """After the flush every rank's local weights are its global weights, the same on all ranks."""
    for rank, run in enumerate(runs):
        after = run["after"]
        for name, value in after["global"].items():
            assert torch.equal(after["local"][name], value), (rank, name)
            assert torch.equal(value, runs[0]["after"]["global"][name]), (rank, name)


def _mean_delta(runs: list[dict], name: str) -> torch.Tensor:
    """The average the flush gets for `name`: the mean over the workers of global - local before it."""
    total = sum((run["before"]["global"][name] - run["before"]["local"][name]).double() for run in runs)
    return (total / len(runs)).float()


def _after_the_flush(runs: list[dict[str, Any]]) -> tuple[list[list[str]], dict[str, Any], dict[str, Any]]:
    """Checks what every flush rule gives (every model the same global weights; the fragment
    exchanged at the last trainer step, 3 % 3, left alone: nothing to add) and returns worker 0's
    fragments' parameter names and its state before and after the flush."""
    _assert_every_model_is_the_same_global_weights(runs)
    names, before, after = runs[0]["names"], runs[0]["before"], runs[0]["after"]
    for name in names[0]:
        assert torch.equal(after["global"][name], before["global"][name]), name
    return names, before, after


@pytest.mark.timeout(120)
def test_the_flush_gives_each_other_fragment_the_workers_mean_weights_with_the_inner_steps_since() -> None:
    """OuterTrainer alone (2 workers on a LocalHub, H = 6, F = 3, 4 trainer steps): the flush
    exchanges the two fragments not exchanged at step 3, each global weight becoming the mean of
    the workers' local weights (global - the averaged global - local computed here), the outer
    momentum untouched; the fragment of step 3 is left alone; afterwards every worker's model is
    its global weights, bit for bit the same on both."""
    world, trainer_steps, settings = 2, 4, OuterSettings(6, 3, outer_lr=0.7, outer_momentum=0.9)
    runs = _run_through_the_flush(world, trainer_steps, settings)
    results = runs[0]["results"]
    assert [(r.step, r.fragment, r.flush, r.tokens) for r in results] == [(4, 1, True, 0), (5, 2, True, 0)]
    assert all(r.inner_steps == trainer_steps * 2 and r.outer_steps == r.step + 1 for r in results)
    assert all(r.grad_norm is None and r.loss != r.loss and r.global_loss != r.global_loss for r in results)
    names, before, after = _after_the_flush(runs)
    for k in (1, 2):
        for index, name in enumerate(names[k]):
            # The average as it is (the workers' mean weights), the outer optimizer left alone.
            expected = before["global"][name] - _mean_delta(runs, name)
            torch.testing.assert_close(after["global"][name], expected, rtol=1e-5, atol=1e-6)
            assert torch.equal(after["momentum"][k][index], before["momentum"][k][index]), name
            assert not torch.equal(after["global"][name], before["global"][name]), name
            # The local weights held inner steps the global weights lacked before the flush.
            assert not torch.equal(before["local"][name], before["global"][name]), name


@pytest.mark.timeout(120)
def test_with_outer_flush_outer_each_flush_step_is_an_outer_optimizer_step() -> None:
    """The same job with `flush="outer"`: each flushed fragment's global weights take one step of
    its outer optimizer with the averaged Δ as the gradient, computed here with a Nesterov SGD of
    the same lr and momentum started from the fragment's momentum before the flush; the momentum
    moves, the result is not the mean rule's global - Δ, and every model still ends on the global
    weights (no keep_local mixing in the flush)."""
    world, trainer_steps = 2, 4
    settings = OuterSettings(6, 3, outer_lr=0.7, outer_momentum=0.9, keep_local=0.5, flush="outer")
    runs = _run_through_the_flush(world, trainer_steps, settings)
    assert [(r.fragment, r.flush) for r in runs[0]["results"]] == [(1, True), (2, True)]
    names, before, after = _after_the_flush(runs)
    for k in (1, 2):
        for index, name in enumerate(names[k]):
            delta = _mean_delta(runs, name)
            weight = before["global"][name].clone()
            reference = torch.optim.SGD([weight], lr=0.7, momentum=0.9, nesterov=True)
            reference.load_state_dict(
                {
                    "state": {0: {"momentum_buffer": before["momentum"][k][index].clone()}},
                    "param_groups": reference.state_dict()["param_groups"],
                }
            )
            weight.grad = delta
            reference.step()
            close = {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(
                after["global"][name], weight, **close, msg=lambda m, n=name: f"{n}: {m}"
            )
            torch.testing.assert_close(
                after["momentum"][k][index], reference.state[weight]["momentum_buffer"], **close
            )
            assert not torch.equal(after["momentum"][k][index], before["momentum"][k][index]), name
            mean_rule = before["global"][name] - delta
            assert not torch.allclose(after["global"][name], mean_rule, **close), name


def _train_on_a_coordinator(
    coordinator, world: int, config: TrainConfig, **options
) -> list[list[StepResult]]:
    """`train` on `world` CoordinatorEngines of one real coordinator (in this process), whose
    --max-steps is the job's engine steps, as launch sets it."""
    from gradserver.train.engines import CoordinatorEngine

    from .helpers.server import connect_all, run_each

    server = coordinator(world_size=world, max_steps=config.total_steps, **options)
    clients = connect_all(server.address, world)
    try:
        return run_each(clients, lambda c: train(CoordinatorEngine(c), config), timeout=240)
    finally:
        for c in clients:
            c.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("outer_steps", "fragments", "steps", "delay"), [(4, 2, 8, 0), (6, 3, 10, 0), (6, 2, 12, 1)]
)
def test_a_job_with_fragments_ends_with_the_flush_and_every_model_is_the_global_weights(
    coordinator, tmp_path: Path, outer_steps: int, fragments: int, steps: int, delay: int
) -> None:
    """Through a real coordinator (--max-steps = the job's engine steps): F - 1 flush steps
    follow the trainer steps, each exchanging a fragment not exchanged at the last one, with no
    tokens; their metrics lines say so and leave the loss out; the final checkpoints hold models
    that are their global weights, the same on both workers. Also with each exchange overlapping
    the step's last inner step, mixed in at keep_local 0.5 (the last step's and the flush's are not)."""
    config = TrainConfig(
        model="tiny",
        steps=steps,
        batch_size=2,
        lr=1e-2,
        out=str(tmp_path),
        outer_steps=outer_steps,
        fragments=fragments,
        outer_delay=delay,
        outer_keep_local=0.5 if delay else 0.0,
    )
    trainer_steps, total = config.trainer_steps, config.total_steps
    assert (config.flush_steps, total) == (fragments - 1, trainer_steps + fragments - 1)
    per_rank = _train_on_a_coordinator(coordinator, 2, config)
    for results in per_rank:
        assert [r.step for r in results] == list(range(total))
        assert [r.flush for r in results] == [False] * trainer_steps + [True] * (fragments - 1)
        flushed = results[trainer_steps:]
        assert sorted(r.fragment for r in flushed) == sorted(
            set(range(fragments)) - {(trainer_steps - 1) % fragments}
        )
        assert all(r.tokens == 0 and r.inner_steps == steps and r.contributors == 2 for r in flushed)
        assert [r.outer_steps for r in results] == list(range(1, total + 1))
    lines = _metrics(tmp_path)
    assert sorted((m["worker_id"], m["step"]) for m in lines) == [
        (w, s) for w in range(2) for s in range(total)
    ]
    for m in lines:
        flush = m["step"] >= trainer_steps
        assert m["flush"] is flush, m
        assert ("loss" in m, "global_loss" in m) == (not flush, not flush), m
        if flush:
            assert (m["tokens"], m["tokens_per_s"], m["inner_steps"]) == (0, 0.0, steps), m
    states = [load_checkpoint(p) for p in sorted(tmp_path.glob("checkpoint-*.pt"))]
    assert len(states) == 2 and {(s.step, s.data_position) for s in states} == {(total - 1, total)}
    _assert_model_is_the_global_weights(states)


@pytest.mark.timeout(120)
def test_resuming_within_or_after_the_flush_finishes_it_without_redoing_a_step(tmp_path: Path) -> None:
    """H = 6, F = 3 (4 trainer steps, flush steps 4 and 5): a job stopped after flush step 4
    (checkpoint of step 4) resumes with flush step 5 alone and ends bit-identical to one that
    ran straight; resuming that finished job does nothing and leaves its checkpoints alone."""
    base = dict(model="tiny", steps=8, batch_size=2, lr=1e-2, outer_steps=6, fragments=3, checkpoint_every=1)
    _train_threads(2, TrainConfig(out=str(tmp_path / "a"), **base))
    b = TrainConfig(out=str(tmp_path / "b"), **base)
    with pytest.raises(_Interrupted):
        _in_threads(2, lambda engine: train(engine, b, _stop_after(5)))
    assert load_checkpoint(tmp_path / "b" / "checkpoint-rank0.pt").data_position == 5
    resumed = _train_threads(2, dataclasses.replace(b, resume=True))
    assert [[(r.step, r.flush) for r in results] for results in resumed] == [[(5, True)]] * 2
    for rank in range(2):
        a, c = (load_checkpoint(tmp_path / d / f"checkpoint-rank{rank}.pt") for d in ("a", "b"))
        assert (a.step, a.data_position) == (c.step, c.data_position) == (5, 6)
        for name, value in a.model_state.items():
            assert torch.equal(c.model_state[name], value), name
        for name, value in a.outer_state["global"].items():
            assert torch.equal(c.outer_state["global"][name], value), name
    finished = [(tmp_path / "a" / f"checkpoint-rank{r}.pt").read_bytes() for r in range(2)]
    lines = len(_metrics(tmp_path / "a"))
    again = _train_threads(2, TrainConfig(out=str(tmp_path / "a"), resume=True, **base))
    assert again == [[], []]
    assert [(tmp_path / "a" / f"checkpoint-rank{r}.pt").read_bytes() for r in range(2)] == finished
    assert len(_metrics(tmp_path / "a")) == lines


@pytest.mark.timeout(120)
def test_a_job_resumed_from_its_flush_cannot_change_its_step_count(tmp_path: Path) -> None:
    """After the flush began, further inner steps would follow flush steps: refused, naming the
    job's --steps; the same job still resumes."""
    base = dict(model="tiny", batch_size=2, lr=1e-2, outer_steps=4, fragments=2, out=str(tmp_path))
    _train_threads(2, TrainConfig(steps=4, **base))
    with pytest.raises(InvalidArgumentError, match=r"saved in the final flush of a job of --steps 4 "):
        _train_threads(2, TrainConfig(steps=8, resume=True, **base))
    assert _train_threads(2, TrainConfig(steps=4, resume=True, **base)) == [[], []]


@pytest.mark.timeout(120)
def test_a_worker_that_joins_during_the_flush_takes_part_in_the_rest_of_it(
    coordinator, tmp_path: Path
) -> None:
    """3 workers, H = 6, F = 3 (4 trainer steps, flush steps 4 and 5), --on-worker-loss
    continue: worker 2 leaves after step 3, the others wait after it until a replacement has
    joined, so the replacement takes part from flush step 4: it takes a live worker's state and
    runs both flush steps, the state digests are compared at step 5, and the three end with the
    same models, which are the global weights."""
    from gradserver.train.engines import CoordinatorEngine
    from gradserver.worker import WorkerClient

    from .helpers.server import TEST_TIMEOUTS, connect_all

    config = TrainConfig(
        model="tiny", steps=8, batch_size=2, lr=1e-2, out=str(tmp_path), outer_steps=6, fragments=3
    )
    server = coordinator(world_size=3, on_worker_loss="continue", max_steps=config.total_steps)
    clients = connect_all(server.address, 3)
    replaced = threading.Event()

    def survivor(result: StepResult) -> None:
        if result.step == config.trainer_steps - 1:
            assert replaced.wait(60), "the replacement did not join"

    def run(client: WorkerClient) -> list[StepResult]:
        if client.worker_id == 2:
            try:
                train(CoordinatorEngine(client), config, _stop_after(config.trainer_steps - 1))
            except _Interrupted:
                return []
            finally:
                client.close()
        return train(CoordinatorEngine(client), config, survivor)

    newcomer: WorkerClient | None = None
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        try:
            futures = [pool.submit(run, c) for c in clients]
            assert futures[2].result(120) == []
            newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
            assert (newcomer.worker_id, newcomer.recovery_step) == (2, config.trainer_steps)
            late = pool.submit(train, CoordinatorEngine(newcomer), config)
            replaced.set()
            survivors = [f.result(180) for f in futures[:2]]
            joined = late.result(180)
        finally:
            replaced.set()
            for c in [*clients, *([newcomer] if newcomer is not None else [])]:
                c.close()
    assert [(r.step, r.flush, r.contributors) for r in joined] == [(4, True, 3), (5, True, 3)]
    for results in survivors:
        assert [r.step for r in results] == list(range(config.total_steps))
    states = [load_checkpoint(tmp_path / f"checkpoint-rank{r}.pt") for r in range(3)]
    assert {s.data_position for s in states} == {config.total_steps}
    _assert_model_is_the_global_weights(states)


@pytest.mark.timeout(120)
def test_the_flush_steps_run_on_the_torch_distributed_engine(tmp_path: Path) -> None:
    """The flush's exchange with 0 tokens on TorchDistributedEngine (gloo, one rank)."""
    import torch.distributed as dist

    from gradserver.train.engines import TorchDistributedEngine

    config = TrainConfig(model="tiny", steps=4, batch_size=2, lr=1e-2, outer_steps=4, fragments=2)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    engine = TorchDistributedEngine()
    try:
        results = train(engine, config)
    finally:
        engine.close()
    tokens = 2 * 2 * 64  # 2 inner steps of 2 samples of 64 tokens
    assert [(r.step, r.flush, r.tokens) for r in results] == [
        (0, False, tokens),
        (1, False, tokens),
        (2, True, 0),
    ]


def test_launch_gives_the_coordinator_the_flush_steps_too() -> None:
    """launch's --max-steps for its coordinator: the trainer steps and the flush's."""
    from gradserver.cli import build_parser
    from gradserver.train.launch import _job

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subcommands.choices["launch"]
    job = _job(parser.parse_args(["--steps", "8", "--outer-steps", "4", "--", "--fragments", "2"]))
    assert job.engine_steps == 5
    assert _job(parser.parse_args(["--steps", "8", "--outer-steps", "4"])).engine_steps == 2
