"""Host groups end to end: workers that share a host other than the coordinator's sum their
contributions there, each chunk crossing the host's link once each way (docs/PROTOCOL.md "Host
groups").

One machine emulates the hosts: every worker says which host it is on (`host_id`), so two
workers saying "host-a" form a group whose arena (a real memfd handed out on a real abstract
socket) and helper threads are the ones a real host uses; the coordinator is on "another" host
since its own id differs. Results are checked against the float64 reference with the bound the
extra rounding allows (a host's partial sum is rounded once to the wire dtype before the
coordinator's average), identical on every worker, and the coordinator's byte counts show one
chunk per group each way.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import GradServerError, InvalidArgumentError
from gradserver.common.messages import CollectiveKind, ReduceOp, TensorKey
from gradserver.common.partition_map import key_hash
from gradserver.worker import WorkerClient

from .helpers.server import (
    TEST_TIMEOUTS,
    ServerThread,
    connect_each,
    run_each,
    run_each_outcome,
    wait_pending,
)
from .helpers.shm import assert_nothing_mapped

pytestmark = pytest.mark.timeout(120)

HOSTS = ("host-a", "host-a", "host-b", "host-b")
ELEMENTS = 300_000  # several 0.25 MiB chunks, so every member sums some


Grouped = Callable[..., tuple[ServerThread, list[WorkerClient]]]


@pytest.fixture
def grouped(coordinator: Callable[..., ServerThread]) -> Iterator[Grouped]:
    """Factory: grouped(hosts=HOSTS, **client_options) -> a coordinator with 0.25 MiB chunks and
    one client per entry of `hosts`, joined as ranks 0, 1, ... saying that host."""
    made: list[WorkerClient] = []

    def make(
        hosts: Sequence[str] = HOSTS, config: dict[str, Any] | None = None, **options: Any
    ) -> tuple[ServerThread, list[WorkerClient]]:
        server = coordinator(world_size=len(hosts), chunk_mib=0.25, **(config or {}))
        clients = join(server.address, hosts, **options)
        made.extend(clients)
        return server, clients

    try:
        yield make
    finally:
        for client in made:
            client.close()


def join(address: str, hosts: Sequence[str], **options: Any) -> list[WorkerClient]:
    return connect_each(address, [{"host_id": host} for host in hosts], **options)


def inputs(n: int, elements: int = ELEMENTS, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(elements).astype(np.float32) for _ in range(n)]


def host_reference(data: Sequence[np.ndarray], hosts: Sequence[str], divide: bool = True) -> np.ndarray:
    """What host groups compute: each host's float64 sum rounded once to float32, those summed in
    float64 in the order of each host's first worker, divided by the worker count, rounded once."""
    partials: dict[str, np.ndarray] = {}
    for array, host in zip(data, hosts, strict=True):
        partials[host] = partials.get(host, np.zeros(array.size)) + array.astype(np.float64)
    total = sum((p.astype(np.float32).astype(np.float64) for p in partials.values()), np.zeros(data[0].size))
    return (total / len(data) if divide else total).astype(np.float32)


def test_two_hosts_of_two_sum_on_their_host_and_every_worker_gets_the_same_average(grouped: Grouped) -> None:
    server, clients = grouped()
    assert [c.host_group for c in clients] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    # The pair shares one stream's pacing window (4 chunks): 2 each.
    windows = {c._link._inner.pacer.window for c in clients}  # type: ignore[attr-defined]
    assert windows == {2 * clients[0].chunk_bytes // 4}
    data = inputs(4)
    before = [server.server.traffic(w) for w in range(4)]  # type: ignore[union-attr]
    steps = 3
    results: list[list[np.ndarray]] = [[] for _ in range(4)]

    def train(client: WorkerClient) -> None:
        for step in range(steps):
            client.send_non_block_gradient(step, NonBlockComponent.LM_HEAD, data[client.worker_id])
            results[client.worker_id].append(client.receive_averaged_non_block().gradients.copy())

    run_each(clients, train)
    expected = host_reference(data, HOSTS)
    exact = np.mean([d.astype(np.float64) for d in data], axis=0)
    for worker in range(4):
        for got in results[worker]:
            np.testing.assert_array_equal(got, results[0][0])  # the same bytes everywhere
    np.testing.assert_array_equal(results[0][0], expected)
    # Two roundings (the host's sum, then the average): within 1.5 float32 ulps of the magnitudes.
    bound = 2.0**-23 * np.abs(np.array(data)).sum(axis=0) / 4 * 1.5
    assert np.all(np.abs(results[0][0] - exact) <= bound + 2.0**-24 * np.abs(exact))
    # One chunk per group crossed each way: S in and S out per group, not per worker.
    after = [server.server.traffic(w) for w in range(4)]  # type: ignore[union-attr]
    for group in ((0, 1), (2, 3)):
        received = sum(after[w].received_bytes - before[w].received_bytes for w in group)
        sent = sum(after[w].sent_bytes - before[w].sent_bytes for w in group)
        assert received == sent == steps * ELEMENTS * 4, (group, received, sent)


def test_block_keys_and_every_summed_collective_kind_go_through_the_group(grouped: Grouped) -> None:
    _, clients = grouped()
    data = inputs(4, 9 * 2000)
    sizes = (2000,) * 9
    outcome: dict[int, dict[str, np.ndarray]] = {}

    def run(client: WorkerClient) -> None:
        w = client.worker_id
        mine: dict[str, np.ndarray] = {}
        client.send_block_gradient(0, 3, 8, data[w], sizes)
        mine["block"] = client.receive_averaged_block().gradients.copy()
        summed = TensorKey.collective(1, 0, ReduceOp.SUM)
        mine["sum"] = client.collective(summed, data[w]).copy()
        scatter = TensorKey.collective(2, 0, ReduceOp.SUM, kind=CollectiveKind.REDUCE_SCATTER)
        mine["scatter"] = client.collective(scatter, data[w]).copy()
        gather = TensorKey.collective(3, 0, kind=CollectiveKind.ALL_GATHER)
        mine["gather"] = client.collective(gather, np.full(3, w, np.uint8)).copy()
        # A reduce to worker 2: its part is everything, the others' nothing (torch's `reduce`).
        splits = tuple(4 * data[w].size * (r == 2) for r in range(4))
        kind = CollectiveKind.REDUCE_SCATTER
        to_root = TensorKey.collective(4, 0, ReduceOp.SUM, kind=kind, split_bytes=splits)
        mine["reduce"] = client.collective(to_root, data[w]).copy()
        outcome[w] = mine

    run_each(clients, run)
    average = host_reference(data, HOSTS)
    total = host_reference(data, HOSTS, divide=False)
    part = data[0].size // 4
    for w in range(4):
        np.testing.assert_array_equal(outcome[w]["block"], average)
        np.testing.assert_array_equal(outcome[w]["sum"], total)
        np.testing.assert_array_equal(outcome[w]["scatter"], total[w * part : (w + 1) * part])
        np.testing.assert_array_equal(outcome[w]["gather"], np.repeat(np.arange(4, dtype=np.uint8), 3))
        np.testing.assert_array_equal(outcome[w]["reduce"], total if w == 2 else total[:0])


def test_a_16_bit_wire_sums_on_the_host_too(grouped: Grouped) -> None:
    _, clients = grouped(wire_dtype="bfloat16")
    data = inputs(4)
    got = run_each(
        clients,
        lambda c: c.collective(TensorKey.collective(0, 0, ReduceOp.AVG), data[c.worker_id]).copy(),
    )
    for result in got:
        np.testing.assert_array_equal(result, got[0])
    exact = np.mean([d.astype(np.float64) for d in data], axis=0)
    # bfloat16 inputs, host sums and averages: each rounding within 2**-8 of its magnitude.
    bound = 2.0**-8 * (np.abs(np.array(data)).sum(axis=0) / 4 * 3 + np.abs(exact))
    assert np.all(np.abs(got[0] - exact) <= bound)


def test_a_non_finite_value_of_a_member_fails_the_step_naming_that_member(grouped: Grouped) -> None:
    _, clients = grouped()
    data = inputs(4)
    data[1][ELEMENTS // 2] = np.nan

    def step(client: WorkerClient) -> None:
        client.send_non_block_gradient(0, NonBlockComponent.LM_HEAD, data[client.worker_id])
        client.receive_averaged_non_block()

    outcomes = run_each_outcome(clients, step)
    key = "step 0 non-block LM_HEAD"
    named = f"worker 1 sent a non-finite value (NaN or Inf) in {key} at element {ELEMENTS // 2}"
    for worker, error in enumerate(outcomes):
        assert isinstance(error, GradServerError), (worker, error)
        assert named in error.message, error
    assert isinstance(outcomes[1], InvalidArgumentError)
    # The job goes on: the next step sums as before.
    data[1][ELEMENTS // 2] = 0.0
    again = run_each(
        clients,
        lambda c: (
            c.send_non_block_gradient(1, NonBlockComponent.LM_HEAD, data[c.worker_id]),
            c.receive_averaged_non_block().gradients.copy(),
        )[1],
    )
    np.testing.assert_array_equal(again[0], host_reference(data, HOSTS))


def test_a_member_that_leaves_dissolves_its_group_and_a_replacement_sends_its_own(grouped: Grouped) -> None:
    server, clients = grouped(config={"rejoin_timeout": 30.0})
    data = inputs(4)

    def step(client: WorkerClient, step: int) -> np.ndarray:
        client.send_non_block_gradient(step, NonBlockComponent.LM_HEAD, data[client.worker_id])
        return client.receive_averaged_non_block().gradients.copy()

    run_each(clients, lambda c: step(c, 0))
    clients[1].close()  # leaves between steps: its group ends, the job waits for a replacement
    assert _wait_until(lambda: _dissolved(clients[0])), "worker 0 never heard that its group dissolved"
    replacement = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS, rank=1, host_id="host-a")
    try:
        assert replacement.host_group == ()  # a replacement joins no group
        survivors = [clients[0], replacement, clients[2], clients[3]]
        got = run_each(survivors, lambda c: step(c, 1))
        for result in got:
            np.testing.assert_array_equal(result, got[0])
        # Group b still sums; worker 0 and the replacement now send their own.
        np.testing.assert_array_equal(got[0], host_reference(data, ["x0", "x1", "host-b", "host-b"]))
    finally:
        replacement.close()


def _wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Polls `condition` (a state another thread changes) until it holds or `timeout` passes."""
    done = threading.Event()
    waited = 0.0
    while not condition():
        if waited >= timeout:
            return False
        done.wait(0.02)
        waited += 0.02
    return True


def _dissolved(client: WorkerClient) -> bool:
    link = client._link
    return getattr(link, "_dissolved", None) is not None


def test_workers_on_the_coordinators_host_and_workers_alone_on_theirs_form_no_group(grouped: Grouped) -> None:
    _, clients = grouped(hosts=["host-a", "host-b", "host-c"])
    assert [c.host_group for c in clients] == [(), (), ()]
    _, off = grouped(hosts=HOSTS, host_groups=False)
    assert [c.host_group for c in off] == [(), (), (), ()]


def test_a_job_that_continues_without_a_lost_worker_forms_no_group(grouped: Grouped) -> None:
    _, clients = grouped(config={"on_worker_loss": "continue"})
    assert [c.host_group for c in clients] == [(), (), (), ()]


def test_host_groups_setting_is_checked_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from gradserver.worker.transports import host_identity

    monkeypatch.setenv("GRADSERVER_HOST_GROUPS", "maybe")
    with pytest.raises(InvalidArgumentError, match="GRADSERVER_HOST_GROUPS='maybe': use on or off"):
        host_identity(None, None)
    monkeypatch.setenv("GRADSERVER_HOST_GROUPS", "off")
    assert host_identity(None, "host-a") == ""
    monkeypatch.setenv("GRADSERVER_HOST_GROUPS", "on")
    assert host_identity(None, "host-a") == "host-a"


def test_an_all_gather_and_a_broadcast_cross_each_hosts_link_once(grouped: Grouped) -> None:
    server, clients = grouped()
    size = 200_000  # bytes per rank: several chunks of bytes each
    pieces = [np.random.default_rng(w).integers(0, 255, size, dtype=np.uint8) for w in range(4)]
    before = [server.server.traffic(w) for w in range(4)]  # type: ignore[union-attr]

    def run(client: WorkerClient) -> tuple[np.ndarray, np.ndarray]:
        gather = TensorKey.collective(0, 0, kind=CollectiveKind.ALL_GATHER)
        gathered = client.collective(gather, pieces[client.worker_id]).copy()
        cast = TensorKey.collective(1, 0, kind=CollectiveKind.BROADCAST, root=2)
        return gathered, client.collective(cast, pieces[client.worker_id]).copy()

    got = run_each(clients, run)
    for gathered, cast in got:
        np.testing.assert_array_equal(gathered, np.concatenate(pieces))
        np.testing.assert_array_equal(cast, pieces[2])
    after = [server.server.traffic(w) for w in range(4)]  # type: ignore[union-attr]
    for group in ((0, 1), (2, 3)):
        sent = sum(after[w].sent_bytes - before[w].sent_bytes for w in group)
        assert sent == 4 * size + size, (group, sent)  # the gathered bytes and the root's, once


def test_an_empty_all_reduce_holds_every_member_until_every_rank_arrived(grouped: Grouped) -> None:
    # torch's barrier: an empty SUM all_reduce. No member may return before the last rank sent.
    server, clients = grouped()
    returned: list[int] = []

    def barrier(client: WorkerClient) -> None:
        if client.worker_id == 0:
            wait_pending(server, 0)  # host b's sum is in: its members are waiting by now
            assert returned == [], returned
        client.collective(TensorKey.collective(0, 0, ReduceOp.SUM), np.zeros(0, np.float32))
        returned.append(client.worker_id)

    run_each(clients, barrier)
    assert sorted(returned) == [0, 1, 2, 3]


def test_a_group_whose_member_never_attaches_does_not_form_and_every_member_sends_its_own() -> None:
    from gradserver.worker.transports.host_arena import form

    key = os.urandom(16)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Worker 12 never comes: the first member gives up after its connect timeout.
        futures = [pool.submit(form, (10, 11, 12), worker, key, 1 << 20, 1.0) for worker in (10, 11)]
        assert [f.result(timeout=30) for f in futures] == [None, None]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # A member with another key (not a member) is refused; the first member gives up too.
        first = pool.submit(form, (20, 21), 20, key, 1 << 20, 1.0)
        stranger = pool.submit(form, (20, 21), 21, os.urandom(16), 1 << 20, 1.0)
        assert first.result(timeout=30) is None and stranger.result(timeout=30) is None
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(form, (30, 31), worker, key, 1 << 20, 5.0) for worker in (30, 31)]
        arenas = [f.result(timeout=30) for f in futures]
    assert all(arena is not None for arena in arenas)
    for arena in arenas:
        assert arena is not None
        arena.close()


def test_a_result_the_group_got_before_the_coordinator_stopped_still_reaches_every_member(
    grouped: Grouped, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's last barrier: rank 0 stops its embedded coordinator as soon as it has the result,
    # while a group member's copy is still on its way through the arena.
    server, clients = grouped(hosts=["host-a", "host-a", "alone"])
    key = TensorKey.collective(0, 0, ReduceOp.SUM)
    _, arena = _summer_of(clients, key)
    publish = arena.publish
    held = threading.Event()

    def slow_publish(*args: Any) -> None:
        held.wait(10)  # until the coordinator is gone
        publish(*args)

    monkeypatch.setattr(arena, "publish", slow_publish)

    def barrier(client: WorkerClient) -> None:
        client.collective(key, np.zeros(0, np.float32))
        if client.worker_id == 2:
            server.stop()
            held.set()

    run_each(clients, barrier)


def test_a_member_that_closes_right_after_its_result_hands_on_what_it_got_first(
    grouped: Grouped, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The member that got the group's copy of the last result closes at once (the job is over).
    _, clients = grouped(hosts=["host-a", "host-a", "alone"])
    key = TensorKey.collective(0, 0, ReduceOp.SUM)
    summer, arena = _summer_of(clients, key)
    free_output = arena.free_output
    closing = threading.Event()
    # Its output slots look busy until it closes: what it owes is still queued then.
    monkeypatch.setattr(arena, "free_output", lambda: free_output() if closing.is_set() else None)

    def run(client: WorkerClient) -> np.ndarray:
        result = client.collective(key, np.full(4, float(client.worker_id + 1), np.float32)).copy()
        if client is summer:
            closing.set()
            client.close()
        return result

    results = run_each(clients, run)
    for result in results:
        np.testing.assert_array_equal(result, np.full(4, 6.0, np.float32))


def _summer_of(clients: list[WorkerClient], key: TensorKey) -> tuple[WorkerClient, Any]:
    """The member of group (0, 1) that sums `key`'s only chunk, and its arena (to slow it)."""
    summer = clients[key_hash(key) % 2]
    return summer, summer._link._arena  # type: ignore[attr-defined]


def test_a_closed_group_leaves_no_helper_thread_and_no_mapping(
    coordinator: Callable[..., ServerThread],
) -> None:
    from gradserver.worker.transports.host_arena import form

    server = coordinator(world_size=4, chunk_mib=0.25)
    clients = join(server.address, HOSTS)
    try:
        data = inputs(4)
        run_each(clients, lambda c: c.collective(TensorKey.collective(0, 0), data[c.worker_id]))
        assert _host_threads(), "the members' helper threads should be running"
    finally:
        for client in clients:
            client.close()
    # A group whose arena did not form gives back what its first member made, too.
    assert form((40, 41), 40, os.urandom(16), 1 << 20, 0.5) is None
    assert _host_threads() == []
    assert_nothing_mapped(what="memfd:gradserver-host-group")


def _host_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("gradserver-host-")]
