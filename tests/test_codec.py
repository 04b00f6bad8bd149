"""Unit tests of the wire codec and chunking: round trips, the single-copy payload path, and
validation of everything one message can be judged on."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from gradserver.common import codec, collective_rules
from gradserver.common._pb import gradient_server_pb2 as pb
from gradserver.common.chunking import chunk_spans
from gradserver.common.components import NonBlockComponent, compute_block_sizes
from gradserver.common.errors import InternalError, InvalidArgumentError, ResourceExhaustedError
from gradserver.common.messages import (
    AveragedChunkOut,
    BarrierIn,
    BarrierReleaseOut,
    ChunkHeader,
    ChunkIn,
    CollectiveKind,
    DType,
    ErrorOut,
    HeartbeatAckOut,
    HeartbeatIn,
    JoinRequestIn,
    LeaveIn,
    PeerDeliveredOut,
    PeerPiece,
    SampleRange,
    SampleRangeAssignmentOut,
    SampleRangeRequestIn,
    SampleStats,
    ShmRef,
    ShutdownOut,
    TensorKey,
)

CHUNK = 1000
LIMITS = codec.WireLimits(chunk_elements=CHUNK, max_tensor_elements=10**9)
SIZES = compute_block_sizes(8, 4, 16)


@pytest.mark.parametrize("total", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 7 * CHUNK + 123])
def test_chunk_and_reassemble_round_trip(total: int) -> None:
    data = np.random.default_rng(total).standard_normal(total).astype(np.float32)
    key = TensorKey.non_block(3, NonBlockComponent.LM_HEAD)
    out = np.empty(total, np.float32)
    spans = list(chunk_spans(total, CHUNK))
    assert spans[0][0] == 0 and sum(n for _, n in spans) == total
    for offset, n in spans:
        raw = codec.encode_worker_event(
            ChunkIn(
                2, key, ChunkHeader(DType.FLOAT32, total, ()), offset, memoryview(data[offset : offset + n])
            )
        )
        event = codec.decode_worker_message(raw, LIMITS)
        assert isinstance(event, ChunkIn) and event.key == key and event.offset == offset
        out[offset : offset + n] = np.frombuffer(event.data, "<f4")
    assert out.tobytes() == data.tobytes()


def test_random_sizes_round_trip() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        total = int(rng.integers(0, 5 * CHUNK))
        assert sum(n for _, n in chunk_spans(total, CHUNK)) == total


def test_single_copy_payload_encoding_is_standard_protobuf() -> None:
    data = np.arange(10, dtype=np.float32)
    event = ChunkIn(
        1,
        TensorKey.block(4, 2, 3),
        ChunkHeader(DType.FLOAT32, 10, (1, 1, 1, 1, 1, 1, 1, 1, 2)),
        0,
        memoryview(data),
    )
    parsed = pb.WorkerMessage.FromString(codec.encode_worker_event(event))
    assert parsed.chunk.data == data.tobytes()
    assert parsed.chunk.key.block.block_idx == 2 and parsed.chunk.worker_id == 1
    reference = pb.WorkerMessage()
    reference.CopyFrom(parsed)
    assert pb.WorkerMessage.FromString(reference.SerializeToString()) == parsed


@pytest.mark.parametrize(
    "event",
    [
        AveragedChunkOut(
            TensorKey.whole_model(9),
            ChunkHeader(DType.FLOAT32, 2, ()),
            0,
            np.ones(2, np.float32).tobytes(),
            3,
            SampleStats(1.5, 2, 4),
        ),
        AveragedChunkOut(
            TensorKey.block(1, 0, 2),
            ChunkHeader(DType.FLOAT32, sum(SIZES), SIZES),
            0,
            b"\0" * 4 * sum(SIZES),
            2,
        ),
        BarrierReleaseOut(4, "epoch"),
        SampleRangeAssignmentOut(3, 1, (SampleRange(1, 10, 3), SampleRange(0, 4, 3))),
        HeartbeatAckOut(12),
        ShutdownOut("bye"),
        ErrorOut(
            10, "step 3 aborted", 3, TensorKey.non_block(3, NonBlockComponent.EMBEDDING), 1, step_failed=True
        ),
        ErrorOut(3, "bad barrier", 2, barrier_name="x"),
        ErrorOut(3, "bad sample ranges", 2, sample_range_step=2),
    ],
)
def test_server_events_round_trip(event) -> None:
    decoded = codec.decode_server_message(codec.encode_server_event(event))
    if isinstance(event, AveragedChunkOut):
        assert bytes(decoded.data) == bytes(event.data)
        decoded = type(decoded)(**{**decoded.__dict__, "data": event.data})
    assert decoded == event


@pytest.mark.parametrize(
    "event",
    [BarrierIn(1, 2, "sync"), SampleRangeRequestIn(0, 5, 100, 4), HeartbeatIn(2, 7), LeaveIn("done")],
)
def test_worker_events_round_trip(event) -> None:
    assert codec.decode_worker_message(codec.encode_worker_event(event), LIMITS) == event


def _chunk(**fields) -> bytes:
    base = {
        "worker_id": 1,
        "key": pb.TensorKey(step=4, non_block=0),
        "dtype": pb.DTYPE_FLOAT32,
        "total_elements": 4,
        "offset": 0,
        "data": b"\0" * 16,
    }
    base.update(fields)
    return pb.WorkerMessage(chunk=pb.GradientChunk(**base)).SerializeToString()


@pytest.mark.parametrize(
    ("raw", "error", "text"),
    [
        (b"\x0a\xff\xff", InvalidArgumentError, "malformed WorkerMessage"),
        (pb.WorkerMessage().SerializeToString(), InvalidArgumentError, "carries no message kind"),
        (_chunk(key=pb.TensorKey(step=4)), InvalidArgumentError, "key names no tensor kind"),
        (
            _chunk(key=pb.TensorKey(step=4, non_block=5)),
            InvalidArgumentError,
            "unknown non-block component 5",
        ),
        (
            _chunk(key=pb.TensorKey(step=4, block=pb.BlockKey(block_idx=3, num_blocks=3))),
            InvalidArgumentError,
            "block_idx 3 is out of range for num_blocks 3",
        ),
        (
            _chunk(key=pb.TensorKey(step=4, block=pb.BlockKey(block_idx=0, num_blocks=70000))),
            InvalidArgumentError,
            "num_blocks 70000 exceeds the limit",
        ),
        # 16 bytes are 8 float16 elements: lengths are checked per item size.
        (_chunk(dtype=pb.DTYPE_FLOAT16), InvalidArgumentError, "holds 8 elements, expected 4"),
        (_chunk(dtype=pb.DTYPE_BFLOAT16, data=b"\0" * 7), InvalidArgumentError, "whole number of bfloat16"),
        (_chunk(dtype=9), InvalidArgumentError, "unknown dtype 9"),
        (_chunk(total_elements=2**40), ResourceExhaustedError, "declared 1099511627776 elements"),
        (_chunk(data=b"\0" * 12), InvalidArgumentError, "holds 3 elements, expected 4"),
        (_chunk(total_elements=3000, offset=500, data=b"\0" * 16), InvalidArgumentError, "not a multiple"),
        (
            _chunk(total_elements=3000, data=b"\0" * 4 * (CHUNK + 1)),
            ResourceExhaustedError,
            "exceeds the chunk size",
        ),
        (_chunk(component_sizes=[4]), InvalidArgumentError, "only for block keys"),
        (
            _chunk(
                key=pb.TensorKey(step=4, block=pb.BlockKey(block_idx=0, num_blocks=1)),
                component_sizes=[1] * 9,
                total_elements=4,
            ),
            InvalidArgumentError,
            r"data length 4 != sum(component_sizes) 9",
        ),
        (
            pb.WorkerMessage(
                chunk=pb.GradientChunk(
                    worker_id=1,
                    key=pb.TensorKey(step=4, non_block=0),
                    dtype=pb.DTYPE_FLOAT32,
                    total_elements=4,
                    shm=pb.SharedMemoryRef(name="x"),
                )
            ).SerializeToString(),
            InvalidArgumentError,
            "shared-memory payload",
        ),
        (
            _chunk(key=pb.TensorKey(step=4, whole_model=pb.WholeModelKey())),
            InvalidArgumentError,
            "must carry sample stats",
        ),
        (
            _chunk(stats=pb.SampleStats(loss=1.0, correct=1, total=1)),
            InvalidArgumentError,
            "only for whole-model keys",
        ),
        (
            _chunk(
                key=pb.TensorKey(step=4, whole_model=pb.WholeModelKey()),
                stats=pb.SampleStats(loss=float("nan"), correct=1, total=1),
            ),
            InvalidArgumentError,
            "loss must be finite",
        ),
        (
            pb.WorkerMessage(
                sample_range_request=pb.SampleRangeRequest(worker_id=0, step=1)
            ).SerializeToString(),
            InvalidArgumentError,
            "positive dataset_size",
        ),
    ],
)
def test_decoder_rejects_with_a_named_reason(raw: bytes, error: type, text: str) -> None:
    with pytest.raises(error) as info:
        codec.decode_worker_message(raw, LIMITS)
    assert text in info.value.message


@pytest.mark.parametrize("world", [0, 3])
def test_a_collective_key_is_refused_exactly_where_the_rules_of_collectives_say(world: int) -> None:
    limits = dataclasses.replace(LIMITS, world_size=world)
    for kind, root, splits in itertools.product(CollectiveKind, (0, 1, 3), ((), (4,), (4, 8, 12), (2, 4, 4))):
        moves_bytes = kind in (CollectiveKind.ALL_GATHER, CollectiveKind.BROADCAST, CollectiveKind.ALL_TO_ALL)
        # A chunk right in every other way: from the root, of a total its splits sum to.
        total = sum(splits) if kind is CollectiveKind.ALL_TO_ALL else 12
        raw = _chunk(
            worker_id=root,
            key=pb.TensorKey(
                step=9, collective=pb.CollectiveKey(group=2, kind=int(kind), root=root, split_bytes=splits)
            ),
            dtype=pb.DTYPE_BYTES if moves_bytes else pb.DTYPE_FLOAT32,
            total_elements=total,
            data=b"\0" * (total if moves_bytes else 4 * total),
        )
        problem = collective_rules.key_problem(kind, root, splits, world)
        if problem is None:
            key = codec.decode_worker_message(raw, limits).key
            assert (key.collective_kind, key.root, key.split_bytes) == (kind, root, splits)
        else:
            with pytest.raises(InvalidArgumentError) as info:
                codec.decode_worker_message(raw, limits)
            assert info.value.message == f"worker {root}, operation 9 of group 2: {problem}"


def test_chunk_key_reads_the_key_of_a_refused_chunk() -> None:
    raw = _chunk(data=b"\0" * 12)
    with pytest.raises(InvalidArgumentError):
        codec.decode_worker_message(raw, LIMITS)
    assert codec.chunk_key(raw) == TensorKey.non_block(4, NonBlockComponent.LM_HEAD)
    assert codec.chunk_key(codec.encode_worker_event(HeartbeatIn(2, 7))) is None
    assert codec.chunk_key(b"\xff\xff") is None


def test_chunk_errors_name_worker_step_and_key() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        codec.decode_worker_message(_chunk(data=b"\0" * 12), LIMITS)
    assert info.value.message.startswith("worker 1, step 4 non-block LM_HEAD")
    assert (info.value.step, info.value.worker_id) == (4, 1)


@pytest.mark.parametrize("name", ["in", "inout", "out", "x"])
def test_a_chunk_names_its_senders_arena_and_an_average_the_output_or_the_recipients(name: str) -> None:
    """Chunks lie in the sender's input arena ("in"; "inout": the average is wanted over them),
    averages in the output arena ("out") or over the recipient's own "inout" chunk ("in"); any
    other name is refused with the names allowed."""
    key = TensorKey.non_block(4, NonBlockComponent.LM_HEAD)
    header = ChunkHeader(DType.FLOAT32, 4, ())
    chunk = ChunkIn(1, key, header, 0, b"", None, ShmRef(name, 64, 16))
    average = AveragedChunkOut(key, header, 0, b"", 2, shm=ShmRef(name, 64, 16))
    raw_chunk, raw_average = codec.encode_worker_event(chunk), codec.encode_server_event(average)
    if name in ("in", "inout"):
        assert codec.decode_worker_message(raw_chunk, LIMITS).shm == ShmRef(name, 64, 16)
    else:
        with pytest.raises(InvalidArgumentError, match="only 'in' or 'inout' is allowed"):
            codec.decode_worker_message(raw_chunk, LIMITS)
    if name in ("out", "in"):
        assert codec.decode_server_message(raw_average).shm == ShmRef(name, 64, 16)
    else:
        with pytest.raises(InternalError, match="only 'out' or 'in' is allowed"):
            codec.decode_server_message(raw_average)


@pytest.mark.parametrize("shared_memory", [False, True])
def test_a_join_request_says_whether_the_worker_sends_through_shared_memory(shared_memory: bool) -> None:
    request = JoinRequestIn(
        "node", 1, "cpu", codec.PROTOCOL_VERSION, 7, {"model": "m"}, rank=1, shared_memory=shared_memory
    )
    assert codec.decode_join_request(codec.encode_join_request(request)) == request
    # An older worker's request (no field): not shared memory, so the job's chunks fit its gRPC.
    old = pb.JoinRequest(node_id="node", protocol_version=codec.PROTOCOL_VERSION).SerializeToString()
    assert codec.decode_join_request(old).shared_memory is False


def test_a_join_request_carries_the_measured_link_and_partition_0s_chunk_size() -> None:
    request = JoinRequestIn(
        "node",
        1,
        "cpu",
        codec.PROTOCOL_VERSION,
        rank=1,
        partition_index=2,
        link_bytes_per_s=25_000_000,
        job_chunk_bytes=1 << 17,
        wire_dtype=DType.BFLOAT16,
    )
    assert codec.decode_join_request(codec.encode_join_request(request)) == request
    # An older worker's request: nothing measured, nothing brought.
    old = codec.decode_join_request(
        pb.JoinRequest(node_id="node", protocol_version=codec.PROTOCOL_VERSION).SerializeToString()
    )
    assert (old.link_bytes_per_s, old.job_chunk_bytes, old.wire_dtype) == (0, 0, DType.FLOAT32)
    for bad, why in ((pb.DTYPE_BYTES, "dtype BYTES is never reduced"), (9, "unknown dtype 9")):
        raw = pb.JoinRequest(node_id="n", protocol_version=codec.PROTOCOL_VERSION, wire_dtype=bad)
        with pytest.raises(InvalidArgumentError, match=f"node 'n': wire_dtype: {why}"):
            codec.decode_join_request(raw.SerializeToString())


def test_a_link_probe_says_its_size_and_one_above_the_limit_is_refused() -> None:
    assert codec.decode_link_probe(codec.encode_link_probe(0)) == 0
    assert codec.decode_link_probe(codec.encode_link_probe(512 * 1024)) == 512 * 1024
    with pytest.raises(InvalidArgumentError, match=f"exceed the limit of {codec.MAX_PROBE_BYTES}"):
        codec.decode_link_probe(codec.encode_link_probe(codec.MAX_PROBE_BYTES + 1))
    with pytest.raises(InvalidArgumentError, match="malformed LinkProbe"):
        codec.decode_link_probe(b"\xff\xff")


# --- point-to-point pieces ---------------------------------------------------------------------


def test_point_to_point_pieces_and_notices_round_trip_with_their_payload() -> None:
    piece = PeerPiece(2, -7, 5, 3 * CHUNK * 4, CHUNK * 4, bytes(range(256)) * 15)
    got = codec.decode_worker_message(codec.encode_worker_event(piece), LIMITS)
    assert isinstance(got, PeerPiece) and (got.peer, got.tag, got.sequence) == (2, -7, 5)
    assert (got.total_bytes, got.offset, bytes(got.data)) == (piece.total_bytes, piece.offset, piece.data)
    relayed = codec.decode_server_message(codec.encode_server_event(piece))
    assert isinstance(relayed, PeerPiece) and bytes(relayed.data) == piece.data
    notice = PeerDeliveredOut(2, 5, 4000)
    assert codec.decode_server_message(codec.encode_server_event(notice)) == notice
    empty = PeerPiece(1, 0, 0, 0, 0, b"")
    got = codec.decode_worker_message(codec.encode_worker_event(empty), LIMITS)
    assert isinstance(got, PeerPiece) and got.total_bytes == 0 and not got.data


@pytest.mark.parametrize(
    ("piece", "words"),
    [
        (PeerPiece(1, 0, 3, 8 * 10**9 + 1, 0, b"x"), "more than the largest message of 8000000000"),
        (PeerPiece(1, 0, 3, 10 * CHUNK * 4, 0, bytes(CHUNK * 4 + 1)), "more than a chunk"),
        (PeerPiece(1, 0, 3, 10, 8, b"abc"), "piece of 3 bytes at offset 8 of 10"),
        (PeerPiece(1, 0, 3, 10, 0, b""), "piece of 0 bytes at offset 0 of 10"),
    ],
    ids=["too large a message", "too large a piece", "beyond its message", "empty piece of a message"],
)
def test_a_point_to_point_piece_that_cannot_be_right_is_refused_naming_it(
    piece: PeerPiece, words: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=words) as refused:
        codec.decode_worker_message(codec.encode_worker_event(piece), LIMITS)
    assert "point-to-point message 3 for worker 1 (tag 0)" in str(refused.value)


def test_a_relayed_piece_beyond_its_message_from_the_coordinator_is_an_internal_error() -> None:
    with pytest.raises(InternalError, match="beyond its message"):
        codec.decode_server_message(codec.encode_server_event(PeerPiece(0, 0, 1, 2, 1, b"ab")))
