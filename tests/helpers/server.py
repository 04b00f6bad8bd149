"""A real GradientServer on 127.0.0.1:0, run in its own thread and event loop.

The worker API is blocking, so in-process tests keep the coordinator's event loop off the test
thread. `ServerThread.stop()` always runs in the fixture's `finally`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from gradserver.server import GradientServer
from gradserver.server.config import CoordinatorConfig
from gradserver.worker import Timeouts, WorkerClient

if TYPE_CHECKING:
    from gradserver.torch._collective import CollectiveClient

T = TypeVar("T")

TEST_TIMEOUTS = Timeouts(connect=10.0, join=20.0, receive=20.0, send=20.0, close=5.0)


class ServerThread:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.server: GradientServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)

    def start(self, timeout: float = 10.0) -> str:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("coordinator did not start")
        if self._error is not None:
            raise self._error
        assert self.server is not None
        return self.server.address

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self.server = GradientServer(self.config)
            try:
                await self.server.start()
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            await self.server.wait_for_termination()

        asyncio.run(main())

    def call(self, fn: Callable[[GradientServer], T], timeout: float = 10.0) -> T:
        """Runs `fn(server)` on the coordinator's loop (to read its state safely)."""
        assert self._loop is not None and self.server is not None
        server = self.server

        async def call() -> T:
            return fn(server)

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        if self._loop is not None and self.server is not None and self._thread.is_alive():
            server = self.server
            future = asyncio.run_coroutine_threadsafe(server.stop("test teardown"), self._loop)
            try:
                future.result(timeout)
            except concurrent.futures.TimeoutError:
                pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("coordinator thread did not stop")


def wait_pending(server: ServerThread, step: int, timeout: float = 10.0) -> None:
    """Blocks until the coordinator holds a key of `step`, so a later message (or another
    connection's event) cannot overtake the one that opened it."""
    deadline = time.monotonic() + timeout
    while step not in server.call(lambda s: s.pending_steps()):
        if time.monotonic() > deadline:
            raise AssertionError(f"step {step} never became pending")
        time.sleep(0.01)


def connect_all(
    address: str, n: int, timeouts: Timeouts = TEST_TIMEOUTS, **options: Any
) -> list[WorkerClient]:
    """N clients joined concurrently (Join waits for the whole world), sorted by worker id;
    `options` go to every WorkerClient.connect (e.g. wire_dtype)."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(WorkerClient.connect, address, node_id=f"test-{i}", timeout=timeouts, **options)
            for i in range(n)
        ]
        clients = [f.result(timeout=timeouts.join + 5) for f in futures]
    return sorted(clients, key=lambda c: c.worker_id)


def connect_each(
    address: str, per_rank: Sequence[dict[str, Any]], timeouts: Timeouts = TEST_TIMEOUTS, **options: Any
) -> list[WorkerClient]:
    """One client per entry of `per_rank`, joined concurrently as ranks 0, 1, ... with `options`
    and that entry's own options (e.g. `host_id`, `peer_memory`)."""
    with concurrent.futures.ThreadPoolExecutor(len(per_rank)) as pool:
        futures = [
            pool.submit(WorkerClient.connect, address, timeout=timeouts, rank=rank, **options, **own)
            for rank, own in enumerate(per_rank)
        ]
        return [f.result(timeout=timeouts.join + 10) for f in futures]


def connect_ranks(address: str, transports: Sequence[str], **options: Any) -> list[CollectiveClient]:
    """One CollectiveClient per entry of `transports`, joined concurrently as ranks 0, 1, ...
    with that transport; `options` go to every connect."""
    from gradserver.torch._collective import CollectiveClient  # imports torch: only when used

    with concurrent.futures.ThreadPoolExecutor(len(transports)) as pool:
        futures = [
            pool.submit(
                CollectiveClient.connect,
                address,
                node_id=f"rank-{rank}",
                timeout=TEST_TIMEOUTS,
                rank=rank,
                transport=transport,
                **options,
            )
            for rank, transport in enumerate(transports)
        ]
        return [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in futures]


def run_each(
    clients: Sequence[WorkerClient], fn: Callable[[WorkerClient], T], timeout: float = 60.0
) -> list[T]:
    """Runs fn(client) for every client concurrently; returns results in worker-id order and
    re-raises the first failure."""
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(fn, c) for c in clients]
        return [f.result(timeout=timeout) for f in futures]


def run_each_outcome(
    clients: Sequence[WorkerClient], fn: Callable[[WorkerClient], Any], timeout: float = 60.0
) -> list[Any]:
    """Like run_each, but returns each worker's exception instead of raising it."""
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(fn, c) for c in clients]
        outcomes: list[Any] = []
        for f in futures:
            try:
                outcomes.append(f.result(timeout=timeout))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes


def metric(server: GradientServer, name: str, labels: dict[str, str] | None = None) -> float:
    """The coordinator's current value of one Prometheus sample (0 when it was never set)."""
    return server.metrics.registry.get_sample_value(name, labels or {}) or 0.0
