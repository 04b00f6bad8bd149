"""The result arrays of keys sent without `into=`: reused for the same key slot's next key when the
caller dropped the earlier one (no allocation, no page faults per step), never while the caller
(or a view, a memoryview, a tensor or a weak reference) still holds it; the bytes are the same."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch

from gradserver.common import compute_block_sizes
from gradserver.worker import WorkerClient

from .helpers.server import run_each

SIZES = compute_block_sizes(64, 32, 256)
TOTAL = sum(SIZES)


def _grads(worker: int, step: int, size: int = TOTAL) -> np.ndarray:
    return np.random.default_rng([worker, step]).standard_normal(size, dtype=np.float32)


def _mean(world: int, step: int, size: int = TOTAL) -> np.ndarray:
    return (sum(_grads(w, step, size).astype(np.float64) for w in range(world)) / world).astype(np.float32)


def _pointer(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _block(client: WorkerClient, step: int, size: int = TOTAL) -> np.ndarray:
    sizes = SIZES if size == TOTAL else (size, 0, 0, 0, 0, 0, 0, 0, 0)
    client.send_block_gradient(step, 0, 1, _grads(client.worker_id, step, size), sizes)
    return client.receive_averaged_block().gradients


@pytest.fixture(params=["grpc", "shm"])
def pair(request, workers) -> list[WorkerClient]:
    clients = workers(2, client_options={"transport": request.param})
    assert {c.transport for c in clients} == {request.param}
    return clients


def test_a_dropped_result_is_reused_with_the_same_bytes(pair) -> None:
    def work(c: WorkerClient) -> list[int]:
        first = _block(c, 0)
        assert first.tobytes() == _mean(2, 0).tobytes()
        where = _pointer(first)
        del first
        # Were the dropped array freed, this would likely take its memory.
        blocker = np.ones(TOTAL, np.float32)
        second = _block(c, 1)
        assert second.tobytes() == _mean(2, 1).tobytes()
        assert not np.shares_memory(second, blocker)
        return [where, _pointer(second)]

    for where, again in run_each(pair, work):
        assert again == where


@pytest.mark.parametrize(
    "keep",
    [
        lambda a: a,
        lambda a: a[5:],
        lambda a: a.reshape(1, -1),
        memoryview,
        torch.from_numpy,
        lambda a: np.frombuffer(a, np.float32),
    ],
    ids=["array", "slice", "reshape", "memoryview", "torch", "frombuffer"],
)
def test_a_kept_result_or_view_is_never_overwritten(pair, keep: Callable[[np.ndarray], object]) -> None:
    def work(c: WorkerClient) -> None:
        kept = keep(_block(c, 0))
        second = _block(c, 1)
        assert second.tobytes() == _mean(2, 1).tobytes()
        assert np.asarray(kept).reshape(-1).tobytes() == _mean(2, 0)[-np.asarray(kept).size :].tobytes()
        assert not np.shares_memory(second, np.asarray(kept))
        # Once dropped, the next step may use it; the one held by the client's pool now is
        # `second`'s, which is still held here: a third array.
        third = _block(c, 2)
        assert not np.shares_memory(third, second) and not np.shares_memory(third, np.asarray(kept))
        assert second.tobytes() == _mean(2, 1).tobytes()
        assert third.tobytes() == _mean(2, 2).tobytes()

    run_each(pair, work)


def test_a_component_view_of_a_block_keeps_its_result(pair) -> None:
    def work(c: WorkerClient) -> None:
        c.send_block_gradient(0, 0, 1, _grads(c.worker_id, 0), SIZES)
        block = c.receive_averaged_block()
        component = next(iter(block.components().values()))
        want = component.tobytes()
        del block
        second = _block(c, 1)
        assert component.tobytes() == want
        assert not np.shares_memory(second, component)

    run_each(pair, work)


def test_a_result_held_by_a_weak_reference_is_never_overwritten(pair) -> None:
    """Weakly held, a result may go away (the pool lets go of it; an arena result is freed), but
    is not reused while it can still be reached."""

    def work(c: WorkerClient) -> None:
        first = _block(c, 0)
        where = _pointer(first)
        ref = weakref.ref(first)
        del first
        second = _block(c, 1)
        held = ref()
        # A pooled result is replaced while still alive, so the new one is elsewhere; an arena
        # result (shared memory) may take freed memory only once nothing can reach the old one.
        if held is not None or c.transport != "shm":
            assert _pointer(second) != where
        assert held is None or held.tobytes() == _mean(2, 0).tobytes()

    run_each(pair, work)


def test_another_size_gets_a_new_array(pair) -> None:
    def work(c: WorkerClient) -> None:
        first = _block(c, 0)
        del first
        smaller = _block(c, 1, size=TOTAL - 7)
        assert smaller.shape == (TOTAL - 7,)
        assert smaller.tobytes() == _mean(2, 1, TOTAL - 7).tobytes()

    run_each(pair, work)


def test_many_steps_of_every_kind_reuse_their_arrays_with_the_same_bytes(pair) -> None:
    """Ten steps of blocks, a non-block component and the whole model through the pool: the
    coordinator's bytes every step, and the same arrays from the second step on."""

    def work(c: WorkerClient) -> None:
        seen: set[int] = set()
        for step in range(10):
            w = c.worker_id
            c.send_block_gradient(step, 1, 2, _grads(w, step), SIZES)
            c.send_block_gradient(step, 0, 2, _grads(w, 100 + step), SIZES)
            c.send_non_block_gradient(step, "lm_head", _grads(w, 200 + step, 5000))
            c.send_gradients(step, _grads(w, 300 + step, 3000), loss=1.0, correct=1, total=2)
            got = [c.receive_averaged_block().gradients for _ in range(2)]
            got.append(c.receive_averaged_non_block().gradients)
            got.append(c.receive_averaged().gradients)
            want = [
                _mean(2, step),
                _mean(2, 100 + step),
                _mean(2, 200 + step, 5000),
                _mean(2, 300 + step, 3000),
            ]
            assert [g.tobytes() for g in got] == [x.tobytes() for x in want]
            pointers = {_pointer(g) for g in got}
            if step:
                assert pointers == seen
            seen = pointers
            del got

    run_each(pair, work)
