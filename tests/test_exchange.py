"""Exchanging gradients in one process, a real grpc.aio coordinator on port 0 and real
WorkerClients: averages of blocks, non-block components, whole models and the loss, whatever the
order and size, barriers, disjoint data sample ranges, and the client's own checks of its input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradserver.common import compute_block_sizes
from gradserver.common.components import BlockComponent, NonBlockComponent
from gradserver.common.errors import FailedPreconditionError, InvalidArgumentError
from gradserver.worker import WorkerClient

from .helpers.server import run_each


def _grads(worker: int, step: int, tag: int, size: int) -> np.ndarray:
    return np.random.default_rng([worker, step, tag]).standard_normal(size, dtype=np.float32)


def _reference(world: int, step: int, tag: int, size: int) -> np.ndarray:
    return sum(_grads(w, step, tag, size).astype(np.float64) for w in range(world)) / world


def _assert_mean(got: np.ndarray, want: np.ndarray) -> None:
    torch.testing.assert_close(
        torch.from_numpy(got.astype(np.float64)), torch.from_numpy(want), rtol=1e-6, atol=0.0
    )


def test_two_workers_ones_and_threes_average_to_twos(workers) -> None:
    clients = workers(2)
    sizes = compute_block_sizes(8, 4, 16)

    def work(c: WorkerClient) -> np.ndarray:
        value = 1.0 if c.worker_id == 0 else 3.0
        c.send_block_gradient(0, 0, 1, np.full(sum(sizes), value, np.float32), sizes)
        return c.receive_averaged_block().gradients

    for got in run_each(clients, work):
        assert np.array_equal(got, np.full(sum(sizes), 2.0, np.float32))


def test_single_worker_gets_back_exactly_what_it_sent(workers) -> None:
    (client,) = workers(1)
    sizes = compute_block_sizes(16, 8, 32)
    data = _grads(0, 0, 1, sum(sizes)) * np.float32(1e-3)
    client.send_block_gradient(0, 0, 1, data, sizes)
    block = client.receive_averaged_block()
    assert block.gradients.tobytes() == data.tobytes()
    client.send_non_block_gradient(0, NonBlockComponent.FINAL_NORM, data[:16])
    assert client.receive_averaged_non_block().gradients.tobytes() == data[:16].tobytes()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_blocks_in_reverse_before_reading_any(workers, world: int) -> None:
    """24 blocks of randomized component sizes, all sent before any average is read, spread
    over several chunks; results match a float64 mean and are bit-identical across workers."""
    clients = workers(world, chunk_mib=1 / 64, max_message_mib=1.0, max_inflight_mib=1.0)
    rng = np.random.default_rng(world)
    num_blocks = 24
    sizes = [tuple(int(s) for s in rng.integers(0, 3000, 9)) for _ in range(num_blocks)]

    def work(c: WorkerClient) -> list[bytes]:
        for b in reversed(range(num_blocks)):
            c.send_block_gradient(5, b, num_blocks, _grads(c.worker_id, 5, b, sum(sizes[b])), sizes[b])
        got = []
        for b in reversed(range(num_blocks)):
            avg = c.receive_averaged_block()
            assert (avg.step, avg.block_idx, avg.num_blocks) == (5, b, num_blocks)
            assert avg.component_sizes == sizes[b]
            assert avg.num_contributors == world
            _assert_mean(avg.gradients, _reference(world, 5, b, sum(sizes[b])))
            got.append(avg.gradients.tobytes())
        return got

    results = run_each(clients, work)
    assert all(r == results[0] for r in results)


def test_lockstep_and_many_steps(workers) -> None:
    clients = workers(3)
    sizes = compute_block_sizes(16, 8, 32)
    total = sum(sizes)

    def work(c: WorkerClient) -> list[bytes]:
        out = []
        for step in range(4):
            for b in reversed(range(3)):
                c.send_block_gradient(step, b, 3, _grads(c.worker_id, step, b, total), sizes)
                avg = c.receive_averaged_block()
                _assert_mean(avg.gradients, _reference(3, step, b, total))
                out.append(avg.gradients.tobytes())
            for comp in NonBlockComponent:
                c.send_non_block_gradient(step, comp, _grads(c.worker_id, step, 100 + comp, 64))
                got = c.receive_averaged_non_block()
                assert got.component is comp
                _assert_mean(got.gradients, _reference(3, step, 100 + comp, 64))
                out.append(got.gradients.tobytes())
        return out

    results = run_each(clients, work)
    assert results[0] == results[1] == results[2]


def test_tensor_sizes_around_the_chunk_boundary(workers) -> None:
    clients = workers(2, chunk_mib=4096 / 2**20, max_message_mib=1.0, max_inflight_mib=1.0)
    chunk = clients[0].chunk_bytes // 4
    lengths = [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk + 7]

    def work(c: WorkerClient) -> None:
        for step, n in enumerate(lengths):
            c.send_non_block_gradient(step, "embedding", _grads(c.worker_id, step, 0, n))
            got = c.receive_averaged_non_block()
            assert got.gradients.shape == (n,)
            _assert_mean(got.gradients, _reference(2, step, 0, n))

    run_each(clients, work)


def test_torch_tensors_and_component_views(workers) -> None:
    clients = workers(2)
    sizes = compute_block_sizes(4, 2, 8)

    def work(c: WorkerClient) -> None:
        grads = torch.arange(sum(sizes), dtype=torch.float32) * (c.worker_id + 1)
        c.send_block_gradient(0, 0, 1, grads, sizes)
        avg = c.receive_averaged_block()
        expected = np.arange(sum(sizes), dtype=np.float32) * 1.5
        np.testing.assert_array_equal(avg.gradients, expected)
        parts = avg.components()
        assert [p.size for p in parts.values()] == list(sizes)
        assert parts[BlockComponent.POST_ATTN_NORM].size == 4

    run_each(clients, work)


def test_whole_model_average_and_sample_weighted_loss(workers) -> None:
    clients = workers(2)
    losses = {0: (2.0, 3, 10), 1: (4.0, 25, 30)}

    def work(c: WorkerClient) -> None:
        loss, correct, total = losses[c.worker_id]
        c.send_gradients(7, np.full(100, c.worker_id, np.float32), loss, correct, total)
        avg = c.receive_averaged()
        assert avg.step == 7
        np.testing.assert_array_equal(avg.gradients, np.full(100, 0.5, np.float32))
        assert avg.global_loss == pytest.approx((2.0 * 10 + 4.0 * 30) / 40)
        assert (avg.correct, avg.total) == (28, 40)

    run_each(clients, work)


def test_barrier_releases_when_the_last_worker_arrives(workers) -> None:
    clients = workers(3)
    run_each(clients, lambda c: c.barrier(0, "start"))
    run_each(clients, lambda c: c.barrier(1, "start"))


def test_sample_ranges_are_disjoint_and_complete(workers) -> None:
    clients = workers(3)
    dataset, batch = 50, 4

    def work(c: WorkerClient) -> list[list[int]]:
        return [c.get_sample_ranges(step, dataset, batch).indices() for step in range(8)]

    per_worker = run_each(clients, work)
    for step in range(8):
        taken = [i for w in range(3) for i in per_worker[w][step]]
        assert len(taken) == len(set(taken)) == 12
    walked = [i for step in range(8) for w in range(3) for i in per_worker[w][step]]
    # 8 steps of 12 = 96 samples walk the 50-sample data set once, then 46 samples again:
    # every sample is used, none more than twice.
    counts = np.bincount(walked, minlength=50)
    assert counts.min() == 1 and counts.max() == 2 and counts.sum() == 96


def test_client_side_checks_name_the_problem(workers) -> None:
    (client,) = workers(1)
    sizes = compute_block_sizes(4, 2, 8)
    with pytest.raises(InvalidArgumentError, match="block_idx 3 is out of range for num_blocks 2"):
        client.send_block_gradient(0, 3, 2, np.zeros(sum(sizes), np.float32), sizes)
    with pytest.raises(ValueError, match=r"data length 5 != sum\(component_sizes\)"):
        client.send_block_gradient(0, 0, 2, np.zeros(5, np.float32), sizes)
    with pytest.raises(InvalidArgumentError, match="dtype float64 is not allowed"):
        client.send_non_block_gradient(0, 0, np.zeros(5))
    with pytest.raises(InvalidArgumentError, match="unknown non-block component 7"):
        client.send_non_block_gradient(0, 7, np.zeros(5, np.float32))
    with pytest.raises(FailedPreconditionError, match="nothing to receive"):
        client.receive_averaged_block()
