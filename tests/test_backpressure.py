"""Back-pressure and slow readers: the coordinator holds back the stream of a worker that does not
read its results; such a worker is evicted within the heartbeat timeout, and when it cancels its
stream with results still queued its place is freed at once for a replacement."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from gradserver.common import codec
from gradserver.common.components import NonBlockComponent
from gradserver.common.messages import AveragedChunkOut, ChunkHeader, ChunkIn, DType, TensorKey
from gradserver.common.rpc import EXCHANGE_METHOD, stream_metadata

from .helpers.logwait import log_waiter
from .helpers.raw import RawWorker, join
from .helpers.server import metric

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


def test_a_cancelled_stream_with_unsent_results_frees_its_place(coordinator) -> None:
    """The writer's failed write after a cancel must not skip the clean-up: otherwise the id
    stays in the stream table and a replacement gets 'already has an Exchange stream open'."""
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


def test_a_worker_that_stops_reading_while_held_back_is_evicted(coordinator) -> None:
    """A paused stream counts as silent: otherwise a hung worker under back-pressure is caught
    only by the step timeout (here: never, every key completes)."""
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
    # Read on the server's loop: the eviction logs before it counts the loss, in the same callback.
    assert server.call(lambda s: metric(s, "gradserver_workers_lost_total")) == 1
