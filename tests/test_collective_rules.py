"""Unit tests of the rules of collectives (`gradserver.common.collective_rules`): what a key may
carry, the dtypes, chunk and contribution shapes, result lengths, how a result is answered, and
what a host group does with each key."""

from __future__ import annotations

import itertools
import random

import pytest

from gradserver.common import collective_rules as rules
from gradserver.common.components import NonBlockComponent
from gradserver.common.messages import ALLOWED_DTYPES, QUANTIZED_DTYPES, CollectiveKind, DType, TensorKey

RS, A2A = CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL
BROADCAST, GATHER, REDUCE = CollectiveKind.BROADCAST, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE


def _collective(kind: CollectiveKind, root: int = 0, split_bytes: tuple[int, ...] = ()) -> TensorKey:
    return TensorKey.collective(5, 1, kind=kind, root=root, split_bytes=split_bytes)


TRAINING_KEYS = {
    "block": TensorKey.block(3, 0, 2),
    "non-block": TensorKey.non_block(3, NonBlockComponent.LM_HEAD),
    "whole-model": TensorKey.whole_model(3),
}
COLLECTIVE_KEYS = {kind.name: _collective(kind) for kind in CollectiveKind}
ALL_KEYS = {**TRAINING_KEYS, **COLLECTIVE_KEYS}


@pytest.mark.parametrize(
    ("kind", "root", "splits", "world", "problem"),
    [
        (REDUCE, 0, (), 0, None),
        (BROADCAST, 3, (), 0, None),  # the world unknown: any root
        (BROADCAST, 3, (), 4, None),
        (BROADCAST, 4, (), 4, "BROADCAST root 4 is out of range for 4 workers"),
        (GATHER, 1, (), 0, "root 1 is only for BROADCAST, not ALL_GATHER"),
        (REDUCE, 0, (4, 4), 0, "split_bytes are only for ALL_TO_ALL and REDUCE_SCATTER, not REDUCE"),
        (RS, 0, (4, 6), 0, "REDUCE_SCATTER split_bytes [4, 6] must be float32 bytes (multiples of 4)"),
        (RS, 0, (4, 8), 2, None),
        (RS, 0, (4, 8), 3, "REDUCE_SCATTER has 2 split_bytes, one per worker needs 3"),
        (RS, 0, (), 3, None),  # even parts
        (A2A, 0, (1, 2, 3), 3, None),
        (A2A, 0, (1, 2), 3, "ALL_TO_ALL has 2 split_bytes, one per worker needs 3"),
        (A2A, 0, (), 3, "ALL_TO_ALL has 0 split_bytes, one per worker needs 3"),
        (A2A, 0, (), 0, None),  # the world unknown: the table checks it
    ],
)
def test_a_key_alone_carries_a_root_and_split_bytes_only_where_its_kind_has_them(
    kind: CollectiveKind, root: int, splits: tuple[int, ...], world: int, problem: str | None
) -> None:
    assert rules.key_problem(kind, root, splits, world) == problem


@pytest.mark.parametrize("name", ALL_KEYS)
@pytest.mark.parametrize("dtype", list(DType))
def test_bytes_travel_with_the_kinds_that_move_bytes_and_floats_with_every_reduction(
    name: str, dtype: DType
) -> None:
    key = ALL_KEYS[name]
    problem = rules.dtype_problem(key, dtype)
    if rules.moves_bytes(key):
        assert (problem is None) == (dtype is DType.BYTES)
        if problem is not None:
            assert f"moves raw bytes: dtype must be BYTES, got {dtype.name}" in problem
    else:
        # Quantized records are summed by the coordinator only: not into a REDUCE_SCATTER's parts.
        quantized_refused = dtype in QUANTIZED_DTYPES and not rules.quantized_sum_exact(key)
        assert (problem is None) == (dtype in ALLOWED_DTYPES and not quantized_refused)
    # Outside any key (a joiner's wire dtype) the rule of reductions applies.
    assert (rules.dtype_problem(None, dtype) is None) == (dtype in ALLOWED_DTYPES)


def test_the_kinds_that_move_bytes_are_gather_broadcast_and_all_to_all() -> None:
    moving = {name for name, key in ALL_KEYS.items() if rules.moves_bytes(key)}
    assert moving == {"ALL_GATHER", "BROADCAST", "ALL_TO_ALL"}
    assert (
        rules.dtype_problem(None, DType.UNSPECIFIED)
        == "dtype missing; allowed: FLOAT32, BFLOAT16, FLOAT16, INT8_BLOCK64, INT4_BLOCK64"
    )


def test_a_broadcasts_other_ranks_send_one_header_only_chunk() -> None:
    key = _collective(BROADCAST, root=2)
    assert rules.header_only(key, 0) and not rules.header_only(key, 2)
    assert not rules.header_only(_collective(GATHER), 1)
    assert rules.chunk_problem(key, 0, 100, 0, 0) is None
    assert rules.chunk_problem(key, 2, 100, 0, 100) is None
    problem = rules.chunk_problem(key, 0, 100, 0, 8)
    assert problem is not None and "is not the root (2) of a BROADCAST" in problem
    assert rules.chunk_problem(key, 0, 100, 25, 0) is not None


def test_an_all_to_all_chunk_declares_the_total_its_split_bytes_sum_to() -> None:
    key = _collective(A2A, split_bytes=(3, 0, 5))
    assert rules.chunk_problem(key, 1, 8, 0, 8) is None
    assert rules.chunk_problem(key, 1, 9, 0, 8) == (
        "ALL_TO_ALL split_bytes [3, 0, 5] sum to 8, but the contribution declares 9 bytes"
    )
    assert rules.chunk_problem(TRAINING_KEYS["block"], 1, 9, 0, 8) is None


@pytest.mark.parametrize(
    ("key", "size", "world", "problem"),
    [
        (_collective(RS), 12, 4, None),
        (_collective(RS), 10, 4, "10 elements do not split into 4 equal parts, one per worker"),
        (_collective(RS, split_bytes=(8, 0, 32)), 10, 3, None),
        (
            _collective(RS, split_bytes=(8, 0, 28)),
            10,
            3,
            "split_bytes [8, 0, 28] must hold one entry per worker (3) and sum to the 40 float32 bytes sent",
        ),
        (_collective(RS, split_bytes=(8, 32)), 10, 3, "split_bytes [8, 32] must hold one entry per worker"),
        (_collective(BROADCAST, root=2), 7, 3, None),
        (_collective(BROADCAST, root=3), 7, 3, "root 3 is out of range for 3 workers"),
        (_collective(A2A, split_bytes=(1, 2, 4)), 7, 3, None),
        (_collective(A2A, split_bytes=(1, 2, 4)), 8, 3, "sum to the 8 bytes sent"),
        (_collective(A2A, split_bytes=(3, 4)), 7, 3, "must hold one entry per worker (3)"),
        (_collective(GATHER), 7, 3, None),
        (_collective(REDUCE), 7, 3, None),
        (TRAINING_KEYS["block"], 7, 3, None),
    ],
)
def test_a_contribution_must_fit_the_world(
    key: TensorKey, size: int, world: int, problem: str | None
) -> None:
    got = rules.shape_problem(key, size, world)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("uneven", [False, True])
def test_the_ranks_parts_of_a_reduce_scatter_cover_its_input_once(world: int, uneven: bool) -> None:
    rng = random.Random(world)
    parts = [rng.randrange(0, 9) for _ in range(world)]
    size = sum(parts) if uneven else 6 * world
    key = _collective(RS, split_bytes=tuple(4 * p for p in parts) if uneven else ())
    assert rules.shape_problem(key, size, world) is None
    got = rules.scatter_parts(key, size, world)
    assert sum(got) == size and len(got) == world
    assert got == (tuple(parts) if uneven else (6,) * world)
    assert [rules.result_length(key, size, world, r) for r in range(world)] == list(got)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_result_lengths_per_kind(world: int) -> None:
    size = 12
    for rank in range(world):
        assert rules.result_length(_collective(REDUCE), size, world, rank) == size
        assert rules.result_length(_collective(GATHER), size, world, rank) == size * world
        assert rules.result_length(_collective(BROADCAST), size, world, rank) == size
        assert rules.result_length(_collective(A2A, split_bytes=(12,) * world), size, world, rank) is None
        for key in TRAINING_KEYS.values():
            assert rules.result_length(key, size, world, rank) == size


def test_an_all_to_all_delivers_every_byte_sent_once() -> None:
    rng = random.Random(7)
    world = 4
    splits = [tuple(rng.randrange(0, 50) for _ in range(world)) for _ in range(world)]
    received = [rules.all_to_all_result_length(splits, r) for r in range(world)]
    assert received == [sum(s[r] for s in splits) for r in range(world)]
    assert sum(received) == sum(map(sum, splits))


def test_every_collective_but_reduce_is_answered_in_pieces_needs_every_rank_and_one_coordinator() -> None:
    native = {"ALL_GATHER", "BROADCAST", "REDUCE_SCATTER", "ALL_TO_ALL"}
    for name, key in ALL_KEYS.items():
        assert rules.result_in_pieces(key) == (name in native), name
        assert rules.needs_every_rank(key) == (name in native), name
        assert rules.served_by_partitions(key) == (name not in native), name


def test_what_host_groups_sum_and_what_they_hand_on() -> None:
    summed = {name for name, key in ALL_KEYS.items() if rules.summed_on_hosts(key)}
    handed = {name for name, key in ALL_KEYS.items() if rules.handed_on_hosts(key)}
    # Sums need the same reduction on every member; whole-model stats are per worker.
    assert summed == {"block", "non-block", "REDUCE", "REDUCE_SCATTER"}
    # A result the same for every rank crosses the host's link once.
    assert handed == {"block", "non-block", "REDUCE", "ALL_GATHER", "BROADCAST"}


@pytest.mark.parametrize(
    ("ids", "world", "ascending"),
    [((0,), 1, True), ((0, 2, 5), 6, True), ((0, 2, 5), 5, False), ((1, 1), 4, False), ((2, 1), 4, False)],
)
def test_ascending_ids(ids: tuple[int, ...], world: int, ascending: bool) -> None:
    assert rules.ascending_ids(ids, world) is ascending


def test_a_partial_sum_covers_its_sender_in_order_within_the_limit_and_only_summed_keys() -> None:
    reduce_key = _collective(REDUCE)
    assert rules.partial_sum_problem(reduce_key, 1, (0, 1, 3), 4) is None
    assert rules.partial_sum_problem(reduce_key, 1, (0, 1, 3), 0) is None  # the world unknown
    for sender, covers, world in [(2, (0, 1), 4), (1, (1, 0), 4), (1, (0, 1, 4), 4)]:
        problem = rules.partial_sum_problem(reduce_key, sender, covers, world)
        assert problem is not None and "must be distinct worker ids in increasing order" in problem
    gather = rules.partial_sum_problem(_collective(GATHER), 0, (0, 1), 2)
    assert gather is not None and "collective ALL_GATHER of group 1 is not summed on hosts" in gather
    too_many = tuple(range(rules.MAX_HOST_GROUP + 1))
    assert rules.partial_sum_problem(reduce_key, 0, too_many, 0) == (
        f"a partial sum covers {rules.MAX_HOST_GROUP + 1} workers, above the limit of {rules.MAX_HOST_GROUP}"
    )
    assert rules.partial_sum_problem(reduce_key, 0, too_many[:-1], 0) is None


def test_every_shape_the_rules_accept_has_results_that_account_for_the_input() -> None:
    """Over kinds, worlds, roots and splits: a key and contribution both accepted give results
    that hold the input (a REDUCE_SCATTER's parts sum to it, an ALL_GATHER holds it per rank)."""
    accepted = 0
    for kind, world, root, splits in itertools.product(
        CollectiveKind, (1, 2, 3), (0, 1, 3), ((), (4,), (4, 8), (0, 4, 8))
    ):
        if rules.key_problem(kind, root, splits, world) is not None:
            continue
        key = _collective(kind, root, splits)
        for size in (0, 3, 12):
            if rules.shape_problem(key, size, world) is not None:
                continue
            accepted += 1
            lengths = [rules.result_length(key, size, world, r) for r in range(world)]
            if kind is RS:
                assert sum(length or 0 for length in lengths) == size
            elif kind is GATHER:
                assert lengths == [size * world] * world
            elif kind is A2A:
                assert lengths == [None] * world
            else:
                assert lengths == [size] * world
    assert accepted > 20
