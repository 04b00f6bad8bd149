"""The reduction table on its own, with a fake clock: arrival order, memory, and failure rules."""

from __future__ import annotations

import itertools

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
    DType,
    ErrorOut,
    SampleStats,
    TensorKey,
)
from gradserver.server.reduction import ReductionTable

CHUNK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(world: int = 2, timeout: float = 10.0) -> tuple[ReductionTable, Clock]:
    clock = Clock()
    return ReductionTable(world, CHUNK, timeout, clock), clock


def chunks(worker: int, key: TensorKey, data: np.ndarray, stats: SampleStats | None = None) -> list[ChunkIn]:
    header = ChunkHeader(DType.FLOAT32, data.size, ())
    return [
        ChunkIn(worker, key, header, off, data[off : off + CHUNK].astype("<f4").tobytes(), stats)
        for off in range(0, max(1, data.size), CHUNK)
    ]


def averages(out) -> dict[int, bytes]:
    return {o.event.offset: o.event.data for o in out if isinstance(o.event, AveragedChunkOut)}


def errors(out) -> list[tuple[tuple[int, ...], ErrorOut]]:
    return [(o.to, o.event) for o in out if isinstance(o.event, ErrorOut)]


def code(name: str) -> int:
    return int(Status[name])


KEY = TensorKey.non_block(0, NonBlockComponent.LM_HEAD)


def test_result_does_not_depend_on_arrival_order() -> None:
    rng = np.random.default_rng(1)
    data = [rng.standard_normal(10).astype(np.float32) * 1e4 for _ in range(3)]
    results = set()
    for order in itertools.permutations(range(3)):
        t, _ = table(3)
        out = []
        for w in order:
            for c in chunks(w, KEY, data[w]):
                out += t.contribute(c)
        got = averages(out)
        assert sorted(got) == [0, 4, 8]
        results.add(b"".join(got[k] for k in sorted(got)))
    assert len(results) == 1


def test_memory_is_freed_chunk_by_chunk() -> None:
    t, _ = table(2)
    a, b = chunks(0, KEY, np.ones(12, np.float32)), chunks(1, KEY, np.ones(12, np.float32))
    t.contribute(a[0])
    t.contribute(a[1])
    assert t.buffered_bytes(0) == 32
    out = t.contribute(b[0])
    assert averages(out).keys() == {0} and t.buffered_bytes(0) == 16 and t.buffered_bytes(1) == 0
    for c in (b[1], a[2], b[2]):
        t.contribute(c)
    assert t.buffered_bytes(0) == t.buffered_bytes(1) == 0 and not t.has_pending()
    assert t.keys_reduced == 1 and t.contributions_counted == 2


def test_borrowed_contributions_do_not_count_toward_the_budget() -> None:
    """A chunk lying in its sender's shared memory (`borrowed`) costs this process nothing to
    hold; owned chunks count as before, and every count returns to 0 however the chunks end."""
    t, _ = table(2)
    a, b = chunks(0, KEY, np.ones(12, np.float32)), chunks(1, KEY, np.ones(12, np.float32))
    t.contribute(a[0], borrowed=True)
    t.contribute(a[1])
    assert t.buffered_bytes(0) == 16
    t.contribute(b[0])
    t.contribute(b[1], borrowed=True)
    assert t.buffered_bytes(0) == t.buffered_bytes(1) == 0
    t.contribute(a[2], borrowed=True)
    t.contribute(chunks(0, TensorKey.non_block(0, NonBlockComponent.FINAL_NORM), np.ones(4, np.float32))[0])
    assert t.buffered_bytes(0) == 16
    out = t.worker_lost(1, "disconnected")  # fails step 0, releasing what it held
    assert errors(out) and t.buffered_bytes(0) == t.buffered_bytes(1) == 0


def test_zero_element_tensor_completes() -> None:
    t, _ = table(2)
    t.contribute(chunks(0, KEY, np.zeros(0, np.float32))[0])
    out = t.contribute(chunks(1, KEY, np.zeros(0, np.float32))[0])
    assert averages(out) == {0: b""}


def test_duplicate_chunk_is_rejected_and_counted_once() -> None:
    t, _ = table(2)
    t.contribute(chunks(0, KEY, np.full(4, 1.0, np.float32))[0])
    out = t.contribute(chunks(0, KEY, np.full(4, 50.0, np.float32))[0])
    [(to, err)] = errors(out)
    assert to == (0,) and err.code == code("INVALID_ARGUMENT") and "twice" in err.message
    out = t.contribute(chunks(1, KEY, np.full(4, 3.0, np.float32))[0])
    assert np.frombuffer(averages(out)[0], "<f4").tolist() == [2.0] * 4


def test_lost_worker_fails_every_pending_step_and_refuses_new_keys() -> None:
    t, _ = table(3)
    t.contribute(chunks(0, KEY, np.ones(4, np.float32))[0])
    out = t.worker_lost(2, "disconnected")
    [(to, err)] = errors(out)
    assert to == (0, 1) and err.step_failed and "step 0 aborted: worker 2 disconnected" in err.message
    assert t.buffered_bytes(0) == 0
    out = t.contribute(
        chunks(1, TensorKey.non_block(1, NonBlockComponent.FINAL_NORM), np.ones(4, np.float32))[0]
    )
    [(to, err)] = errors(out)
    assert to == (1,) and err.code == code("ABORTED") and "world is incomplete" in err.message
    t.worker_joined(2)
    key = TensorKey.non_block(1, NonBlockComponent.FINAL_NORM)
    out = []
    for w in range(3):
        out += t.contribute(chunks(w, key, np.ones(4, np.float32))[0])
    assert averages(out)


def test_step_timeout_names_missing_workers() -> None:
    t, clock = table(3, timeout=5.0)
    t.contribute(chunks(1, KEY, np.ones(4, np.float32))[0])
    clock.now = 4.9
    assert t.expire() == []
    clock.now = 5.0
    [(to, err)] = errors(t.expire())
    assert err.code == code("DEADLINE_EXCEEDED") and "worker(s) 0, 2" in err.message and to == (0, 1, 2)
    assert not t.has_pending()


def test_late_contribution_to_a_failed_step_is_answered_once() -> None:
    t, _ = table(2)
    t.contribute(chunks(0, KEY, np.ones(8, np.float32))[0])
    t.worker_lost(1, "lost")
    t.worker_joined(1)
    late = chunks(0, KEY, np.ones(8, np.float32))[1]
    [(to, err)] = errors(t.contribute(late))
    assert to == (0,) and err.step_failed
    assert t.contribute(late) == []


def test_whole_model_stats_are_sample_weighted() -> None:
    t, _ = table(2)
    key = TensorKey.whole_model(3)
    t.contribute(chunks(0, key, np.zeros(4, np.float32), SampleStats(1.0, 1, 1))[0])
    out = t.contribute(chunks(1, key, np.zeros(4, np.float32), SampleStats(3.0, 2, 3))[0])
    [avg] = [o.event for o in out if isinstance(o.event, AveragedChunkOut)]
    assert avg.stats == SampleStats(2.5, 3, 4)


def test_barrier_release_duplicates_and_replays() -> None:
    t, _ = table(2)
    assert t.barrier(BarrierIn(0, 1, "b")) == []
    [(_, err)] = errors(t.barrier(BarrierIn(0, 1, "b")))
    assert "twice" in err.message
    [release] = t.barrier(BarrierIn(1, 1, "b"))
    assert release.event == BarrierReleaseOut(1, "b") and release.to == (0, 1)
    [(_, err)] = errors(t.barrier(BarrierIn(0, 1, "b")))
    assert err.code == code("FAILED_PRECONDITION") and "already released" in err.message


def test_step_never_goes_backwards_for_a_worker() -> None:
    t, _ = table(2)
    other = TensorKey.non_block(5, NonBlockComponent.EMBEDDING)
    t.contribute(chunks(0, other, np.ones(4, np.float32))[0])
    [(_, err)] = errors(t.contribute(chunks(0, KEY, np.ones(4, np.float32))[0]))
    assert err.code == code("FAILED_PRECONDITION") and "steps only move forward" in err.message


@pytest.mark.parametrize("world", [1, 2, 5])
def test_sample_range_requests_must_agree(world: int) -> None:
    from gradserver.common.messages import SampleRangeAssignmentOut, SampleRangeRequestIn

    t, _ = table(world)
    [ok] = t.sample_ranges(SampleRangeRequestIn(0, 0, 100, 3))
    assert isinstance(ok.event, SampleRangeAssignmentOut)
    [bad] = t.sample_ranges(SampleRangeRequestIn(0, 1, 99, 3))
    assert isinstance(bad.event, ErrorOut) and "this job uses 100 samples" in bad.event.message


EMB0 = TensorKey.non_block(0, NonBlockComponent.EMBEDDING)
NORM0 = TensorKey.non_block(0, NonBlockComponent.FINAL_NORM)
EMB1 = TensorKey.non_block(1, NonBlockComponent.EMBEDDING)
NORM1 = TensorKey.non_block(1, NonBlockComponent.FINAL_NORM)


def send(t: ReductionTable, worker: int, key: TensorKey, value: float = 1.0) -> list:
    out: list = []
    for c in chunks(worker, key, np.full(4, value, np.float32)):
        out += t.contribute(c)
    return out


def test_a_key_opened_after_one_of_its_workers_moved_on_fails_at_once() -> None:
    """Issue 10 item 4a: worker 0 moved to step 1 without final_norm@0; worker 1 then opens
    final_norm@0, which worker 0 can never send: step 0 fails now, not at the step timeout."""
    t, clock = table(2, timeout=300.0)
    send(t, 0, EMB0)
    send(t, 1, EMB0)
    send(t, 0, EMB1)
    out = send(t, 1, NORM0)
    failed = errors(out)
    assert failed, "step 0 must fail at once"
    assert all(e.step_failed and e.step == 0 for _, e in failed)
    assert (
        "worker 0 moved on to step 1 without completing step 0 non-block FINAL_NORM" in failed[0][1].message
    )
    to_culprit = [e for to, e in failed if to == (0,)]
    assert to_culprit and to_culprit[0].code == code("FAILED_PRECONDITION")
    assert 0 not in t.pending_steps()
    out = send(t, 1, EMB1)
    assert averages(out), "step 1 goes on"
    assert t.expire() == [] and clock.now == 0.0


def test_a_barrier_opened_after_one_of_its_workers_moved_on_fails_at_once() -> None:
    t, _ = table(2, timeout=300.0)
    send(t, 0, EMB1)
    out = t.barrier(BarrierIn(1, 0, "commit"))
    failed = errors(out)
    assert failed and all(e.step_failed and e.step == 0 for _, e in failed)
    assert "worker 0 moved on to step 1 without completing step 0 barrier 'commit'" in failed[0][1].message
    assert not t.pending_steps() - {1}


def test_a_step_counts_only_when_every_key_is_done_and_its_workers_moved_on() -> None:
    """Issue 10 item 4b: a step whose first key was reduced and that then fails (NaN in another
    key) is not counted; a step counts once all its keys are done and its workers moved on."""
    t, _ = table(2)
    send(t, 0, EMB0)
    send(t, 1, EMB0)
    assert t.keys_reduced == 1 and t.steps_completed == 0, "other keys of step 0 may follow"
    send(t, 0, NORM0)
    out = send(t, 1, NORM0, float("nan"))
    assert errors(out) and all(e.step_failed for _, e in errors(out))
    send(t, 0, EMB1)
    send(t, 1, EMB1)
    assert t.steps_completed == 0 and t.last_completed_step is None, "the failed step 0 is not counted"
    send(t, 0, NORM1)
    send(t, 1, NORM1)
    assert t.steps_completed == 0, "step 1 is still open: its workers have not moved on"
    t.barrier(BarrierIn(0, 2, "end"))
    assert t.steps_completed == 0, "worker 1 is still at step 1"
    t.barrier(BarrierIn(1, 2, "end"))
    assert t.steps_completed == 1 and t.last_completed_step == 1
    t.worker_lost(0, "left the job")
    t.worker_lost(1, "left the job")
    assert t.steps_completed == 2 and t.last_completed_step == 2, "the last step counts when all left"


def test_a_worker_that_rejoined_owes_no_barrier_it_was_excused_from() -> None:
    """Under continue, a worker lost while a barrier of step 0 waited for it is excused from it; its
    replacement takes part from step 1 and its first contribution fails nothing (it used to fail
    step 0's barrier as 'moved on without completing' it)."""
    clock = Clock()
    t = ReductionTable(3, CHUNK, 10.0, clock, on_worker_loss="continue")
    t.barrier(BarrierIn(0, 0, "commit"))
    t.worker_lost(2, "gone")
    t.worker_joined(2)
    key = TensorKey.non_block(1, NonBlockComponent.LM_HEAD)
    out = t.contribute(chunks(2, key, np.ones(CHUNK, np.float32))[0])
    assert errors(out) == []
    out = t.barrier(BarrierIn(1, 0, "commit"))
    assert errors(out) == []
    assert any(isinstance(o.event, BarrierReleaseOut) for o in out), "workers 0 and 1 were all it awaited"
