"""Bad input from a buggy or hostile worker: each case gets a clear error naming what was wrong,
nothing already accepted is lost, the coordinator stays up, and the next step works afterwards.

Each test pairs one WorkerClient (worker 0 or 1) with a RawWorker, which sends what a buggy or
hostile worker would and sees the coordinator's answers directly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest

from gradserver.common.components import NonBlockComponent, compute_block_sizes
from gradserver.common.errors import (
    AbortedError,
    FailedPreconditionError,
    ResourceExhaustedError,
)
from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    TensorKey,
)
from gradserver.worker import WorkerClient

from .helpers.logwait import log_waiter
from .helpers.raw import RawWorker, client_and_raw
from .helpers.server import TEST_TIMEOUTS, ServerThread, wait_pending

SIZES = compute_block_sizes(8, 4, 16)
TOTAL = sum(SIZES)
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
ABORTED = grpc.StatusCode.ABORTED.value[0]
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@pytest.fixture
def pair(coordinator: Callable[..., ServerThread]) -> Iterator[tuple[WorkerClient, RawWorker, ServerThread]]:
    server = coordinator(world_size=2, heartbeat_timeout=60.0, chunk_mib=1 / 256, max_message_mib=1.0)
    client, raw = client_and_raw(server.address, node_id="good")
    try:
        yield client, raw, server
    finally:
        client.close()
        raw.close()


def block_key(step: int, idx: int = 0, num: int = 2) -> TensorKey:
    return TensorKey.block(step, idx, num)


def ones(value: float = 1.0, n: int = TOTAL) -> np.ndarray:
    return np.full(n, value, np.float32)


def raw_average(raw: RawWorker, timeout: float = 10.0) -> np.ndarray:
    """Assembles the next averaged tensor the raw worker receives."""
    parts: dict[int, bytes] = {}
    total = None
    while total is None or sum(len(p) // 4 for p in parts.values()) < total:
        event = raw.recv(timeout)
        if isinstance(event, ErrorOut):
            raise AssertionError(f"unexpected error: {event.message}")
        if isinstance(event, AveragedChunkOut):
            total = event.header.total_elements
            parts[event.offset] = bytes(event.data)
            if total == 0:
                break
    return np.frombuffer(b"".join(parts[k] for k in sorted(parts)), dtype="<f4")


def next_step_works(client: WorkerClient, raw: RawWorker, step: int) -> None:
    """Both workers complete a fresh step: the coordinator is still serving correctly."""
    client.send_block_gradient(step, 1, 2, ones(1.0), SIZES)
    raw.send_tensor(block_key(step, 1), ones(3.0), SIZES)
    np.testing.assert_array_equal(client.receive_averaged_block().gradients, ones(2.0))
    np.testing.assert_array_equal(raw_average(raw), ones(2.0))


def test_future_or_past_step_for_a_pending_key_is_refused_without_loss(pair) -> None:
    client, raw, server = pair
    client.send_block_gradient(5, 0, 2, ones(1.0), SIZES)
    wait_pending(server, 5)
    for wrong in (6, 4):
        raw.send_tensor(block_key(wrong), ones(9.0), SIZES)
        err = raw.recv_error()
        assert err.code == PRECONDITION and not err.step_failed
        assert f"worker {raw.worker_id} sent step {wrong} block 0 of 2" in err.message
        assert "being reduced at step 5" in err.message
    raw.send_tensor(block_key(5), ones(3.0), SIZES)  # the right step still completes
    np.testing.assert_array_equal(client.receive_averaged_block().gradients, ones(2.0))
    np.testing.assert_array_equal(raw_average(raw), ones(2.0))
    raw.send_tensor(block_key(5), ones(3.0), SIZES)  # replay after reduction
    assert "again after it was reduced" in raw.recv_error().message
    raw.send_tensor(block_key(3, 1), ones(3.0), SIZES)  # stale step
    assert raw.recv_error().code == PRECONDITION
    next_step_works(client, raw, 6)


@pytest.mark.parametrize(
    ("key", "sizes", "data", "match"),
    [
        (TensorKey.block(1, 2, 2), SIZES, ones(), "block_idx 2 is out of range for num_blocks 2"),
        (
            TensorKey(1, TensorKey.non_block(1, NonBlockComponent.LM_HEAD).kind, 7),
            (),
            ones(n=4),
            "unknown non-block component 7",
        ),
        (block_key(1), SIZES, ones(n=TOTAL - 1), r"data length \d+ != sum\(component_sizes\)"),
        (block_key(1), SIZES[:8], ones(n=sum(SIZES[:8])), "8 component_sizes, a block has 9"),
    ],
)
def test_malformed_keys_are_invalid_argument(pair, key, sizes, data, match) -> None:
    client, raw, _ = pair
    if "data length" in match:
        raw.send_tensor(key, data, sizes, total=TOTAL - 1)
    else:
        raw.send_tensor(key, data, sizes)
    err = raw.recv_error()
    assert err.code == INVALID
    assert f"worker {raw.worker_id}" in err.message
    assert __import__("re").search(match, err.message), err.message
    next_step_works(client, raw, 2)


def test_num_blocks_disagreement_fails_the_step_for_everyone(pair) -> None:
    client, raw, server = pair
    client.send_block_gradient(1, 0, 2, ones(), SIZES)
    wait_pending(server, 1)
    raw.send_tensor(TensorKey.block(1, 0, 3), ones(), SIZES)
    err = raw.recv_error()
    assert err.code == INVALID and err.step_failed
    assert "num_blocks 3" in err.message and "says 2" in err.message
    with pytest.raises(AbortedError, match=f"worker {raw.worker_id} sent step 1 block 0 of 3"):
        client.receive_averaged_block()
    next_step_works(client, raw, 2)


def test_component_sizes_disagreement_fails_the_step_for_everyone(pair) -> None:
    client, raw, server = pair
    client.send_block_gradient(1, 0, 2, ones(), SIZES)
    wait_pending(server, 1)
    other = (SIZES[0] - 1, SIZES[1] + 1, *SIZES[2:])
    raw.send_tensor(block_key(1), ones(), other)
    err = raw.recv_error()
    assert err.code == INVALID and err.step_failed
    assert "component_sizes" in err.message and f"worker {client.worker_id}'s" in err.message
    with pytest.raises(AbortedError, match="differ from"):
        client.receive_averaged_block()
    next_step_works(client, raw, 2)


def test_the_same_key_twice_is_refused_and_counted_once(pair) -> None:
    client, raw, _ = pair
    raw.send_tensor(block_key(1), ones(3.0), SIZES)
    raw.send_tensor(block_key(1), ones(100.0), SIZES)  # must not count
    err = raw.recv_error()
    assert err.code == INVALID and "twice" in err.message and not err.step_failed
    client.send_block_gradient(1, 0, 2, ones(1.0), SIZES)
    np.testing.assert_array_equal(client.receive_averaged_block().gradients, ones(2.0))
    np.testing.assert_array_equal(raw_average(raw), ones(2.0))
    next_step_works(client, raw, 2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_payload_halts_the_step_for_all(pair, bad: float) -> None:
    client, raw, _ = pair
    data = ones()
    data[17] = bad
    client.send_block_gradient(1, 0, 2, ones(), SIZES)
    client.send_non_block_gradient(1, NonBlockComponent.FINAL_NORM, ones(n=8))
    raw.send_tensor(block_key(1), data, SIZES)
    err = raw.recv_error()
    assert err.code == INVALID and err.step_failed
    assert f"worker {raw.worker_id} sent a non-finite value" in err.message
    assert "step 1 block 0 of 2" in err.message and "element 17" in err.message
    with pytest.raises(AbortedError, match=f"worker {raw.worker_id} sent a non-finite value"):
        client.receive_averaged_block()
    # The other key of the halted step fails too, and no partial average is handed out.
    with pytest.raises(AbortedError):
        client.receive_averaged_non_block()
    next_step_works(client, raw, 2)


def test_limits_are_checked_before_any_large_allocation(pair) -> None:
    client, raw, _ = pair
    chunk = raw.accepted.chunk_bytes // 4
    header = ChunkHeader(DType.FLOAT32, 2 * chunk, ())
    key = TensorKey.non_block(1, NonBlockComponent.LM_HEAD)
    raw.send(ChunkIn(raw.worker_id, key, header, 0, ones(n=chunk + 1).tobytes()))
    err = raw.recv_error()
    assert err.code == EXHAUSTED and "exceeds the chunk size" in err.message
    absurd = ChunkHeader(DType.FLOAT32, 2**40, ())
    raw.send(ChunkIn(raw.worker_id, key, absurd, 0, ones(n=4).tobytes()))
    err = raw.recv_error()
    assert err.code == EXHAUSTED and "1099511627776 elements" in err.message
    # 16 bytes of bfloat16 are 8 elements, not the 4 declared: lengths are checked per item size.
    for dtype, text in (
        (DType.BFLOAT16, "holds 8 elements, expected 4"),
        (DType.UNSPECIFIED, "dtype missing"),
    ):
        raw.send(ChunkIn(raw.worker_id, key, ChunkHeader(dtype, 4, ()), 0, ones(n=4).tobytes()))
        err = raw.recv_error()
        assert err.code == INVALID and text in err.message
    raw.send(ChunkIn(raw.worker_id, key, ChunkHeader(DType.FLOAT32, 4, ()), 0, b"\x00" * 15))
    assert "not a whole number of float32" in raw.recv_error().message
    raw.send_raw(b"\xff\xff\xff garbage")
    err = raw.recv_error()
    assert err.code == INVALID and "malformed WorkerMessage" in err.message
    next_step_works(client, raw, 2)


def test_a_message_above_the_transport_limit_is_resource_exhausted_naming_its_size(pair) -> None:
    """The others hear the reason too (it used to reach them as 'its stream was cancelled')."""
    _, raw, _ = pair
    with log_waiter() as logs:
        raw.send_raw(b"\x0a" + b"\x00" * (2 * 2**20))
        event = raw.recv(10)
        assert isinstance(event, grpc.RpcError)
        assert event.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        limit = rf"sent a message of 2097153 bytes, above the --max-message-mib limit of {2**20} bytes"
        assert re.search(limit, event.details() or ""), event.details()
        logs.wait_for(rf"worker {raw.worker_id} \(node 'raw'\) {limit}", timeout=10)


def test_a_message_far_above_the_limit_is_cut_by_grpc(pair) -> None:
    _, raw, _ = pair
    raw.send_raw(b"\x0a" + b"\x00" * (5 * 2**20))
    event = raw.recv(10)
    assert isinstance(event, grpc.RpcError)
    assert event.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_message_under_another_worker_id_is_refused(pair) -> None:
    client, raw, _ = pair
    raw.send_tensor(block_key(1), ones(), SIZES, worker_id=client.worker_id)
    err = raw.recv_error()
    assert err.code == PRECONDITION
    assert (
        f"names worker {client.worker_id}, but this stream belongs to worker {raw.worker_id}" in err.message
    )
    next_step_works(client, raw, 2)


def test_unknown_worker_or_session_cannot_open_a_stream(pair) -> None:
    client, raw, server = pair
    from gradserver.common.rpc import stream_metadata

    accepted = raw.accepted
    for metadata, text in (
        (stream_metadata(9, accepted.session_id, 1), "worker 9 is unknown"),
        (stream_metadata(accepted.worker_id, accepted.session_id + 1, accepted.member_token), "session"),
        (stream_metadata(accepted.worker_id, accepted.session_id, accepted.member_token + 1), "not a member"),
    ):
        channel = grpc.insecure_channel(server.address)
        intruder = RawWorker(channel, accepted, metadata=metadata)
        event = intruder.recv(10)
        assert isinstance(event, grpc.RpcError)
        assert event.code() == grpc.StatusCode.FAILED_PRECONDITION and text in (event.details() or "")
        intruder.close()
    next_step_works(client, raw, 2)


def test_joining_a_full_world_is_resource_exhausted(pair) -> None:
    client, raw, server = pair
    with pytest.raises(ResourceExhaustedError, match="the world is full \\(2 of 2 workers joined\\)"):
        WorkerClient.connect(server.address, node_id="late", timeout=TEST_TIMEOUTS)
    next_step_works(client, raw, 2)


def test_a_worker_that_moves_on_without_a_key_fails_that_step(pair) -> None:
    client, raw, server = pair
    client.send_block_gradient(1, 0, 2, ones(), SIZES)
    wait_pending(server, 1)
    raw.send_tensor(block_key(2, 1), ones(), SIZES)  # raw skipped block 0 of step 1
    err = raw.recv_error()
    assert err.code == PRECONDITION and err.step_failed and err.step == 1
    with pytest.raises(AbortedError, match=f"worker {raw.worker_id} moved on to step 2"):
        client.receive_averaged_block()
    client.send_block_gradient(2, 1, 2, ones(3.0), SIZES)
    np.testing.assert_array_equal(client.receive_averaged_block().gradients, ones(2.0))


def test_step_timeout_names_the_missing_worker(coordinator) -> None:
    server = coordinator(world_size=2, step_timeout=1.0, heartbeat_timeout=60.0)
    client, raw = client_and_raw(server.address)
    try:
        client.send_block_gradient(1, 0, 2, ones(), SIZES)
        with pytest.raises(
            TimeoutError, match=f"no complete contribution from worker\\(s\\) {raw.worker_id}"
        ):
            client.receive_averaged_block()
    finally:
        client.close()
        raw.close()


def test_failed_precondition_is_a_gradserver_error(pair) -> None:
    client, _, _ = pair
    with pytest.raises(FailedPreconditionError):
        client.receive_averaged_non_block()
