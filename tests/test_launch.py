"""`gradserver launch` supervises its job: it stops the coordinator and every worker as soon as
one worker fails or is killed, and its last line names the worker that failed (the one the
coordinator lost, not a survivor that exited after it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from .helpers.processes import ManagedProcess, ProcessGroup, descendants, pid_alive
from .helpers.training import tiny_training

# A launch trains twice (up to 240 s and 150 s by its own bounds): more than the global timeout.
pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

_STARTED = re.compile(r"started (\S+) \(pid (\d+)\)")


def _launch(
    processes: ProcessGroup, out: Path, *args: str, steps: int, env: dict[str, str | None] | None = None
) -> ManagedProcess:
    return processes.gradserver(
        "launch",
        "--workers",
        "2",
        *tiny_training(steps),
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
