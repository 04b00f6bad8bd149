"""Operations: Prometheus metrics move during a real run, gRPC health follows the lifecycle,
the configuration can be printed, and JSON logs name worker and step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from gradserver.common.components import NonBlockComponent
from gradserver.train.synthetic import SHAPES, run_exchange

from .helpers.processes import ROOT
from .helpers.raw import client_and_raw
from .helpers.server import connect_all, run_each


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            values[sample.name + (f"{{{label}}}" if label else "")] = sample.value
    return values


def test_metrics_move_during_a_real_run(coordinator) -> None:
    server = coordinator(world_size=2, metrics_port=0, heartbeat_timeout=60.0)
    port = server.call(lambda s: s.metrics.port)
    before = _scrape(port)
    assert before["gradserver_world_size"] == 2 and before["gradserver_workers_joined"] == 0
    client, raw = client_and_raw(server.address)
    try:
        assert _scrape(port)["gradserver_workers_joined"] == 2
        raw.send_raw(b"\xff garbage")
        raw.recv_error()
        errors = _scrape(port)
        assert errors["gradserver_errors_total{code=INVALID_ARGUMENT}"] == 1
    finally:
        client.close()
        raw.close()
    gone = _scrape(port)
    assert gone["gradserver_workers_joined"] == 0
    assert gone["gradserver_workers_lost_total"] == 1  # the raw worker left without a goodbye


def test_metrics_count_steps_keys_bytes_latency_and_barriers(coordinator) -> None:
    server = coordinator(world_size=2, metrics_port=0)
    port = server.call(lambda s: s.metrics.port)
    clients = connect_all(server.address, 2)
    try:
        run_each(clients, lambda c: run_exchange(c, SHAPES["tiny"], 3))
        run_each(clients, lambda c: c.barrier(3, "end"))
        m = _scrape(port)
        keys = 3 * (SHAPES["tiny"].num_blocks + 3)
        assert m["gradserver_steps_completed_total"] == 3
        assert m["gradserver_keys_reduced_total"] == keys
        assert m["gradserver_reduce_latency_seconds_count"] == keys
        assert m["gradserver_barrier_wait_seconds_count"] == 1
        payload = 2 * 3 * SHAPES["tiny"].total_bytes(tuple(NonBlockComponent))
        assert payload < m["gradserver_received_bytes_total"] < payload * 1.1
        assert m["gradserver_sent_bytes_total"] > m["gradserver_received_bytes_total"] * 0.9
    finally:
        for c in clients:
            c.close()


def _health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_health_is_serving_then_not_serving_during_graceful_shutdown(coordinator) -> None:
    server = coordinator(world_size=2, drain_timeout=5.0)
    assert _health(server.address) == "SERVING"
    cli = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "health", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert cli.returncode == 0 and "SERVING" in cli.stdout
    clients = connect_all(server.address, 2)
    channel = grpc.insecure_channel(server.address)
    try:
        sizes = SHAPES["tiny"].block_sizes
        clients[0].send_block_gradient(0, 0, 1, np.ones(sum(sizes), np.float32), sizes)
        # Watch, not polling Check: a graceful stop may now end within milliseconds.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
        stopper.join(30)
    finally:
        channel.close()
        for c in clients:
            c.close()


def test_health_command_fails_for_an_unreachable_coordinator() -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "health", "127.0.0.1:1", "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert cli.returncode == 1 and "UNAVAILABLE" in cli.stdout


def test_print_config_shows_values_and_sources() -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "coordinator", "--print-config", "--world-size", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "GRADSERVER_STEP_TIMEOUT": "12"},
    )
    assert cli.returncode == 0
    assert "world_size = 4  (--world-size)" in cli.stdout
    assert "step_timeout = 12.0  (GRADSERVER_STEP_TIMEOUT)" in cli.stdout
    assert "heartbeat_timeout = 10.0  (default)" in cli.stdout


@pytest.mark.processes
def test_json_logs_name_worker_and_step(processes) -> None:
    coord, address = processes.coordinator("--world-size", "2", "--max-steps", "2", "--log-format", "json")
    workers = [
        processes.gradserver(
            "worker",
            "--job",
            "synthetic",
            "--coordinator",
            address,
            "--steps",
            "2",
            "--log-format",
            "json",
            "--log-level",
            "DEBUG",
            name=f"w{i}",
        )
        for i in range(2)
    ]
    for w in workers:
        assert w.wait(60) == 0, w.output
    assert coord.wait(30) == 0
    entries = [json.loads(line) for line in coord.output.splitlines() if line.startswith("{")]
    joins = [e for e in entries if "joined" in e["message"]]
    assert {e["worker_id"] for e in joins} == {0, 1}
    assert all(e["role"] == "coordinator" and e["level"] for e in entries)
    worker_entries = [json.loads(line) for line in workers[0].output.splitlines() if line.startswith("{")]
    assert any(e["worker_id"] is not None and e["step"] is not None for e in worker_entries)
