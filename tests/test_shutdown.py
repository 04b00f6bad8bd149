"""Graceful shutdown: a stop with workers connected returns as soon as their streams end and
counts none of them as lost; SIGTERM on the coordinator CLI drains, tells the workers why and
exits 0."""

from __future__ import annotations

import logging
import time

import pytest

from .helpers.server import connect_all, metric, run_each


def test_graceful_stop_returns_when_the_streams_end_and_loses_nobody(coordinator, caplog) -> None:
    """A stop with connected workers does not wait the whole drain timeout, and counts none of
    them as lost (no WARNING)."""
    caplog.set_level(logging.INFO)
    server = coordinator(world_size=2, drain_timeout=30.0, heartbeat_timeout=60.0)
    clients = connect_all(server.address, 2)
    try:
        run_each(clients, lambda c: c.barrier(0, "ready"))
        started = time.monotonic()
        server.stop(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        for client in clients:
            client.close()
    assert elapsed < 10.0, f"stop took {elapsed:.1f} s with a drain timeout of 30 s"
    assert metric(server.server, "gradserver_workers_lost_total") == 0
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("gradserver.server") and r.levelno >= logging.WARNING
    ]
    assert warnings == []


@pytest.mark.processes
def test_sigterm_drains_tells_the_workers_and_exits_zero(processes) -> None:
    coord, address = processes.coordinator("--world-size", "2", "--drain-timeout", "5")
    workers = [
        processes.gradserver(
            "worker", "--job", "synthetic", "--coordinator", address, "--steps", "100000", name=f"w{i}"
        )
        for i in range(2)
    ]
    for w in workers:
        w.wait_for(r"step 3:")
    coord.terminate()
    assert coord.wait(30) == 0, coord.output
    assert "shutting down: received SIGTERM" in coord.output
    for w in workers:
        assert w.wait(30) != 0
        assert "shutting down: received SIGTERM" in w.output, w.output
