"""Host groups in the coordinator's pure cores: which members form groups (`HostGroups`), and how
the reduction table takes a group's partial sums (`ReductionTable` with `covers`): the average
stands for every worker covered and goes to the member that sent the partial, the rules that
watch a worker's own steps leave covered workers alone, a member's report fails the step naming
the culprit, and a member's departure dissolves its group. No sockets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gradserver.common import codec
from gradserver.common.averaging import Averager
from gradserver.common.collective_rules import MAX_HOST_GROUP
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import InternalError, InvalidArgumentError, Status
from gradserver.common.messages import (
    AveragedChunkOut,
    BarrierIn,
    ChunkHeader,
    ChunkIn,
    CollectiveKind,
    DType,
    ErrorOut,
    JoinAccepted,
    JoinRequestIn,
    MemberLeftOut,
    ReduceOp,
    SampleStats,
    StepFailureIn,
    TensorKey,
)
from gradserver.server.host_groups import HostGroups
from gradserver.server.reduction import ReductionTable

CHUNK = 4
KEY = TensorKey.non_block(0, NonBlockComponent.LM_HEAD)
GROUPED = [(0, "host-a"), (1, "host-a"), (2, "host-b"), (3, "host-b")]


def grouped_table(members: list[tuple[int, str]] = GROUPED) -> ReductionTable:
    groups = HostGroups("coordinator-host")
    groups.form(members)
    return ReductionTable(len(members), CHUNK, 10.0, host_groups=groups)


def chunk(
    worker: int, data: np.ndarray, offset: int = 0, key: TensorKey = KEY, covers: tuple[int, ...] = ()
) -> ChunkIn:
    header = ChunkHeader(DType.FLOAT32, data.size, ())
    piece = data[offset : offset + CHUNK].astype("<f4").tobytes()
    return ChunkIn(worker, key, header, offset, piece, covers=covers)


def averaged(out: list) -> list[tuple[tuple[int, ...], AveragedChunkOut]]:
    return [(o.to, o.event) for o in out if isinstance(o.event, AveragedChunkOut)]


def errors(out: list) -> list[tuple[tuple[int, ...], ErrorOut]]:
    return [(o.to, o.event) for o in out if isinstance(o.event, ErrorOut)]


# --- forming groups -----------------------------------------------------------------------------


def test_groups_are_the_members_sharing_a_host_other_than_the_coordinators() -> None:
    groups = HostGroups("here")
    formed = groups.form([(0, "here"), (1, "here"), (2, "a"), (3, "b"), (4, "a"), (5, ""), (6, "")])
    assert [g.workers for g in formed] == [(2, 4)]
    assert groups.offer(2)["host_group"] == (2, 4) and len(groups.offer(4)["host_key"]) == 16
    assert groups.offer(0) == groups.offer(3) == groups.offer(5) == {}
    assert HostGroups("here", enabled=False).form([(0, "a"), (1, "a")]) == []


def test_each_group_gets_its_own_key_and_a_member_leaving_dissolves_it() -> None:
    groups = HostGroups("here")
    groups.form(GROUPED)
    assert groups.offer(0)["host_key"] != groups.offer(2)["host_key"]
    assert groups.dissolve(1) == (0,)
    assert groups.group_of(0) is None and groups.offer(0) == {}
    assert groups.group_of(2) is not None
    assert groups.dissolve(0) == ()


def test_partitions_adopt_only_groups_that_every_member_brought_alike() -> None:
    groups = HostGroups("partition-1-host")
    groups.adopt({0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2,)})
    assert groups.group_of(0) is not None and groups.group_of(0).workers == (0, 1)  # type: ignore[union-attr]
    assert groups.group_of(2) is None and groups.group_of(3) is None


def test_a_groups_link_rate_is_what_its_members_measured_together() -> None:
    groups = HostGroups("here")
    groups.form([*GROUPED[:2], (2, "c")])
    assert groups.link_rates({0: 10, 1: 12, 2: 30}) == {0: 22, 1: 22, 2: 30}
    assert groups.link_rates({0: 10, 1: 0, 2: 30}) == {0: 0, 1: 0, 2: 30}  # one unmeasured: unknown


# --- the table ----------------------------------------------------------------------------------


def test_partial_sums_average_over_every_worker_and_go_to_their_senders() -> None:
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(2 * CHUNK).astype(np.float32) for _ in range(4)]
    sums = [(data[0] + data[1]), (data[2] + data[3])]  # what each host's member sends (float32)
    t = grouped_table()
    out = t.contribute(chunk(1, sums[0], 0, covers=(0, 1)))  # chunk 0 of host a, summed by worker 1
    out += t.contribute(chunk(0, sums[0], CHUNK, covers=(0, 1)))  # chunk 1, by worker 0
    assert averaged(out) == []
    out += t.contribute(chunk(2, sums[1], 0, covers=(2, 3)))
    out += t.contribute(chunk(3, sums[1], CHUNK, covers=(2, 3)))
    got = averaged(out)
    assert [(to, e.offset, e.num_contributors) for to, e in got] == [((1, 2), 0, 4), ((0, 3), CHUNK, 4)]
    expected = ((sums[0].astype(np.float64) + sums[1]) / 4).astype(np.float32)
    result = np.concatenate([np.frombuffer(e.data, "<f4") for _, e in got])
    np.testing.assert_array_equal(result, expected)


def test_a_group_member_may_also_send_alone_but_never_twice() -> None:
    data = np.arange(CHUNK, dtype=np.float32)
    t = grouped_table()
    assert t.contribute(chunk(0, data)) == []  # its own contribution, not its group's sum
    [(to, refusal)] = errors(t.contribute(chunk(1, data, covers=(0, 1))))
    assert to == (1,) and refusal.code == int(Status.INVALID_ARGUMENT)
    twice = "worker 0 sent the chunk at offset 0 of step 0 non-block LM_HEAD twice"
    assert f"{twice} (in a partial sum from worker 1)" in refusal.message


def test_a_partial_sum_must_cover_exactly_the_senders_group() -> None:
    data = np.arange(CHUNK, dtype=np.float32)
    t = grouped_table()
    [(_, wrong)] = errors(t.contribute(chunk(1, data, covers=(1, 2))))
    assert (
        "worker 1 sent a partial sum of workers [1, 2], but its host group is workers [0, 1]" in wrong.message
    )
    alone = grouped_table([*GROUPED[:3], (3, "host-c")])
    [(_, stranger)] = errors(alone.contribute(chunk(3, data, covers=(2, 3))))
    assert "worker 3 sent a partial sum of workers [2, 3], but it is in no host group" in stranger.message


def test_a_covered_worker_moving_on_does_not_fail_a_step_its_host_has_not_sent_yet() -> None:
    data = np.arange(CHUNK, dtype=np.float32)
    t = grouped_table()
    t.contribute(chunk(2, data, covers=(2, 3)))
    # Worker 1's host has not sent its sum of step 0 yet, but worker 1 is at step 1 already.
    assert errors(t.barrier(BarrierIn(1, 1, "next"))) == []
    out = t.contribute(chunk(0, data, covers=(0, 1)))
    assert len(averaged(out)) == 1 and errors(out) == []


def test_a_members_report_fails_the_step_naming_the_culprit_and_a_strangers_is_refused() -> None:
    t = grouped_table()
    t.contribute(chunk(2, np.ones(CHUNK, np.float32), covers=(2, 3)))
    report = StepFailureIn(0, int(Status.INVALID_ARGUMENT), "worker 1 sent a NaN", 0, KEY, culprit=1)
    failed = errors(t.step_failure_reported(report))
    assert {to: e.code for to, e in failed} == {
        (0, 2, 3): int(Status.ABORTED),
        (1,): int(Status.INVALID_ARGUMENT),
    }
    assert all(e.step_failed and e.culprit_worker_id == 1 for _, e in failed)
    t2 = grouped_table([*GROUPED[:3], (3, "host-c")])
    [(to, refused)] = errors(t2.step_failure_reported(dataclasses.replace(report, worker_id=3, culprit=None)))
    assert to == (3,) and "only a host group's members report" in refused.message
    [(_, blamed)] = errors(t2.step_failure_reported(dataclasses.replace(report, culprit=2)))
    assert "worker 0 blamed worker 2 for step 0, which is not in its host group [0, 1]" in blamed.message


def test_a_report_of_the_step_a_restarted_coordinators_job_resumes_at_fails_it() -> None:
    """After a coordinator restart the job resumes at step 40: a member's report of step 40,
    before anything of it reached this coordinator, is of the next step, not beyond it."""
    t = grouped_table()
    t.resumes_at(40)
    report = StepFailureIn(
        0,
        int(Status.INVALID_ARGUMENT),
        "worker 1 sent a NaN",
        40,
        dataclasses.replace(KEY, step=40),
        culprit=1,
    )
    failed = errors(t.step_failure_reported(report))
    assert failed and all(e.step_failed and e.step == 40 and e.culprit_worker_id == 1 for _, e in failed)
    beyond = dataclasses.replace(report, step=42, key=dataclasses.replace(KEY, step=42))
    [(_, refused)] = errors(grouped_table().step_failure_reported(beyond))
    assert "beyond step 0" in refused.message


def test_a_member_lost_tells_everyone_first_then_fails_the_steps_in_flight() -> None:
    t = grouped_table()
    t.contribute(chunk(2, np.ones(CHUNK, np.float32), covers=(2, 3)))
    out = t.worker_lost(3, "lost: no message for 5 s")
    # Its group's member (2) stops summing with it; the others hear it too (point-to-point).
    assert isinstance(out[0].event, MemberLeftOut) and out[0].to == (0, 1, 2)
    assert out[0].event == MemberLeftOut(3, "lost: no message for 5 s", aborts=True)
    assert any(e.step_failed and e.culprit_worker_id == 3 for _, e in errors(out))
    [(_, later)] = errors(
        t.contribute(
            chunk(2, np.ones(CHUNK, np.float32), key=dataclasses.replace(KEY, step=1), covers=(2, 3))
        )
    )
    assert later.code != int(Status.OK)


def test_a_reduce_scatters_parts_go_to_every_rank_whoever_sent_the_sum() -> None:
    key = TensorKey.collective(0, 0, ReduceOp.SUM, kind=CollectiveKind.REDUCE_SCATTER)
    data = np.arange(CHUNK, dtype=np.float32)
    t = grouped_table()
    out = t.contribute(chunk(0, data, key=key, covers=(0, 1))) + t.contribute(
        chunk(3, data, key=key, covers=(2, 3))
    )
    assert sorted(to for to, _ in averaged(out)) == [(0,), (1,), (2,), (3,)]


# --- the averaging and the wire -----------------------------------------------------------------


def test_an_average_of_partial_sums_divides_by_every_contributor() -> None:
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal(10_000).astype(np.float32) for _ in range(3)]
    averager = Averager()
    got = np.frombuffer(averager.average([p.data for p in parts], count=7), "<f4")
    expected = (np.sum([p.astype(np.float64) for p in parts], axis=0) / 7).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
    one = np.frombuffer(averager.average([parts[0].data], count=2), "<f4")  # a whole job on one host
    np.testing.assert_array_equal(one, (parts[0].astype(np.float64) / 2).astype(np.float32))


def test_the_wire_carries_host_groups() -> None:
    limits = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=1 << 20, world_size=4)
    covered = chunk(1, np.ones(CHUNK, np.float32), covers=(0, 1))
    decoded = codec.decode_worker_message(codec.encode_worker_event(covered), limits)
    assert isinstance(decoded, ChunkIn) and decoded.covers == (0, 1)
    report = StepFailureIn(1, int(Status.INVALID_ARGUMENT), "why", 3, KEY, culprit=0)
    back = codec.decode_worker_message(codec.encode_worker_event(report), limits)
    assert back == dataclasses.replace(report, worker_id=-1)  # the stream says who sent it
    left = codec.decode_server_message(codec.encode_server_event(MemberLeftOut(2, "left")))
    assert left == MemberLeftOut(2, "left")
    request = JoinRequestIn(
        "n", 0, "cpu", codec.PROTOCOL_VERSION, host_id="boot net uid=0", job_host_group=(0, 1)
    )
    assert codec.decode_join_request(codec.encode_join_request(request)) == request
    accepted = JoinAccepted(
        1,
        4,
        7,
        9,
        codec.PROTOCOL_VERSION,
        16,
        64,
        64,
        1.0,
        5.0,
        20.0,
        0,
        host_group=(0, 1),
        host_key=b"k" * 16,
    )
    assert codec.decode_join_accepted(codec.encode_join_accepted(accepted)) == accepted


@pytest.mark.parametrize(
    ("covers", "key", "problem"),
    [
        ((1, 0), KEY, "distinct worker ids in increasing order"),
        ((0, 2), KEY, "the sender among them"),
        ((0, 1), TensorKey.whole_model(0), "whole-model gradient is not summed on hosts"),
        ((0, 9), KEY, "distinct worker ids in increasing order"),
    ],
)
def test_a_partial_sum_that_cannot_be_right_is_refused_on_the_wire(
    covers: tuple[int, ...], key: TensorKey, problem: str
) -> None:
    limits = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=1 << 20, world_size=4)
    bad = dataclasses.replace(chunk(1, np.ones(CHUNK, np.float32), key=key), covers=covers)
    if key.kind.value == "whole_model":
        bad = dataclasses.replace(bad, stats=SampleStats(1.0, 1, 2))
    raw = codec.encode_worker_event(bad)
    with pytest.raises(InvalidArgumentError, match=problem):
        codec.decode_worker_message(raw, limits)


def test_bytes_every_rank_gets_go_to_one_member_of_each_whole_group_in_turn() -> None:
    groups = HostGroups("here")
    groups.form([*GROUPED, (4, "here")])
    assert groups.one_per_group((0, 1, 2, 3, 4), 0) == (0, 2, 4)
    assert groups.one_per_group((0, 1, 2, 3, 4), 1) == (1, 3, 4)
    assert groups.one_per_group((0, 2, 3), 1) == (0, 3)  # group a not whole: each gets its own
    groups.dissolve(3)
    assert groups.one_per_group((0, 1, 2, 3), 1) == (1, 2, 3)


def test_host_group_fields_beyond_their_limits_are_refused_naming_them() -> None:
    base = JoinRequestIn("n", 0, "cpu", codec.PROTOCOL_VERSION)
    for wrong in (
        dataclasses.replace(base, host_id="x" * (codec.MAX_NAME_LENGTH + 1)),
        dataclasses.replace(base, job_host_group=tuple(range(MAX_HOST_GROUP + 1))),
        dataclasses.replace(base, peer_host_id="x" * (codec.MAX_NAME_LENGTH + 1)),
    ):
        with pytest.raises(
            InvalidArgumentError,
            match="host_id and peer_host_id are limited to 256 characters and job_host_group",
        ):
            codec.decode_join_request(codec.encode_join_request(wrong))
    limits = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=1 << 20, world_size=0)
    huge = dataclasses.replace(chunk(0, np.ones(CHUNK, np.float32)), covers=tuple(range(MAX_HOST_GROUP + 1)))
    with pytest.raises(InvalidArgumentError, match="covers 1025 workers, above the limit of 1024"):
        codec.decode_worker_message(codec.encode_worker_event(huge), limits)
    unknown = StepFailureIn(0, 999, "why", 1)
    with pytest.raises(InvalidArgumentError, match="step failure with unknown status code 999"):
        codec.decode_worker_message(codec.encode_worker_event(unknown), limits)


@pytest.mark.parametrize(
    "group", [(0, 2), (1, 0), (1, 4)], ids=["without the worker", "unordered", "beyond the world"]
)
@pytest.mark.parametrize("field", ["host_group", "host_peers"])
def test_a_join_answer_with_an_impossible_host_group_is_refused(group: tuple[int, ...], field: str) -> None:
    """Host groups and the point-to-point host peers are checked alike."""
    limits = (16, 64, 64, 1.0, 5.0, 20.0, 0)
    accepted = JoinAccepted(1, 4, 7, 9, codec.PROTOCOL_VERSION, *limits, **{field: group})
    with pytest.raises(InternalError, match="inconsistent JoinResponse"):
        codec.decode_join_accepted(codec.encode_join_accepted(accepted))
