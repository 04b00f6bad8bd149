"""Regression tests for the coordinator defects of issue 10: stream clean-up after a failed
write, a monitor that survives its own failure, a graceful stop that returns as soon as the
streams end, a hung worker under back-pressure, and codec rejections that keep their key."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from gradserver.common import codec
from gradserver.common.components import NonBlockComponent
from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    JoinAccepted,
    TensorKey,
)
from gradserver.common.rpc import EXCHANGE_METHOD, stream_metadata
from gradserver.server import GradientServer

from .helpers.logwait import log_waiter
from .helpers.raw import RawWorker, join
from .helpers.server import connect_all, run_each

_END = object()
# Small chunks and a small in-flight budget: a worker that stops reading fills it quickly.
STALL_CONFIG: dict[str, Any] = {"chunk_mib": 1 / 16, "max_message_mib": 1.0, "max_inflight_mib": 1.0}


class StalledWorker:
    """Joins and sends chunks on its Exchange stream, but never reads what the coordinator sends
    back: its results pile up in the coordinator until HTTP/2 flow control stops the writes."""

    def __init__(self, address: str) -> None:
        self.channel, self.accepted = join(address, node_id="stalled")
        self._out: queue.Queue[bytes | object] = queue.Queue()
        metadata = stream_metadata(
            self.accepted.worker_id, self.accepted.session_id, self.accepted.member_token
        )
        self.call = self.channel.stream_stream(EXCHANGE_METHOD)(self._requests(), metadata=metadata)

    def _requests(self) -> Iterator[bytes]:
        while True:
            item = self._out.get()
            if item is _END:
                return
            assert isinstance(item, bytes)
            yield item

    def send_key(self, key: TensorKey, chunks: int) -> None:
        """Queues `chunks` full chunks of one key (the request thread sends them)."""
        elements = self.accepted.chunk_bytes // 4
        header = ChunkHeader(DType.FLOAT32, elements * chunks, ())
        piece = np.ones(elements, "<f4").tobytes()
        for index in range(chunks):
            event = ChunkIn(self.accepted.worker_id, key, header, index * elements, piece)
            self._out.put(codec.encode_worker_event(event))

    def close(self) -> None:
        self._out.put(_END)
        self.call.cancel()
        self.channel.close()


def _metric(server: GradientServer, name: str, labels: dict[str, str] | None = None) -> float:
    return server.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def test_a_cancelled_stream_with_unsent_results_frees_its_place(coordinator) -> None:
    """Item 1: the writer's failed write after a cancel must not skip the clean-up; before the
    fix the id stayed in the stream table and a replacement got 'already has an Exchange stream
    open'."""
    server = coordinator(world_size=1, heartbeat_timeout=60.0, drain_timeout=30.0, **STALL_CONFIG)
    with log_waiter() as logs:
        stalled = StalledWorker(server.address)
        try:
            stalled.send_key(TensorKey.non_block(0, NonBlockComponent.LM_HEAD), 256)
            logs.wait_for(r"holding back worker 0's stream")
        finally:
            stalled.close()
        logs.wait_for(r"worker 0 \(node 'stalled'\) disconnected \(its stream was cancelled\)")
        replacement = RawWorker(*join(server.address, node_id="replacement"))
        try:
            assert replacement.worker_id == 0
            key = TensorKey.non_block(0, NonBlockComponent.FINAL_NORM)
            replacement.send_tensor(key, np.arange(4, dtype=np.float32))
            while True:
                event = replacement.recv(20)
                assert not isinstance(event, grpc.RpcError), f"{event.code()}: {event.details()}"
                if isinstance(event, AveragedChunkOut):
                    break
        finally:
            replacement.close()


def test_a_failing_monitor_is_restarted_and_eviction_goes_on(coordinator) -> None:
    """Item 1: one exception in the monitor used to end heartbeat eviction for good."""
    server = coordinator(world_size=1, heartbeat_timeout=2.0)
    with log_waiter() as logs:
        silent = RawWorker(*join(server.address, node_id="silent"))  # sends no heartbeat
        try:

            def break_expiry_once(s: GradientServer) -> None:
                original = s._table.expire
                calls = [0]

                def expire() -> list:
                    calls[0] += 1
                    if calls[0] == 1:
                        raise RuntimeError("injected monitor failure")
                    return original()

                s._table.expire = expire  # type: ignore[method-assign]

            server.call(break_expiry_once)
            logs.wait_for(r"worker 0 \(node 'silent'\) lost: no message for", timeout=30)
            assert logs.matching(r"liveness monitor failed")
        finally:
            silent.close()


def test_graceful_stop_returns_when_the_streams_end_and_loses_nobody(coordinator, caplog) -> None:
    """Item 5: a stop with connected workers waited the whole drain timeout and counted every
    worker as lost (with a WARNING)."""
    caplog.set_level(logging.INFO)
    server = coordinator(world_size=2, drain_timeout=30.0, heartbeat_timeout=60.0)
    clients = connect_all(server.address, 2)
    try:
        run_each(clients, lambda c: c.barrier(0, "ready"))
        started = time.monotonic()
        server.stop(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        for client in clients:
            client.close()
    assert elapsed < 10.0, f"stop took {elapsed:.1f} s with a drain timeout of 30 s"
    assert _metric(server.server, "gradserver_workers_lost_total") == 0
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("gradserver.server") and r.levelno >= logging.WARNING
    ]
    assert warnings == []


def test_a_worker_that_stops_reading_while_held_back_is_evicted(coordinator) -> None:
    """Item 6: a paused stream was never counted as silent, so a hung worker under
    back-pressure was caught only by the step timeout (here: never, every key completes)."""
    heartbeat = 2.0
    server = coordinator(world_size=1, heartbeat_timeout=heartbeat, step_timeout=300.0, **STALL_CONFIG)
    with log_waiter() as logs:
        stalled = StalledWorker(server.address)
        try:
            stalled.send_key(TensorKey.non_block(0, NonBlockComponent.LM_HEAD), 256)
            paused = logs.wait_for(r"holding back worker 0's stream")
            evicted = logs.wait_for(r"worker 0 \(node 'stalled'\) lost: it read nothing", timeout=30)
        finally:
            stalled.close()
    # The monitor checks every heartbeat/4; the margin is for a loaded machine.
    assert evicted.created - paused.created < heartbeat + 15
    assert _metric(server.server, "gradserver_workers_lost_total") == 1


@pytest.fixture
def raw_pair(coordinator) -> Iterator[tuple[RawWorker, JoinAccepted]]:
    server = coordinator(world_size=1, heartbeat_timeout=60.0, chunk_mib=1 / 256, max_message_mib=1.0)
    raw = RawWorker(*join(server.address))
    try:
        yield raw, raw.accepted
    finally:
        raw.close()


def test_a_codec_rejection_carries_its_key(raw_pair) -> None:
    """Item 9: an error about a chunk whose key could be parsed names that key, so the worker
    fails only that result instead of every pending one."""
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
