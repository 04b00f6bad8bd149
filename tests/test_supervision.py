"""Supervising a job's processes: the last line names what failed (from the coordinator's
verdict, not from whichever process exited first), and a coordinator started for a process does
not outlive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from gradserver.server.shm import remove_stale_dirs
from gradserver.worker.local_coordinator import LostWorker, remove_shm_dirs, verdict
from gradserver.worker.supervisor import Child, error_line, start_child, stop

from .helpers.processes import ManagedProcess, ProcessGroup, descendants, pid_alive

pytestmark = pytest.mark.timeout(120)


def test_an_exception_line_is_found_through_torchs_rank_prefix() -> None:
    lines = [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "train.py", line 3, in <module>',
        "[rank1]:     raise RuntimeError('boom')",
        "[rank1]: RuntimeError: boom",
    ]
    assert error_line(lines) == "RuntimeError: boom"
    assert error_line(["Traceback (most recent call last):", '  File "x"', "ValueError: plain"]) == (
        "ValueError: plain"
    )


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


def _failed_child(name: str) -> Child:
    child = start_child(
        [sys.executable, "-c", "raise RuntimeError('my collective failed')"], name, lambda prefix, line: None
    )
    child.proc.wait(60)
    child.finish_output()
    return child


def test_the_verdict_names_the_worker_the_coordinator_lost_before_the_survivor_that_exited(
    tmp_path: Path,
) -> None:
    events = tmp_path / "events"
    lost = {
        "event": "worker_lost",
        "worker": 1,
        "node": "local-1",
        "reason": "lost: no message for 2.0 s",
        "step": 25,
    }
    events.write_text(json.dumps({"event": "job_ended", "state": "failed", "reason": "x"}) + "\n")
    with events.open("a") as out:
        out.write(json.dumps(lost) + "\n")
    survivor = _failed_child("rank 0")
    culprit, line = verdict(survivor, events, lambda w: f"rank {w.worker}", unit="operation")
    assert culprit is survivor
    assert line == (
        "rank 1 was lost at operation 25 (lost: no message for 2.0 s); "
        "rank 0 exited with code 1: RuntimeError: my collective failed"
    )
    # The lost one itself exiting first: its own ending says it; no verdict at all: the child's.
    lost_one = _failed_child("rank 1")
    assert verdict(lost_one, events, lambda w: f"rank {w.worker}")[1].startswith("rank 1 exited with code 1")
    # The lost one had already ended by itself (crashed, killed) when a survivor's exit is read:
    # its ending, not 'lost', and its code.
    assert verdict(survivor, events, lambda w: f"rank {w.worker}", [survivor, lost_one]) == (
        lost_one,
        "rank 1 exited with code 1: RuntimeError: my collective failed",
    )
    started = time.monotonic()
    assert verdict(survivor, tmp_path / "none", lambda w: "?")[1].startswith("rank 0 exited")
    assert time.monotonic() - started < 5  # waits a moment for a verdict, no more
    assert LostWorker(1, "local-1", "x").step is None


RANK_SCRIPT = """
import sys, time
import torch, torch.distributed as dist
dist.init_process_group("gradserver")
for step in range(600):
    dist.all_reduce(torch.ones(4))
    print(f"STEP {step}", flush=True)
    time.sleep(0.05)
"""


@pytest.mark.processes
def test_a_sigkilled_rank_0_takes_its_embedded_coordinator_along_and_leaves_nothing(tmp_path: Path) -> None:
    """Without GRADSERVER_COORDINATOR rank 0 starts the coordinator: killed, it used to leave it
    running for a minute and its port directory for good."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = ProcessGroup(tmp_path)
    try:
        env = {
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GRADSERVER_COORDINATOR": None,
            "GRADSERVER_HEARTBEAT_TIMEOUT": "2",
            "TMPDIR": str(tmp),
        }
        ranks = [
            processes.start([sys.executable, str(script)], f"rank {r}", {**env, "RANK": str(r)})
            for r in (0, 1)
        ]
        ranks[0].wait_for("^STEP 3$", timeout=90)
        coordinators = [pid for pid, cmd in descendants(ranks[0].proc.pid).items() if " coordinator " in cmd]
        assert len(coordinators) == 1, descendants(ranks[0].proc.pid)
        assert not any(p.name.startswith("gradserver-pg-") for p in tmp.iterdir())  # gone once read
        os.kill(ranks[0].proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while pid_alive(coordinators[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(coordinators[0]), "the coordinator outlived the rank that started it"
        assert ranks[1].wait(30) != 0
        # Rank 1 hears first either that rank 0 (worker 0) is gone or that the coordinator stopped.
        error = ranks[1].output.split("Traceback (most recent call last)")[-1]
        assert "worker 0 disconnected" in error or "coordinator's parent process" in error, error
        deadline = time.monotonic() + 10
        while [p for p in tmp.iterdir() if p.name.startswith("gradserver")] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p.name for p in tmp.iterdir() if p.name.startswith("gradserver")]
    finally:
        processes.close()


STARTED = re.compile(r"started (coordinator|rank \d+) \(pid (\d+)\)")


def _started(proc: ManagedProcess) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in map(STARTED.search, proc.lines) if m}


def _kill_all(pids: Iterable[int]) -> None:
    """Ends what a failed test left (a stopped process takes SIGKILL too)."""
    for pid in pids:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _shm_dirs(parent: Path, pid: int | None = None) -> list[str]:
    prefix = "gradserver-shm-" if pid is None else f"gradserver-shm-{pid}-"
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(prefix))


# Rank 1 fails: with a plain traceback (no torch), or under torch, which prefixes every line of a
# failing rank's output with "[rank1]: ". Rank 0 ends at once (its part is done).
PLAIN_FAILURE = """
import os
if os.environ["RANK"] == "1":
    raise RuntimeError("boom")
"""
TORCH_FAILURE = """
import torch, torch.distributed as dist
dist.init_process_group("gradserver")
dist.all_reduce(torch.ones(2))
if dist.get_rank() == 1:
    raise RuntimeError("boom")
dist.destroy_process_group()
"""


@pytest.mark.processes
@pytest.mark.parametrize("script", [PLAIN_FAILURE, TORCH_FAILURE], ids=["plain", "torch-rank-prefix"])
def test_run_ends_with_the_exception_line_of_the_rank_that_raised(
    processes: ProcessGroup, tmp_path: Path, script: str
) -> None:
    path = tmp_path / "rank.py"
    path.write_text(script)
    run = processes.gradserver("run", "--workers", "2", "--", sys.executable, str(path), name="run")
    try:
        assert run.wait(90) == 1, run.output
        if script is TORCH_FAILURE:
            assert "[rank 1] [rank1]: RuntimeError: boom" in run.lines, run.output
        assert run.lines[-1] == "run: rank 1 exited with code 1: RuntimeError: boom", run.output
        assert not [pid for pid in _started(run).values() if pid_alive(pid)]
    finally:
        _kill_all(_started(run).values())


@pytest.mark.processes
def test_run_names_the_rank_the_coordinator_lost_not_the_survivor_that_exited(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Rank 1 is stopped: the coordinator evicts it after the heartbeat timeout and fails rank
    0's collective, so rank 0 is the first to exit; the last line must name rank 1."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    heartbeat = 2.0
    run = processes.gradserver(
        "run",
        "--workers",
        "2",
        "--heartbeat-timeout",
        f"{heartbeat:g}",
        "--",
        sys.executable,
        str(script),
        name="run",
    )
    try:
        run.wait_for(r"^\[rank 0\] STEP 3$", timeout=90)
        os.kill(_started(run)["rank 1"], signal.SIGSTOP)
        stopped = time.monotonic()
        # Eviction within 2.5 heartbeat timeouts, the survivor's exit, then stopping the rest
        # (the stopped rank is sent SIGCONT with its SIGTERM, so it takes no grace period).
        code = run.wait(2.5 * heartbeat + 20)
        elapsed = time.monotonic() - stopped
        assert code == 1, run.output
        last = run.lines[-1]
        # The reason is the coordinator's (no message for ..., or a keepalive's verdict while
        # it held the stopped rank's stream back); the operation is the collective in flight.
        assert re.fullmatch(
            r"run: rank 1 was lost at operation \d+ \(.+\); rank 0 exited with code 1: .+", last
        ), run.output
        assert elapsed < 2.5 * heartbeat + 15, f"run took {elapsed:.1f} s after the stop:\n{run.output}"
        assert not [pid for pid in _started(run).values() if pid_alive(pid)], run.output
    finally:
        _kill_all(_started(run).values())


@pytest.mark.processes
def test_a_coordinator_sigkilled_under_run_leaves_no_socket_directory(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The rank never uses the coordinator, so no worker of it removes the directory: run must."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    wait = "import threading; print('READY', flush=True); threading.Event().wait(120)"
    run = processes.gradserver(
        "run", "--workers", "1", "--", sys.executable, "-c", wait, name="run", env={"TMPDIR": str(tmp)}
    )
    try:
        run.wait_for(r"^\[rank 0\] READY$", timeout=60)
        coordinator = _started(run)["coordinator"]
        assert _shm_dirs(tmp, coordinator), sorted(p.name for p in tmp.iterdir())
        os.kill(coordinator, signal.SIGKILL)
        assert run.wait(60) == 1, run.output
        assert run.lines[-1] == "run: the coordinator was killed by SIGKILL", run.output
        assert _shm_dirs(tmp) == []
    finally:
        _kill_all(_started(run).values())


@pytest.mark.processes
def test_a_dead_coordinators_socket_directory_is_known_by_its_pid_and_removed_at_once(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    live, _ = processes.coordinator("--world-size", "1", "--shm-dir", str(tmp_path))
    dead, _ = processes.coordinator("--world-size", "1", "--shm-dir", str(tmp_path))
    (dead_dir,) = _shm_dirs(tmp_path, dead.proc.pid)
    assert _shm_dirs(tmp_path, live.proc.pid)
    dead.kill()
    dead.wait(30)
    # Another coordinator on that directory needs no minute to know it for a dead one's.
    assert remove_stale_dirs(str(tmp_path)) == [str(tmp_path / dead_dir)]
    (tmp_path / dead_dir).mkdir(mode=0o700)  # as if left again
    assert remove_shm_dirs(live.proc.pid, str(tmp_path)) is None  # alive: kept
    remove_shm_dirs(dead.proc.pid, str(tmp_path))
    assert _shm_dirs(tmp_path) == _shm_dirs(tmp_path, live.proc.pid) != []


@pytest.mark.processes
def test_an_embedded_coordinator_that_was_sigkilled_leaves_no_socket_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradserver.torch._coordinator import EmbeddedCoordinator

    monkeypatch.setenv("GRADSERVER_SHM_DIR", str(tmp_path))
    embedded = EmbeddedCoordinator(1, 30.0)
    try:
        pid = embedded._process.pid
        assert _shm_dirs(tmp_path, pid)
        os.kill(pid, signal.SIGKILL)
        embedded._process.wait(30)
    finally:
        embedded.stop()
    assert _shm_dirs(tmp_path) == []


# --- the supervisor itself and the workers' progress channel --------------------------------------


def test_stop_escalates_to_sigkill_for_a_child_that_ignores_sigterm() -> None:
    ignores = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(600)"
    )
    ready: list[str] = []
    child = Child([sys.executable, "-c", ignores], "stubborn", lambda prefix, line: ready.append(line))
    deadline = time.monotonic() + 30
    while not ready and child.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polls for the child's own word that its handler is set, bounded
    assert ready, f"the child never said it was ready (exit {child.proc.poll()})"
    started = time.monotonic()
    stop([child], grace_s=0.5)
    assert child.proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10
    assert child.failure() == "stubborn was killed by SIGKILL"


def test_a_child_gets_its_environment_with_the_removed_variables_gone(monkeypatch) -> None:
    monkeypatch.setenv("GRADSERVER_TLS_CERT", "server.crt")
    lines: list[str] = []
    show = "import os; print(os.environ.get('GRADSERVER_TLS_CERT', '-'), os.environ['EXTRA'])"
    child = Child(
        [sys.executable, "-c", show],
        "env",
        lambda p, line: lines.append(line.strip()),
        {"GRADSERVER_TLS_CERT": None, "EXTRA": "yes"},
    )
    child.proc.wait(60)
    child.finish_output()
    assert lines == ["- yes"]


@pytest.mark.processes
def test_launch_follows_its_workers_progress_through_their_channel_not_their_output(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The bar reaches the last step from rank 0's --progress-fd; no worker prints progress."""
    launch = processes.gradserver(
        "launch", "--workers", "2", "--steps", "2", "--batch-size", "2", "--out", str(tmp_path), name="launch"
    )
    assert launch.wait(240) == 0, launch.output
    output = launch.output
    assert "PROGRESS" not in output
    assert re.search(r"2/2 \[.*loss=\d", output), output
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


# --- the supervision run and launch share (gradserver.train.supervision*) -------------------------


def test_a_replacement_that_found_the_job_finished_is_said_one_way() -> None:
    from gradserver.train.supervision_restarts import replacement_note

    loss = LostWorker(1, "local-1", "lost: no message for 2.0 s", step=12)
    assert replacement_note("local-1", loss, "step") == (
        "local-1 was lost at step 12 (lost: no message for 2.0 s) and its replacement found the job finished"
    )
    assert replacement_note("rank 1", LostWorker(1, "host/pid3", "cut off"), "operation") == (
        "rank 1 was lost (cut off) and its replacement found the job finished"
    )
    assert replacement_note("rank 1", None, "operation") == (
        "rank 1 ended and its replacement found the job finished"
    )


def test_the_coordinator_is_placed_on_this_machine_or_on_task_0_of_a_slurm_step() -> None:
    from gradserver.train.slurm import SlurmStep
    from gradserver.train.supervision_placement import coordinator_place

    alone = coordinator_place(None)
    assert (alone.here, alone.bind, alone.address(4321), alone.store_port) == (
        True,
        "127.0.0.1",
        "127.0.0.1:4321",
        None,
    )
    hosts = ("node1", "node2")
    second = SlurmStep(job_id=7, tasks=2, task=1, node=1, local_task=0, tasks_per_node=(1, 1), hosts=hosts)
    coordinator, store = second.ports()
    place = coordinator_place(second)
    assert not place.here and place.address() == f"node1:{coordinator}" and place.store_port == store
    first = coordinator_place(dataclasses.replace(second, task=0, node=0), port=20000)
    assert first.here and (first.bind, first.port, first.store_port) == ("0.0.0.0", 20000, 20001)


def test_a_setting_for_one_machine_is_refused_in_a_slurm_step_of_several_tasks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradserver.common.errors import InvalidArgumentError
    from gradserver.train.supervision_placement import job_step

    step = {
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_STEP_NODELIST": "localhost",
    }
    for name, value in step.items():
        monkeypatch.setenv(name, value)
    found = job_step(no_slurm=False)
    assert found is not None and (found.task, found.tasks) == (1, 2)
    why = "--in-process runs every worker in one process"
    assert job_step(no_slurm=True, one_machine_only=why) is None
    with pytest.raises(InvalidArgumentError) as refused:
        job_step(no_slurm=False, one_machine_only=why)
    assert refused.value.message == (
        f"{why}, and this SLURM step has 2 tasks: start one task, or give --no-slurm"
    )
