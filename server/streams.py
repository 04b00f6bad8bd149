"""One worker's Exchange stream as the coordinator sees it: outbound queue, write progress, end.

The writer task drains `outbound`; `outbound_bytes` (results queued but not yet written) counts
toward the worker's in-flight budget, and `write_progress` lets the liveness monitor tell a
stream whose writes stall from one that merely has nothing to send.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from .membership import Member


class WorkerStream:
    """One worker's Exchange stream: its outbound queue, write progress and how it ends."""

    def __init__(self, member: Member, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.member = member
        self.context = context
        self.outbound: asyncio.Queue[bytes | object] = asyncio.Queue()
        self.outbound_bytes = 0
        self.room = asyncio.Event()
        self.room.set()
        self.paused = False
        self.said_goodbye = False
        self.by_shutdown = False
        # When the oldest unsent byte was queued or the last write completed, whichever is later.
        self.write_progress = time.monotonic()
        loop = asyncio.get_running_loop()
        self.ended: asyncio.Future[tuple[grpc.StatusCode, str] | None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def send(self, raw: bytes) -> None:
        if self.outbound_bytes == 0:
            self.write_progress = time.monotonic()
        self.outbound_bytes += len(raw)
        self.outbound.put_nowait(raw)

    def end(self, status: tuple[grpc.StatusCode, str] | None) -> None:
        if not self.ended.done():
            self.ended.set_result(status)

    def stalled_for(self, now: float) -> float:
        """Seconds the writes to this worker made no progress while bytes waited (0 when none)."""
        return now - self.write_progress if self.outbound_bytes else 0.0
