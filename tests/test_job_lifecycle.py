"""A job's life through the real CLIs: launch ends when a worker fails or is killed, workers that
disagree are refused at Join, a resume finds each worker's checkpoint by its node id whatever the
join order, co-located workers share the cores."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from gradserver.train.checkpoint import load_checkpoint

from .helpers.processes import ManagedProcess, ProcessGroup, descendants, pid_alive
from .helpers.training import assert_identical

pytestmark = pytest.mark.processes

_STARTED = re.compile(r"started (\S+) \(pid (\d+)\)")


def _launch(
    processes: ProcessGroup, out: Path, *args: str, steps: int, env: dict[str, str | None] | None = None
) -> ManagedProcess:
    return processes.gradserver(
        "launch",
        "--workers",
        "2",
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--no-progress",
        *args,
        name="launch",
        env=env,
    )


def _pids(launch: ManagedProcess) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for line in launch.lines if (m := _STARTED.search(line))}


def _children(launch: ManagedProcess) -> dict[str, int]:
    """The coordinator and workers launch started, by name, found in /proc (not its output)."""
    named = {}
    for pid, cmdline in descendants(launch.proc.pid).items():
        if " coordinator " in cmdline:
            named["coordinator"] = pid
        elif m := re.search(r" worker .*--node-id (local-\d+)", cmdline):
            named[m.group(1)] = pid
    return named


def _last_line(launch: ManagedProcess) -> str:
    return launch.lines[-1] if launch.lines else ""


def test_launch_stops_the_job_when_a_worker_fails(processes: ProcessGroup, tmp_path: Path) -> None:
    """local-0 fails at start (its checkpoint is local-1's); local-1 resumes and waits at Join
    for a world that cannot complete. Launch must stop it and the coordinator at once and name
    local-0's error, long before --timeout."""
    first = _launch(processes, tmp_path, steps=2)
    assert first.wait(240) == 0, first.output
    zero, one = sorted(tmp_path.glob("checkpoint-*.pt"))
    shutil.copy(one, zero)
    started = time.monotonic()
    launch = _launch(processes, tmp_path, "--run-timeout", "120", "--", "--resume", steps=4)
    code = launch.wait(150)
    elapsed = time.monotonic() - started
    assert code == 1, launch.output
    assert elapsed < 60, f"launch took {elapsed:.0f} s:\n{launch.output}"
    assert _last_line(launch) == (
        f"launch: local-0 exited with code 2: gradserver worker: {tmp_path}/checkpoint-local-0.pt "
        "was written by node 'local-1', not 'local-0'"
    ), launch.output
    pids = _pids(launch)
    assert set(pids) == {"coordinator", "local-0", "local-1"}, launch.output
    assert not [name for name, pid in pids.items() if pid_alive(pid)]


def test_launch_ends_when_a_worker_is_killed(processes: ProcessGroup, tmp_path: Path) -> None:
    launch = _launch(processes, tmp_path, "--run-timeout", "300", steps=100_000)
    launch.wait_for(r"^\[local-\d\] .*worker \d+ step 2:", timeout=180)
    pids = _children(launch)
    assert set(pids) == {"coordinator", "local-0", "local-1"}, pids
    os.kill(pids["local-1"], signal.SIGKILL)
    started = time.monotonic()
    code = launch.wait(120)
    elapsed = time.monotonic() - started
    assert code == 1, launch.output
    assert elapsed < 60, f"launch took {elapsed:.0f} s after the kill:\n{launch.output}"
    assert _last_line(launch) == "launch: local-1 was killed by SIGKILL", launch.output
    assert not [name for name, pid in pids.items() if pid_alive(pid)]


def test_launch_names_the_worker_the_coordinator_lost_not_the_survivor_that_exited(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """local-1 is stopped: the coordinator evicts it after the heartbeat timeout and fails
    local-0's step, so local-0 is the first to exit; the last line must name local-1."""
    heartbeat = 2.0
    env: dict[str, str | None] = {"GRADSERVER_HEARTBEAT_TIMEOUT": f"{heartbeat:g}"}
    launch = _launch(processes, tmp_path, "--run-timeout", "300", steps=100_000, env=env)
    launch.wait_for(r"^\[local-\d\] .*worker \d+ step 2:", timeout=180)
    pids = _children(launch)
    assert set(pids) == {"coordinator", "local-0", "local-1"}, pids
    try:
        os.kill(pids["local-1"], signal.SIGSTOP)
        started = time.monotonic()
        code = launch.wait(120)
        elapsed = time.monotonic() - started
        assert code == 1, launch.output
        assert re.fullmatch(
            r"launch: local-1 was lost at step \d+ \(.+\); local-0 exited with code 1: .+", _last_line(launch)
        ), launch.output
        # The stopped worker is sent SIGCONT with its SIGTERM: it takes no grace period.
        assert elapsed < 2.5 * heartbeat + 30, f"launch took {elapsed:.0f} s after the stop:\n{launch.output}"
        assert not [name for name, pid in pids.items() if pid_alive(pid)]
    finally:
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


# --- workers that must agree ----------------------------------------------------------------------


def _train_worker(
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
        "--model",
        "tiny",
        "--batch-size",
        "2",
        "--steps",
        str(steps),
        *flags,
        name=name,
        env={"OMP_NUM_THREADS": threads},
    )


@pytest.mark.parametrize(
    ("flags", "field", "ours", "job"),
    [
        (["--seed", "1"], "seed", "1", "0"),
        (["--lr", "0.01"], "lr", "0.01", "0.003"),
        (["--model", "small"], "model.name", "small", "tiny"),
    ],
)
def test_a_worker_with_different_settings_is_refused_at_join(
    coordinator, processes: ProcessGroup, flags: list[str], field: str, ours: str, job: str
) -> None:
    """Whichever joins second is refused, naming the field with both values (its own first)."""
    server = coordinator(world_size=2, join_timeout=60.0)
    same = _train_worker(processes, server.address, "same")
    other = _train_worker(processes, server.address, "other", *flags)
    refused = processes.wait_any([same, other], timeout=120)
    assert refused.proc.returncode not in (0, None), refused.output
    own, theirs = (ours, job) if refused is other else (job, ours)
    assert re.search(rf"{re.escape(field)} {re.escape(own)} != {re.escape(theirs)}", refused.output), (
        refused.output
    )


# --- resume by identity ---------------------------------------------------------------------------


def _start_in_order(
    processes: ProcessGroup, coord: ManagedProcess, address: str, order: list[str], out: Path, *flags: str
) -> dict[str, ManagedProcess]:
    """Workers named `order`, each with its own --out, joined in that order (each start waits
    until the coordinator has logged the previous worker's join)."""
    workers = {}
    for i, name in enumerate(order):
        workers[name] = _train_worker(
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
    a = _train_worker(processes, address, "a", "--node-id", "a", "--out", str(tmp_path), steps=1)
    assert a.wait(240) == 0, a.output
    b = _train_worker(processes, "127.0.0.1:9", "b", "--node-id", "b", "--out", str(tmp_path), "--resume")
    assert b.wait(120) == 2, b.output
    assert f"{tmp_path} has no checkpoint of node 'b' (checkpoint-b.pt) but has checkpoint-a.pt" in b.output


# --- threads --------------------------------------------------------------------------------------


def test_a_worker_logs_its_thread_count(processes: ProcessGroup) -> None:
    _coord, address = processes.coordinator("--world-size", "1", "--max-steps", "1")
    worker = _train_worker(processes, address, "w", "--threads", "1", steps=1)
    assert worker.wait(240) == 0, worker.output
    worker.wait_for(r"using 1 torch threads \(--threads\)", timeout=5)


def test_workers_started_by_hand_on_one_host_share_its_cores(processes: ProcessGroup) -> None:
    """Without --threads or OMP_NUM_THREADS, each of two workers on this host takes half the
    cores (the coordinator reports 2 local workers at Join)."""
    from gradserver.train.cli import available_cores

    _coord, address = processes.coordinator("--world-size", "2", "--max-steps", "1")
    workers = [_train_worker(processes, address, f"w{i}", steps=1, threads=None) for i in range(2)]
    cores = available_cores()
    for w in workers:
        assert w.wait(240) == 0, w.output
        w.wait_for(
            rf"using {max(1, cores // 2)} torch threads \({cores} cores / 2 workers on this host\)", timeout=5
        )


# --- launch's one line ----------------------------------------------------------------------------


def test_launch_names_the_exception_line_of_a_traceback() -> None:
    from gradserver.worker.supervisor import error_line

    traceback = [
        "2026-01-01 INFO [worker] starting",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "    raise KeyError('a')",
        "KeyError: 'a'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "x.py", line 3, in <module>',
        "RuntimeError: boom",
        "some line printed after",
    ]
    assert error_line(traceback) == "RuntimeError: boom"
    assert error_line(["log", "gradserver worker: --out 'x' is not a directory", "log"]) == (
        "gradserver worker: --out 'x' is not a directory"
    )
    assert error_line(["2026-01-01 INFO [worker] nothing wrong"]) == ""
