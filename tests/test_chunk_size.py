"""The chunk size chosen per job (`--chunk-mib 0`, the default): 32 MiB when every worker joined
over loopback and said it sends through shared memory, 8 MiB when every one joined over loopback,
when one joined from another host (a network namespace here) what the slowest measured link
carries in ~10 ms (0.125-4 MiB; 0.25 MiB when a link was not measured), for partitioned
coordinators partition 0's choice (tests/test_partitioned_coordinators.py), --chunk-mib when
given; every buffer sized by it follows (the table, the streams' checks, the output arena's
slots), and the averages are the same bytes whatever the size. The link probe each worker makes
before joining is checked here too."""

from __future__ import annotations

import concurrent.futures
import hashlib
import sys
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from gradserver.common.config import MIB
from gradserver.common.errors import UnauthenticatedError, UnavailableError
from gradserver.common.rpc import SERVICE_NAME
from gradserver.common.security import bearer_metadata
from gradserver.server import GradientServer
from gradserver.server.chunk_size import choose_chunk, chunk_for_rate, is_local_peer
from gradserver.server.config import CoordinatorConfig
from gradserver.server.job import JobState
from gradserver.server.shm import ShmHub
from gradserver.worker import WorkerClient
from gradserver.worker.joining import measure_link
from gradserver.worker.transports.shm_channel import ShmChannel

from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_all, run_each

SHM = 32 * MIB
LOCAL = 8 * MIB
REMOTE = MIB // 4
# 2.5 local chunks, 81 remote ones.
ELEMENTS = 5 * MIB + 12345
# Just over two shared-memory chunks.
SHM_ELEMENTS = 16 * MIB + 4321


def _hub(coordinator: GradientServer) -> ShmHub | None:
    """The coordinator's shared-memory hub (None: it does not offer shared memory)."""
    hub: ShmHub | None = coordinator.features["shm"].hub
    return hub


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
    return server.call(lambda s: (s.chunk_bytes, _hub(s).slot_bytes if _hub(s) is not None else None))


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
    assert remote.chunk_bytes == REMOTE and "10.0.0.7" in remote.why and "not measured" in remote.why
    assert choose_chunk(CoordinatorConfig(chunk_mib=2.0), ["ipv4:10.0.0.7"]).chunk_bytes == 2 * MIB
    partitioned = CoordinatorConfig(partition_map="127.0.0.1:1,127.0.0.1:2")
    assert partitioned.fixed_chunk_bytes is None  # partition 0 chooses per job
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
    # Partitioned: at most 4 MiB (from a fast measured link), halved to what smaller limits allow,
    # down to 0.25 MiB.
    partitions = "127.0.0.1:1,127.0.0.1:2"
    assert CoordinatorConfig(partition_map=partitions).chunk_bytes == 4 * MIB
    assert CoordinatorConfig(partition_map=partitions, max_message_mib=1.0).chunk_bytes == MIB // 2
    assert CoordinatorConfig(partition_map=partitions, max_inflight_mib=3.0).chunk_bytes == 2 * MIB
    assert CoordinatorConfig(partition_map=partitions, max_message_mib=0.3125).chunk_bytes == REMOTE
    with pytest.raises(ValueError, match="--max-message-mib"):
        CoordinatorConfig(partition_map=partitions, max_message_mib=0.3)


def test_remote_jobs_get_what_the_slowest_measured_link_carries_in_10_ms() -> None:
    kib = 1024
    assert chunk_for_rate(1) == 128 * kib
    assert chunk_for_rate(25_000_000) == 128 * kib  # 200 Mbit/s: 250 kB in 10 ms
    assert chunk_for_rate(27_000_000) == 256 * kib
    assert chunk_for_rate(125_000_000) == MIB  # 1 Gbit/s
    assert chunk_for_rate(1_250_000_000) == 4 * MIB  # 10 Gbit/s: at most 4 MiB
    assert chunk_for_rate(1_250_000_000, largest=MIB // 2) == MIB // 2
    # A 16-bit wire: the same bytes on the link hold twice the elements (sizes are in float32 bytes).
    assert chunk_for_rate(1, item_size=2) == 256 * kib
    assert chunk_for_rate(125_000_000, item_size=2) == 2 * MIB
    assert chunk_for_rate(1_250_000_000, item_size=2) == 4 * MIB
    auto = CoordinatorConfig()
    hosts = ["ipv4:127.0.0.1", "ipv4:10.0.0.7", "ipv4:10.0.0.8"]
    # The slowest remote member decides; a member on this host does not count.
    fast, slow, fine = 1_250_000_000, 25_000_000, 130_000_000
    chosen = choose_chunk(auto, hosts, link_rates=[1, fast, slow])
    assert chosen.chunk_bytes == 128 * kib and "200 Mbit/s" in chosen.why
    assert choose_chunk(auto, hosts, link_rates=[1, fast, fine]).chunk_bytes == MIB
    # A bfloat16 member on the slow link: 128 KiB on its wire, 256 KiB of float32 elements.
    bf16 = choose_chunk(auto, hosts, link_rates=[1, fast, slow], item_sizes=[4, 4, 2])
    assert bf16.chunk_bytes == 256 * kib
    # One remote member that measured nothing (an older worker): the fixed remote size.
    assert choose_chunk(auto, hosts, link_rates=[1, 0, slow]).chunk_bytes == REMOTE
    assert choose_chunk(auto, hosts[:2]).chunk_bytes == REMOTE
    # --chunk-mib wins; every member on this host ignores the rates.
    given = CoordinatorConfig(chunk_mib=2.0)
    assert choose_chunk(given, hosts, link_rates=[1, slow, slow]).chunk_bytes == 2 * MIB
    assert choose_chunk(auto, ["ipv4:127.0.0.1"], link_rates=[slow]).chunk_bytes == LOCAL
    # Partition 0 chooses like one coordinator, within its limits; the others adopt what every
    # worker brought from partition 0, or fall back to the fixed remote size when they disagree.
    partitions = "127.0.0.1:1,127.0.0.1:2"
    first = CoordinatorConfig(partition_map=partitions, max_message_mib=1.0)
    assert choose_chunk(first, hosts[1:], link_rates=[fast] * 2).chunk_bytes == MIB // 2
    assert choose_chunk(first, hosts[1:], link_rates=[slow] * 2).chunk_bytes == 128 * kib
    second = CoordinatorConfig(partition_map=partitions, partition_index=1)
    assert choose_chunk(second, hosts[1:], brought=[128 * kib] * 2).chunk_bytes == 128 * kib
    assert choose_chunk(second, hosts[1:], link_rates=[slow] * 2).chunk_bytes == REMOTE
    disagree = choose_chunk(second, hosts[1:], brought=[128 * kib, MIB])
    assert disagree.chunk_bytes == REMOTE and "no single chunk size" in disagree.why


def test_every_worker_measures_its_link_before_joining(coordinator) -> None:
    server = coordinator(world_size=2)
    clients = connect_all(server.address, 2, TEST_TIMEOUTS, transport="grpc", wire_dtype="bfloat16")
    try:
        links = server.call(
            lambda s: [(m.link_bytes_per_s, m.wire_item_size) for m in s._membership.members()]
        )
        assert len(links) == 2 and all(rate > 0 and size == 2 for rate, size in links), links
        # Over loopback the rates do not matter: the same-host size.
        assert [c.chunk_bytes for c in clients] == [LOCAL] * 2
    finally:
        for c in clients:
            c.close()


def test_a_coordinator_without_the_probe_leaves_the_rate_unknown() -> None:
    """An older coordinator answers UNIMPLEMENTED: the worker joins with no rate (0)."""
    bare = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = bare.add_insecure_port("127.0.0.1:0")
    bare.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert measure_link(channel, 5.0, ()) == 0
    finally:
        bare.stop(None)


def test_a_probe_slower_than_its_deadline_leaves_the_rate_unknown() -> None:
    """A coordinator that does not answer the probe within the connect timeout: no rate (0), so the
    job falls back to the fixed remote size instead of the worker waiting on."""
    release = threading.Event()

    def stalled(_request: bytes, _context: grpc.ServicerContext) -> bytes:
        release.wait(30.0)
        return b""

    stalling = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
    stalling.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE_NAME, {"Probe": grpc.unary_unary_rpc_method_handler(stalled)}
            ),
        )
    )
    port = stalling.add_insecure_port("127.0.0.1:0")
    stalling.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            started = time.monotonic()
            assert measure_link(channel, 0.3, ()) == 0
            assert time.monotonic() - started < 10.0
    finally:
        release.set()
        stalling.stop(None)


def test_a_probe_without_the_auth_token_is_refused(coordinator) -> None:
    server = coordinator(world_size=1, auth_token="sesame")
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(UnauthenticatedError, match=r"link probe: .*auth token"):
            measure_link(channel, 5.0, bearer_metadata("wrong"))
        assert measure_link(channel, 5.0, bearer_metadata("sesame")) > 0


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
    print("RESULT", step, hashlib.sha256(_exchange(client, step, int(sys.argv[3]))).hexdigest(), flush=True)
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


def _remote_worker(processes, peer_host, port: int, steps: int = 1, size: int = ELEMENTS):
    return processes.start(
        [
            *peer_host.host.prefix(),
            sys.executable,
            "-c",
            _REMOTE_WORKER,
            f"{peer_host.local_ip}:{port}",
            str(steps),
            str(size),
        ],
        name="remote-worker",
    )


@pytest.mark.processes
@pytest.mark.parametrize("link", ["veth", "40mbit"])
def test_a_worker_on_another_host_makes_the_job_use_a_chunk_sized_from_its_link(
    processes, coordinator, peer_host, link: str
) -> None:
    """One worker here (shared memory, output slots of the job's size after all) and one in another
    network namespace (gRPC): the job's chunks are what the remote link carries in ~10 ms, from
    what the worker measured before joining (an unlimited veth: 0.5 MiB or more; 40 Mbit/s: the
    smallest, 0.125 MiB), and the averages the same bytes as ever."""
    size = ELEMENTS
    if link != "veth":
        peer_host.slow(link)
        size = 300_000  # 1.2 MB each way per step at 40 Mbit/s
    server = coordinator(world_size=2, bind="0.0.0.0:0", insecure=True, heartbeat_timeout=30.0)
    port = int(server.address.rsplit(":", 1)[1])
    remote = _remote_worker(processes, peer_host, port, steps=2, size=size)
    (local,) = connect_all(f"127.0.0.1:{port}", 1, TEST_TIMEOUTS)
    try:
        joined = remote.wait_for(r"JOINED (\d) (\d+) (\w+)", timeout=60)
        chunk = int(joined.group(2))
        if link == "veth":
            assert chunk in (MIB // 2, MIB, 2 * MIB, 4 * MIB), chunk
        else:
            assert chunk == MIB // 8
        assert joined.group(3) == "grpc"
        assert (local.chunk_bytes, local.transport) == (chunk, "shm")
        assert _chunk_state(server) == (chunk, chunk)
        world_ids = sorted([local.worker_id, int(joined.group(1))])
        assert world_ids == [0, 1]
        for step in range(2):
            mine = _exchange(local, step, size)
            assert mine == _expected(2, step, size)
            theirs = remote.wait_for(rf"RESULT {step} (\w+)", timeout=60).group(1)
            assert theirs == hashlib.sha256(mine).hexdigest()
        assert remote.wait(60) == 0, remote.output
    finally:
        local.close()


@pytest.mark.processes
def test_a_fresh_job_chooses_again(processes, coordinator, peer_host) -> None:
    """A job whose workers all left gives way to a fresh one, which chooses its own size: local
    first (32 MiB: shared memory), then remote (from its unlimited veth link, 0.5-4 MiB), then local again
    (32 MiB, the arena's slots too)."""
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
    remote_chunk = int(remote.wait_for(r"JOINED \d (\d+)", timeout=60).group(1))
    assert remote_chunk in (MIB // 2, MIB, 2 * MIB, 4 * MIB), remote_chunk  # an unlimited veth
    assert remote.wait_for(r"RESULT 0 (\w+)", timeout=60).group(1) == hashlib.sha256(_grads(0, 0)).hexdigest()
    assert remote.wait(60) == 0, remote.output
    _wait_for_a_fresh_job(server)
    # Between jobs: the table waits with the largest size, the output arena kept the last job's.
    assert _chunk_state(server) == (SHM, remote_chunk)
    local_job()
    assert _chunk_state(server) == (SHM, SHM)
