"""What a failed step or a refused key leaves behind: the failure reaches every key of that step
(naming the step, the culprit and the key) and only that step, a refused key fails only its own
receive, and the next step gets its own averages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from gradserver.common import compute_block_sizes
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import AbortedError, InvalidArgumentError
from gradserver.common.messages import ChunkHeader, ChunkIn, DType, ErrorOut, JoinAccepted, TensorKey
from gradserver.worker import WorkerClient

from .helpers.raising import raised
from .helpers.raw import RawWorker, join
from .helpers.server import run_each

SIZES = compute_block_sizes(8, 4, 16)


def test_after_a_failed_step_the_next_step_gets_its_own_averages(workers) -> None:
    clients = workers(2)
    total = sum(SIZES)

    def work(c: WorkerClient) -> dict[str, Any]:
        poisoned = np.ones(total, np.float32)
        if c.worker_id == 1:
            poisoned[3] = np.inf
        c.send_block_gradient(0, 1, 2, poisoned, SIZES)
        c.send_block_gradient(0, 0, 2, np.ones(total, np.float32), SIZES)
        c.send_non_block_gradient(0, "final_norm", np.ones(16, np.float32))
        step0 = raised(c.receive_averaged_block)
        # Step 1 goes on: its block average comes back, not step 0's other block.
        c.send_block_gradient(1, 0, 1, np.full(total, c.worker_id + 1.0, np.float32), SIZES)
        block = c.receive_averaged_block()
        # Step 0's non-block key still reports step 0's failure, once, naming the culprit.
        stale = raised(c.receive_averaged_non_block)
        c.send_non_block_gradient(1, "final_norm", np.full(16, c.worker_id * 2.0, np.float32))
        non_block = c.receive_averaged_non_block()
        return {"step0": step0, "block": block, "stale": stale, "non_block": non_block}

    results = run_each(clients, work)
    for c, got in zip(clients, results, strict=True):
        expected = InvalidArgumentError if c.worker_id == 1 else AbortedError
        for error in (got["step0"], got["stale"]):
            assert isinstance(error, expected), error
            assert (error.step, error.worker_id, error.key) == (0, 1, "step 0 block 1 of 2"), error
        assert (got["block"].step, got["block"].block_idx) == (1, 0)
        np.testing.assert_array_equal(got["block"].gradients, 1.5)
        assert got["non_block"].step == 1
        np.testing.assert_array_equal(got["non_block"].gradients, 1.0)


def test_a_refused_key_fails_only_that_key_and_the_step_goes_on(workers) -> None:
    """An in-stream error that names a key (step not failed) fails that key's receive only."""
    clients = workers(2)
    sizes = compute_block_sizes(8, 4, 16)
    ones = np.ones(sum(sizes), np.float32)
    run_each(clients, lambda c: (c.send_block_gradient(0, 0, 2, ones, sizes), c.receive_averaged_block()))
    clients[0].send_block_gradient(0, 1, 2, ones, sizes)
    clients[0].send_block_gradient(0, 0, 2, ones, sizes)  # again: refused, the first copy counts
    clients[1].send_block_gradient(0, 1, 2, ones * 3, sizes)
    np.testing.assert_array_equal(clients[0].receive_averaged_block().gradients, 2.0)
    with pytest.raises(InvalidArgumentError, match="again after it was reduced") as info:
        clients[0].receive_averaged_block()
    assert (info.value.step, info.value.key) == (0, "step 0 block 0 of 2")
    assert clients[1].receive_averaged_block().block_idx == 1
    run_each(clients, lambda c: c.barrier(0, "commit"))


@pytest.fixture
def raw_pair(coordinator) -> Iterator[tuple[RawWorker, JoinAccepted]]:
    server = coordinator(world_size=1, heartbeat_timeout=60.0, chunk_mib=1 / 256, max_message_mib=1.0)
    raw = RawWorker(*join(server.address))
    try:
        yield raw, raw.accepted
    finally:
        raw.close()


def test_a_codec_rejection_carries_its_key(raw_pair) -> None:
    """An error about a chunk whose key could be parsed names that key, so the worker fails only
    that result instead of every pending one."""
    raw, _accepted = raw_pair
    key = TensorKey.non_block(3, NonBlockComponent.FINAL_NORM)
    header = ChunkHeader(DType.FLOAT32, 8, ())
    raw.send(ChunkIn(raw.worker_id, key, header, 3, np.ones(4, "<f4").tobytes()))  # not a boundary
    error = raw.recv_error()
    assert error.key == key and not error.step_failed and error.step == 3
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # A message whose key itself is bad still gets an error, without a key.
    raw.send_raw(b"\xff garbage")
    garbage = raw.recv_error()
    assert isinstance(garbage, ErrorOut) and garbage.key is None
