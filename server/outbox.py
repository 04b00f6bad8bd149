"""Outboxes: how the messages the reduction table returns reach the workers, one outbox per
transport behind one interface.

The table returns messages as `Outgoing`; `Outboxes.deliver` encodes each once and queues the
same bytes on every recipient's gRPC stream (`streams`). An outbox per other transport sits in
between: it may reroute a message (the shared-memory outbox writes an average once into its
output arena and names it to its readers: `ShmOutbox` in `shm_transport`), resolve what a chunk
names (a range of the sender's arena) and offer joiners its JoinAccepted fields. Delivery only:
what a transport does as members come and go, jobs reset and the coordinator stops, it
subscribes to (server/lifecycle.py). Adding a transport is one module with its outbox and its
subscriptions, and one line in server/features.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from gradserver.common import codec
from gradserver.common.chunking import payload_nbytes
from gradserver.common.errors import InvalidArgumentError, status_code_from_value
from gradserver.common.messages import AveragedChunkOut, ChunkIn, ErrorOut

from .membership import Member
from .metrics import CoordinatorMetrics
from .outgoing import Outgoing
from .streams import Streams


class Outbox(Protocol):
    """One transport's part in delivery."""

    def route(self, item: Outgoing) -> list[Outgoing]:
        """The messages that carry `item` (the same one, or parts for different recipients)."""
        ...

    def resolve(self, chunk: ChunkIn, member: Member) -> ChunkIn | None:
        """The chunk with its data in hand when it names this transport's memory; else None."""
        ...

    def offer(self) -> dict[str, Any]:
        """The JoinAccepted fields that tell a joiner how to use this transport."""
        ...


class Outboxes:
    """Every outbox of one coordinator, applied in order, in front of the gRPC streams (which
    need none of their own)."""

    def __init__(self, streams: Streams, metrics: CoordinatorMetrics) -> None:
        self._streams = streams
        self._metrics = metrics
        self._outboxes: list[Outbox] = []

    def add(self, outbox: Outbox | None) -> None:
        """Adds `outbox` (None: its transport is not offered)."""
        if outbox is not None:
            self._outboxes.append(outbox)

    def deliver(self, outgoing: Sequence[Outgoing]) -> None:
        """Sends every message to its recipients (errors counted by code, per recipient)."""
        for item in outgoing:
            if isinstance(item.event, ErrorOut):
                code = status_code_from_value(item.event.code)
                self._metrics.errors.labels(code.name).inc(len(item.to))
            for part in self.route(item):
                if isinstance(part.event, AveragedChunkOut):
                    self._metrics.payload_sent(part.to, _payload_bytes(part.event))
                self._streams.send(part.to, codec.encode_server_event(part.event))
        if outgoing:
            self._streams.wake_readers()

    def route(self, item: Outgoing) -> list[Outgoing]:
        items = [item]
        for outbox in self._outboxes:
            items = [part for each in items for part in outbox.route(each)]
        return items

    def resolve(self, chunk: ChunkIn, member: Member) -> ChunkIn:
        """`chunk` with its data in hand; raises naming the worker, step and key when it names
        memory of a transport that this coordinator does not offer."""
        if chunk.shm is None:
            return chunk
        for outbox in self._outboxes:
            resolved = outbox.resolve(chunk, member)
            if resolved is not None:
                return resolved
        w, key = chunk.worker_id, chunk.key
        raise InvalidArgumentError(
            f"worker {w}, {key}: chunk names shared memory, which this coordinator does not offer",
            step=key.step,
            key=str(key),
            worker_id=w,
        )

    def offer(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for outbox in self._outboxes:
            fields.update(outbox.offer())
        return fields


def _payload_bytes(event: AveragedChunkOut) -> int:
    if event.shm is not None:
        return event.shm.length
    return payload_nbytes(event.data)
