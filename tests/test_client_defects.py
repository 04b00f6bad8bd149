"""Regression tests for WorkerClient defects of issue 10 (and issue 9's connect progress).

Each test drives a real coordinator on port 0 with real clients, and fails on the client code
before its fix: threads and streams leaked by closing a broken client, stored exceptions that
grow their tracebacks and keep gradient arrays alive, a failed step's keys answering the next
step's receives, the torch.distributed loss reduced on the CPU, and a silent connect wait.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from gradserver.common import compute_block_sizes
from gradserver.common.errors import (
    AbortedError,
    GradServerError,
    InvalidArgumentError,
    UnavailableError,
)
from gradserver.worker import Timeouts, WorkerClient

from .helpers.server import connect_all, run_each

SIZES = compute_block_sizes(8, 4, 16)
THREADS_END_WITHIN = 15.0
PROGRESS = r"still trying to reach the coordinator at 127\.0\.0\.1:1 \(\d+\.\d s of 1 s\)"


def _raised(call: Callable[[], Any]) -> GradServerError:
    """The GradServerError `call` raises (the test fails if it returns)."""
    try:
        call()
    except GradServerError as exc:
        return exc
    raise AssertionError(f"{call} did not raise")


def _wait_broken(client: WorkerClient, within: float = 30.0) -> None:
    """Waits until the client's receiver saw its stream end (the state close() must handle)."""
    stream = client._link
    with stream._cond:
        assert stream._cond.wait_for(lambda: stream._broken is not None, within), "stream never broke"


def _wait_threads_end(threads: set[threading.Thread], within: float) -> list[str]:
    """Joins each thread against one shared deadline; the names of those still alive."""
    deadline = time.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threads if t.is_alive())


# --- item 2: closing a client whose stream broke --------------------------------------------------


def _one_cycle(coordinator: Callable[..., Any]) -> tuple[list[weakref.ref[Any]], int]:
    """Connects two clients, leaves one average pending, stops the coordinator, waits until both
    clients saw their stream end, closes them; returns weak references to what must be freed and
    how many results a closed client the caller still holds keeps registered."""
    server = coordinator(world_size=2, drain_timeout=0.5)
    clients = connect_all(server.address, 2)
    clients[0].send_block_gradient(0, 0, 1, np.ones(sum(SIZES), np.float32), SIZES)
    stream = clients[0]._link
    refs: list[weakref.ref[Any]] = [weakref.ref(c._link) for c in clients]
    refs += [weakref.ref(p.array) for p in stream._results.values()]
    server.stop()
    for client in clients:
        _wait_broken(client)
        client.close()
    return refs, len(stream._results)


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
        errors = [_raised(client.send_heartbeat) for _ in range(5)]
        assert len({id(e) for e in errors}) == len(errors), "the same exception object was re-raised"
        depths = {len(traceback.extract_tb(e.__traceback__)) for e in errors}
        assert len(depths) == 1, f"tracebacks grow from raise to raise: {sorted(depths)}"
        assert all(isinstance(e, ConnectionError) for e in errors)
        assert all(type(e) is type(errors[0]) and e.message == errors[0].message for e in errors)
    finally:
        client.close()


# --- item 3: failed steps must not keep arrays alive ---------------------------------------------


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
            result_arrays.extend(weakref.ref(p.array) for p in c._link._results.values())
        return str(_raised(c.receive_averaged_block))

    for step in range(3):
        messages = run_each(clients, lambda c, s=step: failing_step(c, s))
        assert all(f"step {step}" in m and "non-finite" in m for m in messages), messages
    assert len(result_arrays) == len(sent_arrays) == 3
    gc.collect()
    alive = [i for i, ref in enumerate(result_arrays + sent_arrays) if ref() is not None]
    assert not alive, f"arrays of failed steps still alive (results 0-2, sent 3-5): {alive}"
    # Repeated reports of one failed step are fresh exceptions, not one growing traceback.
    repeated = [_raised(lambda: clients[0].barrier(2, "late", timeout=30)) for _ in range(4)]
    assert len({id(e) for e in repeated}) == 4
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in repeated}) == 1
    assert all(isinstance(e, AbortedError) and e.step == 2 for e in repeated)


# --- item 4d: what a client sees after a failed step ---------------------------------------------


def test_after_a_failed_step_the_next_step_gets_its_own_averages(workers) -> None:
    clients = workers(2)
    total = sum(SIZES)

    def work(c: WorkerClient) -> dict[str, Any]:
        poisoned = np.ones(total, np.float32)
        if c.worker_id == 1:
            poisoned[3] = np.inf
        c.send_block_gradient(0, 1, 2, poisoned, SIZES)
        c.send_block_gradient(0, 0, 2, np.ones(total, np.float32), SIZES)
        c.send_non_block_gradient(0, "final_norm", np.ones(16, np.float32))
        step0 = _raised(c.receive_averaged_block)
        # Step 1 goes on: its block average comes back, not step 0's other block.
        c.send_block_gradient(1, 0, 1, np.full(total, c.worker_id + 1.0, np.float32), SIZES)
        block = c.receive_averaged_block()
        # Step 0's non-block key still reports step 0's failure, once, naming the culprit.
        stale = _raised(c.receive_averaged_non_block)
        c.send_non_block_gradient(1, "final_norm", np.full(16, c.worker_id * 2.0, np.float32))
        non_block = c.receive_averaged_non_block()
        return {"step0": step0, "block": block, "stale": stale, "non_block": non_block}

    results = run_each(clients, work)
    for c, got in zip(clients, results, strict=True):
        expected = InvalidArgumentError if c.worker_id == 1 else AbortedError
        for error in (got["step0"], got["stale"]):
            assert isinstance(error, expected), error
            assert (error.step, error.worker_id, error.key) == (0, 1, "step 0 block 1 of 2"), error
        assert (got["block"].step, got["block"].block_idx) == (1, 0)
        np.testing.assert_array_equal(got["block"].gradients, 1.5)
        assert got["non_block"].step == 1
        np.testing.assert_array_equal(got["non_block"].gradients, 1.0)


# --- item 8: torch.distributed reduces the loss on the gradients' device ---------------------------


def test_torch_distributed_loss_is_reduced_on_the_gradients_device(monkeypatch) -> None:
    import torch.distributed as dist

    from gradserver.train.backends import TorchDistributedBackend

    reduced: list[torch.Tensor] = []

    class _Work:
        def wait(self) -> None:
            return None

    def all_reduce(tensor: torch.Tensor, async_op: bool = False) -> _Work:
        reduced.append(tensor)
        return _Work()

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    backend = TorchDistributedBackend()
    backend.start_step(0)
    backend.submit_block(0, 1, torch.zeros(sum(SIZES), device="meta"), SIZES)
    backend.submit_loss(2.5, 8)
    assert [t.device.type for t in reduced] == ["meta", "meta"]
    assert reduced[1].dtype == torch.float64


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.distributed.is_nccl_available(), reason="needs a CUDA GPU"
)
def test_nccl_engine_averages_gradients_and_loss_on_the_gpu(tmp_path) -> None:
    import torch.distributed as dist

    from gradserver.train.backends import TorchDistributedBackend

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    backend = TorchDistributedBackend()
    try:
        backend.start_step(0)
        backend.submit_block(0, 1, torch.full((sum(SIZES),), 2.0, device="cuda"), SIZES)
        backend.submit_loss(2.5, 8)
        [(key, average)] = backend.finish()
        assert key == ("block", 0) and average.device.type == "cuda"
        assert torch.equal(average.cpu(), torch.full((sum(SIZES),), 2.0))
        assert backend.global_loss() == pytest.approx(2.5)
    finally:
        backend.close()


# --- issue 9 item 6: reaching an unreachable coordinator says so ---------------------------------


def test_unreachable_coordinator_logs_progress_and_names_address_and_time(caplog) -> None:
    caplog.set_level(logging.INFO, logger="gradserver.worker")
    with pytest.raises(UnavailableError) as info:
        WorkerClient.connect("127.0.0.1:1", timeout=Timeouts(connect=1.0))
    assert "127.0.0.1:1" in str(info.value) and "tried for 1 s" in str(info.value)
    progress = [r.getMessage() for r in caplog.records if "still trying to reach" in r.getMessage()]
    assert progress, "no progress line while trying to reach the coordinator"
    assert all(re.fullmatch(PROGRESS, line) for line in progress), progress
