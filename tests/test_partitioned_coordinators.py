"""Partitioned coordinators (issue 15 part A): K partitions each average their chunks of every key.

Every partition runs behind a FaultProxy started first, so the partition map (the proxies' addresses) is
known before any partition binds port 0, and a partition's link can be cut and restored. Workers are
given partition 0's address only and learn the map at Join.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from gradserver.common import codec
from gradserver.common.chunking import chunk_count
from gradserver.common.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    GradServerError,
    InvalidArgumentError,
    Status,
)
from gradserver.common.messages import ChunkHeader, ChunkIn, DType, JoinRequestIn, ReduceOp, TensorKey
from gradserver.common.partition_map import NOTIFY_METHOD, PartitionMap, PartitionNotice, encode_notice
from gradserver.common.security import TlsFiles
from gradserver.server import GradientServer
from gradserver.server.config import CoordinatorConfig
from gradserver.server.reduction import ReductionTable
from gradserver.torch._collective import CollectiveClient
from gradserver.worker import WorkerClient
from gradserver.worker.joining import join_at

from .helpers.logwait import log_waiter
from .helpers.processes import ManagedProcess, ProcessGroup
from .helpers.proxy import FaultProxy
from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_all, run_each, run_each_outcome

CHUNK_ELEMENTS = 32
CHUNK_MIB = CHUNK_ELEMENTS * 4 / (1 << 20)
SIZES = (40, 8, 8, 40, 100, 100, 100, 3, 3)  # a block's 9 components: 402 elements, 13 chunks


class Partitions:
    """K partitions of one job, each behind its own proxy; `address` is partition 0's, for workers."""

    def __init__(self, proxies: list[FaultProxy], servers: list[ServerThread]) -> None:
        self.proxies = proxies
        self.servers = servers
        self.killed: set[int] = set()

    def kill(self, index: int) -> None:
        """Partition `index` vanishes for everyone: its connections are reset, nothing listens."""
        self.killed.add(index)
        self.proxies[index].stop()

    @property
    def address(self) -> str:
        return self.proxies[0].address

    @property
    def partition_map(self) -> PartitionMap:
        return PartitionMap(tuple(p.address for p in self.proxies))


def _config(**overrides: Any) -> CoordinatorConfig:
    overrides.setdefault("bind", "127.0.0.1:0")
    overrides.setdefault("heartbeat_timeout", 5.0)
    overrides.setdefault("step_timeout", 20.0)
    overrides.setdefault("join_timeout", 20.0)
    overrides.setdefault("chunk_mib", CHUNK_MIB)
    overrides.setdefault("max_message_mib", 1.0)
    overrides.setdefault("max_inflight_mib", 1.0)
    return CoordinatorConfig(**overrides)


@pytest.fixture
def partitioned() -> Iterator[Callable[..., Partitions]]:
    """Factory: partitioned(k, world_size=..., **config) -> K started partitions behind proxies."""
    made: list[Partitions] = []
    servers: list[ServerThread] = []

    def make(k: int, each: Sequence[dict[str, Any]] = (), **overrides: Any) -> Partitions:
        """`each[i]`: settings of partition i only (on top of `overrides`)."""
        mine = [FaultProxy("127.0.0.1", 0).start() for _ in range(k)]
        partitions = Partitions(mine, [])
        made.append(partitions)
        partition_map = ",".join(p.address for p in mine)
        for index, proxy in enumerate(mine):
            own = {**overrides, **(each[index] if index < len(each) else {})}
            server = ServerThread(_config(partition_map=partition_map, partition_index=index, **own))
            servers.append(server)
            server.start()
            proxy.target = ("127.0.0.1", server.server.port if server.server else 0)
            partitions.servers.append(server)
        return partitions

    try:
        yield make
    finally:
        for server in servers:
            server.stop()
        for partitions in made:
            for index, proxy in enumerate(partitions.proxies):
                if index not in partitions.killed:
                    proxy.stop()


@pytest.fixture
def clients() -> Iterator[list[WorkerClient]]:
    """Clients the test connected; closed in `finally`."""
    joined: list[WorkerClient] = []
    try:
        yield joined
    finally:
        for client in joined:
            client.close()


def _connect(
    address: str, n: int, joined: list[WorkerClient], collective: bool = False
) -> list[WorkerClient]:
    if collective:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [
                pool.submit(CollectiveClient.connect_as_rank, address, rank, timeout=TEST_TIMEOUTS)
                for rank in range(n)
            ]
            made: list[WorkerClient] = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in futures]
    else:
        made = connect_all(address, n, TEST_TIMEOUTS)
    joined.extend(made)
    return made


def _gradients(worker: int, step: int, size: int, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * worker + 17 * step + salt)
    return rng.standard_normal(size).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 3))


def _one_step(client: WorkerClient, step: int) -> list[bytes]:
    """Every kind of key the trainer uses, pipelined; the averages' bytes in a fixed order."""
    w = client.worker_id
    for block in range(2):
        client.send_block_gradient(step, block, 2, _gradients(w, step, sum(SIZES), block), SIZES)
    client.send_non_block_gradient(step, "LM_HEAD", _gradients(w, step, 300, 10))
    client.send_non_block_gradient(step, "FINAL_NORM", _gradients(w, step, 5, 11))  # one chunk
    client.send_gradients(step, _gradients(w, step, 250, 12), loss=1.5 + w, correct=w, total=10)
    out = [client.receive_averaged_block().gradients.tobytes() for _ in range(2)]
    out += [client.receive_averaged_non_block().gradients.tobytes() for _ in range(2)]
    whole = client.receive_averaged()
    out += [whole.gradients.tobytes(), np.float64(whole.global_loss).tobytes()]
    client.barrier(step, "after")
    samples = client.get_sample_ranges(step, dataset_size=97, batch_size=4)
    out.append(repr((samples.worker_id, samples.ranges)).encode())
    return out


def _lockstep(client: WorkerClient, step: int) -> list[bytes]:
    """Send block i, receive block i (the non-pipelined use)."""
    out = []
    for block in range(2):
        data = _gradients(client.worker_id, step, sum(SIZES), 20 + block)
        client.send_block_gradient(step, block, 2, data, SIZES)
        out.append(client.receive_averaged_block().gradients.tobytes())
    return out


def _collectives(client: WorkerClient) -> list[bytes]:
    assert isinstance(client, CollectiveClient)
    out = []
    for sequence, op in enumerate((ReduceOp.AVG, ReduceOp.SUM, ReduceOp.AVG)):
        client.send_collective(sequence, 0, _gradients(client.worker_id, sequence, 70, 30), op)
        out.append(client.receive_collective().tobytes())
    return out


def _run_job(address: str, n: int, joined: list[WorkerClient]) -> list[list[bytes]]:
    made = _connect(address, n, joined)
    results = run_each(made, lambda c: _one_step(c, 0) + _one_step(c, 1) + _lockstep(c, 2))
    for client in made:
        client.close()
    return results


def _run_collectives(address: str, n: int, joined: list[WorkerClient]) -> list[list[bytes]]:
    made = _connect(address, n, joined, collective=True)
    results = run_each(made, _collectives)
    for client in made:
        client.close()
    return results


# --- the assignment rule ------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_every_chunk_has_exactly_one_owner_and_partitions_get_a_fair_share(k: int) -> None:
    partition_map = PartitionMap(tuple(f"127.0.0.1:{5000 + i}" for i in range(k)))
    key = TensorKey.whole_model(7)
    for num_chunks in (1, 2, 7, 100):
        owners = [partition_map.owner(key, c) for c in range(num_chunks)]
        counts = [partition_map.owned_chunks(key, num_chunks, s) for s in range(k)]
        assert counts == [owners.count(s) for s in range(k)]
        assert max(counts) - min(counts) <= 1
    # One-chunk keys spread over the partitions instead of all landing on partition 0.
    small = {partition_map.owner(TensorKey.block(0, b, 64), 0) for b in range(64)}
    assert small == set(range(k))
    # The rule ignores the step: a key's chunks stay on the same partitions step after step.
    assert [partition_map.owner(TensorKey.block(3, 5, 8), c) for c in range(9)] == [
        partition_map.owner(TensorKey.block(90, 5, 8), c) for c in range(9)
    ]


def test_a_partition_refuses_a_chunk_that_the_map_assigns_to_another_partition() -> None:
    partition_map = PartitionMap(("127.0.0.1:1", "127.0.0.1:2"))
    table = ReductionTable(1, 4, 30.0, partition=(partition_map, 0))
    key = TensorKey.collective(0, 0)
    foreign = next(c for c in range(4) if partition_map.owner(key, c) == 1)
    header = ChunkHeader(DType.FLOAT32, 16, ())
    data = np.zeros(4, dtype=np.float32).tobytes()
    out = table.contribute(ChunkIn(0, key, header, foreign * 4, data))
    assert len(out) == 1
    message = out[0].event.message  # type: ignore[union-attr]
    assert f"chunk {foreign} of {key} to partition 0 (127.0.0.1:1)" in message
    assert "assigns it to partition 1 (127.0.0.1:2)" in message
    assert not table.has_pending()  # refused before it opened anything
    own = [c for c in range(4) if partition_map.owner(key, c) == 0]
    for c in own:
        out = table.contribute(ChunkIn(0, key, header, c * 4, data))
    assert [o.event.offset for o in out] == [own[-1] * 4]  # type: ignore[union-attr]
    assert not table.has_pending()  # the key completed with this partition's chunks alone
    assert chunk_count(16, 4) == 4


# --- partitioned exchange equals the unpartitioned one ---------------------------------------------------


@pytest.fixture(scope="module")
def unpartitioned_results() -> tuple[list[list[bytes]], list[list[bytes]]]:
    server = ServerThread(_config(world_size=3))
    joined: list[WorkerClient] = []
    try:
        server.start()
        return _run_job(server.address, 3, joined), _run_collectives(server.address, 3, joined)
    finally:
        for client in joined:
            client.close()
        server.stop()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_partitioned_averages_equal_the_unpartitioned_ones_bit_for_bit(
    k: int,
    partitioned: Callable[..., Partitions],
    clients: list[WorkerClient],
    unpartitioned_results: tuple[list[list[bytes]], list[list[bytes]]],
) -> None:
    partitions = partitioned(k, world_size=3)
    expected_job, expected_collectives = unpartitioned_results
    job = _run_job(partitions.address, 3, clients)
    assert job == expected_job
    averages = [[b for b in r if not b.startswith(b"(")] for r in job]  # less the data partitions
    assert all(r == averages[0] for r in averages)  # every worker got the same bytes
    partitions = partitioned(k, world_size=3)
    assert _run_collectives(partitions.address, 3, clients) == expected_collectives


def test_each_partition_averages_only_its_share_of_the_bytes(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, world_size=2)
    made = _connect(partitions.address, 2, clients)
    size = 64 * CHUNK_ELEMENTS

    def step(client: WorkerClient) -> None:
        client.send_gradients(0, np.ones(size, np.float32), loss=1.0, correct=1, total=1)
        client.receive_averaged()

    run_each(made, step)
    received = [s.call(lambda g: g.metrics.received_bytes._value.get()) for s in partitions.servers]
    assert all(r > 0.4 * 2 * size * 4 for r in received), received  # about half each
    assert all(r < 0.7 * 2 * size * 4 for r in received), received


def test_partitions_other_than_0_refuse_a_worker_that_did_not_join_partition_0(
    partitioned: Callable[..., Partitions],
) -> None:
    partitions = partitioned(2, world_size=1)
    with pytest.raises(FailedPreconditionError) as info:
        WorkerClient.connect(partitions.proxies[1].address, timeout=TEST_TIMEOUTS)
    assert f"workers join partition 0 at {partitions.address}" in info.value.message
    assert f"partition 1 ({partitions.proxies[1].address})" in info.value.message


def test_partitions_started_with_different_chunk_sizes_are_refused_naming_the_partition(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, each=[{}, {"chunk_mib": 2 * CHUNK_MIB}], world_size=1)
    with pytest.raises(FailedPreconditionError) as info:
        clients.append(WorkerClient.connect(partitions.address, timeout=TEST_TIMEOUTS))
    assert (
        f"{partitions.partition_map.describe(1)} made this worker 0 with 256-byte chunks"
        in info.value.message
    )
    assert "--chunk-mib" in info.value.message


def test_partitions_without_chunk_mib_all_use_the_remote_chunk_size_with_the_same_averages(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    """--chunk-mib 0 (the default) on partitioned coordinators: workers on one host get 0.25 MiB
    from partition 0, which each brings to partition 1 (chunk ownership depends on the size); the
    averages are the bytes one coordinator with any chunk size gives."""
    partitions = partitioned(2, world_size=2, chunk_mib=0.0)
    made = _connect(partitions.address, 2, clients)
    assert [c.chunk_bytes for c in made] == [1 << 18] * 2
    assert {s.call(lambda g: g.chunk_bytes) for s in partitions.servers} == {1 << 18}
    size = 3 * (1 << 17) + 1001  # 7 chunks, spread over both partitions

    def work(c: WorkerClient) -> bytes:
        c.send_non_block_gradient(0, "LM_HEAD", _gradients(c.worker_id, 0, size, 40))
        return c.receive_averaged_non_block().gradients.tobytes()

    got = run_each(made, work)
    want = ((_gradients(0, 0, size, 40).astype(np.float64) + _gradients(1, 0, size, 40)) / 2).astype(
        np.float32
    )
    assert got == [want.tobytes()] * 2


def test_partitions_without_chunk_mib_adopt_the_size_partition_0_gave_each_worker(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    """Partition 0 decides (here by --chunk-mib, as it would from measured links); partition 1,
    automatic, takes what the workers bring, so keys are cut alike on both."""
    partitions = partitioned(2, each=[{"chunk_mib": 4 * CHUNK_MIB}, {"chunk_mib": 0.0}], world_size=2)
    made = _connect(partitions.address, 2, clients)
    assert [c.chunk_bytes for c in made] == [16 * CHUNK_ELEMENTS] * 2
    assert [s.call(lambda g: g.chunk_bytes) for s in partitions.servers] == [16 * CHUNK_ELEMENTS] * 2
    assert run_each(made, lambda c: _averaged_step(c, 0)) == [_reference_average(2, 0)] * 2


def test_a_partition_refuses_a_chunk_size_it_cannot_hold_naming_the_worker(
    partitioned: Callable[..., Partitions],
) -> None:
    partitions = partitioned(2, world_size=1, chunk_mib=0.0)
    largest = partitions.servers[1].call(lambda g: g.config.chunk_bytes)
    for brought, why in ((largest * 2, f"up to {largest} bytes"), (1001, "whole float32 elements")):
        request = JoinRequestIn(
            "n0", 0, "cpu", codec.PROTOCOL_VERSION, rank=0, partition_index=1, job_chunk_bytes=brought
        )
        with pytest.raises(InvalidArgumentError) as info:
            join_at(partitions.proxies[1].address, request, TEST_TIMEOUTS, None, "", ())
        assert f"node 'n0' (worker 0) brought a chunk size of {brought} bytes" in info.value.message
        assert why in info.value.message


def test_a_join_refused_by_another_partition_names_that_partition(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, each=[{}, {"world_size": 1}], world_size=2)
    outcomes = run_each_outcome(
        [0, 1], lambda i: WorkerClient.connect(partitions.address, node_id=f"n{i}", timeout=TEST_TIMEOUTS)
    )
    clients.extend(o for o in outcomes if isinstance(o, WorkerClient))
    refused = [o for o in outcomes if isinstance(o, GradServerError)]
    assert refused, outcomes  # worker 1 asks partition 1 (a world of 1) for rank 1
    assert any(
        f"{partitions.partition_map.describe(1)}: node " in e.message and "rank 1, out of range" in e.message
        for e in refused
    ), refused


# --- failure rules ---------------------------------------------------------------------------------


def _whole_model(client: WorkerClient, step: int, size: int = 8 * CHUNK_ELEMENTS) -> None:
    data = _gradients(client.worker_id, step, size, 40)
    client.send_gradients(step, data, loss=1.0, correct=1, total=2)


def _fail_step_on(server: ServerThread, step: int, why: str) -> None:
    """Fails `step` on that partition's coordinator as its own table would (ABORTED, `why`)."""
    server.call(lambda g: g._deliver(g._table.fail_step(step, why, Status.ABORTED)))


def _averaged_step(client: WorkerClient, step: int) -> bytes:
    _whole_model(client, step)
    return client.receive_averaged().gradients.tobytes()


def _wait_pending(server: ServerThread, step: int, timeout: float = 10.0) -> None:
    """Blocks until the partition holds a key of `step` (as tests/test_bad_input.py does)."""
    deadline = time.monotonic() + timeout
    while step not in server.call(lambda s: s.pending_steps()):
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} never became pending")
        time.sleep(0.01)


def _first_sent_then(made: Sequence[WorkerClient], step: int) -> None:
    """Worker 0 contributes to `step` (so every partition has it in flight); the others do not."""
    _whole_model(made[0], step)


def _receive_outcomes(made: Sequence[WorkerClient], timeout: float) -> list[Any]:
    return run_each_outcome(made, lambda c: c.receive_averaged(timeout=timeout), timeout=timeout + 30)


def test_a_partition_killed_mid_step_fails_every_workers_receive_naming_the_partition(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, world_size=2, heartbeat_timeout=3.0)
    made = _connect(partitions.address, 2, clients)
    run_each(made, lambda c: (_whole_model(c, 0), c.receive_averaged()))
    _first_sent_then(made, 1)
    _whole_model(made[1], 1)
    dead = partitions.partition_map.describe(1)
    # A killed process tells no one: partition 1 may not warn partition 0 (its notices go nowhere).
    partitions.servers[1].call(
        lambda g: setattr(g.features["partition"].peers, "notify", lambda notice: None)
    )
    partitions.kill(1)
    started = time.monotonic()
    outcomes = _receive_outcomes(made, timeout=60.0)
    elapsed = time.monotonic() - started
    for outcome in outcomes:
        # No average: the step is not applied in part on any worker.
        assert isinstance(outcome, GradServerError), outcome
        assert dead in outcome.message, outcome.message
    assert elapsed < 20.0  # the failure came from the dead partition, not from a 60 s receive timeout


def test_a_partition_whose_link_is_cut_fails_the_step_everywhere_and_the_job_resumes_once_restored(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, world_size=2, heartbeat_timeout=2.0, rejoin_timeout=60.0)
    made = _connect(partitions.address, 2, clients)
    expected = run_each(made, lambda c: _averaged_step(c, 0))
    _first_sent_then(made, 1)
    partitions.proxies[1].blackhole = True  # connections stay open; nothing moves either way
    _whole_model(made[1], 1)
    outcomes = _receive_outcomes(made, timeout=60.0)
    for outcome in outcomes:
        # Partition 1 lost both workers (heartbeat timeout) and told partition 0, or partition 0
        # found partition 1 unreachable: either way not a local timeout.
        assert isinstance(outcome, GradServerError), outcome
        assert not isinstance(outcome, DeadlineExceededError), outcome
        assert partitions.partition_map.describe(1) in outcome.message, outcome.message
    partitions.proxies[1].blackhole = False
    for client in made:
        client.close()
    # Restored: a new set of workers joins both partitions again and steps on with the same averages.
    again = _connect(partitions.address, 2, clients)
    assert run_each(again, lambda c: _averaged_step(c, 0)) == expected


def _reference_average(n: int, step: int, size: int = 8 * CHUNK_ELEMENTS) -> bytes:
    """What any coordinator returns: the float64 sum in worker order over n, rounded once."""
    total = sum(_gradients(w, step, size, 40).astype(np.float64) for w in range(n))
    return (total / n).astype(np.float32).tobytes()


def test_a_slow_partition_delays_the_step_but_it_completes_with_the_same_averages(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, world_size=2)
    made = _connect(partitions.address, 2, clients)
    partitions.proxies[1].delay_s = 0.02  # every piece of partition 1's traffic waits, both ways
    partitions.proxies[1].slice_bytes = 256
    slow = run_each(made, lambda c: _averaged_step(c, 0))
    assert slow == [_reference_average(2, 0)] * 2
    partitions.proxies[1].delay_s = 0.0
    fast = run_each(made, lambda c: _averaged_step(c, 1))
    assert fast == [_reference_average(2, 1)] * 2


def test_a_step_that_times_out_on_one_partition_fails_on_every_partition_naming_it(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, world_size=2, step_timeout=1.5, heartbeat_timeout=30.0)
    made = _connect(partitions.address, 2, clients)
    run_each(made, lambda c: (_whole_model(c, 0), c.receive_averaged()))
    _first_sent_then(made, 1)
    # Worker 0's chunks reached partition 1; then partition 1 hears nothing more (worker 1's chunks stall
    # in the cut link), so partition 1's part of step 1 times out. Its streams to the workers are cut
    # too: the workers learn of it only through partition 0, which partition 1 told.
    _wait_pending(partitions.servers[1], 1)
    partitions.proxies[1].blackhole = True
    _whole_model(made[1], 1)
    outcomes = _receive_outcomes(made, timeout=60.0)
    for outcome in outcomes:
        assert isinstance(outcome, GradServerError), outcome
        assert f"step 1 failed on {partitions.partition_map.describe(1)}" in outcome.message, outcome.message
        assert "step timeout" in outcome.message
    partitions.proxies[1].blackhole = False


def test_a_worker_lost_on_one_partition_fails_the_step_on_every_partition(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, world_size=2)
    made = _connect(partitions.address, 2, clients)
    _first_sent_then(made, 0)

    def evict_worker_1(g: GradientServer) -> None:
        member = g._membership.get(1) if g._membership is not None else None
        assert member is not None
        g._evict(member, "lost: cut off by the test")

    _wait_pending(partitions.servers[0], 0)
    _wait_pending(partitions.servers[1], 0)
    partitions.servers[1].call(evict_worker_1)
    with pytest.raises(GradServerError) as info:
        made[0].receive_averaged(timeout=60.0)
    assert "step 0 aborted" in info.value.message and "worker 1" in info.value.message
    # Worker 1's stream to partition 1 was ended: its client is broken on every partition, naming partition 1.
    with pytest.raises(GradServerError) as info:
        made[1].barrier(0, "never released", timeout=60.0)
    assert partitions.partition_map.describe(1) in info.value.message, info.value.message


# --- the real CLIs ---------------------------------------------------------------------------------

_SHAPE = [
    "--num-blocks",
    "2",
    "--hidden",
    "64",
    "--kv-hidden",
    "32",
    "--intermediate",
    "96",
    "--vocab",
    "256",
]


def _cli_partitions(
    processes: ProcessGroup, k: int, *args: str
) -> tuple[list[FaultProxy], list[ManagedProcess]]:
    """K `gradserver coordinator --partition-index I --partition-map ...` processes behind proxies."""
    proxies = [FaultProxy("127.0.0.1", 0).start() for _ in range(k)]
    partition_map = ",".join(p.address for p in proxies)
    procs = []
    for index, proxy in enumerate(proxies):
        proc, address = processes.coordinator(
            "--partition-map", partition_map, "--partition-index", str(index), "--chunk-mib", "0.01", *args
        )
        host, port = address.rsplit(":", 1)
        proxy.target = (host, int(port))
        procs.append(proc)
    return proxies, procs


@pytest.mark.processes
def test_two_partition_processes_and_two_synthetic_workers_through_the_cli(processes: ProcessGroup) -> None:
    proxies, partitions = _cli_partitions(processes, 2, "--world-size", "2", "--max-steps", "2")
    try:
        workers = [
            processes.gradserver(
                "worker", "--job", "synthetic", "--coordinator", proxies[0].address, "--steps", "2", "--json",
                *_SHAPE, name=f"worker-{i}",
            )
            for i in range(2)
        ]  # fmt: skip
        summaries = [json.loads(w.wait_for(r'^\{"worker_id"', timeout=120).string) for w in workers]
        for w in workers:
            assert w.wait(60) == 0, w.output
        for partition in partitions:
            assert partition.wait(30) == 0, partition.output
            assert "reached --max-steps 2" in partition.output
        assert sorted(s["worker_id"] for s in summaries) == [0, 1]
        for step in range(2):
            assert len({s["steps"][step]["checksum"] for s in summaries}) == 1, "averages differ"
            assert all(s["steps"][step]["max_rel_error"] <= 1e-6 for s in summaries)
    finally:
        for proxy in proxies:
            proxy.stop()


def _synthetic_workers_past_step_2(processes: ProcessGroup, address: str) -> list[ManagedProcess]:
    """Two `gradserver worker --job synthetic` processes given partition 0's address, once both
    logged step 2 (the job is under way on every partition)."""
    workers = [
        processes.gradserver(
            "worker", "--job", "synthetic", "--coordinator", address, "--steps", "100000",
            *_SHAPE, name=f"worker-{i}",
        )
        for i in range(2)
    ]  # fmt: skip
    for w in workers:
        w.wait_for(r"step 2:", timeout=120)
    return workers


@pytest.mark.processes
def test_a_killed_partition_process_ends_every_worker_naming_the_partition(processes: ProcessGroup) -> None:
    proxies, partitions = _cli_partitions(processes, 2, "--world-size", "2", "--heartbeat-timeout", "3")
    try:
        workers = _synthetic_workers_past_step_2(processes, proxies[0].address)
        partitions[1].kill()
        for w in workers:
            assert w.wait(60) != 0, w.output
            assert f"partition 1 ({proxies[1].address})" in w.output, w.output
    finally:
        for proxy in proxies:
            proxy.stop()


def test_the_partitioned_compose_file_gives_every_partition_the_same_map_and_its_own_index() -> None:
    import dataclasses

    import yaml

    from gradserver.common.config import env_name

    from .helpers.processes import ROOT

    services = yaml.safe_load((ROOT / "docker-compose.partitioned.yml").read_text())["services"]
    partitions = {name: s for name, s in services.items() if s["command"] == ["coordinator"]}
    known = {env_name(f.name) for f in dataclasses.fields(CoordinatorConfig)}
    maps = {s["environment"]["GRADSERVER_PARTITION_MAP"] for s in partitions.values()}
    assert len(maps) == 1
    (partition_map,) = maps
    for name, service in partitions.items():
        assert set(service["environment"]) <= known, set(service["environment"]) - known
        index = int(service["environment"]["GRADSERVER_PARTITION_INDEX"])
        assert partition_map.split(",")[index] == f"{name}:50051"
    assert services["worker"]["environment"]["GRADSERVER_COORDINATOR"] == partition_map.split(",")[0]


def test_partitions_reach_each_other_with_the_auth_token_and_refuse_notices_without_it(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    token = "shared-secret-for-partitions"
    partitions = partitioned(2, world_size=1, auth_token=token)
    client = WorkerClient.connect(partitions.address, timeout=TEST_TIMEOUTS, auth_token=token)
    clients.append(client)
    assert _averaged_step(client, 0) == _reference_average(1, 0)
    with log_waiter() as logs:
        _fail_step_on(partitions.servers[1], 7, "a failure for the test")
        logs.wait_for(re.escape(f"{partitions.partition_map.describe(1)} reports: a failure for the test"))
    with grpc.insecure_channel(partitions.address) as channel:
        notify = channel.unary_unary(NOTIFY_METHOD)
        with pytest.raises(grpc.RpcError) as info:
            notify(encode_notice(PartitionNotice(1, 2, 3, 10, "forged")), timeout=10)
    assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_several_partitions_refuse_the_continue_mode_at_start() -> None:
    with pytest.raises(InvalidArgumentError, match="needs --on-worker-loss abort"):
        _config(partition_map="127.0.0.1:1,127.0.0.1:2", on_worker_loss="continue")
    with pytest.raises(InvalidArgumentError, match=r"--partition-index .* got 2"):
        _config(partition_map="127.0.0.1:1,127.0.0.1:2", partition_index=2)


def test_partitions_speak_tls_to_workers_and_to_each_other(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient], tmp_path: Path
) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1", common_name="partition")
    files = {
        "ca.pem": ca.cert_pem.bytes(),
        "partition.crt": b"".join(p.bytes() for p in cert.cert_chain_pems),
        "partition.key": cert.private_key_pem.bytes(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    partitions = partitioned(
        2,
        world_size=1,
        tls_cert=str(tmp_path / "partition.crt"),
        tls_key=str(tmp_path / "partition.key"),
        partition_tls_ca=str(tmp_path / "ca.pem"),
    )
    tls = TlsFiles.load(ca=str(tmp_path / "ca.pem"))
    client = WorkerClient.connect(partitions.address, timeout=TEST_TIMEOUTS, tls=tls)
    clients.append(client)
    assert _averaged_step(client, 0) == _reference_average(1, 0)
    with log_waiter() as logs:
        _fail_step_on(partitions.servers[0], 9, "a failure over TLS")
        logs.wait_for(re.escape(f"{partitions.partition_map.describe(0)} reports: a failure over TLS"))


def test_a_new_job_on_the_same_partitions_tells_its_step_failures_again(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    partitions = partitioned(2, world_size=1)
    with log_waiter() as logs:
        for job in ("first", "second"):
            client = WorkerClient.connect(partitions.address, timeout=TEST_TIMEOUTS)
            clients.append(client)
            assert _averaged_step(client, 0) == _reference_average(1, 0)
            _fail_step_on(partitions.servers[1], 3, f"the {job} job's step 3 failed")
            logs.wait_for(re.escape(f"reports: the {job} job's step 3 failed"))
            client.close()
            # Every worker left: each partition resets its job, and the next job counts from step 0.
            deadline = time.monotonic() + 20
            while any(s.call(lambda g: g.state.value) != "waiting" for s in partitions.servers):
                assert time.monotonic() < deadline, "the partitions did not reset their job"
                time.sleep(0.01)


@pytest.mark.processes
def test_a_stopped_partition_process_fails_the_step_for_every_worker_naming_the_partition(
    processes: ProcessGroup,
) -> None:
    """SIGSTOP: the partition's connections stay open and it tells no one; partition 0 finds it silent."""
    proxies, partitions = _cli_partitions(processes, 2, "--world-size", "2", "--heartbeat-timeout", "3")
    try:
        workers = _synthetic_workers_past_step_2(processes, proxies[0].address)
        partitions[1].stop()
        for w in workers:
            assert w.wait(60) != 0, w.output
            assert f"partition 1 ({proxies[1].address}) is unreachable" in w.output, w.output
        assert "is unreachable: no answer for" in partitions[0].output
    finally:
        partitions[1].resume()
        for proxy in proxies:
            proxy.stop()


def test_host_groups_sum_across_partitioned_coordinators_as_they_do_with_one(
    partitioned: Callable[..., Partitions], clients: list[WorkerClient]
) -> None:
    from .test_host_groups import HOSTS, join

    one = ServerThread(_config(world_size=len(HOSTS)))
    try:
        one.start()
        grouped = join(one.address, HOSTS)
        clients.extend(grouped)
        expected = run_each(grouped, lambda c: _one_step(c, 0))
    finally:
        for client in clients:
            client.close()
        clients.clear()
        one.stop()
    partitions = partitioned(2, world_size=len(HOSTS))
    made = join(partitions.address, HOSTS)
    clients.extend(made)
    assert [c.host_group for c in made] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    # Partition 1 adopted partition 0's groups: it takes their partial sums too (else it would
    # refuse them and fail the step).
    assert run_each(made, lambda c: _one_step(c, 0)) == expected
