"""Dead, hung and missing peers: nobody waits forever, and every error names who and which step;
the liveness monitor survives its own failure, and a worker trying to reach a coordinator says so."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time

import numpy as np
import pytest

from gradserver.common.errors import AbortedError, DeadlineExceededError, UnavailableError
from gradserver.server import GradientServer
from gradserver.train.synthetic import SHAPES, run_exchange, synthetic_gradient
from gradserver.worker import Timeouts, WorkerClient

from .helpers.logwait import log_waiter
from .helpers.raw import RawWorker, join
from .helpers.server import TEST_TIMEOUTS, connect_all

HEARTBEAT = 2.0
# Detection must come from the heartbeat or the connection, never from the step timeout (60 s):
# bounds allow this much beyond the heartbeat timeout, for a loaded machine.
MARGIN = 10.0
TINY = SHAPES["tiny"]
PROGRESS = r"still trying to reach the coordinator at 127\.0\.0\.1:1 \(\d+\.\d s of 1 s\)"


def _join_with_scripted(processes, coordinator, *script_args: str):
    """A coordinator (world 2) with one scripted worker process and one in-process client,
    both past one full synthetic step."""
    server = coordinator(world_size=2, heartbeat_timeout=HEARTBEAT, step_timeout=60.0)
    proc = processes.scripted_worker(server.address, "--full-steps", "1", *script_args, name="victim")
    client = WorkerClient.connect(server.address, node_id="survivor", timeout=TEST_TIMEOUTS)
    victim_id = int(proc.wait_for(r"JOINED worker (\d)").group(1))
    assert victim_id == 1 - client.worker_id
    run_exchange(client, TINY, 1)
    proc.wait_for(r"STALLED worker \d step 1")
    return server, proc, client, victim_id


def _send_step(client: WorkerClient, step: int) -> None:
    """Sends every block of `step`, and receives the last block, which the victim sent too
    before it stalled (it sent only the first block, in reverse order)."""
    sizes = TINY.block_sizes
    for b in reversed(range(TINY.num_blocks)):
        grads = synthetic_gradient(0, step, client.worker_id, 1000 + b, sum(sizes))
        client.send_block_gradient(step, b, TINY.num_blocks, grads, sizes)
    assert client.receive_averaged_block().block_idx == TINY.num_blocks - 1


@pytest.mark.processes
def test_sigkilled_worker_aborts_the_step_for_the_others(processes, coordinator) -> None:
    server, proc, client, victim = _join_with_scripted(processes, coordinator, "--send-blocks", "1")
    try:
        _send_step(client, 1)
        proc.kill()
        started = time.monotonic()
        with pytest.raises(AbortedError) as info:
            client.receive_averaged_block()
        assert time.monotonic() - started < HEARTBEAT + MARGIN
        # Either the step was in flight (aborted) or the survivor's last key arrived after the
        # loss (refused): both name the step and the lost worker.
        assert re.search(rf"step 1 .*worker {victim} disconnected", str(info.value))
        # The coordinator keeps serving: a replacement takes the lost place and a step completes.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            replacement = pool.submit(
                WorkerClient.connect, server.address, node_id="replacement", timeout=TEST_TIMEOUTS
            ).result(30)
        try:
            assert replacement.worker_id == victim
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                done = [pool.submit(run_exchange, c, TINY, 1, first_step=2) for c in (client, replacement)]
                reports = [f.result(60) for f in done]
            assert reports[0][0].checksum == reports[1][0].checksum
        finally:
            replacement.close()
    finally:
        client.close()


@pytest.mark.processes
def test_sigstopped_worker_is_evicted_by_heartbeat(processes, coordinator) -> None:
    _, proc, client, victim = _join_with_scripted(processes, coordinator, "--send-blocks", "1")
    try:
        _send_step(client, 1)
        proc.stop()
        started = time.monotonic()
        with pytest.raises(AbortedError, match=rf"worker {victim} lost: no message for"):
            client.receive_averaged_block()
        elapsed = time.monotonic() - started
        assert HEARTBEAT * 0.5 < elapsed < HEARTBEAT + MARGIN
    finally:
        proc.resume()
        client.close()


@pytest.mark.processes
def test_sigkilled_coordinator_fails_pending_calls_with_a_connection_error(processes) -> None:
    coord, address = processes.coordinator("--world-size", "2", "--heartbeat-timeout", "30")
    clients = connect_all(address, 2)
    try:
        sizes = TINY.block_sizes
        clients[0].send_block_gradient(0, 0, 1, np.ones(sum(sizes), np.float32), sizes)
        coord.kill()
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="connection to the coordinator") as info:
            clients[0].receive_averaged_block()
        assert isinstance(info.value, ConnectionError)
        assert time.monotonic() - started < MARGIN  # the receive timeout is 20 s
        # The other worker, idle at the time, learns it at its next call; then sends fail fast.
        with pytest.raises(UnavailableError, match="connection to the coordinator"):
            clients[1].barrier(0, "after-the-kill")
        with pytest.raises(UnavailableError, match="connection to the coordinator"):
            clients[1].send_non_block_gradient(0, 0, np.ones(4, np.float32))
    finally:
        for c in clients:
            c.close()


def test_join_times_out_naming_how_many_joined(coordinator) -> None:
    server = coordinator(world_size=3, join_timeout=1.0)
    with pytest.raises(DeadlineExceededError, match="1 of 3 workers joined") as info:
        WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
    assert isinstance(info.value, TimeoutError)


def test_a_failing_monitor_is_restarted_and_eviction_goes_on(coordinator) -> None:
    """One exception in the liveness monitor must not end heartbeat eviction for good."""
    server = coordinator(world_size=1, heartbeat_timeout=2.0)
    with log_waiter() as logs:
        silent = RawWorker(*join(server.address, node_id="silent"))  # sends no heartbeat
        try:

            def break_expiry_once(s: GradientServer) -> None:
                original = s._table.expire
                calls = [0]

                def expire() -> list:
                    calls[0] += 1
                    if calls[0] == 1:
                        raise RuntimeError("injected monitor failure")
                    return original()

                s._table.expire = expire  # type: ignore[method-assign]

            server.call(break_expiry_once)
            logs.wait_for(r"worker 0 \(node 'silent'\) lost: no message for", timeout=30)
            assert logs.matching(r"liveness monitor failed")
        finally:
            silent.close()


def test_unreachable_coordinator_is_a_clear_connection_error() -> None:
    with pytest.raises(UnavailableError, match=r"cannot reach the coordinator at 127\.0\.0\.1:1"):
        WorkerClient.connect("127.0.0.1:1", timeout=Timeouts(connect=0.5))


def test_unreachable_coordinator_logs_progress_and_names_address_and_time(caplog) -> None:
    caplog.set_level(logging.INFO, logger="gradserver.worker")
    with pytest.raises(UnavailableError) as info:
        WorkerClient.connect("127.0.0.1:1", timeout=Timeouts(connect=1.0))
    assert "127.0.0.1:1" in str(info.value) and "tried for 1 s" in str(info.value)
    progress = [r.getMessage() for r in caplog.records if "still trying to reach" in r.getMessage()]
    assert progress, "no progress line while trying to reach the coordinator"
    assert all(re.fullmatch(PROGRESS, line) for line in progress), progress


def test_receive_deadline_is_a_timeout_and_can_be_retried(workers) -> None:
    clients = workers(2)
    sizes = TINY.block_sizes
    clients[0].send_block_gradient(0, 0, 1, np.ones(sum(sizes), np.float32), sizes)
    with pytest.raises(DeadlineExceededError, match=r"no average for step 0 block 0 of 1 within 0\.2 s"):
        clients[0].receive_averaged_block(timeout=0.2)
    clients[1].send_block_gradient(0, 0, 1, np.full(sum(sizes), 3.0, np.float32), sizes)
    np.testing.assert_array_equal(clients[0].receive_averaged_block().gradients, 2.0)
