"""Workers on one host: the coordinator tells each joiner how many workers share its host, each
worker logs how many torch threads it uses and why, and workers started by hand on one host share
its cores."""

from __future__ import annotations

import pytest

from gradserver.server import coordinator as coordinator_module

from .helpers.processes import ProcessGroup
from .helpers.server import connect_all
from .helpers.training import train_worker


def test_join_reports_how_many_workers_share_the_joiners_host(coordinator) -> None:
    server = coordinator(world_size=2, heartbeat_timeout=60.0)
    clients = connect_all(server.address, 2)
    try:
        assert [c.local_workers for c in clients] == [2, 2]
    finally:
        for client in clients:
            client.close()


def test_peer_host_drops_the_port() -> None:
    peer_host = coordinator_module.peer_host
    assert peer_host("ipv4:127.0.0.1:5555") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:5555") == "ipv6:[::1]"
    assert peer_host("ipv6:%5B::1%5D:5555") == "ipv6:%5B::1%5D"
    assert peer_host("unix:/tmp/socket") == peer_host("unix-abstract:x") == "unix"


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
