"""A protocol-level worker that sends whatever bytes a test wants: the "corrupt" fault helper.

It joins and opens an Exchange stream like WorkerClient, but without any client-side checks, so
tests reach the coordinator's own validation. Received messages are decoded into the plain types
of gradserver.common.messages and queued.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any

import grpc
import numpy as np

from gradserver.common import codec
from gradserver.common.messages import (
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    JoinAccepted,
    JoinRequestIn,
    SampleStats,
    ServerEvent,
    TensorKey,
    WorkerEvent,
)
from gradserver.common.rpc import EXCHANGE_METHOD, JOIN_METHOD, stream_metadata, worker_channel_options
from gradserver.worker import WorkerClient

from .server import TEST_TIMEOUTS

_END = object()


class StreamEnded:
    """Put in `received` when the coordinator ended the stream with status OK."""

    def __repr__(self) -> str:
        return "StreamEnded()"


def join(address: str, node_id: str = "raw", timeout: float = 20.0) -> tuple[grpc.Channel, JoinAccepted]:
    channel = grpc.insecure_channel(address, options=worker_channel_options())
    raw = channel.unary_unary(JOIN_METHOD)(
        codec.encode_join_request(JoinRequestIn(node_id, 0, "cpu", codec.PROTOCOL_VERSION)),
        timeout=timeout,
    )
    return channel, codec.decode_join_accepted(raw)


def client_and_raw(address: str, **client_options: Any) -> tuple[WorkerClient, RawWorker]:
    """A WorkerClient (`client_options` go to `connect`) and a RawWorker joined to the same
    coordinator at once (a Join returns only when the world is complete)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        client_f = pool.submit(WorkerClient.connect, address, timeout=TEST_TIMEOUTS, **client_options)
        raw_f = pool.submit(join, address)
        client = client_f.result(30)
        return client, RawWorker(*raw_f.result(30))


class RawWorker:
    def __init__(self, channel: grpc.Channel, accepted: JoinAccepted, metadata: Any = None) -> None:
        self.channel = channel
        self.accepted = accepted
        self.worker_id = accepted.worker_id
        self._out: queue.Queue[bytes | object] = queue.Queue()
        self.received: queue.Queue[ServerEvent | grpc.RpcError] = queue.Queue()
        if metadata is None:
            metadata = stream_metadata(accepted.worker_id, accepted.session_id, accepted.member_token)
        self._call = channel.stream_stream(EXCHANGE_METHOD)(self._requests(), metadata=metadata)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _requests(self) -> Any:
        while True:
            item = self._out.get()
            if item is _END:
                return
            yield item

    def _read(self) -> None:
        try:
            for raw in self._call:
                self.received.put(codec.decode_server_message(raw))
            self.received.put(StreamEnded())  # type: ignore[arg-type]
        except grpc.RpcError as exc:
            self.received.put(exc)

    def send_raw(self, raw: bytes) -> None:
        self._out.put(raw)

    def send(self, event: WorkerEvent) -> None:
        self._out.put(codec.encode_worker_event(event))

    def send_tensor(
        self,
        key: TensorKey,
        data: np.ndarray,
        sizes: tuple[int, ...] = (),
        *,
        worker_id: int | None = None,
        total: int | None = None,
        stats: SampleStats | None = None,
        dtype: DType = DType.FLOAT32,
    ) -> None:
        """Sends `data` as chunks of the coordinator's chunk size, header fields overridable."""
        chunk = self.accepted.chunk_bytes // 4
        data = np.ascontiguousarray(data, dtype="<f4")
        header = ChunkHeader(dtype, data.size if total is None else total, sizes)
        wid = self.worker_id if worker_id is None else worker_id
        for offset in range(0, max(1, data.size), chunk):
            piece = data[offset : offset + chunk].tobytes()
            self.send(ChunkIn(wid, key, header, offset, piece, stats))

    def recv(self, timeout: float = 10.0) -> ServerEvent | grpc.RpcError:
        return self.received.get(timeout=timeout)

    def recv_error(self, timeout: float = 10.0) -> ErrorOut:
        """The next in-stream error, skipping heartbeat acks and other traffic."""
        while True:
            event = self.recv(timeout)
            if isinstance(event, ErrorOut):
                return event
            if isinstance(event, grpc.RpcError):
                raise AssertionError(f"stream ended instead: {event.code()} {event.details()}")

    def close(self) -> None:
        self._out.put(_END)
        self._thread.join(5)
        self.channel.close()
