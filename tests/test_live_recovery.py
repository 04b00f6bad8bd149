"""Live recovery with real processes: a training worker that was killed is started again with its
command, joins the running job (`--on-worker-loss continue`) in its old place, takes the model,
optimizer state and step of a live worker and trains on; every checkpoint ends bit-identical."""

from __future__ import annotations

import json
import math
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from gradserver.train.checkpoint import Checkpoint, load_checkpoint

from .helpers.processes import ManagedProcess, ProcessGroup, descendants, pid_alive
from .helpers.training import tiny_training

pytestmark = [pytest.mark.processes, pytest.mark.timeout(180)]

STEPS = 500
_TOOK = re.compile(r"worker (\d+): took the state of step (\d+) from worker (\d+)")


def _worker(
    processes: ProcessGroup,
    address: str,
    node: str,
    out: Path,
    *flags: str,
    name: str = "",
    env: dict[str, str | None] | None = None,
) -> ManagedProcess:
    return processes.gradserver(
        "worker",
        "--job",
        "train",
        "--coordinator",
        address,
        *tiny_training(STEPS),
        "--node-id",
        node,
        "--out",
        str(out),
        *flags,
        name=name or node,
        env={"OMP_NUM_THREADS": "1", **(env or {})},
    )


def _start_in_order(
    processes: ProcessGroup, coord: ManagedProcess, address: str, out: Path, *flags: str
) -> list[ManagedProcess]:
    """n0, n1, n2 (worker ids 0, 1, 2), each with its own --out, joined in that order."""
    workers = []
    for i in range(3):
        node = f"n{i}"
        workers.append(_worker(processes, address, node, out / node, *flags))
        coord.wait_for(rf"worker {i} joined: node '{node}'", timeout=60)
    return workers


def _assert_same_state(a: Path, b: Path) -> Checkpoint:
    """The checkpoints at `a` and `b` hold bit-identical weights and optimizer state (every
    tensor, and every other per-parameter value); returns a's."""
    ca, cb = load_checkpoint(a), load_checkpoint(b)
    assert ca.model_state.keys() == cb.model_state.keys(), (a, b)
    for name, tensor in ca.model_state.items():
        other = cb.model_state[name]
        assert tensor.dtype == other.dtype and torch.equal(tensor, other), f"weight {name}: {a} vs {b}"
    sa, sb = ca.optimizer_state["state"], cb.optimizer_state["state"]
    assert sa and sa.keys() == sb.keys(), (a, b, sorted(sa), sorted(sb))
    for index, values in sa.items():
        assert values.keys() == sb[index].keys(), (index, a, b)
        for key, value in values.items():
            other = sb[index][key]
            if isinstance(value, torch.Tensor):
                same = (
                    isinstance(other, torch.Tensor)
                    and value.dtype == other.dtype
                    and torch.equal(value, other)
                )
            else:
                same = value == other
            assert same, f"optimizer state {index}/{key}: {a} vs {b}"
    assert ca.optimizer_state["param_groups"] == cb.optimizer_state["param_groups"], (a, b)
    assert (ca.step, ca.data_position) == (cb.step, cb.data_position), (a, b)
    return ca


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(out: Path, node: str) -> Path:
    return out / f"checkpoint-{node}.pt"


def test_a_killed_worker_started_again_takes_a_live_workers_state(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    coord, address = processes.coordinator(
        "--world-size", "3", "--on-worker-loss", "continue", "--max-steps", str(STEPS)
    )
    n0, n1, n2 = _start_in_order(processes, coord, address, tmp_path)
    n2.wait_for(r"worker 2 step 20:", timeout=60)
    n2.kill()
    assert n2.wait(30) == -signal.SIGKILL
    again = _worker(processes, address, "n2", tmp_path / "n2-again", name="n2-again")
    took = again.wait_for(_TOOK.pattern, timeout=60)
    assert took.group(1) == "2" and took.group(3) == "0", took.group(0)
    step = int(took.group(2))
    again.wait_for(rf"joined the running job at step {step}: took the state from worker 0", timeout=5)
    for w in (n0, n1, again):
        assert w.wait(120) == 0, w.output
    assert coord.wait(60) == 0, coord.output
    n0.wait_for(rf"worker 0: serving its state of step {step} to worker 2", timeout=5)
    n0.wait_for(rf"worker 0: worker 2 has the state of step {step}", timeout=5)

    final = _assert_same_state(_checkpoint(tmp_path / "n0", "n0"), _checkpoint(tmp_path / "n1", "n1"))
    _assert_same_state(_checkpoint(tmp_path / "n0", "n0"), _checkpoint(tmp_path / "n2-again", "n2"))
    assert (final.step, final.data_position) == (STEPS - 1, STEPS)

    replaced = _metrics(tmp_path / "n2-again")
    assert 0 < step < STEPS - 1
    assert [m["step"] for m in replaced] == list(range(step, STEPS))
    assert {m["worker_id"] for m in replaced} == {2}
    survivors = {w: _metrics(tmp_path / w) for w in ("n0", "n1")}
    for node, metrics in survivors.items():
        assert [m["step"] for m in metrics] == list(range(STEPS)), node
        before = [m["contributors"] for m in metrics if m["step"] < step]
        assert 2 in before, (node, before)
        after = {m["contributors"] for m in metrics if m["step"] >= step}
        assert after == {3}, (node, after)
    first = replaced[0]["loss"]
    assert math.isfinite(first), replaced[0]
    # The curve goes on: a fresh model's loss (step 0's) is far above the trained one's.
    start = survivors["n0"][0]["loss"]
    at_step = next(m["loss"] for m in survivors["n0"] if m["step"] == step)
    assert first < start - 0.5, (first, start, at_step)
    assert abs(first - at_step) < 0.5 * start, (first, at_step)
    # Step S's loss over the job is one average, the same on every worker that took part in it.
    shared = {m["global_loss"] for w in survivors.values() for m in w if m["step"] == step}
    assert shared == {replaced[0]["global_loss"]}, (shared, replaced[0])


# Started with this directory first on PYTHONPATH, a worker process imports torch and gradserver's
# training code, says so and waits for GATE_FILE before `gradserver worker` runs: a replacement
# that joins within milliseconds of the test's word, whatever the machine's load.
_GATE = """
import os, sys, time
gate = os.environ.get("GATE_FILE")
if gate:
    import torch
    import gradserver.train.training
    import gradserver.worker
    print("gate: ready", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.005)
"""


def test_a_replacement_whose_first_donor_is_lost_takes_the_state_from_the_next(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Worker 0, the first donor, is stopped (SIGSTOP) before the replacement joins; the
    replacement asks it first, gets nothing, and when the coordinator evicts worker 0 (heartbeat
    timeout) it takes the state from worker 1. The replacement is started ahead behind a gate so
    that it joins before the eviction: else it would take worker 0's free place and never ask it."""
    coord, address = processes.coordinator(
        "--world-size",
        "3",
        "--on-worker-loss",
        "continue",
        "--max-steps",
        str(STEPS),
        "--heartbeat-timeout",
        "3",
    )
    n0, n1, n2 = _start_in_order(processes, coord, address, tmp_path)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_GATE)
    go = tmp_path / "go"
    again = _worker(
        processes,
        address,
        "n2",
        tmp_path / "n2-again",
        name="n2-again",
        env={"PYTHONPATH": str(site), "GATE_FILE": str(go)},
    )
    again.wait_for(r"^gate: ready$", timeout=60)
    n2.wait_for(r"worker 2 step 20:", timeout=60)
    n2.kill()
    assert n2.wait(30) == -signal.SIGKILL
    coord.wait_for(r"worker 2 \(node 'n2'\) disconnected", timeout=30)
    n0.stop()
    try:
        go.touch()
        again.wait_for(r"joined 127\.0\.0\.1:\d+ as worker 2 of 3", timeout=30)
        failed = again.wait_for(r"worker 2: recovery from worker 0 failed: (.+)", timeout=60)
        took = again.wait_for(_TOOK.pattern, timeout=60)
        assert (took.group(1), took.group(3)) == ("2", "1"), took.group(0)
        step = int(took.group(2))
        again.wait_for(rf"joined the running job at step {step}: took the state from worker 1", timeout=5)
        coord.wait_for(r"worker 0 \(node 'n0'\) lost: ", timeout=5)
        assert "serving its state" not in n0.output, n0.output
    finally:
        n0.resume()
    # Evicted while it was stopped: it cannot go on, and it ends by itself.
    assert n0.wait(60) != 0, n0.output
    for w in (n1, again):
        assert w.wait(120) == 0, w.output
    assert coord.wait(60) == 0, coord.output
    n1.wait_for(rf"worker 1: worker 2 has the state of step {step}", timeout=5)
    assert not (tmp_path / "n0" / "checkpoint-n0.pt").exists()
    final = _assert_same_state(_checkpoint(tmp_path / "n1", "n1"), _checkpoint(tmp_path / "n2-again", "n2"))
    assert (final.step, final.data_position) == (STEPS - 1, STEPS)
    assert [m["step"] for m in _metrics(tmp_path / "n2-again")] == list(range(step, STEPS)), failed.group(0)


def test_a_replacement_started_with_resume_ignores_its_stale_checkpoint(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    coord, address = processes.coordinator(
        "--world-size", "3", "--on-worker-loss", "continue", "--max-steps", str(STEPS)
    )
    n0, n1, n2 = _start_in_order(processes, coord, address, tmp_path, "--checkpoint-every", "5")
    # Each step's line comes before its checkpoint: step 20's line follows step 19's checkpoint.
    n2.wait_for(r"worker 2 step 20:", timeout=60)
    n2.kill()
    assert n2.wait(30) == -signal.SIGKILL
    stale = load_checkpoint(_checkpoint(tmp_path / "n2", "n2"))
    assert stale.data_position >= 20 and stale.data_position % 5 == 0, stale.data_position
    again = _worker(
        processes, address, "n2", tmp_path / "n2", "--checkpoint-every", "5", "--resume", name="n2-again"
    )
    took = again.wait_for(_TOOK.pattern, timeout=60)
    step = int(took.group(2))
    assert step > stale.data_position, (step, stale.data_position)
    again.wait_for(
        rf"joined a running job at step {step}: its checkpoint of step {stale.data_position} is not used; "
        "the state comes from a live worker",
        timeout=5,
    )
    assert "resumed " not in again.output, again.output
    for w in (n0, n1, again):
        assert w.wait(120) == 0, w.output
    assert coord.wait(60) == 0, coord.output
    final = _assert_same_state(_checkpoint(tmp_path / "n0", "n0"), _checkpoint(tmp_path / "n2", "n2"))
    _assert_same_state(_checkpoint(tmp_path / "n0", "n0"), _checkpoint(tmp_path / "n1", "n1"))
    assert (final.step, final.data_position) == (STEPS - 1, STEPS)
    # metrics.jsonl is appended to: the first run's steps, then the replacement's from `step`.
    steps = [m["step"] for m in _metrics(tmp_path / "n2")]
    cut = steps.index(step)
    assert steps[cut:] == list(range(step, STEPS)), steps
    assert steps[:cut] == list(range(cut)) and cut >= 21, steps


def _launch(processes: ProcessGroup, out: Path, *args: str, steps: int) -> ManagedProcess:
    return processes.gradserver(
        "launch",
        "--workers",
        "3",
        *tiny_training(steps),
        "--out",
        str(out),
        "--no-progress",
        *args,
        name="launch",
    )


def _worker_pid(launch: ManagedProcess, node: str) -> int:
    """The pid of launch's worker `node` (local-N), found in /proc."""
    found = [
        pid
        for pid, cmdline in descendants(launch.proc.pid).items()
        if re.search(rf" worker .*--node-id {node}(\s|$)", cmdline)
    ]
    assert len(found) == 1, (node, descendants(launch.proc.pid))
    return found[0]


def test_launch_restarts_a_killed_worker_which_takes_a_live_workers_state(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    steps = 800  # the survivors must still run when the restarted worker joins, on a busy machine too
    launch = _launch(processes, tmp_path, "--restart-lost", "1", "--run-timeout", "150", steps=steps)
    launch.wait_for(r"^\[local-1\] .*worker \d+ step 20:", timeout=60)
    os.kill(_worker_pid(launch, "local-1"), signal.SIGKILL)
    launch.wait_for(r"^launch: local-1 was killed by SIGKILL; restarting it \(0 restart\(s\) left\)$", 30)
    took = launch.wait_for(r"^\[local-1\] .*worker (\d+): took the state of step (\d+) from worker (\d+)", 60)
    assert took.group(1) != took.group(3) and int(took.group(2)) > 20, took.group(0)
    assert launch.wait(120) == 0, launch.output
    assert launch.lines[-1] == "launch: all processes finished", launch.output
    paths = sorted(tmp_path.glob("checkpoint-*.pt"))
    assert [p.name for p in paths] == [f"checkpoint-local-{i}.pt" for i in range(3)]
    final = _assert_same_state(paths[0], paths[1])
    _assert_same_state(paths[0], paths[2])
    assert (final.step, final.data_position) == (steps - 1, steps)


def _lose_two_workers(processes: ProcessGroup, out: Path, second: str) -> tuple[ManagedProcess, list[int]]:
    """A launch with one restart: local-1 is killed and restarted; once it has taken the state,
    `second` is killed. Returns the launch and the pids of what it had started then."""
    launch = _launch(processes, out, "--restart-lost", "1", "--run-timeout", "150", steps=100_000)
    launch.wait_for(r"^\[local-1\] .*worker \d+ step 20:", timeout=60)
    os.kill(_worker_pid(launch, "local-1"), signal.SIGKILL)
    launch.wait_for(r"^launch: local-1 was killed by SIGKILL; restarting it \(0 restart\(s\) left\)$", 30)
    launch.wait_for(r"^\[local-1\] .*worker \d+: took the state of step \d+ from worker \d+", 60)
    started = list(descendants(launch.proc.pid))
    os.kill(_worker_pid(launch, second), signal.SIGKILL)
    return launch, started


def test_launch_ends_the_job_when_the_restarted_worker_is_lost_again(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    launch, started = _lose_two_workers(processes, tmp_path, "local-1")
    assert launch.wait(60) == 1, launch.output
    assert launch.lines[-1] == "launch: local-1 was killed by SIGKILL", launch.output
    assert launch.output.count("restarting it") == 1, launch.output
    assert not [pid for pid in started if pid_alive(pid)], launch.output


def test_launch_names_the_second_lost_worker_when_the_restarts_are_spent(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    launch, started = _lose_two_workers(processes, tmp_path, "local-2")
    assert launch.wait(60) == 1, launch.output
    assert launch.output.count("restarting it") == 1, launch.output
    assert not [pid for pid in started if pid_alive(pid)], launch.output
    assert launch.lines[-1] == "launch: local-2 was killed by SIGKILL", launch.output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--restart-lost", "-1"], "--restart-lost must not be negative, got -1"),
        (
            ["--restart-lost", "1", "--in-process"],
            "--restart-lost needs worker processes that train through a coordinator",
        ),
        (
            ["--restart-lost", "1", "--engine", "gloo"],
            "--restart-lost needs worker processes that train through a coordinator",
        ),
    ],
)
def test_launch_refuses_restarts_it_cannot_heal(
    processes: ProcessGroup, flags: list[str], message: str
) -> None:
    launch = processes.gradserver(
        "launch", "--workers", "2", "--steps", "2", "--no-progress", *flags, name="launch"
    )
    assert launch.wait(60) == 2, launch.output
    lines = [line for line in launch.lines if line.strip()]
    assert len(lines) == 1 and message in lines[0], launch.output
