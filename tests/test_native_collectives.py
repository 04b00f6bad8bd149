"""Native collectives by bytes (ALL_GATHER, BROADCAST, REDUCE_SCATTER, ALL_TO_ALL): the pure
table without sockets, then a real coordinator with raw gRPC streams and shared-memory workers:
the bytes each rank receives, the bytes on the wire, and the errors naming the rank."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import queue
import random
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from gradserver.common import codec
from gradserver.common import shm as shm_support
from gradserver.common.errors import InvalidArgumentError, Status
from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    CollectiveKind,
    DType,
    ErrorOut,
    ReduceOp,
    TensorKey,
)
from gradserver.server.metrics import Traffic
from gradserver.server.outgoing import Outgoing
from gradserver.server.reduction import ReductionTable
from gradserver.worker import WorkerClient

from .helpers import raw
from .helpers.raw import RawWorker
from .helpers.server import TEST_TIMEOUTS, ServerThread

CHUNK = 4  # elements (bytes, for DTYPE_BYTES) per chunk in the pure-table tests
GROUP = 3


def table(world: int, timeout: float = 10.0, chunk: int = CHUNK) -> ReductionTable:
    return ReductionTable(world, chunk, timeout, lambda: 0.0)


def payload(rank: int, size: int, tag: int = 0) -> bytes:
    return np.random.default_rng([rank, size, tag]).integers(0, 256, size, dtype=np.uint8).tobytes()


def floats(rank: int, size: int, tag: int = 0) -> np.ndarray:
    return np.random.default_rng([rank, size, tag, 1]).standard_normal(size).astype("<f4") * 1e3


def key_of(
    kind: CollectiveKind, *, op: ReduceOp = ReduceOp.SUM, root: int = 0, splits: Sequence[int] = ()
) -> TensorKey:
    return TensorKey.collective(0, GROUP, op, kind=kind, root=root, split_bytes=tuple(splits))


def byte_chunks(rank: int, key: TensorKey, data: bytes, chunk: int = CHUNK) -> list[ChunkIn]:
    """`data` cut as a worker cuts it; a non-root BROADCAST rank sends one header-only chunk."""
    if key.collective_kind is CollectiveKind.BROADCAST and rank != key.root:
        return [ChunkIn(rank, key, ChunkHeader(DType.BYTES, len(data)), 0, b"")]
    header = ChunkHeader(DType.BYTES, len(data))
    return [
        ChunkIn(rank, key, header, off, data[off : off + chunk]) for off in range(0, max(1, len(data)), chunk)
    ]


def float_chunks(rank: int, key: TensorKey, data: np.ndarray, chunk: int = CHUNK) -> list[ChunkIn]:
    header = ChunkHeader(DType.FLOAT32, data.size)
    return [
        ChunkIn(rank, key, header, off, data[off : off + chunk].tobytes())
        for off in range(0, max(1, data.size), chunk)
    ]


class Results:
    """What each rank received, assembled from the pieces; checks every byte comes exactly once."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.buffers: dict[int, bytearray] = {}
        self.covered: dict[int, np.ndarray] = {}
        self.empty: dict[int, int] = {}

    def take(self, out: list[Outgoing]) -> None:
        for item in out:
            if not isinstance(item.event, AveragedChunkOut):
                continue
            event = item.event
            data = bytes(event.data)
            item_size = 1 if event.header.dtype is DType.BYTES else 4
            for rank in item.to:
                total = event.header.total_elements * item_size
                buf = self.buffers.setdefault(rank, bytearray(total))
                cover = self.covered.setdefault(rank, np.zeros(total, np.int64))
                assert len(buf) == total, f"rank {rank} was told two result sizes"
                start = event.offset * item_size
                assert start + len(data) <= total
                buf[start : start + len(data)] = data
                cover[start : start + len(data)] += 1
                if not data:
                    self.empty[rank] = self.empty.get(rank, 0) + 1

    def complete(self, rank: int) -> bool:
        cover = self.covered.get(rank)
        if cover is None:
            return False
        if cover.size == 0:
            return self.empty.get(rank, 0) == 1
        return bool((cover == 1).all())

    def of(self, rank: int) -> bytes:
        assert self.complete(rank), f"rank {rank}'s result is incomplete or has bytes sent twice"
        return bytes(self.buffers[rank])


def errors(out: list[Outgoing]) -> list[tuple[tuple[int, ...], ErrorOut]]:
    return [(o.to, o.event) for o in out if isinstance(o.event, ErrorOut)]


def run_interleaved(t: ReductionTable, per_rank: list[list[ChunkIn]], seed: int) -> list[Outgoing]:
    """Feeds every rank's chunks in its own order, ranks interleaved at random."""
    queues = [list(chunks) for chunks in per_rank]
    rng = random.Random(seed)
    out: list[Outgoing] = []
    while any(queues):
        rank = rng.choice([r for r, q in enumerate(queues) if q])
        out += t.contribute(queues[rank].pop(0))
    return out


# --- the pure table ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("size", [0, 1, 7, 13])
def test_all_gather_gives_every_rank_the_contributions_in_rank_order(world: int, size: int) -> None:
    key = key_of(CollectiveKind.ALL_GATHER)
    data = [payload(r, size) for r in range(world)]
    for seed in range(3):
        t = table(world)
        got = Results(world)
        got.take(run_interleaved(t, [byte_chunks(r, key, data[r]) for r in range(world)], seed))
        for rank in range(world):
            assert got.of(rank) == b"".join(data)
        assert not t.has_pending() and all(t.buffered_bytes(r) == 0 for r in range(world))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("size", [0, 5, 11])
def test_broadcast_relays_the_roots_bytes_to_every_rank(world: int, size: int) -> None:
    for root in range(world):
        key = key_of(CollectiveKind.BROADCAST, root=root)
        data = payload(root, size)
        for seed in range(3):
            t = table(world)
            got = Results(world)
            got.take(run_interleaved(t, [byte_chunks(r, key, data) for r in range(world)], seed))
            assert [got.of(r) for r in range(world)] == [data] * world
            assert not t.has_pending()


def test_broadcast_holds_the_roots_bytes_until_every_rank_arrived() -> None:
    key = key_of(CollectiveKind.BROADCAST, root=1)
    data = payload(1, 10)
    t = table(3)
    out = []
    for c in byte_chunks(1, key, data) + byte_chunks(0, key, data):
        out += t.contribute(c)
    assert not any(isinstance(o.event, AveragedChunkOut) for o in out)
    assert t.buffered_bytes(1) == 10
    got = Results(3)
    got.take(t.contribute(byte_chunks(2, key, data)[0]))
    assert [got.of(r) for r in range(3)] == [data] * 3 and t.buffered_bytes(1) == 0


def reduce_bytes(world: int, data: list[np.ndarray], op: ReduceOp) -> bytes:
    """What a REDUCE of these inputs gives (the same table, kind REDUCE)."""
    key = key_of(CollectiveKind.REDUCE, op=op)
    t = table(world)
    got = Results(world)
    for rank in range(world):
        for c in float_chunks(rank, key, data[rank]):
            got.take(t.contribute(c))
    return got.of(0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
@pytest.mark.parametrize("part", [0, 1, 5])
def test_reduce_scatter_gives_each_rank_its_part_of_the_exact_reduction(
    world: int, op: ReduceOp, part: int
) -> None:
    size = part * world
    data = [floats(r, size) for r in range(world)]
    whole = reduce_bytes(world, data, op)
    key = key_of(CollectiveKind.REDUCE_SCATTER, op=op)
    for seed in range(3):
        t = table(world)
        got = Results(world)
        got.take(run_interleaved(t, [float_chunks(r, key, data[r]) for r in range(world)], seed))
        for rank in range(world):
            assert got.of(rank) == whole[rank * part * 4 : (rank + 1) * part * 4]
        assert not t.has_pending() and all(t.buffered_bytes(r) == 0 for r in range(world))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("parts", [(0, 0, 29), (29, 0, 0), (7, 0, 22), (3, 13, 13)])
def test_a_reduce_scatter_with_uneven_parts_gives_each_rank_its_part_and_an_empty_one_ends(
    world: int, parts: tuple[int, ...]
) -> None:
    """`split_bytes` (float32 bytes per rank): a reduce to one root is all of it for the root
    and nothing for the others, who still hear that it is done (an empty piece at the end)."""
    parts = (*parts[: world - 1], sum(parts[world - 1 :]))
    size = sum(parts)
    data = [floats(r, size, 7) for r in range(world)]
    whole = reduce_bytes(world, data, ReduceOp.SUM)
    key = key_of(CollectiveKind.REDUCE_SCATTER, splits=[4 * p for p in parts])
    for seed in range(3):
        t = table(world)
        got = Results(world)
        got.take(run_interleaved(t, [float_chunks(r, key, data[r]) for r in range(world)], seed))
        start = 0
        for rank in range(world):
            assert got.complete(rank) and got.of(rank) == whole[start * 4 : (start + parts[rank]) * 4]
            start += parts[rank]
        assert not t.has_pending()
    wrong = key_of(CollectiveKind.REDUCE_SCATTER, splits=[4] * world)
    [err] = [e for to, e in errors(table(world).contribute(float_chunks(0, wrong, data[0])[0])) if to == (0,)]
    assert err.code == int(Status.INVALID_ARGUMENT) and "split_bytes" in err.message


def test_no_reduce_scatter_part_is_complete_before_the_whole_sum_is_reduced() -> None:
    key = key_of(CollectiveKind.REDUCE_SCATTER)
    data = [floats(r, 24) for r in range(2)]
    t = table(2)
    got = Results(2)
    chunks = [float_chunks(r, key, data[r]) for r in range(2)]
    for c in chunks[0] + chunks[1][:-1]:
        got.take(t.contribute(c))
        assert not got.complete(0) and not got.complete(1)
    assert got.buffers, "no piece was sent before the last chunk: parts are not streamed"
    got.take(t.contribute(chunks[1][-1]))
    whole = reduce_bytes(2, data, ReduceOp.SUM)
    assert [got.of(0), got.of(1)] == [whole[:48], whole[48:]]


def all_to_all_expected(splits: list[list[int]], data: list[bytes]) -> list[bytes]:
    world = len(splits)
    pieces = []
    for source in range(world):
        begin, mine = 0, []
        for length in splits[source]:
            mine.append(data[source][begin : begin + length])
            begin += length
        pieces.append(mine)
    return [b"".join(pieces[source][dest] for source in range(world)) for dest in range(world)]


ALL_TO_ALL_SPLITS = {
    "uneven": [[3, 0, 6], [1, 9, 2], [0, 0, 5]],
    "gather-to-1": [[0, 5, 0], [0, 5, 0], [0, 5, 0]],
    "scatter-from-2": [[0, 0, 0], [0, 0, 0], [7, 1, 6]],
    "all-empty": [[0, 0, 0], [0, 0, 0], [0, 0, 0]],
    "two-ranks": [[9, 2], [0, 13]],
}


@pytest.mark.parametrize("name", sorted(ALL_TO_ALL_SPLITS))
def test_all_to_all_routes_each_piece_to_its_rank_in_source_order(name: str) -> None:
    splits = ALL_TO_ALL_SPLITS[name]
    world = len(splits)
    data = [payload(r, sum(splits[r]), 7) for r in range(world)]
    expected = all_to_all_expected(splits, data)
    for seed in range(4):
        t = table(world)
        got = Results(world)
        per_rank = [
            byte_chunks(r, key_of(CollectiveKind.ALL_TO_ALL, splits=splits[r]), data[r]) for r in range(world)
        ]
        got.take(run_interleaved(t, per_rank, seed))
        assert [got.of(r) for r in range(world)] == expected
        assert not t.has_pending() and all(t.buffered_bytes(r) == 0 for r in range(world))


def test_no_all_to_all_result_is_complete_before_every_contribution_arrived() -> None:
    splits = [[3, 6], [1, 10]]
    data = [payload(r, sum(splits[r])) for r in range(2)]
    chunks = [byte_chunks(r, key_of(CollectiveKind.ALL_TO_ALL, splits=splits[r]), data[r]) for r in range(2)]
    t = table(2)
    got = Results(2)
    last = chunks[1].pop()
    for c in itertools.chain(*chunks):
        got.take(t.contribute(c))
        assert not got.complete(0) and not got.complete(1)
    got.take(t.contribute(last))
    assert [got.of(0), got.of(1)] == all_to_all_expected(splits, data)


def test_a_gather_size_that_differs_fails_the_operation_naming_the_rank_and_both_sizes() -> None:
    key = key_of(CollectiveKind.ALL_GATHER)
    t = table(3)
    t.contribute(byte_chunks(0, key, payload(0, 8))[0])
    out = t.contribute(byte_chunks(2, key, payload(2, 6))[0])
    [(to, culprit), (to_others, others)] = sorted(errors(out), key=lambda e: e[1].code)
    assert {to, to_others} == {(2,), (0, 1)} and others.code == int(Status.ABORTED)
    assert culprit.step_failed and culprit.culprit_worker_id == 2
    message = culprit.message
    assert "worker 2" in message and "6" in message and "8" in message and "worker 0" in message
    assert not t.has_pending() and t.buffered_bytes(0) == 0


@pytest.mark.parametrize(
    ("first", "second", "words"),
    [
        (key_of(CollectiveKind.ALL_GATHER), key_of(CollectiveKind.BROADCAST), "BROADCAST"),
        (key_of(CollectiveKind.BROADCAST, root=0), key_of(CollectiveKind.BROADCAST, root=1), "from rank 1"),
    ],
    ids=["kind", "root"],
)
def test_a_kind_or_root_that_differs_fails_the_operation_naming_the_rank(
    first: TensorKey, second: TensorKey, words: str
) -> None:
    t = table(2)
    t.contribute(byte_chunks(0, first, payload(0, 4))[0])
    out = t.contribute(byte_chunks(1, second, payload(0, 4))[0])
    errs = errors(out)
    culprit = next(e for to, e in errs if to == (1,))
    assert culprit.code == int(Status.INVALID_ARGUMENT) and "worker 1" in culprit.message
    assert words in culprit.message
    assert any(to == (0,) and e.code == int(Status.ABORTED) for to, e in errs)


@pytest.mark.parametrize(
    ("key", "data", "words"),
    [
        (key_of(CollectiveKind.BROADCAST, root=3), b"abc", "root 3 is not a rank of 3"),
        (key_of(CollectiveKind.ALL_TO_ALL, splits=[1, 2]), b"abc", "2 split_bytes, one per rank of 3"),
    ],
    ids=["root", "splits"],
)
def test_a_root_or_split_that_does_not_fit_the_world_fails_the_operation(
    key: TensorKey, data: bytes, words: str
) -> None:
    t = table(3)
    chunk = ChunkIn(1, key, ChunkHeader(DType.BYTES, len(data)), 0, data)
    [err] = [e for to, e in errors(t.contribute(chunk)) if to == (1,)]
    assert err.code == int(Status.INVALID_ARGUMENT) and err.step_failed and words in err.message
    assert "worker 1" in err.message


def test_a_reduce_scatter_not_divisible_by_the_ranks_fails_naming_it() -> None:
    key = key_of(CollectiveKind.REDUCE_SCATTER)
    t = table(3)
    out = t.contribute(float_chunks(2, key, floats(2, 7))[0])
    [err] = [e for to, e in errors(out) if to == (2,)]
    assert (
        err.code == int(Status.INVALID_ARGUMENT) and "7 elements" in err.message and "3 ranks" in err.message
    )


@pytest.mark.parametrize(
    "key",
    [
        key_of(CollectiveKind.ALL_GATHER),
        key_of(CollectiveKind.BROADCAST, root=0),
        key_of(CollectiveKind.ALL_TO_ALL, splits=[4, 4, 4]),
    ],
    ids=["all-gather", "broadcast", "all-to-all"],
)
def test_a_lost_rank_fails_the_operation_naming_it_and_frees_what_was_held(key: TensorKey) -> None:
    t = table(3)
    t.contribute(byte_chunks(0, key, payload(0, 12))[0])
    [(to, err)] = errors(t.worker_lost(2, "disconnected"))
    assert to == (0, 1) and err.code == int(Status.ABORTED) and err.step_failed
    assert "worker 2 disconnected" in err.message and err.culprit_worker_id == 2
    assert not t.has_pending() and t.buffered_bytes(0) == 0


def test_a_native_collective_without_every_rank_fails_naming_the_absent_one() -> None:
    t = ReductionTable(3, CHUNK, 10.0, lambda: 0.0, on_worker_loss="continue")
    t.worker_lost(2, "disconnected")
    out = t.contribute(byte_chunks(0, key_of(CollectiveKind.ALL_GATHER), payload(0, 4))[0])
    [err] = [e for to, e in errors(out) if to == (0,)]
    assert err.code == int(Status.ABORTED) and err.step_failed and "worker(s) 2" in err.message
    assert "needs every rank" in err.message and not t.has_pending()


def test_a_byte_chunk_sent_twice_is_refused_and_forwarded_once() -> None:
    key = key_of(CollectiveKind.ALL_GATHER)
    data = [payload(r, 6) for r in range(2)]
    t = table(2)
    first = byte_chunks(0, key, data[0])
    t.contribute(first[0])
    [(to, err)] = errors(t.contribute(ChunkIn(0, key, first[0].header, 0, b"zzzz")))
    assert to == (0,) and err.code == int(Status.INVALID_ARGUMENT) and "twice" in err.message
    got = Results(2)
    for c in first[1:] + byte_chunks(1, key, data[1]):
        got.take(t.contribute(c))
    assert got.of(0) == got.of(1) == b"".join(data)


def test_a_missing_broadcast_rank_is_named_at_the_step_timeout() -> None:
    now = [0.0]
    t = ReductionTable(3, CHUNK, 5.0, lambda: now[0])
    key = key_of(CollectiveKind.BROADCAST, root=0)
    for c in byte_chunks(0, key, payload(0, 9)) + byte_chunks(2, key, payload(0, 9)):
        t.contribute(c)
    now[0] = 6.0
    [(to, err)] = errors(t.expire())
    assert err.code == int(Status.DEADLINE_EXCEEDED) and "worker(s) 1" in err.message and to == (0, 1, 2)


def test_a_later_all_to_all_chunk_with_other_splits_fails_naming_both() -> None:
    t = table(2)
    first = byte_chunks(0, key_of(CollectiveKind.ALL_TO_ALL, splits=[4, 4]), payload(0, 8))
    second = byte_chunks(0, key_of(CollectiveKind.ALL_TO_ALL, splits=[2, 6]), payload(0, 8))
    t.contribute(first[0])
    [err] = [e for to, e in errors(t.contribute(second[1])) if to == (0,)]
    assert "split [2, 6]" in err.message and "split [4, 4]" in err.message


def test_partitioned_coordinators_refuse_the_native_kinds() -> None:
    from gradserver.common.partition_map import PartitionMap

    partition_map = PartitionMap.parse("a:1,b:2")
    t = ReductionTable(2, CHUNK, 10.0, lambda: 0.0, partition=(partition_map, 0))
    chunk = byte_chunks(0, key_of(CollectiveKind.ALL_GATHER), payload(0, 4))[0]
    [(to, err)] = errors(t.contribute(chunk))
    assert to == (0,) and err.code == int(Status.FAILED_PRECONDITION) and "ALL_GATHER" in err.message


# --- the codec ----------------------------------------------------------------------------------

LIMITS = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=1 << 20, world_size=3)


def test_the_new_key_fields_survive_the_wire() -> None:
    key = key_of(CollectiveKind.ALL_TO_ALL, splits=[1, 0, 3])
    chunk = ChunkIn(2, key, ChunkHeader(DType.BYTES, 4), 0, b"wxyz")
    decoded = codec.decode_worker_message(codec.encode_worker_event(chunk), LIMITS)
    assert isinstance(decoded, ChunkIn)
    assert decoded.key.collective_kind is CollectiveKind.ALL_TO_ALL and decoded.key.split_bytes == (1, 0, 3)
    assert decoded.header.dtype is DType.BYTES and bytes(decoded.data) == b"wxyz"
    out = AveragedChunkOut(key_of(CollectiveKind.BROADCAST, root=2), ChunkHeader(DType.BYTES, 3), 1, b"ab", 3)
    back = codec.decode_server_message(codec.encode_server_event(out))
    assert isinstance(back, AveragedChunkOut) and back.key.root == 2 and bytes(back.data) == b"ab"
    assert str(back.key) == "operation 0 collective BROADCAST from rank 2 of group 3"


EIGHT = b"abcdefgh"


@pytest.mark.parametrize(
    ("key", "dtype", "worker", "data", "words"),
    [
        (key_of(CollectiveKind.ALL_GATHER), DType.FLOAT32, 0, b"abcd", "dtype must be BYTES"),
        (key_of(CollectiveKind.REDUCE), DType.BYTES, 0, b"abcd", "BYTES is never reduced"),
        (key_of(CollectiveKind.REDUCE_SCATTER), DType.BYTES, 0, b"abcd", "BYTES is never reduced"),
        (key_of(CollectiveKind.BROADCAST, root=1), DType.BYTES, 0, b"ab", "header-only"),
        (key_of(CollectiveKind.BROADCAST, root=5), DType.BYTES, 5, b"ab", "root 5 is out of range"),
        (key_of(CollectiveKind.ALL_TO_ALL, splits=[1, 1]), DType.BYTES, 0, b"ab", "2 split_bytes"),
        (key_of(CollectiveKind.ALL_TO_ALL, splits=[1, 1, 1]), DType.BYTES, 0, b"ab", "sum to 3"),
        (key_of(CollectiveKind.ALL_GATHER, root=1), DType.BYTES, 0, b"ab", "only for BROADCAST"),
        (key_of(CollectiveKind.ALL_GATHER, splits=[1, 1, 0]), DType.BYTES, 0, b"ab", "only for ALL_TO_ALL"),
        (key_of(CollectiveKind.REDUCE, splits=[4, 4, 0]), DType.FLOAT32, 0, EIGHT, "only for ALL_TO_ALL"),
        (key_of(CollectiveKind.REDUCE_SCATTER, splits=[4, 2, 2]), DType.FLOAT32, 0, EIGHT, "multiples of 4"),
        (key_of(CollectiveKind.REDUCE_SCATTER, splits=[4, 4]), DType.FLOAT32, 0, EIGHT, "2 split_bytes"),
    ],
)
def test_the_decoder_refuses_a_collective_chunk_that_is_wrong_on_its_own(
    key: TensorKey, dtype: DType, worker: int, data: bytes, words: str
) -> None:
    chunk = ChunkIn(
        worker, key, ChunkHeader(dtype, len(data) // (4 if dtype is DType.FLOAT32 else 1)), 0, data
    )
    with pytest.raises(InvalidArgumentError, match=words):
        codec.decode_worker_message(codec.encode_worker_event(chunk), LIMITS)


def test_the_decoder_refuses_an_unknown_collective_kind() -> None:
    from gradserver.common._pb import gradient_server_pb2 as pb

    msg = pb.WorkerMessage(
        chunk=pb.GradientChunk(
            worker_id=0,
            key=pb.TensorKey(step=1, collective=pb.CollectiveKey(group=0, kind=9)),  # type: ignore[arg-type]
            dtype=pb.DTYPE_BYTES,
            total_elements=0,
            data=b"",
        )
    )
    with pytest.raises(InvalidArgumentError, match="unknown collective kind 9"):
        codec.decode_worker_message(msg.SerializeToString(), LIMITS)


# --- a real coordinator -------------------------------------------------------------------------

WIRE_CHUNK_BYTES = 64  # chunk_bytes: 16 elements (bytes, for DTYPE_BYTES) per chunk
WIRE_CHUNK = WIRE_CHUNK_BYTES // 4


def _wire_config(world: int, **overrides: Any) -> dict[str, Any]:
    return {"world_size": world, "chunk_mib": WIRE_CHUNK_BYTES / (1 << 20), **overrides}


def _join_raw(address: str, world: int) -> list[RawWorker]:
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        joined = list(pool.map(lambda i: raw.join(address, node_id=f"native-{i}"), range(world)))
    workers = sorted(
        (RawWorker(channel, accepted) for channel, accepted in joined), key=lambda w: w.worker_id
    )
    assert [w.worker_id for w in workers] == list(range(world))
    return workers


def _send(worker: RawWorker, key: TensorKey, data: bytes | np.ndarray) -> None:
    """Sends one contribution as a worker cuts it (floats for the reductions, else bytes)."""
    if isinstance(data, np.ndarray):
        worker.send_tensor(key, data)
        return
    for c in byte_chunks(worker.worker_id, key, data, WIRE_CHUNK):
        worker.send(c)


def _receive(worker: RawWorker, key: TensorKey) -> bytes:
    """This worker's whole result of `key` (its pieces, each byte exactly once)."""
    got = Results(1)
    while not got.complete(0):
        event = worker.recv(timeout=TEST_TIMEOUTS.receive)
        assert isinstance(event, AveragedChunkOut), f"worker {worker.worker_id} got {event!r}"
        assert event.key == key, f"worker {worker.worker_id} got a piece of {event.key}, not {key}"
        got.take([Outgoing((0,), event)])
    return got.of(0)


def _own_key(key: TensorKey, splits: list[list[int]], rank: int) -> TensorKey:
    """`key` as `rank` sends it: an ALL_TO_ALL carries that rank's own split_bytes."""
    if key.collective_kind is CollectiveKind.ALL_TO_ALL:
        return dataclasses.replace(key, split_bytes=tuple(splits[rank]))
    return key


def _traffic(server: ServerThread, world: int) -> list[Traffic]:
    return server.call(lambda s: [s.traffic(w) for w in range(world)])


Operation = tuple[TensorKey, list[bytes | np.ndarray], list[bytes]]


def _operations(world: int) -> tuple[list[Operation], list[list[int]]]:
    """Operations 0.. of one group: each key, what each rank sends, what each must receive;
    and the ALL_TO_ALL's split_bytes of each rank."""
    size = 3 * WIRE_CHUNK + 5  # several chunks, the last one short
    gathered = [payload(r, size, 1) for r in range(world)]
    root = world - 1
    broadcast = payload(root, size, 2)
    part = WIRE_CHUNK + 3  # a part that spans two chunks
    scattered = [floats(r, part * world, 3) for r in range(world)]
    exact = np.sum(np.stack([d.astype(np.float64) for d in scattered]), axis=0)  # rank order
    summed = exact.astype("<f4").tobytes()
    splits = [[(7 * r + 3 * d + 1) % 23 for d in range(world)] for r in range(world)]
    routed = [payload(r, sum(splits[r]), 4) for r in range(world)]

    def key(op: int, kind: CollectiveKind, **fields: Any) -> TensorKey:
        return TensorKey.collective(op, GROUP, ReduceOp.SUM, kind=kind, **fields)

    return [
        (key(0, CollectiveKind.ALL_GATHER), list(gathered), [b"".join(gathered)] * world),
        (key(1, CollectiveKind.BROADCAST, root=root), [broadcast] * world, [broadcast] * world),
        (
            key(2, CollectiveKind.REDUCE_SCATTER),
            list(scattered),
            [summed[r * part * 4 : (r + 1) * part * 4] for r in range(world)],
        ),
        (key(3, CollectiveKind.ALL_TO_ALL), list(routed), all_to_all_expected(splits, routed)),
    ], splits


@pytest.mark.parametrize("world", [2, 3])
def test_every_kind_over_grpc_gives_each_rank_its_bytes_and_costs_what_the_contract_bounds(
    coordinator, world: int
) -> None:
    server = coordinator(**_wire_config(world))
    workers = _join_raw(server.address, world)
    operations, splits = _operations(world)
    try:
        for key, inputs, expected in operations:
            before = _traffic(server, world)
            for rank, worker in enumerate(workers):
                _send(worker, _own_key(key, splits, rank), inputs[rank])
            got = [_receive(worker, key) for worker in workers]
            assert got == expected, f"{key}: a rank received other bytes"
            after = _traffic(server, world)
            for rank in range(world):
                received = after[rank].received_bytes - before[rank].received_bytes
                sent = after[rank].sent_bytes - before[rank].sent_bytes
                _check_bounds(key, rank, world, inputs, splits, received, sent)
    finally:
        for worker in workers:
            worker.close()


def _check_bounds(
    key: TensorKey,
    rank: int,
    world: int,
    inputs: list[bytes | np.ndarray],
    splits: list[list[int]],
    received: int,
    sent: int,
) -> None:
    """The contract's bytes-on-the-wire bounds (payload bytes, from the coordinator's counters)."""
    data = inputs[rank]
    size = data.nbytes if isinstance(data, np.ndarray) else len(data)
    kind = key.collective_kind
    what = f"rank {rank} of {key}: received {received}, sent {sent} for S = {size}"
    if kind is CollectiveKind.ALL_GATHER:
        assert received == size and sent == world * size, what
        assert received + sent <= 1.1 * (size + world * size), what
    elif kind is CollectiveKind.BROADCAST:
        assert received == (size if rank == key.root else 0) and sent == size, what
    elif kind is CollectiveKind.REDUCE_SCATTER:
        assert received == size and sent == size // world, what
        assert received + sent <= 1.1 * (size + size / world), what
    else:
        assert received == size and sent == sum(split[rank] for split in splits), what


def test_a_disagreeing_root_over_grpc_fails_the_operation_for_both_naming_the_rank(coordinator) -> None:
    server = coordinator(**_wire_config(2))
    workers = _join_raw(server.address, 2)
    try:
        data = payload(0, 20)
        _send(workers[0], key_of(CollectiveKind.BROADCAST, root=0), data)
        _send(workers[1], key_of(CollectiveKind.BROADCAST, root=1), data)
        got = [worker.recv_error() for worker in workers]
        # The streams race: whichever rank's chunk reached the table second is the one named.
        blamed = got[0].culprit_worker_id
        assert blamed in (0, 1) and got[1].culprit_worker_id == blamed
        assert got[blamed].code == int(Status.INVALID_ARGUMENT)
        assert got[1 - blamed].code == int(Status.ABORTED)
        for err in got:
            assert err.step_failed and f"worker {blamed}" in err.message
            assert "from rank 1" in err.message and "from rank 0" in err.message
    finally:
        for worker in workers:
            worker.close()


def test_a_rank_lost_during_an_all_gather_fails_it_for_the_others_naming_the_rank(coordinator) -> None:
    server = coordinator(**_wire_config(3))
    workers = _join_raw(server.address, 3)
    key = key_of(CollectiveKind.ALL_GATHER)
    try:
        # Rank 2 sends part of its bytes and leaves: its stream orders the chunk before the end,
        # so the operation is pending when the loss is heard, whatever the others' timing.
        workers[2].send(byte_chunks(2, key, payload(2, 40), WIRE_CHUNK)[0])
        workers[2].close()
        for worker in workers[:2]:
            _send(worker, key, payload(worker.worker_id, 40))
        for worker in workers[:2]:
            err = worker.recv_error()
            assert err.code == int(Status.ABORTED) and err.step_failed and err.culprit_worker_id == 2
            assert "worker 2" in err.message
    finally:
        for worker in workers[:2]:
            worker.close()


# --- shared-memory workers --------------------------------------------------------------------


class ShmRank:
    """A shared-memory worker driven at the link level: the worker library has no public call
    for the byte kinds yet (that is the coll-worker branch), so this sends chunks through its
    link (staged in the input arena) and records each result piece, read from the output arena."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self.link = client._link  # see the class docstring
        self.pieces: queue.Queue[tuple[AveragedChunkOut, bytes]] = queue.Queue()
        self.via_shm = 0
        self.link.payloads.received = self._record  # type: ignore[attr-defined]

    def _record(self, event: AveragedChunkOut) -> bool:
        """Takes every result piece instead of the link's ledger (nothing is awaited there)."""
        if event.shm is None:
            self.pieces.put((event, bytes(event.data)))
            return False
        self.via_shm += 1
        arenas = self.link.payloads.arenas  # type: ignore[attr-defined]
        try:
            self.pieces.put((event, arenas.average(event.shm).tobytes()))
        finally:
            arenas.release(event.shm)
        return False

    def send(self, key: TensorKey, data: bytes | np.ndarray) -> None:
        array = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        dtype = DType.FLOAT32 if isinstance(data, np.ndarray) else DType.BYTES
        header = ChunkHeader(dtype, array.size)
        if key.collective_kind is CollectiveKind.BROADCAST and self.client.worker_id != key.root:
            self.link.send_chunk(key, header, 0, array[:0], None)
            return
        for offset in range(0, max(1, array.size), WIRE_CHUNK):
            self.link.send_chunk(key, header, offset, array[offset : offset + WIRE_CHUNK], None)

    def receive(self) -> bytes:
        got = Results(1)
        while not got.complete(0):
            event, data = self.pieces.get(timeout=TEST_TIMEOUTS.receive)
            got.take([Outgoing((0,), dataclasses.replace(event, data=data, shm=None))])
        return got.of(0)


@pytest.mark.skipif(not shm_support.supported(), reason="needs Linux memfd and fd passing")
@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_workers_get_the_same_bytes_through_the_arenas(
    coordinator, tmp_path, world: int
) -> None:
    server = coordinator(**_wire_config(world, shm_dir=str(tmp_path)))
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        clients = list(
            pool.map(
                lambda r: WorkerClient.connect(
                    server.address, node_id=f"shm-{r}", timeout=TEST_TIMEOUTS, rank=r, transport="shm"
                ),
                range(world),
            )
        )
    ranks = [ShmRank(c) for c in clients]
    # Whole float32 elements everywhere: the arena hands out 4-byte aligned float32 views.
    size = 3 * WIRE_CHUNK + 4
    gathered = [payload(r, size, 5) for r in range(world)]
    splits = [[4 * ((r + d) % 3) for d in range(world)] for r in range(world)]
    routed = [payload(r, sum(splits[r]), 6) for r in range(world)]
    part = WIRE_CHUNK + 2
    scattered = [floats(r, part * world, 7) for r in range(world)]
    summed = np.sum(np.stack([d.astype(np.float64) for d in scattered]), axis=0).astype("<f4").tobytes()
    operations: list[Operation] = [
        (key_of(CollectiveKind.ALL_GATHER), list(gathered), [b"".join(gathered)] * world),
        (
            TensorKey.collective(1, GROUP, kind=CollectiveKind.BROADCAST, root=1),
            [gathered[1]] * world,
            [gathered[1]] * world,
        ),
        (
            TensorKey.collective(2, GROUP, ReduceOp.SUM, kind=CollectiveKind.REDUCE_SCATTER),
            scattered,
            [summed[r * part * 4 : (r + 1) * part * 4] for r in range(world)],
        ),
        (
            TensorKey.collective(3, GROUP, kind=CollectiveKind.ALL_TO_ALL),
            routed,
            all_to_all_expected(splits, routed),
        ),
    ]
    try:
        for key, inputs, expected in operations:
            for rank in ranks:
                r = rank.client.worker_id
                rank.send(_own_key(key, splits, r), inputs[r])
            assert [rank.receive() for rank in ranks] == expected, f"{key}: a rank received other bytes"
        assert all(rank.via_shm for rank in ranks), "no result came through the output arena"
    finally:
        for c in clients:
            c.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("splits", "words"),
    [((4, 4), "one entry per worker (1)"), ((12,), "sum to the 8 float32 bytes sent")],
    ids=["a part per worker", "the parts sum to the input"],
)
def test_a_reduce_scatter_with_impossible_parts_is_refused_before_it_is_sent(
    coordinator: Any, splits: tuple[int, ...], words: str
) -> None:
    """The client checks uneven parts (`split_bytes`) as the coordinator would, naming the key."""
    server = coordinator(world_size=1)
    with WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS) as client:
        kind = CollectiveKind.REDUCE_SCATTER
        key = TensorKey.collective(0, GROUP, ReduceOp.SUM, kind=kind, split_bytes=splits)
        with pytest.raises(InvalidArgumentError, match=re.escape(words)) as refused:
            client.collective(key, np.ones(2, np.float32))
        assert "operation 0" in str(refused.value), refused.value
        right = dataclasses.replace(key, split_bytes=(8,))
        assert client.collective(right, np.ones(2, np.float32)).tolist() == [1.0, 1.0]
