"""A job's life on the coordinator: a job always ends (finished: exit 0; failed: exit 1 with one
line naming the cause), a lost worker replaced in time keeps it running, --max-steps is an
absolute step number, and a fresh job after a clean end keeps nothing of the old one."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping

import grpc
import numpy as np
import pytest

from gradserver.common.components import NonBlockComponent
from gradserver.common.messages import BarrierIn, LeaveIn, TensorKey
from gradserver.server import GradientServer
from gradserver.train.synthetic import SHAPES, run_exchange
from gradserver.worker import WorkerClient

from .helpers.fingerprints import JOB
from .helpers.logwait import log_waiter
from .helpers.raw import RawWorker, join
from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_all, run_each


def _state(server: ServerThread) -> str:
    return server.call(lambda s: s.state.value)


def _wait_ended(server: ServerThread, timeout: float = 30.0) -> GradientServer:
    """The coordinator stopped by itself (its thread ends when it stops)."""
    server._thread.join(timeout)
    assert not server._thread.is_alive(), "the coordinator did not stop by itself"
    assert server.server is not None
    return server.server


# --- a job always ends ---------------------------------------------------------------------------


def test_all_workers_lost_fails_the_job_after_the_rejoin_timeout(coordinator) -> None:
    server = coordinator(world_size=2, rejoin_timeout=1.5, heartbeat_timeout=60.0)
    with log_waiter() as logs:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            raws = [RawWorker(*f.result(30)) for f in [pool.submit(join, server.address) for _ in range(2)]]
        for raw in raws:
            raw.close()  # the stream ends without a goodbye: lost
        ended = _wait_ended(server)
        failed = [r for r in logs.records if r.levelno >= logging.ERROR]
    assert ended.state.value == "failed" and ended.exit_code == 1
    assert logs.matching(r"job running -> restarting")
    assert len(failed) == 1, [r.getMessage() for r in failed]
    line = failed[0].getMessage()
    assert "--rejoin-timeout 1.5 s" in line
    assert "worker 0 disconnected" in line and "worker 1 disconnected" in line
    sample = ended.metrics.registry.get_sample_value
    assert sample("gradserver_job_state", {"gradserver_job_state": "failed"}) == 1


def test_a_lost_worker_replaced_in_time_keeps_the_job_running(coordinator) -> None:
    server = coordinator(world_size=2, rejoin_timeout=30.0, heartbeat_timeout=60.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        raws = [RawWorker(*f.result(30)) for f in [pool.submit(join, server.address) for _ in range(2)]]
    raws.sort(key=lambda r: r.worker_id)
    with log_waiter() as logs:
        raws[1].close()
        logs.wait_for(r"job running -> restarting")
        replacement = RawWorker(*join(server.address, node_id="replacement"))
        logs.wait_for(r"job restarting -> running")
    try:
        assert replacement.worker_id == 1
        key = TensorKey.non_block(0, NonBlockComponent.FINAL_NORM)
        for raw in (raws[0], replacement):
            raw.send_tensor(key, np.ones(4, np.float32))
        assert all(_first_average(raw).key == key for raw in (raws[0], replacement))
    finally:
        raws[0].close()
        replacement.close()


def _first_average(raw: RawWorker):  # type: ignore[no-untyped-def]
    while True:
        event = raw.recv(20)
        assert not isinstance(event, grpc.RpcError), f"{event.code()}: {event.details()}"
        if hasattr(event, "data"):
            return event


def test_the_job_finishes_at_the_absolute_max_steps_also_when_resumed(coordinator) -> None:
    """--max-steps 5 with workers resumed at step 3 ends after step 4 (counting only this
    session's steps, it would never end)."""
    server = coordinator(world_size=2, max_steps=5, heartbeat_timeout=60.0)
    with log_waiter() as logs:
        clients = connect_all(server.address, 2)
        try:
            run_each(clients, lambda c: run_exchange(c, SHAPES["tiny"], 2, first_step=3))
        finally:
            for client in clients:
                client.close()
        ended = _wait_ended(server)
        assert logs.matching(r"reached --max-steps 5 at step 4")
    assert ended.state.value == "finished" and ended.exit_code == 0


def test_a_step_beyond_max_steps_is_refused(coordinator) -> None:
    server = coordinator(world_size=1, max_steps=2, heartbeat_timeout=60.0)
    raw = RawWorker(*join(server.address))
    try:
        raw.send_tensor(TensorKey.non_block(2, NonBlockComponent.FINAL_NORM), np.ones(4, np.float32))
        error = raw.recv_error()
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "--max-steps 2 ends the job after step 1" in error.message
        assert error.key == TensorKey.non_block(2, NonBlockComponent.FINAL_NORM)
        raw.send(BarrierIn(raw.worker_id, 3, "commit"))
        refused = raw.recv_error()
        assert refused.barrier_name == "commit" and refused.step == 3 and refused.key is None
    finally:
        raw.close()


def test_a_replacement_whose_join_waits_as_the_last_rank_leaves_is_told_the_job_finished(coordinator) -> None:
    """Issue 50 (--on-worker-loss continue): worker 2 is lost, worker 1 leaves, and a replacement
    joins (2 of 3: its Join waits for the world). When worker 0, the last that took part, leaves
    with a goodbye, the job has finished: the waiting Join is refused at once, saying so and at
    which step, and the coordinator ends with exit 0 instead of waiting --rejoin-timeout."""
    server = coordinator(world_size=3, on_worker_loss="continue", rejoin_timeout=60.0, heartbeat_timeout=60.0)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        raws = [RawWorker(*f.result(30)) for f in [pool.submit(join, server.address) for _ in range(3)]]
    raws.sort(key=lambda r: r.worker_id)
    for step in (0, 1):
        key = TensorKey.non_block(step, NonBlockComponent.FINAL_NORM)
        for raw in raws:
            raw.send_tensor(key, np.ones(4, np.float32))
        assert all(_first_average(raw).key == key for raw in raws)
    with log_waiter() as logs, concurrent.futures.ThreadPoolExecutor(1) as pool:
        raws[2].close()  # without a goodbye: lost
        logs.wait_for(r"worker 2 .* disconnected")
        raws[1].send(LeaveIn("done"))
        logs.wait_for(r"worker 1 .* left the job")
        late = pool.submit(join, server.address, "late")
        logs.wait_for(r"joined: node 'late'.*\(2 of 3\)")
        raws[0].send(LeaveIn("done"))
        with pytest.raises(grpc.RpcError) as refused:
            late.result(timeout=10)
        ended = _wait_ended(server, timeout=10)
    for raw in raws:
        raw.close()
    assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "the job finished at step 1: every worker that took part left with a goodbye" in (
        refused.value.details() or ""
    )
    assert ended.state.value == "finished" and ended.exit_code == 0
    assert logs.matching(r"job running -> finished")


@pytest.mark.processes
def test_the_coordinator_exits_1_with_one_line_when_its_workers_are_lost(processes) -> None:
    coord, address = processes.coordinator(
        "--world-size", "1", "--rejoin-timeout", "1", "--heartbeat-timeout", "30"
    )
    raw = RawWorker(*join(address, node_id="doomed"))
    raw.close()
    assert coord.wait(60) == 1, coord.output
    errors = [line for line in coord.output.splitlines() if " ERROR " in line]
    assert len(errors) == 1, coord.output
    assert "job failed" in errors[0] and "worker 0 disconnected" in errors[0]


# --- a fresh job after a clean end ---------------------------------------------------------------


def test_a_fresh_job_after_every_worker_left_starts_from_scratch(coordinator) -> None:
    """Every worker left cleanly (no --max-steps): the next joiners get ids from 0, their Join
    waits for the whole world, step 0 is new again and a different fingerprint defines the job."""
    server = coordinator(world_size=2, heartbeat_timeout=60.0)
    with log_waiter() as logs:
        first = _connect_all(server.address, 2, JOB)
        try:
            run_each(first, lambda c: run_exchange(c, SHAPES["tiny"], 2))
        finally:
            for client in first:
                client.close()
        logs.wait_for(r"job running -> waiting")
    assert _state(server) == "waiting"
    other_job = {**JOB, "seed": "7"}
    with log_waiter() as logs, concurrent.futures.ThreadPoolExecutor(2) as pool:
        early = pool.submit(_connect, server.address, "fresh-0", other_job)
        logs.wait_for(r"worker 0 joined: node 'fresh-0'.*\(1 of 2\)")
        with pytest.raises(concurrent.futures.TimeoutError):
            early.result(timeout=1.0)  # Join returns only when the whole world joined
        late = pool.submit(_connect, server.address, "fresh-1", other_job)
        second = sorted([early.result(30), late.result(30)], key=lambda c: c.worker_id)
    try:
        assert [c.worker_id for c in second] == [0, 1]
        reports = run_each(second, lambda c: run_exchange(c, SHAPES["tiny"], 2))
        assert len({r[0].checksum for r in reports}) == 1
    finally:
        for client in second:
            client.close()


def _connect(address: str, node: str, fingerprint: Mapping[str, str]) -> WorkerClient:
    return WorkerClient.connect(address, node_id=node, timeout=TEST_TIMEOUTS, fingerprint=fingerprint)


def _connect_all(address: str, n: int, fingerprint: Mapping[str, str]) -> list[WorkerClient]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_connect, address, f"w{i}", fingerprint) for i in range(n)]
        return sorted((f.result(30) for f in futures), key=lambda c: c.worker_id)
