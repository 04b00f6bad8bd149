"""Fixtures: each owns a coordinator, clients or processes and ends them in `finally`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gradserver.server.config import CoordinatorConfig
from gradserver.worker import WorkerClient

from .helpers.processes import ProcessGroup
from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_all


@pytest.fixture
def coordinator() -> Iterator[Callable[..., ServerThread]]:
    """Factory: coordinator(world_size=2, **config) -> a started ServerThread on port 0."""
    started: list[ServerThread] = []

    def make(**overrides: Any) -> ServerThread:
        overrides.setdefault("bind", "127.0.0.1:0")
        overrides.setdefault("heartbeat_timeout", 5.0)
        overrides.setdefault("step_timeout", 20.0)
        overrides.setdefault("join_timeout", 20.0)
        server = ServerThread(CoordinatorConfig(**overrides))
        started.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def workers(coordinator: Callable[..., ServerThread]) -> Iterator[Callable[..., list[WorkerClient]]]:
    """Factory: workers(n, client_options=None, **config) -> n clients joined to a fresh
    coordinator; `client_options` go to every WorkerClient.connect (e.g. wire_dtype)."""
    clients: list[WorkerClient] = []

    def make(n: int, client_options: dict[str, Any] | None = None, **overrides: Any) -> list[WorkerClient]:
        server = coordinator(world_size=n, **overrides)
        joined = connect_all(server.address, n, TEST_TIMEOUTS, **(client_options or {}))
        clients.extend(joined)
        return joined

    try:
        yield make
    finally:
        for client in clients:
            client.close()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.close()
