"""Prometheus metrics of one coordinator, served over HTTP on `--metrics-port`.

Each GradientServer has its own registry, so several coordinators can run in one process (tests)
without sharing counters. Names start with `gradserver_`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server

log = logging.getLogger("gradserver.server.metrics")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Payload bytes exchanged with one worker since the coordinator started: contributions read
    from it and results written to it, inline and through shared memory together, headers not
    counted (docs/PROTOCOL.md, "Native collectives")."""

    received_bytes: int
    sent_bytes: int


class CoordinatorMetrics:
    def __init__(self, world_size: int) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.world_size = Gauge("gradserver_world_size", "Workers the job needs", registry=registry)
        self.world_size.set(world_size)
        self.workers_joined = Gauge(
            "gradserver_workers_joined", "Workers currently joined", registry=registry
        )
        self.workers_lost = Counter(
            "gradserver_workers_lost", "Workers lost or evicted (not counting goodbyes)", registry=registry
        )
        self.steps_completed = Counter(
            "gradserver_steps_completed",
            "Steps with every key and barrier done, not failed, and every worker moved on or left",
            registry=registry,
        )
        self.keys_reduced = Counter("gradserver_keys_reduced", "Keys fully averaged", registry=registry)
        self.received_bytes = Counter(
            "gradserver_received_bytes",
            "Bytes read from workers, every transport (gRPC messages and shared-memory payloads)",
            registry=registry,
        )
        self.sent_bytes = Counter(
            "gradserver_sent_bytes",
            "Bytes written to workers, every transport (gRPC messages; shared-memory averages per recipient)",
            registry=registry,
        )
        self.shm_bytes = Counter(
            "gradserver_shm_bytes",
            "The part of gradserver_sent_bytes that went through shared memory (averages to same-host "
            "workers, counted per recipient)",
            registry=registry,
        )
        self.shm_received_bytes = Counter(
            "gradserver_shm_received_bytes",
            "The part of gradserver_received_bytes read from same-host workers' shared memory",
            registry=registry,
        )
        self.shm_inline_fallbacks = Counter(
            "gradserver_shm_inline_fallbacks",
            "Averages sent inline to same-host workers because the output arena had no free slot "
            "(a larger --shm-arena-mib avoids them)",
            registry=registry,
        )
        self.lane_rounds = Counter(
            "gradserver_lane_rounds",
            "Rounds of one-shot collectives served through the shared-memory collective lane",
            registry=registry,
        )
        self.shm_averaged_in_place_bytes = Counter(
            "gradserver_shm_averaged_in_place_bytes",
            "Bytes of averages written straight into an output slot (no copy to publish them)",
            registry=registry,
        )
        self.shm_averaged_over_inputs_bytes = Counter(
            "gradserver_shm_averaged_over_inputs_bytes",
            "Bytes of averages written over the contributors' own inout chunks (bytes per average)",
            registry=registry,
        )
        self.reduce_latency = Histogram(
            "gradserver_reduce_latency_seconds",
            "Per key: first contribution to last averaged chunk",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.barrier_wait = Histogram(
            "gradserver_barrier_wait_seconds",
            "Per barrier: first arrival to release",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "gradserver_errors", "Errors sent to workers, by gRPC status code", ["code"], registry=registry
        )
        self.job_state = Enum(
            "gradserver_job_state",
            "The job's state: waiting (for joins), running, restarting (a lost worker's place may be "
            "retaken), finished, failed",
            states=["waiting", "running", "restarting", "finished", "failed"],
            registry=registry,
        )
        # Per worker id: payload bytes read and written (`traffic`); in-process only, for tests and
        # benchmarks that bound what each collective costs on the wire.
        self._payload_received: collections.Counter[int] = collections.Counter()
        self._payload_sent: collections.Counter[int] = collections.Counter()
        self._http: Any = None
        self.port = 0
        self._counted = (0, 0)  # steps and keys of the current job's table already counted

    def count_table(self, steps_completed: int, keys_reduced: int) -> None:
        """Adds what the current job's table completed since the last call."""
        self.steps_completed.inc(steps_completed - self._counted[0])
        self.keys_reduced.inc(keys_reduced - self._counted[1])
        self._counted = (steps_completed, keys_reduced)

    def payload_received(self, worker_id: int, nbytes: int) -> None:
        self._payload_received[worker_id] += nbytes

    def payload_sent(self, to: tuple[int, ...], nbytes: int) -> None:
        for worker_id in to:
            self._payload_sent[worker_id] += nbytes

    def traffic(self, worker_id: int) -> Traffic:
        """The payload bytes read from and written to `worker_id` so far."""
        return Traffic(self._payload_received[worker_id], self._payload_sent[worker_id])

    def new_table(self) -> None:
        """A fresh job's table counts from 0 again."""
        self._counted = (0, 0)

    def serve(self, host: str, port: int) -> int:
        """Starts the /metrics endpoint; port 0 picks a free port. Returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        self.port = int(server.server_port)
        log.info("metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
