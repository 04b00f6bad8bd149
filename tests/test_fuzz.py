"""Property-based fuzzing of the wire decoder and the coordinator's reduction table: random and
mutated messages never crash them, never make them allocate by a declared size, and always end
in a result or a status code; the table's invariants hold after every event."""

from __future__ import annotations

import random

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradserver.common import codec
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import GradServerError
from gradserver.common.messages import (
    AveragedChunkOut,
    BarrierIn,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    HeartbeatIn,
    KeyKind,
    LeaveIn,
    SampleRangeRequestIn,
    SampleStats,
    TensorKey,
)
from gradserver.server.reduction import ReductionTable

CHUNK = 4
LIMITS = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=64, max_blocks=8)
STATUS_VALUES = {code.value[0] for code in grpc.StatusCode}
SIZES = (1, 1, 1, 1, 1, 1, 1, 2, 3)


def _valid_chunk(worker: int, step: int, which: int, offset_index: int, value: float) -> bytes:
    if which == 0:
        key, sizes, total, stats = TensorKey.block(step, 1, 3), SIZES, sum(SIZES), None
    elif which == 1:
        key, sizes, total, stats = TensorKey.non_block(step, NonBlockComponent.FINAL_NORM), (), 10, None
    else:
        key, sizes, total, stats = TensorKey.whole_model(step), (), 5, SampleStats(1.0, 1, 2)
    offset = min(offset_index * CHUNK, max(0, (total - 1) // CHUNK * CHUNK))
    length = min(CHUNK, total - offset)
    data = np.full(length, value, np.float32).tobytes()
    return codec.encode_worker_event(
        ChunkIn(worker, key, ChunkHeader(DType.FLOAT32, total, sizes), offset, data, stats)
    )


valid_messages = st.one_of(
    st.builds(
        _valid_chunk,
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 2),
        st.integers(0, 3),
        st.sampled_from([1.0, -2.5, 0.0, float("nan"), float("inf")]),
    ),
    st.builds(
        lambda w, s, n: codec.encode_worker_event(BarrierIn(w, s, n)),
        st.integers(0, 3),
        st.integers(0, 3),
        st.sampled_from(["", "a", "b"]),
    ),
    st.builds(
        lambda w, s, d, b: codec.encode_worker_event(SampleRangeRequestIn(w, s, d, b)),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 50),
        st.integers(0, 20),
    ),
    st.builds(lambda w: codec.encode_worker_event(HeartbeatIn(w, 1)), st.integers(0, 3)),
    st.just(codec.encode_worker_event(LeaveIn("bye"))),
)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    raw = bytearray(draw(valid_messages))
    for _ in range(draw(st.integers(0, 4))):
        action = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        if not raw:
            break
        at = draw(st.integers(0, len(raw) - 1))
        if action == "flip":
            raw[at] ^= draw(st.integers(1, 255))
        elif action == "truncate":
            del raw[at:]
        elif action == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[at]
    return bytes(raw)


def _decode(raw: bytes) -> object:
    try:
        return codec.decode_worker_message(raw, LIMITS)
    except GradServerError as exc:
        assert int(exc.code) in STATUS_VALUES and exc.message
        return exc


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=200), mutated()))
def test_decoder_never_crashes(raw: bytes) -> None:
    event = _decode(raw)
    if isinstance(event, ChunkIn):
        # Whatever was accepted is internally consistent and within the limits.
        assert event.header.total_elements <= LIMITS.max_tensor_elements
        assert len(event.data) // 4 <= CHUNK and event.offset % CHUNK == 0
        if event.key.kind is KeyKind.BLOCK:
            assert sum(event.header.component_sizes) == event.header.total_elements


def _check_invariants(table: ReductionTable, out: list, world: int) -> None:
    for item in out:
        assert all(0 <= w < world for w in item.to)
        if isinstance(item.event, ErrorOut):
            assert item.event.code in STATUS_VALUES and item.event.message
        if isinstance(item.event, AveragedChunkOut):
            assert len(item.event.data) // 4 <= CHUNK
    for w in range(world):
        assert table.buffered_bytes(w) >= 0
    if not table.has_pending():
        assert all(table.buffered_bytes(w) == 0 for w in range(world))
    _check_no_abandoned_step(table)


def _check_no_abandoned_step(table: ReductionTable) -> None:
    """No key or barrier stays pending once every worker that still owes it moved to a later
    step (steps only move forward, so it could only end at the step timeout)."""

    def moved_on(w: int, step: int) -> bool:
        known = table._worker_step[w]
        return known is not None and known > step

    for slot in table._pending.values():
        owing = slot.missing_workers()
        assert not owing or not all(moved_on(w, slot.key.step) for w in owing), (
            f"{slot.key} is pending, but every worker that owes it moved on: {owing}"
        )
    for bar in table._barriers.values():
        owing = sorted(bar.expected - bar.arrived)
        assert not owing or not all(moved_on(w, bar.step) for w in owing), (
            f"step {bar.step} barrier {bar.name!r} is pending, but every worker that owes it moved on"
        )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("msg"), st.integers(0, 2), st.one_of(valid_messages, mutated())),
            st.tuples(st.just("lost"), st.integers(0, 2), st.just(b"")),
            st.tuples(st.just("joined"), st.integers(0, 2), st.just(b"")),
            st.tuples(st.just("tick"), st.just(0), st.just(b"")),
        ),
        max_size=60,
    ),
    st.sampled_from(["abort", "continue"]),
)
def test_reduction_table_survives_any_sequence(events: list, policy: str) -> None:
    world = 3
    clock = [0.0]
    table = ReductionTable(world, CHUNK, 5.0, lambda: clock[0], on_worker_loss=policy)
    for kind, worker, raw in events:
        if kind == "lost":
            out = table.worker_lost(worker, "fuzzed away")
        elif kind == "joined":
            table.worker_joined(worker)
            out = []
        elif kind == "tick":
            clock[0] += 2.0
            out = table.expire()
        else:
            event = _decode(raw)
            if isinstance(event, ChunkIn) and event.worker_id == worker:
                # Some chunks as if lent from shared memory: the budget's counts must still balance.
                out = table.contribute(event, borrowed=len(raw) % 3 == 0)
            elif isinstance(event, BarrierIn) and event.worker_id == worker:
                out = table.barrier(event)
            elif isinstance(event, SampleRangeRequestIn) and event.worker_id == worker:
                out = table.sample_ranges(event)
            else:
                out = []
        _check_invariants(table, out, world)


def _whole_contribution(worker: int, step: int, which: int) -> list[ChunkIn]:
    chunks = []
    for index in range(3):
        event = _decode(_valid_chunk(worker, step, which, index, 1.0))
        assert isinstance(event, ChunkIn)
        if all(c.offset != event.offset for c in chunks):
            chunks.append(event)
    return chunks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("key"), st.integers(0, 1), st.integers(0, 2), st.integers(0, 2)),
            st.tuples(st.just("barrier"), st.integers(0, 1), st.integers(0, 2), st.integers(0, 1)),
            st.tuples(st.just("lost"), st.integers(0, 1), st.just(0), st.just(0)),
            st.tuples(st.just("joined"), st.integers(0, 1), st.just(0), st.just(0)),
        ),
        max_size=40,
    ),
    st.sampled_from(["abort", "continue"]),
)
def test_no_step_stays_pending_after_its_contributors_moved_on(events: list, policy: str) -> None:
    """Well-formed whole contributions in any order of workers, steps and keys: whatever is
    still pending is owed by a worker that has not moved past its step."""
    table = ReductionTable(2, CHUNK, 300.0, lambda: 0.0, on_worker_loss=policy)
    for kind, worker, step, which in events:
        out: list = []
        if kind == "key":
            for chunk in _whole_contribution(worker, step, which):
                out += table.contribute(chunk)
        elif kind == "barrier":
            out = table.barrier(BarrierIn(worker, step, "ab"[which]))
        elif kind == "lost":
            out = table.worker_lost(worker, "fuzzed away")
        else:
            table.worker_joined(worker)
        _check_invariants(table, out, 2)


def test_a_live_coordinator_answers_garbage_with_status_codes(coordinator) -> None:
    """Seeded random and mutated bytes at a real coordinator: every message gets an answer or is
    absorbed, the stream survives, and a valid exchange still works afterwards."""
    from .helpers.raw import RawWorker, join

    server = coordinator(world_size=1, heartbeat_timeout=60.0, chunk_mib=1 / 1024, max_message_mib=1.0)
    raw = RawWorker(*join(server.address))
    rng = random.Random(1234)
    try:
        sent = 0
        for _ in range(200):
            base = bytearray(codec.encode_worker_event(BarrierIn(raw.worker_id, rng.randrange(3), "x")))
            if rng.random() < 0.5:
                base = bytearray(rng.randbytes(rng.randrange(1, 64)))
            else:
                for _ in range(rng.randrange(1, 4)):
                    base[rng.randrange(len(base))] ^= rng.randrange(1, 256)
            if isinstance(_decode(bytes(base)), LeaveIn):
                continue  # a valid goodbye would (rightly) end the stream
            raw.send_raw(bytes(base))
            sent += 1
        final = 10**12  # above any step a mutation can produce
        raw.send_tensor(
            TensorKey.non_block(final, NonBlockComponent.FINAL_NORM), np.arange(6, dtype=np.float32)
        )
        while True:
            event = raw.recv(20)
            assert not isinstance(event, grpc.RpcError), f"stream ended: {event}"
            if isinstance(event, ErrorOut):
                assert event.code in STATUS_VALUES
            if isinstance(event, AveragedChunkOut) and event.key.step == final:
                break
        assert sent > 150
    finally:
        raw.close()
