"""Fault matrix rows over real processes (docs/RELIABILITY.md lists every row and its test)."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gradserver.common import compute_block_sizes
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import AbortedError, ResourceExhaustedError
from gradserver.common.rpc import EXCHANGE_METHOD, stream_metadata
from gradserver.train.fingerprint import synthetic_fingerprint
from gradserver.train.synthetic import SHAPES, synthetic_gradient
from gradserver.worker import WorkerClient

from .helpers.logwait import log_waiter
from .helpers.server import TEST_TIMEOUTS, connect_all, run_each, wait_pending

HEARTBEAT = 2.0
# A loss must be detected by the heartbeat or the connection, not by the step timeout: bounds
# allow this much beyond the heartbeat timeout (a loaded machine), far below STEP_TIMEOUT.
MARGIN = 10.0
STEP_TIMEOUT = 120.0
BLOCKS = 24


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _send_all_blocks(client: WorkerClient, step: int) -> None:
    sizes = SHAPES["tiny"].block_sizes
    for b in reversed(range(BLOCKS)):
        grads = synthetic_gradient(0, step, client.worker_id, 1000 + b, sum(sizes))
        client.send_block_gradient(step, b, BLOCKS, grads, sizes)


@pytest.mark.processes
def test_row1_sigkill_after_k_of_24_blocks(processes, coordinator) -> None:
    server = coordinator(world_size=2, heartbeat_timeout=HEARTBEAT, step_timeout=STEP_TIMEOUT)
    proc = processes.scripted_worker(
        server.address, "--num-blocks", str(BLOCKS), "--send-blocks", "5", name="victim"
    )
    client = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
    try:
        victim = int(proc.wait_for(r"JOINED worker (\d)").group(1))
        proc.wait_for(r"STALLED worker \d step 0")
        _send_all_blocks(client, 0)
        for _ in range(5):  # the five blocks both sent are averaged
            assert client.receive_averaged_block().num_contributors == 2
        proc.kill()
        started = time.monotonic()
        with pytest.raises(AbortedError, match=rf"step 0 .*worker {victim} disconnected"):
            client.receive_averaged_block()
        assert time.monotonic() - started < HEARTBEAT + MARGIN
        assert _serving(server.address)
    finally:
        client.close()


@pytest.mark.processes
def test_row2_sigstopped_worker_is_evicted_and_told_after_sigcont(processes, coordinator) -> None:
    server = coordinator(world_size=2, heartbeat_timeout=HEARTBEAT)
    proc = processes.scripted_worker(
        server.address, "--send-blocks", "1", "--hold", "1", "--then-receive", name="stopped"
    )
    client = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
    try:
        stopped = int(proc.wait_for(r"JOINED worker (\d)").group(1))
        proc.wait_for(r"STALLED")
        proc.stop()
        sizes = SHAPES["tiny"].block_sizes
        client.send_block_gradient(0, 0, 2, np.ones(sum(sizes), np.float32), sizes)
        with pytest.raises(AbortedError, match=rf"worker {stopped} lost: no message for"):
            client.receive_averaged_block()
        proc.resume()
        result = proc.wait_for(r"RESULT .*", timeout=30).group(0)
        assert "evicted" in result and "FailedPrecondition" in result
    finally:
        client.close()


@pytest.mark.processes
def test_row16_a_sigstopped_worker_whose_stream_is_held_back_is_dropped_in_time(
    processes, coordinator
) -> None:
    # The coordinator reads nothing from a stream it holds back, so it cannot see that worker's
    # heartbeats; only its own HTTP/2 keepalive can tell a stopped process from a waiting one.
    # The worker sends over gRPC: contributions in shared memory cost the coordinator nothing to
    # hold and never hold a stream back.
    server = coordinator(
        world_size=2, heartbeat_timeout=HEARTBEAT, step_timeout=120.0, chunk_mib=0.03, max_inflight_mib=0.05
    )
    with log_waiter() as logs:
        proc = processes.scripted_worker(
            server.address,
            "--send-blocks",
            "2",
            "--hold",
            "60",
            "--then-receive",
            name="held-back",
            env={"GRADSERVER_TRANSPORT": "grpc"},
        )
        client = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
        try:
            stopped = int(proc.wait_for(r"JOINED worker (\d)").group(1))
            proc.wait_for(r"STALLED")
            logs.wait_for(rf"holding back worker {stopped}'s stream")
            proc.stop()
            started = time.monotonic()
            logs.wait_for(rf"worker {stopped} .*(lost|disconnected)", timeout=HEARTBEAT + MARGIN)
            assert time.monotonic() - started < HEARTBEAT + MARGIN  # far below the step timeout
            sizes = SHAPES["tiny"].block_sizes
            client.send_block_gradient(0, 0, 2, np.ones(sum(sizes), np.float32), sizes)
            with pytest.raises(AbortedError, match=rf"worker {stopped} "):
                client.receive_averaged_block()
        finally:
            client.close()
            proc.resume()


def test_row10_a_barrier_waiter_that_cancels_leaves_the_count_right(coordinator) -> None:
    server = coordinator(world_size=3)
    clients = connect_all(server.address, 3)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(clients[0].barrier, 0, "sync")
            clients[2].close()  # the third worker gives up instead of arriving
            with pytest.raises(AbortedError, match="worker 2"):
                waiting.result(20)
            replacement = pool.submit(WorkerClient.connect, server.address, timeout=TEST_TIMEOUTS).result(30)
        everyone = [clients[0], clients[1], replacement]
        run_each(everyone, lambda c: c.barrier(1, "sync"))  # releases only with all three
        replacement.close()
    finally:
        for c in clients:
            c.close()


def test_row11_a_flood_of_joins_and_bogus_streams_is_refused_while_work_goes_on(coordinator) -> None:
    server = coordinator(world_size=2)
    clients = connect_all(server.address, 2)
    sizes = compute_block_sizes(8, 4, 16)
    try:

        def flood_join(_: int) -> str:
            try:
                WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS).close()
                return "joined"
            except ResourceExhaustedError:
                return "refused"

        def bogus_stream(i: int) -> grpc.StatusCode:
            with grpc.insecure_channel(server.address) as channel:
                call = channel.stream_stream(EXCHANGE_METHOD)(iter(()), metadata=stream_metadata(i % 2, 1, 1))
                try:
                    list(call)
                except grpc.RpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            joins = pool.map(flood_join, range(100))
            streams = pool.map(bogus_stream, range(100))
            assert _serving(server.address)
            results = run_each(
                clients,
                lambda c: (
                    c.send_block_gradient(0, 0, 1, np.ones(sum(sizes), np.float32), sizes),
                    c.receive_averaged_block(),
                )[1],
            )
            assert set(joins) == {"refused"}
            assert set(streams) == {grpc.StatusCode.FAILED_PRECONDITION}
        assert all(r.num_contributors == 2 for r in results)
        assert _serving(server.address)
    finally:
        for c in clients:
            c.close()


@pytest.fixture
def proxied(coordinator):
    """A coordinator (world 2) and a FaultProxy in front of it; stopped in finally."""
    from .helpers.proxy import FaultProxy

    server = coordinator(
        world_size=2,
        heartbeat_timeout=HEARTBEAT,
        step_timeout=STEP_TIMEOUT,
        chunk_mib=1 / 64,
        max_message_mib=1.0,
    )
    host, port = server.address.rsplit(":", 1)
    proxy = FaultProxy(host, int(port)).start()
    try:
        yield server, proxy
    finally:
        proxy.stop()


def _pair(server, proxy) -> tuple[WorkerClient, WorkerClient]:
    """One worker direct, one through the proxy (ids sorted: direct first is not guaranteed)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        direct = pool.submit(WorkerClient.connect, server.address, node_id="direct", timeout=TEST_TIMEOUTS)
        via = pool.submit(WorkerClient.connect, proxy.address, node_id="proxied", timeout=TEST_TIMEOUTS)
        return direct.result(30), via.result(30)


def test_row8_sliced_and_delayed_bytes_still_average_correctly(proxied) -> None:
    from gradserver.train.synthetic import run_exchange

    server, proxy = proxied
    proxy.slice_bytes, proxy.delay_s = 997, 0.0005
    direct, via = _pair(server, proxy)
    try:
        reports = run_each([direct, via], lambda c: run_exchange(c, SHAPES["tiny"], 2), timeout=120)
        assert [r.checksum for r in reports[0]] == [r.checksum for r in reports[1]]
    finally:
        direct.close()
        via.close()


def test_row8_a_reset_connection_is_a_clear_error_and_nothing_counts_twice(proxied) -> None:
    server, proxy = proxied
    direct, via = _pair(server, proxy)
    sizes = compute_block_sizes(8, 4, 16)
    ones = np.ones(sum(sizes), np.float32)
    try:
        direct.send_block_gradient(0, 0, 2, ones, sizes)
        via.send_block_gradient(0, 1, 2, ones, sizes)
        # Step 0 must be in flight when the coordinator hears of the reset, which reaches it over
        # another connection: had direct's chunk come second, it would be refused as "the world
        # is incomplete" (a refusal of that key, not of the step), and the replacement's step 0
        # below would wait for a block 1 that direct never sends.
        wait_pending(server, 0)
        proxy.reset()
        with pytest.raises(ConnectionError):
            via.receive_averaged_block()  # its block 1 waits on a connection that is gone
        with pytest.raises(ConnectionError):
            via.send_block_gradient(0, 0, 2, ones, sizes)
        with pytest.raises(AbortedError, match=rf"worker {via.worker_id} disconnected"):
            direct.receive_averaged_block()
        via.close()
        # The reset worker comes back in its place and resends step 0: refused clearly, because
        # step 0 was aborted; step 1 then completes with every contribution counted once.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            again = pool.submit(WorkerClient.connect, proxy.address, timeout=TEST_TIMEOUTS).result(30)
        again.send_block_gradient(0, 1, 2, ones, sizes)  # queued: the refusal comes back in-stream
        with pytest.raises(AbortedError, match="step 0"):
            again.receive_averaged_block()
        results = run_each(
            [direct, again],
            lambda c: (
                c.send_block_gradient(1, 0, 1, ones * (c.worker_id + 1), sizes),
                c.receive_averaged_block(),
            )[1],
        )
        assert all(r.num_contributors == 2 for r in results)
        np.testing.assert_array_equal(results[0].gradients, ones * 1.5)
        again.close()
    finally:
        direct.close()
        via.close()


def test_row8_a_blackholed_worker_is_evicted_by_heartbeat(proxied) -> None:
    server, proxy = proxied
    direct, via = _pair(server, proxy)
    sizes = compute_block_sizes(8, 4, 16)
    try:
        direct.send_block_gradient(0, 0, 1, np.ones(sum(sizes), np.float32), sizes)
        proxy.blackhole = True
        started = time.monotonic()
        with pytest.raises(AbortedError, match=rf"worker {via.worker_id} lost: no message for"):
            direct.receive_averaged_block()
        assert time.monotonic() - started < HEARTBEAT + MARGIN
        # The cut-off worker does not hang: its next call fails or times out within its deadline.
        with pytest.raises((ConnectionError, TimeoutError)):
            via.barrier(0, "after-eviction", timeout=3)
    finally:
        proxy.blackhole = False
        direct.close()
        via.close()


@pytest.fixture
def peer_host():
    """A host in its own network namespace whose only link is a veth pair to this one."""
    from bench._netns import PeerHost, available

    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces unavailable here: {why}")
    with PeerHost() as host:
        yield host


@pytest.mark.processes
def test_row6_a_cut_link_is_detected_like_a_stopped_worker(processes, coordinator, peer_host) -> None:
    server = coordinator(
        world_size=2,
        heartbeat_timeout=HEARTBEAT,
        step_timeout=STEP_TIMEOUT,
        bind=f"{peer_host.local_ip}:0",
        insecure=True,
    )
    remote = processes.start(
        [
            *peer_host.host.prefix(),
            sys.executable,
            "-m",
            "tests.helpers.scripted_worker",
            "--coordinator",
            server.address,
            "--send-blocks",
            "1",
            "--hold",
            "0.5",
            "--then-receive",
        ],
        name="behind-the-link",
    )
    client = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
    try:
        lost = int(remote.wait_for(r"JOINED worker (\d)").group(1))
        remote.wait_for("STALLED")
        peer_host.cut()
        sizes = SHAPES["tiny"].block_sizes
        client.send_block_gradient(0, 0, 2, np.ones(sum(sizes), np.float32), sizes)
        started = time.monotonic()
        with pytest.raises(AbortedError, match=rf"worker {lost} lost: no message for"):
            client.receive_averaged_block()
        assert time.monotonic() - started < HEARTBEAT + MARGIN
        peer_host.restore()
        result = remote.wait_for(r"RESULT .*", timeout=40).group(0)
        assert "evicted" in result or "UnavailableError" in result, result
    finally:
        peer_host.restore()
        client.close()


@pytest.mark.processes
def test_row7_a_slow_link_is_slower_but_correct_without_false_eviction(
    processes, coordinator, peer_host
) -> None:
    server = coordinator(
        world_size=2,
        heartbeat_timeout=HEARTBEAT,
        bind=f"{peer_host.local_ip}:0",
        insecure=True,
        chunk_mib=0.25,
        max_message_mib=1.0,
    )
    peer_host.slow("20mbit")
    remote = processes.start(
        [
            *peer_host.host.prefix(),
            sys.executable,
            "-m",
            "gradserver.cli",
            "worker",
            "--job",
            "synthetic",
            "--coordinator",
            server.address,
            "--model",
            "small",
            "--steps",
            "1",
            "--json",
            "--log-level",
            "WARNING",
        ],
        name="slow-link",
    )
    # The CLI worker sends its job's fingerprint; a joiner without one would not match it.
    fingerprint = synthetic_fingerprint(SHAPES["small"], tuple(NonBlockComponent), steps=1, seed=0)
    client = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS, fingerprint=fingerprint)
    try:
        from gradserver.train.synthetic import run_exchange

        ours = run_exchange(client, SHAPES["small"], 1)
        assert remote.wait(120) == 0, remote.output
        theirs = json.loads(remote.wait_for(r'^\{"worker_id"').string)
        assert theirs["steps"][0]["checksum"] == ours[0].checksum
        assert ours[0].seconds > 1.0  # 13 MiB each way through 20 Mbit/s
        lost = server.call(lambda s: s.metrics.registry.get_sample_value("gradserver_workers_lost_total"))
        assert lost == 0
    finally:
        client.close()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_row5_coordinator_restarted_on_the_same_port(processes, tmp_path) -> None:
    from .helpers.training import assert_identical_checkpoints, train_workers

    first, address = processes.coordinator("--world-size", "2", "--heartbeat-timeout", "5")
    workers = train_workers(processes, address, 2, tmp_path, "--reconnect-timeout", "60", steps=12)
    for w in workers:
        w.wait_for(r"worker \d step 4:", timeout=120)
    processes.restart_coordinator(first, address, "--world-size", "2", "--heartbeat-timeout", "5")
    for w in workers:
        assert w.wait(240) == 0, w.output
        assert "rejoining" in w.output
    states = assert_identical_checkpoints(tmp_path, 2)
    assert states[0].data_position == states[1].data_position == 12


def test_a_worker_ahead_after_a_restart_rolls_its_step_back() -> None:
    from gradserver.train.corpus import TokenWindows, corpus_bytes
    from gradserver.train.engines import LocalEngine, LocalHub
    from gradserver.train.model import CONFIGS, TransformerLM
    from gradserver.train.trainer import DistributedTrainer
    from gradserver.train.training import _rejoin

    class Restartable(LocalEngine):
        resume = 0

        @property
        def can_reconnect(self) -> bool:
            return True

        def reconnect(self, committed_step: int) -> int | None:
            return self.resume

    model = TransformerLM(CONFIGS["tiny"], seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    backend = Restartable(LocalHub(1), 0)
    trainer = DistributedTrainer(model, backend, lr=1e-2, keep_snapshot=True)
    data = TokenWindows(corpus_bytes(), 32)
    trainer.train_step([data.batch([0, 1])])
    assert trainer.step == 1
    from gradserver.common.errors import UnavailableError

    _rejoin(trainer, backend, UnavailableError("coordinator gone"))  # the others applied 0 steps
    assert trainer.step == 0
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
