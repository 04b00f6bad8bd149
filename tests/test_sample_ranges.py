"""Property tests: workers' sample ranges are disjoint and complete, for random sizes and more
workers than batches."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradserver.common.sample_ranges import batches_of_rank, step_sample_ranges


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.integers(1, 64))
def test_batches_of_rank_partition_every_batch(num_batches: int, world: int) -> None:
    per_rank = [batches_of_rank(num_batches, rank, world) for rank in range(world)]
    flat = [b for s in per_rank for b in s]
    assert sorted(flat) == list(range(num_batches))
    assert max(len(s) for s in per_rank) - min(len(s) for s in per_rank) <= 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.integers(1, 16), st.integers(0, 200), st.data())
def test_step_sample_ranges_are_disjoint_within_a_step_and_walk_the_data_set(
    world, batch, step, data
) -> None:
    dataset = data.draw(st.integers(world * batch, world * batch * 5))
    per_step = []
    for s in range(step, step + dataset):  # enough steps to wrap several times
        taken = [
            i
            for w in range(world)
            for r in step_sample_ranges(s, w, world, dataset, batch)
            for i in r.indices()
        ]
        assert len(taken) == len(set(taken)) == world * batch
        assert all(0 <= i < dataset for i in taken)
        per_step.append(sorted(taken))
    # Consecutive steps cover positions p..p+W*b: over `dataset` steps every sample appears
    # exactly W*b times.
    counts = [0] * dataset
    for taken in per_step:
        for i in taken:
            counts[i] += 1
    assert set(counts) == {world * batch}


def test_the_old_names_shard_batches_and_shard_assignment_still_work_with_a_deprecation_warning() -> None:
    import gradserver.common
    import gradserver.worker

    with pytest.warns(DeprecationWarning, match="use batches_of_rank"):
        assert gradserver.common.shard_batches(7, 1, 3) == batches_of_rank(7, 1, 3) == [1, 4]
    assert gradserver.worker.ShardAssignment is gradserver.worker.SampleRangeAssignment
