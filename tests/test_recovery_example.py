"""examples/live_recovery.py as a user runs it: three workers of a custom loop, one SIGKILLed and
started again with the same command; it takes the live state and every worker ends with the same
state digest."""

from __future__ import annotations

import re
import sys

import pytest

from .helpers.processes import ROOT, ManagedProcess, ProcessGroup

pytestmark = pytest.mark.processes

STEPS = 2500


def _example(processes: ProcessGroup, address: str, name: str) -> ManagedProcess:
    argv = [sys.executable, str(ROOT / "examples" / "live_recovery.py"), "--coordinator", address]
    return processes.start([*argv, "--steps", str(STEPS)], name, env={"OMP_NUM_THREADS": "1"})


def test_a_killed_worker_of_a_custom_loop_comes_back_with_the_live_state(processes: ProcessGroup) -> None:
    coord, address = processes.coordinator("--world-size", "3", "--on-worker-loss", "continue")
    first = [_example(processes, address, f"w{i}") for i in range(3)]
    victim = first[2]
    victim.wait_for(r"worker \d step 200:", timeout=120)
    victim.kill()
    again = _example(processes, address, "w2-again")
    joined = again.wait_for(r"worker (\d): joined at step (\d+), state from worker (\d)", timeout=120)
    assert 200 <= int(joined[2]) < STEPS
    digests = set()
    for proc in [first[0], first[1], again]:
        assert proc.wait(180) == 0, proc.output
        final = re.search(rf"worker \d: {STEPS} steps, loss \S+, digest (0x[0-9a-f]+)", proc.output)
        assert final is not None, proc.output
        digests.add(final[1])
    assert len(digests) == 1, digests
    coord.kill()
