"""Supervising a job's processes: the last line names what failed (from the coordinator's
verdict, not from whichever process exited first), and a coordinator started for a process does
not outlive it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from gradserver.train.launch import Child, error_line, start_child, verdict
from gradserver.worker.local_coordinator import LostWorker

from .helpers.processes import ProcessGroup, descendants, pid_alive

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
    lost = {"event": "worker_lost", "worker": 1, "node": "local-1", "reason": "lost: no message for 2.0 s"}
    events.write_text(json.dumps({"event": "job_ended", "state": "failed", "reason": "x"}) + "\n")
    with events.open("a") as out:
        out.write(json.dumps(lost) + "\n")
    survivor = _failed_child("rank 0")
    line = verdict(survivor, events, lambda w: f"rank {w.worker}")
    assert line == (
        "rank 1 was lost (lost: no message for 2.0 s); "
        "rank 0 exited with code 1: RuntimeError: my collective failed"
    )
    # The lost one itself exiting first: its own ending says it; no verdict at all: the child's.
    assert verdict(_failed_child("rank 1"), events, lambda w: f"rank {w.worker}").startswith(
        "rank 1 exited with code 1"
    )
    started = time.monotonic()
    assert verdict(survivor, tmp_path / "none", lambda w: "?").startswith("rank 0 exited")
    assert time.monotonic() - started < 5  # waits a moment for a verdict, no more
    assert LostWorker(1, "local-1", "x").node == "local-1"


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
