"""Messages that ask the coordinator to act on more than the sender's own contribution are
believed only within their rules (server/message_rules.py, issue 47): a host group member's
`step_failure` fails only a step that is open (in flight, or the next one) with a real status; a
`StartAt` is only the answer to a recovery plan, within the range it allows, and its refusal is
labelled as one; a partial sum's `covers` names ids of this world.

Each test pairs healthy workers with a RawWorker that sends what a buggy or hostile one would, and
checks that the refusal reaches the sender alone, naming the worker, the step and the rule, that no
step fails, that the healthy workers' averages stay exact and that the next step works. Every wait
is bounded; ordering comes from the streams (a message sent after another on one stream is handled
after it) and from results received, never from sleeping.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from gradserver.common import codec
from gradserver.common.errors import AbortedError, FailedPreconditionError, InvalidArgumentError, Status
from gradserver.common.messages import (
    START_AT_WINDOW,
    BarrierIn,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    JoinRequestIn,
    StartAtIn,
    StepFailureIn,
)
from gradserver.common.rpc import JOIN_METHOD, worker_channel_options
from gradserver.worker import WorkerClient

from .helpers.logwait import LogWaiter, log_waiter
from .helpers.raw import RawWorker, client_and_raw, join
from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_all
from .test_bad_input import SIZES, TOTAL, block_key, next_step_works, ones, raw_average

pytestmark = pytest.mark.timeout(120)

INVALID = int(Status.INVALID_ARGUMENT)
PRECONDITION = int(Status.FAILED_PRECONDITION)
ABORTED = int(Status.ABORTED)
GROUP = (1, 2)
ELSEWHERE = "a host other than the coordinator's"
CONFIG = {"heartbeat_timeout": 60.0, "chunk_mib": 1 / 256, "max_message_mib": 1.0}

Group = tuple[WorkerClient, RawWorker, RawWorker]


def join_raw(address: str, *, rank: int | None = None, host_id: str = "") -> RawWorker:
    """A RawWorker joined as `rank` (None: the lowest free id), saying it is on `host_id`."""
    channel = grpc.insecure_channel(address, options=worker_channel_options())
    request = JoinRequestIn("raw", 0, "cpu", codec.PROTOCOL_VERSION, rank=rank, host_id=host_id)
    raw = channel.unary_unary(JOIN_METHOD)(codec.encode_join_request(request), timeout=30)
    return RawWorker(channel, codec.decode_join_accepted(raw))


@pytest.fixture
def group(coordinator: Callable[..., ServerThread]) -> Iterator[Group]:
    """Worker 0, a WorkerClient on the coordinator's host, and workers 1 and 2, RawWorkers saying
    they share another host: the host group (1, 2), whose member 1 misbehaves."""
    server = coordinator(world_size=3, **CONFIG)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        client_f = pool.submit(WorkerClient.connect, server.address, rank=0, timeout=TEST_TIMEOUTS)
        raw_f = [pool.submit(join_raw, server.address, rank=r, host_id=ELSEWHERE) for r in GROUP]
        client = client_f.result(30)
        members = [f.result(30) for f in raw_f]
    try:
        assert [m.accepted.host_group for m in members] == [GROUP, GROUP]
        assert client.host_group == ()
        yield client, members[0], members[1]
    finally:
        client.close()
        for member in members:
            member.close()


@pytest.fixture
def waiter() -> Iterator[LogWaiter]:
    with log_waiter() as seen:
        yield seen


def group_step(g: Group, step: int) -> None:
    """One healthy step: worker 0 sends 3.0, member 1 the group's partial sum 2.0 + 4.0; worker 0
    and member 1 (who hands it on to its group) get exactly (3 + 6) / 3."""
    client, member, _ = g
    client.send_block_gradient(step, 0, 2, ones(3.0), SIZES)
    member.send(partial_sum(step, ones(6.0)))
    got = client.receive_averaged_block()
    assert (got.step, got.num_contributors) == (step, 3)
    np.testing.assert_array_equal(got.gradients, ones(3.0))
    np.testing.assert_array_equal(raw_average(member), ones(3.0))


def partial_sum(step: int, data: np.ndarray, covers: tuple[int, ...] = GROUP) -> ChunkIn:
    header = ChunkHeader(DType.FLOAT32, TOTAL, SIZES)
    return ChunkIn(covers[0], block_key(step), header, 0, data.astype("<f4").tobytes(), covers=covers)


def report(step: int, code: Status = Status.INVALID_ARGUMENT) -> StepFailureIn:
    """Member 1's report that member 2 sent a NaN in block 0 of `step` (the sender is its stream's)."""
    return StepFailureIn(1, int(code), "worker 2 sent a NaN", step, block_key(step), culprit=2)


def hears_nothing_wrong(raw: RawWorker) -> None:
    """Everything queued for `raw` so far holds no error: the answer to a heartbeat sent now comes
    after it on the same stream."""
    raw.send(HeartbeatIn(raw.worker_id, 4747))
    while True:
        event = raw.recv(10)
        assert not isinstance(event, ErrorOut | grpc.RpcError), event
        if isinstance(event, HeartbeatAckOut) and event.sequence == 4747:
            return


def nothing_failed(seen: LogWaiter) -> None:
    """No step failed on the coordinator and no WorkerClient heard an error."""
    assert seen.matching(r"^step \d+ failed") == []
    assert seen.matching(r"^coordinator: ") == []


def refused(raw: RawWorker, code: int, *parts: str) -> ErrorOut:
    err = raw.recv_error()
    assert err.code == code and not err.step_failed, err
    for part in parts:
        assert part in err.message, err.message
    return err


# --- step_failure --------------------------------------------------------------------------------


def test_a_report_for_a_completed_step_is_refused_to_its_sender_alone(
    group: Group, waiter: LogWaiter
) -> None:
    _, member, partner = group
    group_step(group, 1)
    group_step(group, 2)  # everyone moved past step 1: it counts complete
    for step in (2, 1):
        member.send(report(step))
        err = refused(
            member,
            PRECONDITION,
            f"worker 1 reported a failure of step {step} in block 0 of 2",
            "is done here up to step 2",
            "a report fails only a step still in flight",
        )
        assert err.key == block_key(step)
    hears_nothing_wrong(partner)
    group_step(group, 3)
    nothing_failed(waiter)


def test_a_report_for_a_far_future_step_is_refused(group: Group, waiter: LogWaiter) -> None:
    _, member, partner = group
    group_step(group, 1)
    member.send(report(1 + 10**6))
    refused(
        member,
        PRECONDITION,
        f"worker 1 reported a failure of step {1 + 10**6}",
        "beyond step 2, the next step no key or barrier has opened here",
    )
    hears_nothing_wrong(partner)
    group_step(group, 2)
    nothing_failed(waiter)


def test_a_report_with_status_ok_is_refused_and_its_step_goes_on(group: Group, waiter: LogWaiter) -> None:
    client, member, partner = group
    # The group's partial sum opens step 1; the report, after it on the same stream, finds it in flight.
    member.send(partial_sum(1, ones(6.0)))
    member.send(report(1, Status.OK))
    refused(member, INVALID, "worker 1 reported a failure of step 1 with status OK")
    client.send_block_gradient(1, 0, 2, ones(3.0), SIZES)
    np.testing.assert_array_equal(client.receive_averaged_block().gradients, ones(3.0))
    np.testing.assert_array_equal(raw_average(member), ones(3.0))
    hears_nothing_wrong(partner)
    group_step(group, 2)
    nothing_failed(waiter)


def test_a_flood_of_future_step_reports_fails_no_step_and_reaches_no_one_else(
    group: Group, waiter: LogWaiter
) -> None:
    _, member, partner = group
    group_step(group, 1)
    floods = range(3, 203)  # every one beyond step 2, the next one
    for step in floods:
        member.send(report(step))
    for step in floods:
        assert refused(member, PRECONDITION, f"step {step} in block 0 of 2", "beyond step 2").step == step
    hears_nothing_wrong(partner)
    group_step(group, 2)
    nothing_failed(waiter)
    assert [r for r in waiter.records if r.levelno >= logging.WARNING] == []


def test_a_report_for_the_step_in_flight_or_the_next_one_still_fails_it(group: Group) -> None:
    """What the rules leave open: a member's report can be the first word of its step here (a key
    of one chunk found wrong on its host never reaches the coordinator)."""
    client, member, partner = group
    group_step(group, 1)
    member.send(report(2))  # nothing of step 2 opened yet: the next step
    for raw, code in ((member, ABORTED), (partner, INVALID)):
        err = raw.recv_error()
        assert (err.step, err.code, err.step_failed, err.culprit_worker_id) == (2, code, True, 2)
        assert err.message == "worker 2 sent a NaN"
    client.send_block_gradient(2, 0, 2, ones(3.0), SIZES)
    with pytest.raises(AbortedError, match="worker 2 sent a NaN") as info:
        client.receive_averaged_block()
    assert info.value.step == 2
    group_step(group, 3)


# --- covers --------------------------------------------------------------------------------------


def test_covers_naming_an_id_outside_the_world_is_out_of_range(group: Group, waiter: LogWaiter) -> None:
    _, member, partner = group
    member.send(partial_sum(1, ones(6.0), covers=(1, 7)))
    err = refused(
        member, INVALID, "worker 1 sent a partial sum covering worker 7, out of range for a world of 3"
    )
    assert err.key == block_key(1)
    hears_nothing_wrong(partner)
    group_step(group, 1)  # nothing of the refused sum was counted
    nothing_failed(waiter)


# --- StartAt ------------------------------------------------------------------------------------


@pytest.fixture
def pair(coordinator: Callable[..., ServerThread]) -> Iterator[tuple[WorkerClient, RawWorker]]:
    """A fresh job (--on-worker-loss abort): a WorkerClient and a RawWorker, neither with a plan."""
    server = coordinator(world_size=2, **CONFIG)
    client, raw = client_and_raw(server.address)
    try:
        yield client, raw
    finally:
        client.close()
        raw.close()


def both_contribute(client: WorkerClient, raw: RawWorker, step: int) -> None:
    """Step `step` waits for both: each gets exactly (1 + 3) / 2 from 2 contributors."""
    client.send_block_gradient(step, 0, 2, ones(1.0), SIZES)
    raw.send_tensor(block_key(step), ones(3.0), SIZES)
    got = client.receive_averaged_block()
    assert (got.step, got.num_contributors) == (step, 2)
    np.testing.assert_array_equal(got.gradients, ones(2.0))
    np.testing.assert_array_equal(raw_average(raw), ones(2.0))


def test_start_at_without_a_recovery_plan_is_refused(pair, waiter: LogWaiter) -> None:
    client, raw = pair
    assert raw.accepted.recovery_step is None
    raw.send(StartAtIn(raw.worker_id, 5))
    refused(
        raw,
        PRECONDITION,
        f"worker {raw.worker_id} asked to take part from step 5, but it has no recovery plan",
        "--on-worker-loss abort",
    )
    # Step 0 still waits for the raw worker: the client's own gradient is not "the average".
    both_contribute(client, raw, 0)
    with pytest.raises(FailedPreconditionError, match=f"worker {client.worker_id} joined as the job began"):
        client.start_at(5)
    next_step_works(client, raw, 1)
    nothing_failed(waiter)


def test_start_at_after_a_coordinator_restart_is_refused_on_both_sides(
    coordinator: Callable[..., ServerThread], waiter: LogWaiter
) -> None:
    """A worker that rejoins a restarted coordinator without state gets a plan (the resume step and
    its donors), but every member resumes there together: that plan cannot be moved."""
    server = coordinator(world_size=3, **CONFIG)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        client_f = pool.submit(WorkerClient.connect, server.address, timeout=TEST_TIMEOUTS, committed_step=5)
        fresh_f = pool.submit(WorkerClient.connect, server.address, timeout=TEST_TIMEOUTS)
        raw_f = pool.submit(join_raw, server.address)
        client, fresh, raw = client_f.result(30), fresh_f.result(30), raw_f.result(30)
    try:
        assert (raw.accepted.recovery_step, fresh.recovery_step, client.recovery_step) == (5, 5, None)
        # The table knows the job resumes at 5: a failure report of step 5 is of the next step.
        assert server.call(lambda s: s._table._roster.newest_step) == 4
        with pytest.raises(
            FailedPreconditionError, match="rejoined a restarted coordinator: every member resumes"
        ):
            fresh.start_at(6)
        raw.send(StartAtIn(raw.worker_id, 6))
        refused(raw, PRECONDITION, "asked to take part from step 6, but it has no recovery plan to move")
        for step in (5, 6):
            for c in (client, fresh):
                c.send_block_gradient(step, 0, 2, ones(float(c.worker_id)), SIZES)
            raw.send_tensor(block_key(step), ones(float(raw.worker_id)), SIZES)
            for c in (client, fresh):
                got = c.receive_averaged_block()
                assert got.num_contributors == 3
                np.testing.assert_array_equal(got.gradients, ones(1.0))
            np.testing.assert_array_equal(raw_average(raw), ones(1.0))
        nothing_failed(waiter)
    finally:
        for c in (client, fresh):
            c.close()
        raw.close()


@pytest.fixture
def replaced(coordinator: Callable[..., ServerThread]) -> Iterator[tuple[WorkerClient, Callable[[], object]]]:
    """--on-worker-loss continue: two workers complete step 0, worker 1 leaves; `newcomer()` joins
    in its place (a RawWorker, or a WorkerClient with `client=True`) with a plan for step 1."""
    server = coordinator(world_size=2, on_worker_loss="continue", **CONFIG)
    clients = connect_all(server.address, 2)
    made: list[WorkerClient | RawWorker] = list(clients)

    def newcomer(client: bool = False) -> WorkerClient | RawWorker:
        joined: WorkerClient | RawWorker
        if client:
            joined = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
            assert (joined.worker_id, joined.recovery_step) == (1, 1)
        else:
            joined = RawWorker(*join(server.address))
            assert (joined.worker_id, joined.accepted.recovery_step, joined.accepted.donors) == (1, 1, (0,))
        made.append(joined)
        return joined

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            sent = [pool.submit(c.send_block_gradient, 0, 0, 2, ones(1.0), SIZES) for c in clients]
            for f in sent:
                f.result(30)
            for c in clients:
                np.testing.assert_array_equal(c.receive_averaged_block().gradients, ones(1.0))
        clients[1].close()
        yield clients[0], newcomer
    finally:
        for m in made:
            m.close()


def test_start_at_out_of_the_range_its_plan_allows_is_refused(replaced, waiter: LogWaiter) -> None:
    survivor, newcomer = replaced
    raw = newcomer()
    assert isinstance(raw, RawWorker)
    latest = 1 + START_AT_WINDOW
    for step in (2**64 - 1, latest + 1):
        raw.send(StartAtIn(1, step))
        refused(
            raw,
            PRECONDITION,
            f"worker 1 asked to take part from step {step}, out of the range its recovery plan allows: "
            f"steps 1 to {latest}",
        )
    raw.send(StartAtIn(1, 0))
    refused(raw, PRECONDITION, "worker 1 asked to take part from step 0, before its first step 1")
    # Step 1 still waits for the newcomer (its plan is unchanged), and the next step works.
    both_contribute(survivor, raw, 1)
    next_step_works(survivor, raw, 2)
    nothing_failed(waiter)


def test_the_client_refuses_a_start_at_its_plan_does_not_allow(replaced, waiter: LogWaiter) -> None:
    survivor, newcomer = replaced
    late = newcomer(client=True)
    assert isinstance(late, WorkerClient)
    latest = 1 + START_AT_WINDOW
    for step in (2**64 - 1, latest + 1):
        with pytest.raises(InvalidArgumentError, match=f"start_at moves it to step {latest} at the latest"):
            late.start_at(step)
    assert late.recovery_step == 1
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sent = [
            pool.submit(c.send_block_gradient, 1, 0, 2, ones(2.0 * c.worker_id), SIZES)
            for c in (survivor, late)
        ]
        for f in sent:
            f.result(30)
    for c in (survivor, late):
        got = c.receive_averaged_block()
        assert got.num_contributors == 2
        np.testing.assert_array_equal(got.gradients, ones(1.0))
    nothing_failed(waiter)


def test_a_start_at_refusal_is_labelled_as_one_not_as_a_barrier(pair) -> None:
    client, raw = pair
    raw.send(StartAtIn(raw.worker_id, 3))
    err = refused(raw, PRECONDITION, "has no recovery plan")
    assert err.start_at == StartAtIn(raw.worker_id, 3)
    assert (err.barrier_name, err.key, err.sample_range_step, err.peer_message) == (None, None, None, None)
    # The label survives the wire both ways, and a barrier named "start_at" is only a barrier.
    assert codec.decode_server_message(codec.encode_server_event(err)) == err
    raw.send(BarrierIn(raw.worker_id, 0, "start_at"))
    client.barrier(0, "start_at")
    next_step_works(client, raw, 1)
