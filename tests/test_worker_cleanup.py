"""A worker cleans up after itself: closing a client whose stream broke leaves no thread, stream or
result array behind, a broken client raises a fresh exception with a short traceback each time,
and a failed step keeps none of its gradient arrays alive."""

from __future__ import annotations

import gc
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from gradserver.common import compute_block_sizes
from gradserver.common.errors import AbortedError
from gradserver.worker import WorkerClient

from .helpers.raising import raised
from .helpers.server import connect_all, run_each

SIZES = compute_block_sizes(8, 4, 16)
THREADS_END_WITHIN = 15.0


def _wait_broken(client: WorkerClient, within: float = 30.0) -> None:
    """Waits until the client's receiver saw its stream end (the state close() must handle)."""
    ledger = client._link.ledger
    with ledger.cond:
        assert ledger.cond.wait_for(lambda: ledger.broken is not None, within), "stream never broke"


def _wait_threads_end(threads: set[threading.Thread], within: float) -> list[str]:
    """Joins each thread against one shared deadline; the names of those still alive."""
    deadline = time.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threads if t.is_alive())


def _one_cycle(coordinator: Callable[..., Any]) -> tuple[list[weakref.ref[Any]], int]:
    """Connects two clients, leaves one average pending, stops the coordinator, waits until both
    clients saw their stream end, closes them; returns weak references to what must be freed and
    how many results a closed client the caller still holds keeps registered."""
    server = coordinator(world_size=2, drain_timeout=0.5)
    clients = connect_all(server.address, 2)
    clients[0].send_block_gradient(0, 0, 1, np.ones(sum(SIZES), np.float32), SIZES)
    stream = clients[0]._link
    refs: list[weakref.ref[Any]] = [weakref.ref(c._link) for c in clients]
    refs += [weakref.ref(p.array) for p in stream.ledger._results.values()]
    server.stop()
    for client in clients:
        _wait_broken(client)
        client.close()
    return refs, len(stream.ledger._results)


def test_closing_clients_after_the_coordinator_stopped_leaks_no_thread_or_stream(coordinator) -> None:
    _one_cycle(coordinator)  # starts gRPC's process-wide threads (the aio poller), kept for good
    before = set(threading.enumerate())
    cycles = [_one_cycle(coordinator) for _ in range(3)]
    alive = _wait_threads_end(set(threading.enumerate()) - before, THREADS_END_WITHIN)
    assert not alive, f"threads still running after close: {alive}"
    assert [kept for _, kept in cycles] == [0, 0, 0], "closed clients keep their result arrays"
    refs = [ref for cycle_refs, _ in cycles for ref in cycle_refs]
    del cycles
    gc.collect()
    leaked = [ref() for ref in refs if ref() is not None]
    assert not leaked, f"{len(leaked)} streams or result arrays outlived their closed clients"


def test_a_broken_client_raises_fresh_errors_with_short_tracebacks(coordinator) -> None:
    server = coordinator(world_size=1, drain_timeout=0.5)
    (client,) = connect_all(server.address, 1)
    try:
        server.stop()
        _wait_broken(client)
        errors = [raised(client.send_heartbeat) for _ in range(5)]
        assert len({id(e) for e in errors}) == len(errors), "the same exception object was re-raised"
        depths = {len(traceback.extract_tb(e.__traceback__)) for e in errors}
        assert len(depths) == 1, f"tracebacks grow from raise to raise: {sorted(depths)}"
        assert all(isinstance(e, ConnectionError) for e in errors)
        assert all(type(e) is type(errors[0]) and e.message == errors[0].message for e in errors)
    finally:
        client.close()


def test_failed_steps_do_not_keep_their_arrays_alive(workers) -> None:
    clients = workers(2)
    elements = 1 << 18  # 1 MiB per array
    sizes = (elements, 0, 0, 0, 0, 0, 0, 0, 0)
    result_arrays: list[weakref.ref[np.ndarray]] = []
    sent_arrays: list[weakref.ref[np.ndarray]] = []

    def failing_step(c: WorkerClient, step: int) -> str:
        grads = np.ones(elements, np.float32)
        if c.worker_id == 1:
            grads[7] = np.nan
        c.send_block_gradient(step, 0, 1, grads, sizes)
        if c.worker_id == 0:
            sent_arrays.append(weakref.ref(grads))
            result_arrays.extend(weakref.ref(p.array) for p in c._link.ledger._results.values())
        return str(raised(c.receive_averaged_block))

    for step in range(3):
        messages = run_each(clients, lambda c, s=step: failing_step(c, s))
        assert all(f"step {step}" in m and "non-finite" in m for m in messages), messages
    assert len(result_arrays) == len(sent_arrays) == 3
    gc.collect()
    alive = [i for i, ref in enumerate(result_arrays + sent_arrays) if ref() is not None]
    assert not alive, f"arrays of failed steps still alive (results 0-2, sent 3-5): {alive}"
    # Repeated reports of one failed step are fresh exceptions, not one growing traceback.
    repeated = [raised(lambda: clients[0].barrier(2, "late", timeout=30)) for _ in range(4)]
    assert len({id(e) for e in repeated}) == 4
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in repeated}) == 1
    assert all(isinstance(e, AbortedError) and e.step == 2 for e in repeated)
