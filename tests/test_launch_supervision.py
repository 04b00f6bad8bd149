"""`gradserver launch --restart-lost` supervises like `gradserver run` (one supervision,
gradserver.train.supervision): a killed coordinator is started again on its port and the workers
(with --reconnect-timeout) rejoin it and finish the job, and a worker the coordinator declared lost
while it still runs is stopped and started again. Real processes; every test checks that nothing
launch started is left running."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers.processes import ManagedProcess, ProcessGroup, descendants, pid_alive
from .helpers.training import assert_identical_checkpoints, tiny_training

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

_STARTED = re.compile(r"started \S+ \(pid (\d+)\)")


@contextlib.contextmanager
def _launch(
    processes: ProcessGroup, out: Path, *args: str, steps: int, env: dict[str, str | None] | None = None
) -> Iterator[ManagedProcess]:
    """Two workers with one restart; every process launch started is gone afterwards."""
    launch = processes.gradserver(
        "launch",
        "--workers",
        "2",
        *tiny_training(steps),
        "--out",
        str(out),
        "--no-progress",
        "--restart-lost",
        "1",
        "--run-timeout",
        "240",
        *args,
        name="launch",
        env=env,
    )
    try:
        yield launch
    finally:
        launch.ensure_ended()
        for pid in _STARTED.findall(launch.output):
            if pid_alive(int(pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _pid(launch: ManagedProcess, pattern: str) -> int:
    """The pid of the one process launch started whose command line matches `pattern`."""
    found = [pid for pid, cmdline in descendants(launch.proc.pid).items() if re.search(pattern, cmdline)]
    assert len(found) == 1, (pattern, descendants(launch.proc.pid))
    return found[0]


def test_a_killed_coordinator_is_started_again_and_the_workers_rejoin_and_finish(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    steps = 60
    with _launch(processes, tmp_path, "--", "--reconnect-timeout", "60", steps=steps) as launch:
        launch.wait_for(r"^\[local-\d\] .*worker \d+ step 2:", timeout=180)
        started = set(descendants(launch.proc.pid))
        os.kill(_pid(launch, r" coordinator "), signal.SIGKILL)
        again = r"starting it again on its port \(0 restart\(s\) left\)$"
        launch.wait_for(rf"^launch: coordinator was killed by SIGKILL; {again}", 60)
        assert launch.wait(200) == 0, launch.output
        assert launch.lines[-1] == "launch: all processes finished", launch.output
        for node in ("local-0", "local-1"):
            assert re.search(rf"^\[{node}\] .*rejoining", launch.output, re.MULTILINE), launch.output
        assert launch.output.count("restarting it") == 0, launch.output  # no worker was lost
        states = assert_identical_checkpoints(tmp_path, 2)
        assert states[0].data_position == states[1].data_position == steps
        assert not [pid for pid in started if pid_alive(pid)], launch.output


def test_without_reconnect_a_killed_coordinator_ends_the_job_naming_it(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Workers that do not rejoin a coordinator would only fail against a new one: it is not
    started again, and the job ends as before."""
    with _launch(processes, tmp_path, steps=100_000) as launch:
        launch.wait_for(r"^\[local-\d\] .*worker \d+ step 2:", timeout=180)
        started = set(descendants(launch.proc.pid))
        os.kill(_pid(launch, r" coordinator "), signal.SIGKILL)
        assert launch.wait(60) == 1, launch.output
        assert launch.lines[-1] == "launch: coordinator was killed by SIGKILL", launch.output
        assert "starting it again" not in launch.output, launch.output
        assert not [pid for pid in started if pid_alive(pid)], launch.output


def test_a_lost_worker_that_still_runs_is_stopped_and_started_again(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """local-1 is stopped (SIGSTOP): the coordinator declares it lost after the heartbeat
    timeout while its process still exists; launch kills it, starts it again, and the replacement
    takes local-0's state. The job (far from its last step) then ends on SIGTERM, forwarded to
    every process."""
    env: dict[str, str | None] = {"GRADSERVER_HEARTBEAT_TIMEOUT": "2"}
    with _launch(processes, tmp_path, steps=100_000, env=env) as launch:
        launch.wait_for(r"^\[local-1\] .*worker \d+ step 2:", timeout=180)
        stopped = _pid(launch, r" worker .*--node-id local-1(\s|$)")
        os.kill(stopped, signal.SIGSTOP)
        launch.wait_for(r"^launch: local-1 was lost \(.+\); stopping it$", 60)
        launch.wait_for(r"^launch: local-1 was killed by SIGKILL; restarting it \(0 restart\(s\) left\)$", 30)
        took = launch.wait_for(
            r"^\[local-1\] .*worker (\d+): took the state of step (\d+) from worker (\d+)", 120
        )
        assert took.group(1) != took.group(2), took.group(0)
        assert not pid_alive(stopped)
        started = set(descendants(launch.proc.pid))
        launch.terminate()
        assert launch.wait(60) == 128 + signal.SIGTERM, launch.output
        assert launch.lines[-1] == "launch: stopped by SIGTERM", launch.output
        assert not [pid for pid in started if pid_alive(pid)], launch.output
