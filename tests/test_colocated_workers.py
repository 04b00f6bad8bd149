"""Workers on one host: each logs how many torch threads it uses and why, and workers started by
hand on one host share its cores."""

from __future__ import annotations

import pytest

from .helpers.processes import ProcessGroup
from .helpers.training import train_worker


@pytest.mark.processes
def test_a_worker_logs_its_thread_count(processes: ProcessGroup) -> None:
    _coord, address = processes.coordinator("--world-size", "1", "--max-steps", "1")
    worker = train_worker(processes, address, "w", "--threads", "1", steps=1)
    assert worker.wait(240) == 0, worker.output
    worker.wait_for(r"using 1 torch threads \(--threads\)", timeout=5)


@pytest.mark.processes
def test_workers_started_by_hand_on_one_host_share_its_cores(processes: ProcessGroup) -> None:
    """Without --threads or OMP_NUM_THREADS, each of two workers on this host takes half the
    cores (the coordinator reports 2 local workers at Join)."""
    from gradserver.train.cli import available_cores

    _coord, address = processes.coordinator("--world-size", "2", "--max-steps", "1")
    workers = [train_worker(processes, address, f"w{i}", steps=1, threads=None) for i in range(2)]
    cores = available_cores()
    for w in workers:
        assert w.wait(240) == 0, w.output
        w.wait_for(
            rf"using {max(1, cores // 2)} torch threads \({cores} cores / 2 workers on this host\)", timeout=5
        )
