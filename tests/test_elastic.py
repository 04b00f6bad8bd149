"""--on-worker-loss continue: a step whose worker is lost completes with the survivors, averaged
over the real contributors and reported as such; the lost place can be refilled at a later step."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from gradserver.common import compute_block_sizes
from gradserver.common.errors import AbortedError, FailedPreconditionError
from gradserver.common.messages import AveragedChunkOut, ErrorOut, TensorKey
from gradserver.worker import WorkerClient

from .helpers.raw import client_and_raw
from .helpers.server import TEST_TIMEOUTS, connect_all, run_each

SIZES = compute_block_sizes(8, 4, 16)
TOTAL = sum(SIZES)


def _send(client: WorkerClient, step: int, value: float) -> None:
    client.send_block_gradient(step, 0, 1, np.full(TOTAL, value, np.float32), SIZES)


def test_survivors_finish_the_step_and_a_replacement_joins_later(coordinator) -> None:
    server = coordinator(world_size=3, on_worker_loss="continue")
    clients = connect_all(server.address, 3)
    try:
        run_each(clients, lambda c: (_send(c, 0, c.worker_id), c.receive_averaged_block()))
        _send(clients[0], 1, 1.0)
        _send(clients[1], 1, 3.0)
        clients[2].close()  # leaves before sending step 1
        for c in clients[:2]:
            avg = c.receive_averaged_block()
            assert avg.num_contributors == 2
            np.testing.assert_array_equal(avg.gradients, np.full(TOTAL, 2.0, np.float32))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            replacement = pool.submit(WorkerClient.connect, server.address, timeout=TEST_TIMEOUTS).result(30)
        assert replacement.worker_id == 2
        _send(replacement, 1, 9.0)
        with pytest.raises(FailedPreconditionError, match="takes part from step 2"):
            replacement.receive_averaged_block()
        everyone = [clients[0], clients[1], replacement]
        results = run_each(
            everyone, lambda c: (_send(c, 2, 3.0 * c.worker_id), c.receive_averaged_block())[1]
        )
        assert all(r.num_contributors == 3 for r in results)
        np.testing.assert_array_equal(results[0].gradients, np.full(TOTAL, 3.0, np.float32))
        replacement.close()
    finally:
        for c in clients:
            c.close()


def test_a_lost_workers_complete_contribution_stays_counted(coordinator) -> None:
    server = coordinator(world_size=3, on_worker_loss="continue")
    clients = connect_all(server.address, 3)
    try:
        _send(clients[2], 0, 6.0)
        clients[2].close()  # its key is complete: it was accepted, so it counts
        _send(clients[0], 0, 0.0)
        _send(clients[1], 0, 3.0)
        for c in clients[:2]:
            avg = c.receive_averaged_block()
            assert avg.num_contributors == 3
            np.testing.assert_array_equal(avg.gradients, np.full(TOTAL, 3.0, np.float32))
    finally:
        for c in clients:
            c.close()


def test_a_loss_that_would_mix_an_average_fails_the_step(coordinator) -> None:
    server = coordinator(
        world_size=2,
        on_worker_loss="continue",
        chunk_mib=1 / 1024,
        max_message_mib=1.0,
        heartbeat_timeout=60.0,
    )
    client, raw = client_and_raw(server.address)
    try:
        chunk = raw.accepted.chunk_bytes // 4
        key = TensorKey.block(0, 0, 1)
        data = np.ones(TOTAL, np.float32)
        assert chunk < TOTAL
        raw.send_tensor(key, data[:chunk], SIZES, total=TOTAL)  # only the first chunk
        _send(client, 0, 1.0)
        event = raw.recv(10)
        while not (isinstance(event, AveragedChunkOut) and event.offset == 0):
            assert not isinstance(event, ErrorOut), event
            event = raw.recv(10)  # wait until chunk 0 was averaged with the raw worker's data
        raw.close()
        with pytest.raises(
            AbortedError, match="after part of step 0 block 0 of 1 was averaged with its data"
        ):
            client.receive_averaged_block()
    finally:
        client.close()


def test_barrier_releases_with_the_survivors(coordinator) -> None:
    server = coordinator(world_size=3, on_worker_loss="continue")
    clients = connect_all(server.address, 3)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(c.barrier, 0, "sync") for c in clients[:2]]
            clients[2].close()
            for f in waiting:
                f.result(20)
    finally:
        for c in clients:
            c.close()
