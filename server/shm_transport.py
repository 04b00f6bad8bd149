"""The same-host transport as the coordinator sees it: its outbox (`ShmOutbox`) and its part in
the coordinator's lifecycle (`ShmTransport`, `subscribe`).

The hub (`ShmHub`, server/shm.py) owns the socket and the arenas; the lane (`Lane`,
server/lane.py) the collective lane. Here they are opened once the coordinator serves (unless
--no-shm or the platform lacks them) and told what they must hear: a stream that opens (the lane
closes for a worker streaming without shared memory), a departure (what the table holds of the
departed worker's arena is copied first), a fresh job, a shutdown. They also weigh in on the
job's chunk size (32 MiB when every member will use shared memory; the output slots re-cut to
it), name a lane operation in flight when a worker is lost, and let large averages run on the
loop when only shared-memory workers stream.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from gradserver.common import lane, shm
from gradserver.common.averaging import Averager
from gradserver.common.messages import AveragedChunkOut, ChunkIn

from .config import CoordinatorConfig
from .lane import Lane
from .lifecycle import ChunkInputs, Departure, Lifecycle, Shell
from .membership import Member
from .metrics import CoordinatorMetrics
from .outgoing import Outgoing
from .reducer import average_on_loop
from .shm import Authenticate, ShmHub

log = logging.getLogger("gradserver.server.shm")


class ShmOutbox:
    """The shared-memory transport's outbox (server/outbox.py): resolves chunks named in a
    worker's input arena and publishes averages through the output arena (the slot accounting
    is the hub's)."""

    def __init__(self, hub: ShmHub, metrics: CoordinatorMetrics) -> None:
        self.hub = hub
        self._metrics = metrics

    @classmethod
    async def open(
        cls,
        config: CoordinatorConfig,
        metrics: CoordinatorMetrics,
        authenticate: Authenticate,
        averager: Averager,
    ) -> ShmOutbox | None:
        """Offers the shared-memory path unless --no-shm or the platform lacks it; a failure to
        set it up leaves gRPC only, with a warning. `averager` then writes float32 averages
        straight into output slots, so publishing them copies nothing."""
        if config.no_shm or not shm.supported():
            return None
        hub = ShmHub(
            config.shm_dir,
            config.shm_arena_bytes,
            config.chunk_bytes,
            config.heartbeat_timeout,
            authenticate,
            metrics,
        )
        try:
            await hub.start()
            if not config.no_lane and lane.supported():
                hub.lane = Lane(
                    config.world_size, config.lane_chunk_bytes, averager, metrics, config.step_timeout
                )
        except OSError as exc:
            log.warning("shared memory is off (gRPC only): %r", exc)
            await hub.stop()
            return None
        averager.output_buffers = hub
        return cls(hub, metrics)

    def route(self, item: Outgoing) -> list[Outgoing]:
        """Averages go through the output arena to shared-memory workers, inline to the rest."""
        if not isinstance(item.event, AveragedChunkOut):
            return [item]
        parts = self.hub.publish(item.event, item.to)
        for event, to in parts:
            if event.shm is not None:
                self._metrics.shm_bytes.inc(event.shm.length * len(to))
                self._metrics.sent_bytes.inc(event.shm.length * len(to))
        return [Outgoing(to, event) for event, to in parts]

    def resolve(self, chunk: ChunkIn, member: Member) -> ChunkIn | None:
        resolved = self.hub.resolve(chunk, member)
        self._metrics.shm_received_bytes.inc(len(resolved.data))
        self._metrics.received_bytes.inc(len(resolved.data))
        return resolved

    def offer(self) -> dict[str, Any]:
        return {"shm_socket": self.hub.path, "shm_nonce": self.hub.nonce}


class ShmTransport:
    """The coordinator's shared-memory transport: `hub` is None until it serves, and stays None
    when shared memory is not offered."""

    def __init__(self, lifecycle: Lifecycle, shell: Shell) -> None:
        self._lifecycle = lifecycle
        self._shell = shell
        self.hub: ShmHub | None = None
        # The cores the averaging thread competes for (the host's, or what a test assumes).
        self.cores = shell.cores

    async def start(self) -> None:
        """Opens the hub (and the lane) and subscribes to what they must hear; nothing when
        shared memory is not offered."""
        shell = self._shell
        outbox = await ShmOutbox.open(shell.config, shell.metrics, shell.authenticate, shell.averager)
        if outbox is None:
            return
        hub = self.hub = outbox.hub
        shell.add_outbox(outbox)
        events = self._lifecycle
        events.on_chunk_inputs(self._chunk_inputs)
        events.on_chunk_chosen(hub.reslot)
        events.on_departed(self._departed)
        events.on_close(hub.stop)
        workers = shell.streaming_workers
        events.on_average_on_loop(lambda: average_on_loop(workers(), hub.registered, self.cores))
        if hub.lane is not None:
            events.on_stream_opened(self._stream_opened)
            events.on_reset(self._reset)
            events.on_stopping(self._stopping)
            events.on_step_in_flight(self._step_in_flight)
            events.on_counting(self._counting)

    # The lane is looked up at each call: stopping the hub closes it and forgets it.

    def _stream_opened(self, worker_id: int) -> None:
        if self.hub is not None and self.hub.lane is not None:
            self.hub.lane.streaming(worker_id)

    def _reset(self) -> None:
        if self.hub is not None and self.hub.lane is not None:
            self.hub.lane.reset()

    def _stopping(self, reason: str) -> None:
        if self.hub is not None and self.hub.lane is not None:
            self.hub.lane.stopping(reason)

    def _step_in_flight(self) -> int | None:
        if self.hub is not None and self.hub.lane is not None:
            return self.hub.lane.operation_in_flight()
        return None

    def _counting(self) -> None:
        if self.hub is not None and self.hub.lane is not None:
            self.hub.lane.sync_counters()

    def _chunk_inputs(self, inputs: ChunkInputs, members: Sequence[Member]) -> ChunkInputs:
        return dataclasses.replace(inputs, shared_memory=all(m.shared_memory for m in members))

    def _departed(self, departure: Departure) -> None:
        hub = self.hub
        assert hub is not None
        # Its arena may still be written (a zombie): what the table keeps of it is copied first.
        self._shell.table().copy_held_data(departure.worker_id)
        hub.worker_gone(departure.worker_id)
        if hub.lane is not None:
            hub.lane.worker_gone(departure.worker_id, departure.reason, lost=departure.lost)


def subscribe(lifecycle: Lifecycle, shell: Shell) -> ShmTransport:
    """The shared-memory transport, opened as the coordinator starts serving."""
    transport = ShmTransport(lifecycle, shell)
    lifecycle.on_start(transport.start)
    return transport
