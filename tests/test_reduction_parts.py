"""The reduction table's parts on their own (server/step_ledger.py, barriers.py, inflight.py,
placement.py, chunk_ownership.py, slots.py, pending_keys.py): each part's rules without the
table around it. The table's behaviour as a whole is tests/test_reduction.py's and the fuzz
tests' (tests/test_fuzz.py)."""

from __future__ import annotations

import numpy as np
import pytest

from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import Status
from gradserver.common.messages import (
    AveragedChunkOut,
    BarrierIn,
    BarrierReleaseOut,
    ChunkHeader,
    ChunkIn,
    CollectiveKind,
    DType,
    ErrorOut,
    ReduceOp,
    TensorKey,
)
from gradserver.common.partition_map import PartitionMap
from gradserver.server.barriers import Barriers, Undecided
from gradserver.server.chunk_ownership import Partition, WholeJob, chunk_ownership
from gradserver.server.host_groups import HostGroups
from gradserver.server.inflight import InFlightBytes
from gradserver.server.participation import Participation
from gradserver.server.pending_keys import PendingKeys
from gradserver.server.placement import OwnChunk, PartialSum, Placements
from gradserver.server.slots import AveragedSlot, RoutedSlot, ScatteredSlot, SlotSetting
from gradserver.server.step_ledger import FAILED_STEPS_KEPT, StepFailure, StepLedger

CHUNK = 4
KEY = TensorKey.non_block(0, NonBlockComponent.LM_HEAD)


def chunk(worker: int, key: TensorKey, data: bytes, offset: int = 0, *, total: int = 8, covers=()) -> ChunkIn:
    dtype = DType.BYTES if key.collective_kind in (CollectiveKind.ALL_GATHER,) else DType.FLOAT32
    return ChunkIn(worker, key, ChunkHeader(dtype, total), offset, data, covers=covers)


def floats(*values: float) -> bytes:
    return np.array(values, "<f4").tobytes()


# --- the step ledger ----------------------------------------------------------------------------


def ledger(world: int = 2, policy: str = "abort") -> tuple[StepLedger, Participation]:
    roster = Participation(world, rejoin_next_step=policy == "continue")
    return StepLedger(roster, abort_on_loss=policy == "abort"), roster


def test_a_failed_step_answers_each_worker_and_subject_once() -> None:
    book, _ = ledger()
    failure = StepFailure(Status.ABORTED, "step 3 broke", culprit=1, culprit_code=Status.INVALID_ARGUMENT)
    assert book.fail(3, failure) is failure
    assert book.fail(3, StepFailure(Status.ABORTED, "again", None, Status.ABORTED)) is None
    [answer] = book.admit(1, 3, KEY, what=str(KEY)) or []
    assert isinstance(answer.event, ErrorOut) and answer.event.step_failed
    assert answer.event.code == int(Status.INVALID_ARGUMENT) and answer.event.message == "step 3 broke"
    assert book.admit(1, 3, KEY, what=str(KEY)) == []
    [other] = book.admit(0, 3, KEY, what=str(KEY)) or []
    assert other.to == (0,) and isinstance(other.event, ErrorOut) and other.event.code == int(Status.ABORTED)


def test_steps_only_move_forward_for_a_worker_own_messages() -> None:
    book, _ = ledger()
    assert book.admit(0, 5, KEY, what="k") is None and book.advance(0, 5)
    assert not book.advance(0, 4) and book.worker_steps[0] == 5
    [refused] = book.admit(0, 4, KEY, what="k") or []
    assert isinstance(refused.event, ErrorOut) and "steps only move forward" in refused.event.message
    assert book.admit(0, 4, KEY, what="k", in_order=False) is None


def test_a_vacant_place_refuses_under_abort_but_not_under_continue() -> None:
    for policy, refused in (("abort", True), ("continue", False)):
        book, roster = ledger(3, policy)
        roster.lost(2, "disconnected")
        answer = book.admit(0, 0, KEY, what="k")
        assert (answer is not None) == refused
        if answer:
            assert isinstance(answer[0].event, ErrorOut) and answer[0].event.culprit_worker_id == 2


def test_a_step_settles_once_every_expected_worker_moved_past_it() -> None:
    book, _ = ledger()
    book.opened(0)
    book.advance(0, 1)
    book.settle(pending=set())
    assert book.steps_completed == 0 and book.open_steps == {0}
    book.advance(1, 1)
    book.settle(pending={0})
    assert book.steps_completed == 0, "still pending"
    book.settle(pending=set())
    assert book.steps_completed == 1 and book.last_completed_step == 0 and not book.open_steps


def test_only_the_newest_failures_are_kept() -> None:
    book, _ = ledger()
    for step in range(FAILED_STEPS_KEPT + 3):
        book.fail(step, StepFailure(Status.ABORTED, f"step {step}", None, Status.ABORTED))
    assert len(book.failed_steps) == FAILED_STEPS_KEPT and min(book.failed_steps) == 3


def test_a_failure_notice_gives_the_live_culprit_its_own_code() -> None:
    failure = StepFailure(Status.ABORTED, "m", culprit=1, culprit_code=Status.INVALID_ARGUMENT)
    notices = failure.notice(2, KEY, (0, 1, 2))
    assert [(n.to, n.event.code) for n in notices if isinstance(n.event, ErrorOut)] == [
        ((0, 2), int(Status.ABORTED)),
        ((1,), int(Status.INVALID_ARGUMENT)),
    ]
    assert [n.to for n in failure.notice(2, KEY, (0, 2))] == [(0, 2)]


# --- barriers -----------------------------------------------------------------------------------


def barriers() -> tuple[Barriers, list[float]]:
    waited: list[float] = []
    return Barriers(lambda: 0.0, waited.append), waited


def test_a_barrier_releases_once_everyone_expected_arrived_and_not_again() -> None:
    bars, waited = barriers()
    bar = bars.open(BarrierIn(0, 1, "b"), frozenset({0, 1}), 10.0)
    bars.arrive(bar, BarrierIn(0, 1, "b"))
    assert bars.release(bar, (0, 1)) == [] and bars.is_pending(bar)
    assert bars.arrival_refusal(bar, BarrierIn(0, 1, "b")) == "worker 0 arrived at step 1 barrier 'b' twice"
    bars.arrive(bar, BarrierIn(1, 1, "b"))
    [release] = bars.release(bar, (0, 1))
    assert release.to == (0, 1) and release.event == BarrierReleaseOut(1, "b") and waited == [0.0]
    assert not bars and "already released at step 1" in (bars.replay(BarrierIn(1, 1, "b")) or "")
    assert bars.replay(BarrierIn(1, 2, "b")) is None


def test_the_digest_vote_leaves_out_the_diverged_and_fails_without_a_majority() -> None:
    bars, _ = barriers()
    bar = bars.open(BarrierIn(0, 0, "d", 7), frozenset({0, 1, 2}), 10.0)
    assert "without a state digest" in (bars.arrival_refusal(bar, BarrierIn(1, 0, "d")) or "")
    for w, digest in ((0, 7), (1, 7), (2, 9)):
        bars.arrive(bar, BarrierIn(w, 0, "d", digest))
    [release] = bars.release(bar, (0, 1, 2))
    assert release.to == (0, 1) and [w for w, _ in bars.take_diverged()] == [2]
    tie = bars.open(BarrierIn(0, 1, "d", 1), frozenset({0, 1}), 10.0)
    for w, digest in ((0, 1), (1, 2)):
        bars.arrive(tie, BarrierIn(w, 1, "d", digest))
    assert isinstance(bars.release(tie, (0, 1)), Undecided) and bars.is_pending(tie)


def test_excused_workers_are_no_longer_awaited() -> None:
    bars, _ = barriers()
    early = bars.open(BarrierIn(0, 0, "x"), frozenset({0, 1}), 10.0)
    late = bars.open(BarrierIn(0, 2, "x"), frozenset({0, 1}), 10.0)
    assert bars.excuse_before(1, 1) == [early] and early.expected == {0}
    assert late.expected == {0, 1}
    bars.arrive(late, BarrierIn(1, 2, "x"))
    assert [step for step, _ in bars.owed_by(0, 3)] == [0, 2]
    assert bars.owed_by(1, 3) == [], "excused from the first, arrived at the second"
    assert bars.excuse_lost(1) == [] and bars.excuse_lost(0) == [early, late]
    assert bars.owed_by(0, 3) == [], "a lost worker's replacement owes nothing it was excused from"
    bars.drop_step(2)
    assert bars.steps() == {0}


# --- in-flight bytes ----------------------------------------------------------------------------


def test_charges_balance_however_a_key_ends() -> None:
    account = InFlightBytes(3)
    charges = account.charges()
    charges.hold(0, 0, 16)
    charges.hold(0, 1, 16)
    charges.hold(1, 0, 8)
    charges.follow(2, 5)
    assert [account.of(w) for w in range(3)] == [24, 16, 5]
    charges.release_chunk(0)
    assert [account.of(w) for w in range(3)] == [8, 0, 5]
    charges.release_worker(0)
    charges.follow(2, 3)
    assert [account.of(w) for w in range(3)] == [0, 0, 3]
    charges.hold(2, 1, 4)
    charges.release_all()
    charges.release_all()  # a second release frees nothing twice
    assert [account.of(w) for w in range(3)] == [0, 0, 0]


# --- placement ----------------------------------------------------------------------------------


def test_a_partial_sum_counts_for_its_group_and_sits_at_its_first_place() -> None:
    placements = Placements(HostGroups("", enabled=False))
    own = placements.of(ChunkIn(1, KEY, ChunkHeader(DType.FLOAT32, 4), 0, b""))
    partial = placements.of(ChunkIn(3, KEY, ChunkHeader(DType.FLOAT32, 4), 0, b"", covers=(2, 3)))
    assert own == OwnChunk(1) and own.covers == (1,) and own.in_order and own.forwarded == ()
    assert partial == PartialSum(3, (2, 3)) and partial.place == 2 and not partial.in_order
    assert partial.forwarded == (2,) and partial.duplicate_note(2) == " (in a partial sum from worker 3)"
    groups = HostGroups("here")
    groups.form([(0, "a"), (1, "a"), (2, "b"), (3, "b")])
    assert partial.refusal(4, groups) is None
    refused = PartialSum(3, (1, 3)).refusal(4, groups)
    assert refused is not None and refused.code is Status.INVALID_ARGUMENT


def test_grouped_workers_owe_summed_keys_out_of_step_order() -> None:
    groups = HostGroups("here")
    groups.form([(0, "a"), (1, "a"), (2, "")])
    placements = Placements(groups)
    assert not placements.owes_in_step_order(0, KEY) and placements.owes_in_step_order(2, KEY)
    assert Placements(HostGroups("", enabled=False)).owes_in_step_order(0, KEY)


# --- chunk ownership ----------------------------------------------------------------------------


def test_a_partition_owns_the_chunks_its_map_assigns_and_only_reduce_collectives() -> None:
    assert isinstance(chunk_ownership(None), WholeJob) and not WholeJob().partitioned
    partition_map = PartitionMap(("127.0.0.1:1", "127.0.0.1:2"))
    mine, theirs = chunk_ownership((partition_map, 0)), Partition(partition_map, 1)
    assert mine == Partition(partition_map, 0) and chunk_ownership(mine) is mine and mine.partitioned
    assert mine.owned_chunks(KEY, 5) + theirs.owned_chunks(KEY, 5) == 5
    owner = partition_map.owner(KEY, 0)
    other = Partition(partition_map, 1 - owner)
    assert Partition(partition_map, owner).refusal(0, KEY, 0) is None
    foreign = other.refusal(0, KEY, 0)
    assert (
        foreign is not None and foreign.code is Status.INVALID_ARGUMENT and "assigns it to" in foreign.message
    )
    gather = TensorKey.collective(0, 1, ReduceOp.SUM, kind=CollectiveKind.ALL_GATHER)
    refused = Partition(partition_map, owner).refusal(0, gather, 0)
    assert refused is not None and refused.code is Status.FAILED_PRECONDITION
    assert WholeJob().refusal(0, gather, 0) is None and WholeJob().owned_chunks(gather, 3) == 3


# --- slots and the pending keys -----------------------------------------------------------------


def pending(
    world: int = 2, groups: HostGroups | None = None
) -> tuple[PendingKeys, InFlightBytes, list[float]]:
    account = InFlightBytes(world)
    reduced: list[float] = []
    placements = Placements(groups or HostGroups("", enabled=False))
    keys = PendingKeys(
        SlotSetting(world, CHUNK, placements, lambda: tuple(range(world))),
        step_timeout=10.0,
        clock=lambda: 1.0,
        ownership=WholeJob(),
        inflight=account,
        on_key_reduced=reduced.append,
    )
    return keys, account, reduced


def test_each_key_kind_gets_its_slot() -> None:
    keys, _, _ = pending()
    kinds = {
        KEY: AveragedSlot,
        TensorKey.collective(0, 1, ReduceOp.SUM): AveragedSlot,
        TensorKey.collective(0, 2, kind=CollectiveKind.REDUCE_SCATTER): ScatteredSlot,
        TensorKey.collective(0, 3, kind=CollectiveKind.ALL_GATHER): RoutedSlot,
        TensorKey.collective(0, 4, kind=CollectiveKind.BROADCAST): RoutedSlot,
        TensorKey.collective(0, 5, kind=CollectiveKind.ALL_TO_ALL, split_bytes=(4, 4)): RoutedSlot,
    }
    for key, kind in kinds.items():
        assert type(keys.open(key, ChunkHeader(DType.FLOAT32, 8), frozenset({0, 1}))) is kind
    assert keys.steps() == {0} and len(keys.slots()) == len(kinds)


def test_an_averaged_slot_hands_out_a_chunk_once_every_part_arrived_and_then_is_done() -> None:
    keys, account, reduced = pending()
    slot = keys.open(KEY, ChunkHeader(DType.FLOAT32, 4), frozenset({0, 1}))
    first = chunk(0, KEY, floats(1, 2, 3, 4), total=4)
    assert slot.refusal(OwnChunk(0), 0, first) is None
    accepted = slot.accept(OwnChunk(0), 0, first, 16)
    assert accepted.request is None and account.of(0) == 16 and slot.missing_workers() == [1]
    again = slot.refusal(OwnChunk(0), 0, first)
    assert again is not None and "twice" in again.message
    accepted = slot.accept(OwnChunk(1), 0, chunk(1, KEY, floats(3, 4, 5, 6), total=4), 0)
    request = accepted.request
    assert request is not None and request.contributors == (0, 1) and request.to == (0, 1)
    assert keys.awaiting(request) is slot
    result = slot.reduced(request, floats(2, 3, 4, 5))
    [sent] = result.out
    assert result.done and isinstance(sent.event, AveragedChunkOut) and sent.event.num_contributors == 2
    assert account.of(0) == 0 and keys.awaiting(request) is None
    keys.finish(slot, 2)
    assert not keys and reduced == [0.0] and keys.keys_reduced == 1 and keys.contributions_counted == 2
    replay = keys.refusal(0, KEY, keys.get(KEY))
    assert replay is not None and "again after it was reduced" in replay.message


def test_a_partial_sum_completes_its_group_and_its_average_goes_to_its_sender() -> None:
    groups = HostGroups("here")
    groups.form([(1, "a"), (2, "a")])
    keys, _, _ = pending(3, groups)
    slot = keys.open(KEY, ChunkHeader(DType.FLOAT32, 4), frozenset({0, 1, 2}))
    slot.accept(OwnChunk(0), 0, chunk(0, KEY, floats(1, 1, 1, 1), total=4), 16)
    partial = PartialSum(2, (1, 2))
    request = slot.accept(partial, 0, chunk(2, KEY, floats(2, 2, 2, 2), total=4, covers=(1, 2)), 16).request
    assert request is not None and request.senders == (0, 2) and request.to == (0, 2) and request.count == 3


def test_a_key_goes_on_without_a_worker_unless_part_of_it_was_averaged_or_it_needs_every_rank() -> None:
    keys, account, _ = pending(3)
    slot = keys.open(KEY, ChunkHeader(DType.FLOAT32, 8), frozenset({0, 1, 2}))
    slot.accept(OwnChunk(0), 0, chunk(0, KEY, floats(1, 1, 1, 1)), 16)
    slot.accept(OwnChunk(1), 0, chunk(1, KEY, floats(1, 1, 1, 1)), 16)
    slot.accept(OwnChunk(2), 1, chunk(2, KEY, floats(1, 1, 1, 1), 4), 16)
    assert slot.without(2, "worker 2 lost") is None and account.of(2) == 0
    [request] = list(slot.take_complete())
    assert request.index == 0 and request.contributors == (0, 1)
    refused = slot.without(1, "worker 1 lost")
    assert refused is not None and "was averaged with its data" in refused
    scatter = keys.open(
        TensorKey.collective(0, 2, kind=CollectiveKind.REDUCE_SCATTER),
        ChunkHeader(DType.FLOAT32, 8),
        frozenset({0, 1}),
    )
    assert "needs every rank" in (scatter.without(0, "worker 0 lost") or "")
    keys.drop_step(0)
    assert not keys and account.of(0) == account.of(1) == 0


def test_a_routed_slot_sends_pieces_as_they_become_ready_and_charges_what_it_holds() -> None:
    keys, account, _ = pending()
    key = TensorKey.collective(0, 3, kind=CollectiveKind.ALL_GATHER)
    slot = keys.open(key, ChunkHeader(DType.BYTES, 4), frozenset({0, 1}))
    first = slot.accept(OwnChunk(0), 0, chunk(0, key, b"abcd", total=4), 4)
    assert first.out == [] and not first.done and account.of(0) == 4
    second = slot.accept(OwnChunk(1), 0, chunk(1, key, b"efgh", total=4), 4)
    assert second.done and account.of(0) == account.of(1) == 0
    assert sorted(bytes(o.event.data) for o in second.out if isinstance(o.event, AveragedChunkOut)) == [
        b"abcd",
        b"efgh",
    ]
    assert list(slot.take_complete()) == []


@pytest.mark.parametrize("declared", [4, 8])
def test_a_slot_names_what_a_chunk_declares_unlike_its_first_contributor(declared: int) -> None:
    keys, _, _ = pending()
    slot = keys.open(KEY, ChunkHeader(DType.FLOAT32, 4), frozenset({0, 1}))
    slot.accept(OwnChunk(0), 0, chunk(0, KEY, floats(1, 1, 1, 1), total=4), 16)
    mismatch = slot.mismatch(chunk(1, KEY, floats(1, 1, 1, 1), total=declared))
    assert (mismatch is None) == (declared == 4)
    if mismatch:
        assert "worker 0's" in mismatch and "4 FLOAT32 elements" in mismatch
