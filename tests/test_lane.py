"""The collective lane (same-host one-shot collectives through shared memory and futexes): the
same bytes as the gRPC path for every kind and size, when it opens and closes, and every way an
operation can fail in it, each failure named as the gRPC path names it and never a hang."""

from __future__ import annotations

import concurrent.futures
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradserver.common import lane as shared
from gradserver.common.errors import (
    AbortedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from gradserver.common.lane import Descriptor, LaneState
from gradserver.common.lane_rounds import RoundPlan, RoundProblem, plan_round
from gradserver.common.messages import CollectiveKind, ReduceOp, TensorKey
from gradserver.server import GradientServer
from gradserver.server.shm import ShmHub
from gradserver.torch._collective import CollectiveClient

from .helpers.server import ServerThread, connect_ranks, metric

pytestmark = [
    pytest.mark.skipif(not shared.supported(), reason="the lane needs x86-64 Linux"),
    pytest.mark.timeout(120),
]

SLOT = 16384  # 1/64 MiB chunks: slots of 16 KiB, so the larger operations below take many rounds
KINDS = (
    CollectiveKind.REDUCE,
    CollectiveKind.REDUCE_SCATTER,
    CollectiveKind.ALL_GATHER,
    CollectiveKind.BROADCAST,
    CollectiveKind.ALL_TO_ALL,
)


def _hub(coordinator: GradientServer) -> ShmHub | None:
    """The coordinator's shared-memory hub (None: it does not offer shared memory)."""
    hub: ShmHub | None = coordinator.features["shm"].hub
    return hub


# --- the pure planner -----------------------------------------------------------------------------


def _descriptor(kind: CollectiveKind = CollectiveKind.REDUCE, total: int = 64, **fields: Any) -> Descriptor:
    world = fields.pop("world", 2)
    offset, length = shared.round_span(kind, total, world, SLOT, fields.get("part", 0))
    length = shared.posted_length(kind, length, world, root=True)
    values: dict[str, Any] = {
        "sequence": 3,
        "total": total,
        "offset": offset,
        "length": length,
        "part": 0,
        "group": 0,
        "root": 0,
        "kind": kind,
        "op": ReduceOp.SUM,
    }
    values.update(fields)
    return Descriptor(**values)


def test_a_consistent_reduce_round_is_reduced_and_counted() -> None:
    plan = plan_round([_descriptor(), _descriptor()], SLOT)
    assert isinstance(plan, RoundPlan)
    assert (plan.reduce_bytes, plan.divide, plan.finite_only) == (64, False, True)
    assert plan.received == (64, 64) and plan.sent == (64, 64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"sequence": 4},
            r"worker 1 issued operation 4 collective SUM of group 0 where worker 0 issued operation 3",
        ),
        ({"kind": CollectiveKind.ALL_GATHER}, r"worker 1 issued operation 3 collective ALL_GATHER"),
        ({"op": ReduceOp.AVG}, r"worker 1 asked for operation 3 collective AVG"),
        ({"total": 128, "length": 128}, r"worker 1 contributed 128 bytes, worker 0 64"),
        ({"group": 1}, r"worker 1 issued operation 3 collective SUM of group 1"),
        ({"length": 60}, r"worker 1 posted bytes \[0, \+60\) for round 0, expected \[0, \+64\)"),
    ],
)
def test_a_round_whose_workers_disagree_is_refused_naming_the_worker(
    change: dict[str, Any], message: str
) -> None:
    plan = plan_round([_descriptor(), Descriptor(**{**_descriptor().__dict__, **change})], SLOT)
    assert isinstance(plan, RoundProblem)
    assert plan.culprit == 1
    assert re.search(message, plan.message), plan.message


def test_shapes_that_cannot_be_split_or_rooted_are_refused() -> None:
    odd = [_descriptor(CollectiveKind.REDUCE_SCATTER, total=12) for _ in range(2)]
    problem = plan_round(odd, SLOT)
    assert (
        isinstance(problem, RoundProblem) and "3 elements do not split into 2 equal parts" in problem.message
    )
    rooted = [_descriptor(CollectiveKind.BROADCAST, total=8, root=5, length=0) for _ in range(2)]
    problem = plan_round(rooted, SLOT)
    assert isinstance(problem, RoundProblem) and "root 5 is out of range for 2 workers" in problem.message
    splits = [
        _descriptor(CollectiveKind.ALL_TO_ALL, total=8, splits=(4, 4)),
        _descriptor(CollectiveKind.ALL_TO_ALL, total=8, splits=(4, 3)),
    ]
    problem = plan_round(splits, SLOT)
    assert (
        isinstance(problem, RoundProblem) and problem.culprit == 1 and "split_bytes [4, 3]" in problem.message
    )


def test_a_reduce_scatter_round_names_elements_of_the_whole_operation() -> None:
    """Round 1 of a reduce-scatter of two parts of 8192 elements each: element 5 of the second
    piece in the slot is element 8192 + 2048 + 5 of the operation (pieces of 2048 elements)."""
    total = 2 * 8192 * 4
    descriptors = [_descriptor(CollectiveKind.REDUCE_SCATTER, total=total, part=1) for _ in range(2)]
    plan = plan_round(descriptors, SLOT)
    assert isinstance(plan, RoundPlan)
    assert plan.piece_bytes == SLOT // 2
    assert plan.element(2048 + 5) == 8192 + 2048 + 5
    assert plan.element(7) == 2048 + 7


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("total", [0, 4, SLOT - 4, SLOT, 5 * SLOT + 12])
def test_round_spans_cover_each_input_exactly_once(kind: CollectiveKind, total: int) -> None:
    world = 4
    total = total // (4 * world) * 4 * world if kind is CollectiveKind.REDUCE_SCATTER else total
    rounds = shared.own_rounds(kind, total, world, SLOT)
    spans = [shared.round_span(kind, total, world, SLOT, part) for part in range(rounds)]
    span = total // world if kind is CollectiveKind.REDUCE_SCATTER else total
    assert sum(length for _, length in spans) == span
    assert [offset for offset, _ in spans] == sorted(offset for offset, _ in spans)
    assert all(shared.posted_length(kind, length, world, root=True) <= SLOT for _, length in spans)


# --- end to end -----------------------------------------------------------------------------------


@pytest.fixture
def lane_coordinator(coordinator: Callable[..., ServerThread], tmp_path: Any) -> Callable[..., ServerThread]:
    def make(**overrides: Any) -> ServerThread:
        config: dict[str, Any] = {"chunk_mib": SLOT / 2**20, "max_message_mib": 1.0, "shm_dir": str(tmp_path)}
        return coordinator(**{**config, **overrides})

    return make


def _each(clients: Sequence[CollectiveClient], fn: Callable[[CollectiveClient], Any]) -> list[Any]:
    """fn(client) on every client at once; each one's result or exception, in rank order."""
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(fn, c) for c in clients]
        outcomes: list[Any] = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout=60))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes


def _input(kind: CollectiveKind, rank: int, world: int, size: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Rank `rank`'s input of about `size` bytes (float32 for the reducing kinds), and for an
    ALL_TO_ALL its uneven split sizes."""
    rng = np.random.default_rng([rank, size, int(kind)])
    if kind in (CollectiveKind.REDUCE, CollectiveKind.REDUCE_SCATTER):
        elements = size // 4 // world * world if kind is CollectiveKind.REDUCE_SCATTER else size // 4
        return rng.standard_normal(elements, dtype=np.float32), ()
    if kind is CollectiveKind.ALL_TO_ALL:
        splits = tuple(int(n) for n in rng.integers(0, size // world + 2, world))
        return rng.integers(0, 256, sum(splits), dtype=np.uint8), splits
    return rng.integers(0, 256, size, dtype=np.uint8), ()


def _workload(
    kind: CollectiveKind, sizes: Sequence[int], op: ReduceOp = ReduceOp.SUM
) -> Callable[[CollectiveClient], list[bytes]]:
    def run(client: CollectiveClient) -> list[bytes]:
        out = []
        for sequence, size in enumerate(sizes):
            data, splits = _input(kind, client.worker_id, client.total_workers, size)
            result = client.run_collective(
                sequence,
                0,
                data,
                op,
                kind=kind,
                root=1 if kind is CollectiveKind.BROADCAST else 0,
                split_bytes=splits,
                timeout=30,
            )
            out.append(result.tobytes())
        return out

    return run


SIZES = [0, 4, 100, SLOT - 4, SLOT + 4, 7 * SLOT + 36]


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_gives_the_grpc_paths_bytes_at_every_size(
    lane_coordinator: Callable[..., ServerThread], kind: CollectiveKind
) -> None:
    results = {}
    for no_lane in (False, True):
        server = lane_coordinator(world_size=3, no_lane=no_lane)
        clients = connect_ranks(server.address, ["shm"] * 3)
        try:
            results[no_lane] = _each(clients, _workload(kind, SIZES))
            server.call(lambda s: s.traffic(0))  # takes in what workers counted of peer rounds
            rounds = server.call(lambda s: metric(s, "gradserver_lane_rounds_total"))
            assert (rounds > 0) is (not no_lane)
        finally:
            for c in clients:
                c.close()
            server.stop()
    assert not any(isinstance(r, Exception) for r in results[False]), results[False]
    assert results[False] == results[True]


def test_averages_are_the_float64_rank_order_mean_and_in_place_results_land_in_the_input(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    server = lane_coordinator(world_size=3)
    clients = connect_ranks(server.address, ["shm"] * 3)
    size = 3 * SLOT // 4 + 5
    try:

        def run(client: CollectiveClient) -> np.ndarray:
            data, _ = _input(CollectiveKind.REDUCE, client.worker_id, 3, size * 4)
            result = client.run_collective(0, 0, data, ReduceOp.AVG, into=data, timeout=30)
            assert np.shares_memory(result, data)
            return data

        results = _each(clients, run)
        expected = sum(_input(CollectiveKind.REDUCE, w, 3, size * 4)[0].astype(np.float64) for w in range(3))
        for result in results:
            assert result.tobytes() == (expected / 3).astype(np.float32).tobytes()
    finally:
        for c in clients:
            c.close()


def test_a_worker_on_grpc_closes_the_lane_and_every_collective_goes_over_grpc(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    server = lane_coordinator(world_size=2)
    clients = connect_ranks(server.address, ["shm", "grpc"])
    try:
        results = _each(clients, _workload(CollectiveKind.ALL_GATHER, [10, SLOT * 2]))
        assert results[0] == results[1]
        assert (
            server.call(lambda s: _hub(s).lane.state if _hub(s) and _hub(s).lane else None)
            is LaneState.CLOSED
        )
        assert server.call(lambda s: metric(s, "gradserver_lane_rounds_total")) == 0
    finally:
        for c in clients:
            c.close()


def test_lane_bytes_count_in_the_coordinators_traffic(lane_coordinator: Callable[..., ServerThread]) -> None:
    server = lane_coordinator(world_size=2)
    clients = connect_ranks(server.address, ["shm"] * 2)
    size = 3 * SLOT + 8
    try:
        _each(clients, _workload(CollectiveKind.ALL_GATHER, [size]))
        for w in range(2):
            traffic = server.call(lambda s, w=w: s.traffic(w))
            assert (traffic.received_bytes, traffic.sent_bytes) == (size, 2 * size)
    finally:
        for c in clients:
            c.close()


# --- failures -------------------------------------------------------------------------------------


def _clients(
    lane_coordinator: Callable[..., ServerThread], **config: Any
) -> tuple[ServerThread, list[CollectiveClient]]:
    server = lane_coordinator(world_size=2, **config)
    return server, connect_ranks(server.address, ["shm"] * 2)


def _until_posted(server: ServerThread, worker: int) -> None:
    """Waits (bounded) until `worker` posted a round in the coordinator's lane: it is then inside
    an operation. (The lane's words have no event to wait on from another thread.)"""
    lane = server.call(lambda s: _hub(s).lane if _hub(s) else None)
    assert lane is not None
    end = time.monotonic() + 10
    while lane.memory.posted(worker) == 0:
        assert time.monotonic() < end, f"worker {worker} never posted a round"
        time.sleep(0.002)


def _worker_0_waits_while(
    server: ServerThread, clients: Sequence[CollectiveClient], action: Callable[[], object]
) -> np.ndarray:
    """Worker 0 begins a collective alone; once it waits in the lane, `action` runs; returns its
    result or raises its error."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_reduce, clients[0], 0, np.ones(3, np.float32))
        _until_posted(server, 0)
        action()
        return waiting.result(timeout=30)


def _until_state(server: ServerThread, state: LaneState) -> None:
    """Waits (bounded) until the coordinator's lane is in `state`."""
    lane = server.call(lambda s: _hub(s).lane if _hub(s) else None)
    assert lane is not None
    end = time.monotonic() + 10
    while lane.state is not state:
        assert time.monotonic() < end, f"the lane never became {state.name}"
        time.sleep(0.002)


def _reduce(client: CollectiveClient, sequence: int, data: np.ndarray, **kwargs: Any) -> np.ndarray:
    return client.run_collective(sequence, 0, data, ReduceOp.SUM, **{"timeout": 30, **kwargs})


def _then_grpc_still_works(clients: Sequence[CollectiveClient], sequence: int) -> None:
    """After the lane failed, the next collective goes over gRPC on every worker and completes;
    unless a worker had already begun it in the lane, so that it fails on every worker alike, and
    the one after completes."""
    for attempt in (sequence, sequence + 1):
        results = _each(
            clients, lambda c, s=attempt: _reduce(c, s, np.full(5, c.worker_id + 1.0, np.float32))
        )
        failed = [isinstance(r, Exception) for r in results]
        if not any(failed):
            assert [r.tolist() for r in results] == [[3.0] * 5] * 2
            return
        assert attempt == sequence and all(failed), results
        assert len({getattr(r, "message", str(r)) for r in results}) == 1, results
    raise AssertionError("unreachable")


def test_a_worker_that_stops_waiting_fails_the_operation_for_everyone_naming_itself(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    server, clients = _clients(lane_coordinator)
    try:
        started = time.monotonic()
        with pytest.raises(
            DeadlineExceededError, match=r"operation 0 collective SUM of group 0: no result .*worker\(s\) 1"
        ):
            _reduce(clients[0], 0, np.ones(3, np.float32), timeout=0.5)
        assert time.monotonic() - started < 5
        # Once the coordinator has failed the lane, a worker that comes to that operation hears why.
        _until_state(server, LaneState.FAILED)
        with pytest.raises(
            AbortedError, match=r"operation 0 collective SUM of group 0 aborted: worker 0 gave up"
        ) as info:
            _reduce(clients[1], 0, np.ones(3, np.float32))
        assert info.value.culprit == 0
        _then_grpc_still_works(clients, 1)
    finally:
        for c in clients:
            c.close()


def test_workers_that_disagree_fail_the_operation_the_culprit_hears_its_own_error(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    _, clients = _clients(lane_coordinator)
    try:
        outcomes = _each(clients, lambda c: _reduce(c, 0, np.ones(4 + 4 * c.worker_id, np.float32)))
        assert isinstance(outcomes[1], InvalidArgumentError), outcomes
        assert isinstance(outcomes[0], AbortedError) and outcomes[0].culprit == 1
        for outcome in outcomes:
            assert "worker 1 contributed 32 bytes, worker 0 16" in str(outcome)
        _then_grpc_still_works(clients, 1)
    finally:
        for c in clients:
            c.close()


def test_a_non_finite_value_is_named_by_worker_and_element_unless_it_is_let_through(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    _, clients = _clients(lane_coordinator)
    size = 3 * SLOT // 4  # three rounds
    try:

        def send_nan(client: CollectiveClient, sequence: int, **kwargs: Any) -> np.ndarray:
            data = np.ones(size, np.float32)
            if client.worker_id == 1:
                data[size - 3] = np.nan
            return _reduce(client, sequence, data, **kwargs)

        passed = _each(clients, lambda c: send_nan(c, 0, propagate_non_finite=True))
        assert all(np.isnan(r[size - 3]) and r[0] == 2.0 for r in passed)
        outcomes = _each(clients, lambda c: send_nan(c, 1))
        assert isinstance(outcomes[1], InvalidArgumentError) and isinstance(outcomes[0], AbortedError)
        for outcome in outcomes:
            named = "worker 1 sent a non-finite value (NaN or Inf) in operation 1 collective SUM of group 0"
            assert f"{named} at element {size - 3}" in str(outcome)
    finally:
        for c in clients:
            c.close()


def _hold_a_round_behind(client: CollectiveClient, until_worker_gave_up: int) -> None:
    """Makes `client` stop after reading the second-to-last round of its lane operations until
    worker `until_worker_gave_up` has given up on one (bounded): a worker a round behind."""
    lane = client._link.payloads.arenas.lane
    assert lane is not None
    read_peer = lane._read_peer

    def a_round_behind(op: Any, part: int, g: int) -> None:
        read_peer(op, part, g)
        if part == op.rounds - 2:
            end = time.monotonic() + 10
            while not lane.memory.abandoned(until_worker_gave_up):
                assert time.monotonic() < end, f"worker {until_worker_gave_up} never gave up"
                time.sleep(0.002)

    lane._read_peer = a_round_behind  # type: ignore[method-assign]


def test_a_worker_a_round_behind_names_the_non_finite_value_too(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    """Worker 0 finds a NaN in the last round and gives up while worker 1 is a round behind (held
    there until worker 0 gave up): worker 0 had posted every round, so worker 1 reads them all and
    fails naming the culprit and element too, not merely that worker 0 gave up."""
    _, clients = _clients(lane_coordinator)
    size = 3 * SLOT // 4  # three rounds
    try:
        _hold_a_round_behind(clients[1], until_worker_gave_up=0)

        def send_nan(client: CollectiveClient) -> np.ndarray:
            data = np.ones(size, np.float32)
            if client.worker_id == 1:
                data[size - 3] = np.nan
            return _reduce(client, 0, data)

        outcomes = _each(clients, send_nan)
        assert isinstance(outcomes[1], InvalidArgumentError) and isinstance(outcomes[0], AbortedError), (
            outcomes
        )
        named = "worker 1 sent a non-finite value (NaN or Inf) in operation 0 collective SUM of group 0"
        assert all(f"{named} at element {size - 3}" in str(outcome) for outcome in outcomes), outcomes
    finally:
        for c in clients:
            c.close()


def test_a_worker_a_round_behind_one_that_gave_up_fails_even_with_every_round_there(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    """Worker 0 posts every round of an operation, then gives up on it for a reason of its own
    (an error injected into its last read) while worker 1 is a round behind: worker 1 reads the
    rounds, which are all there and fine, and still fails naming worker 0, as every worker fails
    an operation that one gave up on."""
    _, clients = _clients(lane_coordinator)
    size = 3 * SLOT // 4  # three rounds
    quitter = clients[0]._link.payloads.arenas.lane
    assert quitter is not None
    finish = quitter._finish

    def fail_last_read(op: Any, part: int, g: int, deadline: float, check: Any) -> None:
        if part == op.rounds - 1:
            raise RuntimeError("injected: worker 0 gives up")
        finish(op, part, g, deadline, check)

    try:
        quitter._finish = fail_last_read  # type: ignore[method-assign]
        _hold_a_round_behind(clients[1], until_worker_gave_up=0)
        outcomes = _each(clients, lambda c: _reduce(c, 0, np.ones(size, np.float32)))
        assert isinstance(outcomes[0], RuntimeError), outcomes
        assert isinstance(outcomes[1], AbortedError) and "worker 0 gave up on it" in str(outcomes[1]), (
            outcomes
        )
    finally:
        for c in clients:
            c.close()


def test_a_worker_that_leaves_mid_operation_fails_it_for_the_others_naming_it(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    server, clients = _clients(lane_coordinator)
    try:
        with pytest.raises(
            AbortedError, match=r"operation 0 collective SUM of group 0 aborted: worker 1 left"
        ):
            _worker_0_waits_while(server, clients, clients[1].close)
    finally:
        for c in clients:
            c.close()


def test_the_coordinators_step_timeout_names_the_workers_that_did_not_post(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    _, clients = _clients(lane_coordinator, step_timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(
            AbortedError,
            match=r"operation 0 collective SUM of group 0 timed out after 1 s waiting for worker\(s\) 1",
        ):
            _reduce(clients[0], 0, np.ones(3, np.float32))
        assert time.monotonic() - started < 10
    finally:
        for c in clients:
            c.close()


def test_a_stopping_coordinator_fails_a_waiting_operation_as_unavailable(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    server, clients = _clients(lane_coordinator)
    try:
        with pytest.raises((UnavailableError, FailedPreconditionError), match="coordinator"):
            _worker_0_waits_while(server, clients, server.stop)
    finally:
        for c in clients:
            c.close()


def test_an_all_to_all_result_buffer_of_the_wrong_size_fails_naming_the_sizes(
    lane_coordinator: Callable[..., ServerThread],
) -> None:
    _, clients = _clients(lane_coordinator)
    try:

        def run(client: CollectiveClient) -> np.ndarray:
            data = np.arange(8, dtype=np.uint8)
            into = np.empty(8 if client.worker_id == 0 else 5, np.uint8)
            key = TensorKey.collective(0, 0, kind=CollectiveKind.ALL_TO_ALL, split_bytes=(4, 4))
            return client.collective(key, data, into=into, timeout=30)

        outcomes = _each(clients, run)
        assert isinstance(
            outcomes[1], ValueError
        ) and "send this worker 8 bytes, but the result buffer holds 5" in str(outcomes[1])
        assert isinstance(outcomes[0], np.ndarray | AbortedError)
        _then_grpc_still_works(clients, 1)
    finally:
        for c in clients:
            c.close()


def test_every_word_and_counter_of_a_control_block_is_its_own() -> None:
    """Each value a worker publishes lives apart from the others (a counter once overlapped a
    bell, and the coordinator served a round nobody had rung for)."""
    from gradserver.common import shm

    layout = shared.LaneLayout(3, SLOT)
    fd, mapping = shm.create_arena(layout.size, "lane-test")
    try:
        memory = shared.LaneMemory.create(mapping, layout)
        for w in range(3):
            memory.set_posted(w, 11 + w)
            memory.set_taken(w, 21 + w)
            memory.ring(w, 42 + 2 * w)  # an even round
            memory.ring(w, 43 + 2 * w)  # an odd one
            memory.count_peer_round(w, 1000 + w, 2000 + w)
            memory.set_abandoned(w, 51 + w)
            memory.write_descriptor(w, 1, _descriptor(total=64, index=7, sequence=9))
        for w in range(3):
            assert memory.posted(w) == 11 + w and memory.taken(w) == 21 + w
            assert memory.rung(w, 0) == 42 + 2 * w and memory.rung(w, 1) == 43 + 2 * w
            assert memory.bell(w) == 43 + 2 * w
            assert memory.peer_counters(w) == (1, 1000 + w, 2000 + w)
            assert memory.abandoned(w) == 51 + w
            assert memory.read_descriptor(w, 1).index == 7 and memory.read_descriptor(w, 1).sequence == 9
        memory.close()
    finally:
        os.close(fd)
        mapping.close()


# --- the planner under random input -------------------------------------------------------------

_KINDS = st.sampled_from(list(CollectiveKind))


@settings(max_examples=300, deadline=None)
@given(
    kind=_KINDS,
    world=st.integers(1, 5),
    elements=st.integers(0, 3 * SLOT // 4),
    root=st.integers(0, 4),
    part_seed=st.integers(0, 1 << 16),
    splits_seed=st.integers(0, 1 << 16),
)
def test_descriptors_of_one_consistent_round_always_plan(
    kind: CollectiveKind, world: int, elements: int, root: int, part_seed: int, splits_seed: int
) -> None:
    """Every worker describing the same round of a well-formed operation gives a plan that moves
    exactly the bytes the round's geometry says; never a problem."""
    root = root % world if kind is CollectiveKind.BROADCAST else 0
    total = elements * 4 // (4 * world) * 4 * world if kind is CollectiveKind.REDUCE_SCATTER else elements * 4
    rng = np.random.default_rng(splits_seed)
    totals = [total] * world
    splits: list[tuple[int, ...]] = [()] * world
    if kind is CollectiveKind.ALL_TO_ALL:
        splits = [tuple(int(x) for x in rng.integers(0, SLOT, world)) for _ in range(world)]
        totals = [sum(s) for s in splits]
    rounds = max(shared.own_rounds(kind, t, world, SLOT) for t in totals)
    part = part_seed % rounds
    descriptors = []
    for w in range(world):
        offset, length = shared.round_span(kind, totals[w], world, SLOT, part)
        posted = shared.posted_length(kind, length, world, root=w == root)
        descriptors.append(
            Descriptor(5, totals[w], offset, posted, part, 0, root, kind, ReduceOp.SUM, 0, splits[w], 9)
        )
    plan = plan_round(descriptors, SLOT)
    assert isinstance(plan, RoundPlan), plan
    assert plan.received == tuple(d.length for d in descriptors)
    assert all(n >= 0 for n in plan.sent)
    if kind is CollectiveKind.ALL_GATHER:
        assert plan.sent == (sum(plan.received),) * world


@settings(max_examples=500, deadline=None)
@given(
    fields=st.lists(
        st.tuples(
            st.integers(0, 3),  # sequence
            st.integers(0, 1 << 20),  # total
            st.integers(0, 1 << 20),  # offset
            st.integers(0, 1 << 20),  # length
            st.integers(0, 3),  # part
            st.integers(0, 2),  # root
            _KINDS,
            st.sampled_from(list(ReduceOp)),
            st.lists(st.integers(0, 1 << 16), max_size=4),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_any_descriptors_plan_or_name_a_problem_never_crash(fields: list[tuple]) -> None:
    """Whatever workers wrote (a buggy or hostile one), the planner answers a plan or a problem,
    and a plan never asks to reduce more than a slot."""
    descriptors = [
        Descriptor(seq, total, offset, length, part, 0, root, kind, op, 0, tuple(splits), 1)
        for seq, total, offset, length, part, root, kind, op, splits in fields
    ]
    plan = plan_round(descriptors, SLOT)
    assert isinstance(plan, RoundPlan | RoundProblem)
    if isinstance(plan, RoundPlan):
        assert 0 <= plan.reduce_bytes <= SLOT and all(d.length <= SLOT for d in descriptors)
    else:
        assert plan.message and (plan.culprit is None or 0 <= plan.culprit < len(descriptors))
