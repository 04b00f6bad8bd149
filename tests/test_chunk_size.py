"""The chunk size chosen per job (`--chunk-mib 0`, the default): 32 MiB when every worker joined
over loopback and said it sends through shared memory, 8 MiB when every one joined over loopback,
0.25 MiB when one joined from another host (a network namespace here) and for partitioned
coordinators (tests/test_partitioned_coordinators.py), --chunk-mib when given; every buffer sized
by it follows (the table, the streams' checks, the output arena's slots), and the averages are the
same bytes whatever the size."""

from __future__ import annotations

import concurrent.futures
import hashlib
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from gradserver.common.config import MIB
from gradserver.common.errors import UnavailableError
from gradserver.server import GradientServer
from gradserver.server.chunk_size import choose_chunk, is_local_peer
from gradserver.server.config import CoordinatorConfig
from gradserver.server.job import JobState
from gradserver.worker import WorkerClient
from gradserver.worker.transports.shm_channel import ShmChannel

from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_all, run_each

SHM = 32 * MIB
LOCAL = 8 * MIB
REMOTE = MIB // 4
# 2.5 local chunks, 81 remote ones.
ELEMENTS = 5 * MIB + 12345
# Just over two shared-memory chunks.
SHM_ELEMENTS = 16 * MIB + 4321


def _grads(worker: int, step: int, size: int = ELEMENTS) -> np.ndarray:
    return np.random.default_rng([worker, step]).standard_normal(size, dtype=np.float32)


def _exchange(client: WorkerClient, step: int = 0, size: int = ELEMENTS) -> bytes:
    client.send_non_block_gradient(step, "lm_head", _grads(client.worker_id, step, size))
    return client.receive_averaged_non_block().gradients.tobytes()


def _expected(world: int, step: int = 0, size: int = ELEMENTS) -> bytes:
    """What every chunk size must give: the coordinator's rule (a float64 sum in worker order,
    divided and rounded once; for two workers the float32 path proven to give the same bytes)."""
    total = sum(_grads(w, step, size).astype(np.float64) for w in range(world))
    return (total / world).astype(np.float32).tobytes()


def _chunk_state(server: ServerThread) -> tuple[int, int | None]:
    return server.call(lambda s: (s.chunk_bytes, s.shm.slot_bytes if s.shm is not None else None))


def _wait_for_a_fresh_job(server: ServerThread, timeout: float = 20.0) -> None:
    """Until every worker of the last job has left and the coordinator waits for a new one."""
    deadline = time.monotonic() + timeout

    def waiting(s: GradientServer) -> bool:
        return (
            s.state is JobState.WAITING
            and s.metrics.registry.get_sample_value("gradserver_workers_joined") == 0
        )

    while not server.call(waiting):
        assert time.monotonic() < deadline, "the coordinator did not give way to a fresh job"
        time.sleep(0.05)


def test_the_choice_follows_where_members_joined_from() -> None:
    auto = CoordinatorConfig()
    here = ["ipv4:127.0.0.1", "ipv6:[::1]", "unix"]
    assert choose_chunk(auto, here).chunk_bytes == LOCAL
    assert choose_chunk(auto, here, shared_memory=True).chunk_bytes == SHM
    remote = choose_chunk(auto, ["ipv4:127.0.0.1", "ipv4:10.0.0.7"], shared_memory=True)
    assert remote.chunk_bytes == REMOTE and "10.0.0.7" in remote.why
    assert choose_chunk(CoordinatorConfig(chunk_mib=2.0), ["ipv4:10.0.0.7"]).chunk_bytes == 2 * MIB
    partitioned = CoordinatorConfig(partition_map="127.0.0.1:1,127.0.0.1:2")
    assert partitioned.fixed_chunk_bytes == REMOTE
    assert choose_chunk(partitioned, ["ipv4:127.0.0.1"]).chunk_bytes == REMOTE
    assert [is_local_peer(h) for h in ("ipv4:127.0.0.2", "ipv6:[::ffff:127.0.0.1]", "ipv4:192.168.1.2")] == [
        True,
        True,
        False,
    ]


def test_the_shared_memory_size_stays_within_the_limits() -> None:
    """The shared-memory chunk shrinks (whole MiB) to what --max-message-mib (a worker that falls
    back to gRPC sends chunks whole), --max-inflight-mib and a quarter of --shm-arena-mib allow,
    but never below the same-host gRPC size."""
    assert CoordinatorConfig().shm_chunk_bytes == SHM
    assert CoordinatorConfig(max_message_mib=16.0).shm_chunk_bytes == 15 * MIB
    assert CoordinatorConfig(max_inflight_mib=20.5).shm_chunk_bytes == 20 * MIB
    assert CoordinatorConfig(shm_arena_mib=64.0).shm_chunk_bytes == 16 * MIB
    assert CoordinatorConfig(max_message_mib=9.0).shm_chunk_bytes == LOCAL
    assert CoordinatorConfig(max_message_mib=16.0).chunk_bytes == 15 * MIB
    # Without shared memory no job gets it: buffers sized by a chunk need only the gRPC size.
    assert CoordinatorConfig(no_shm=True).chunk_bytes == LOCAL
    assert "32 MiB" in CoordinatorConfig().setting_notes()["chunk_mib"]
    assert "32 MiB" not in CoordinatorConfig(no_shm=True).setting_notes()["chunk_mib"]
    # The collective lane keeps its slots sized by the gRPC size.
    assert CoordinatorConfig().lane_chunk_bytes == LOCAL
    assert CoordinatorConfig(chunk_mib=2.0).lane_chunk_bytes == 2 * MIB


def test_limits_are_checked_against_the_largest_automatic_chunk() -> None:
    assert CoordinatorConfig().chunk_bytes == SHM
    with pytest.raises(ValueError, match=r"--max-message-mib .* at least 8.0625 \(the largest automatic"):
        CoordinatorConfig(max_message_mib=4.0)
    with pytest.raises(ValueError, match="--shm-arena-mib"):
        CoordinatorConfig(shm_arena_mib=4.0)
    assert CoordinatorConfig(max_message_mib=4.0, chunk_mib=2.0).chunk_bytes == 2 * MIB
    # Partitioned: 0.25 MiB whatever joins, so smaller limits do.
    assert (
        CoordinatorConfig(partition_map="127.0.0.1:1,127.0.0.1:2", max_message_mib=1.0).chunk_bytes == REMOTE
    )


def test_workers_on_this_host_using_shared_memory_get_32_mib_chunks_and_the_same_bytes(coordinator) -> None:
    server = coordinator(world_size=3)
    clients = connect_all(server.address, 3, TEST_TIMEOUTS)
    try:
        assert [c.chunk_bytes for c in clients] == [SHM] * 3
        assert {c.transport for c in clients} == {"shm"}
        assert _chunk_state(server) == (SHM, SHM)
        got = run_each(clients, lambda c: _exchange(c, size=SHM_ELEMENTS))
        assert got == [_expected(3, size=SHM_ELEMENTS)] * 3
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("transports", [("grpc", "grpc"), ("shm", "grpc")])
def test_a_worker_on_this_host_using_grpc_makes_the_job_use_8_mib_chunks(coordinator, transports) -> None:
    server = coordinator(world_size=2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                WorkerClient.connect, server.address, node_id=f"w{i}", timeout=TEST_TIMEOUTS, transport=t
            )
            for i, t in enumerate(transports)
        ]
        clients = sorted((f.result(timeout=60) for f in futures), key=lambda c: c.worker_id)
    try:
        assert [c.chunk_bytes for c in clients] == [LOCAL] * 2
        assert sorted(c.transport for c in clients) == sorted(transports)
        assert _chunk_state(server) == (LOCAL, LOCAL)
        assert run_each(clients, _exchange) == [_expected(2)] * 2
    finally:
        for c in clients:
            c.close()


def test_workers_that_fall_back_to_grpc_still_fit_shared_memory_chunks_in_a_message(
    coordinator, monkeypatch
) -> None:
    """Workers said at Join they would use shared memory, then could not register (here: the
    registration fails; in life, e.g. a container sharing the network but not the socket's
    directory): the job's 32 MiB chunks go inline over gRPC, within the default message limit."""

    def refuse(*args: object, **kwargs: object) -> ShmChannel:
        raise UnavailableError("no shared memory in this test")

    monkeypatch.setattr(ShmChannel, "open", refuse)
    server = coordinator(world_size=2)
    clients = connect_all(server.address, 2, TEST_TIMEOUTS)
    try:
        assert [(c.chunk_bytes, c.transport) for c in clients] == [(SHM, "grpc")] * 2
        got = run_each(clients, lambda c: _exchange(c, size=SHM_ELEMENTS))
        assert got == [_expected(2, size=SHM_ELEMENTS)] * 2
    finally:
        for c in clients:
            c.close()


def test_an_explicit_chunk_mib_wins(coordinator) -> None:
    server = coordinator(world_size=2, chunk_mib=1.0)
    clients = connect_all(server.address, 2, TEST_TIMEOUTS)
    try:
        assert [c.chunk_bytes for c in clients] == [MIB] * 2
        assert _chunk_state(server) == (MIB, MIB)
        assert run_each(clients, _exchange) == [_expected(2)] * 2
    finally:
        for c in clients:
            c.close()


# --- a worker on another host: a network namespace ------------------------------------------

_REMOTE_WORKER = """
import hashlib, sys
import numpy as np
from gradserver.worker import Timeouts, WorkerClient
from tests.test_chunk_size import _exchange
client = WorkerClient.connect(sys.argv[1], node_id="remote", timeout=Timeouts.of(30.0))
print("JOINED", client.worker_id, client.chunk_bytes, client.transport, flush=True)
for step in range(int(sys.argv[2])):
    print("RESULT", step, hashlib.sha256(_exchange(client, step)).hexdigest(), flush=True)
client.close()
"""


@pytest.fixture
def peer_host() -> Iterator[object]:
    """A host in its own network namespace whose only link is a veth pair to this one."""
    from bench._netns import PeerHost, available

    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces unavailable here: {why}")
    with PeerHost() as host:
        yield host


def _remote_worker(processes, peer_host, port: int, steps: int = 1):
    return processes.start(
        [
            *peer_host.host.prefix(),
            sys.executable,
            "-c",
            _REMOTE_WORKER,
            f"{peer_host.local_ip}:{port}",
            str(steps),
        ],
        name="remote-worker",
    )


@pytest.mark.processes
def test_a_worker_on_another_host_makes_the_job_use_the_remote_chunk_size(
    processes, coordinator, peer_host
) -> None:
    """One worker here (shared memory, 0.25 MiB output slots after all) and one in another network
    namespace (gRPC): the job's chunks are 0.25 MiB and the averages the same bytes as ever."""
    server = coordinator(world_size=2, bind="0.0.0.0:0", insecure=True, heartbeat_timeout=30.0)
    port = int(server.address.rsplit(":", 1)[1])
    remote = _remote_worker(processes, peer_host, port, steps=2)
    (local,) = connect_all(f"127.0.0.1:{port}", 1, TEST_TIMEOUTS)
    try:
        joined = remote.wait_for(r"JOINED (\d) (\d+) (\w+)", timeout=60)
        assert (int(joined.group(2)), joined.group(3)) == (REMOTE, "grpc")
        assert (local.chunk_bytes, local.transport) == (REMOTE, "shm")
        assert _chunk_state(server) == (REMOTE, REMOTE)
        world_ids = sorted([local.worker_id, int(joined.group(1))])
        assert world_ids == [0, 1]
        for step in range(2):
            mine = _exchange(local, step)
            assert mine == _expected(2, step)
            theirs = remote.wait_for(rf"RESULT {step} (\w+)", timeout=60).group(1)
            assert theirs == hashlib.sha256(mine).hexdigest()
        assert remote.wait(60) == 0, remote.output
    finally:
        local.close()


@pytest.mark.processes
def test_a_fresh_job_chooses_again(processes, coordinator, peer_host) -> None:
    """A job whose workers all left gives way to a fresh one, which chooses its own size: local
    first (32 MiB: shared memory), then remote (0.25 MiB), then local again (32 MiB, the arena's
    slots too)."""
    server = coordinator(world_size=1, bind="0.0.0.0:0", insecure=True)
    port = int(server.address.rsplit(":", 1)[1])

    def local_job() -> None:
        (client,) = connect_all(f"127.0.0.1:{port}", 1, TEST_TIMEOUTS)
        with client:
            assert client.chunk_bytes == SHM
            assert _exchange(client) == _grads(0, 0).tobytes()

    local_job()
    assert _chunk_state(server) == (SHM, SHM)
    _wait_for_a_fresh_job(server)
    remote = _remote_worker(processes, peer_host, port)
    assert int(remote.wait_for(r"JOINED \d (\d+)", timeout=60).group(1)) == REMOTE
    assert remote.wait_for(r"RESULT 0 (\w+)", timeout=60).group(1) == hashlib.sha256(_grads(0, 0)).hexdigest()
    assert remote.wait(60) == 0, remote.output
    _wait_for_a_fresh_job(server)
    # Between jobs: the table waits with the largest size, the output arena kept the last job's.
    assert _chunk_state(server) == (SHM, REMOTE)
    local_job()
    assert _chunk_state(server) == (SHM, SHM)
