"""Live recovery through the client library: a worker that joins a running job takes the state
of a live member, checked byte for byte, and the replicas stay bit-identical; state digests
name and evict a diverged replica (in one process: a real coordinator and real clients)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import numpy as np
import pytest

from gradserver.common import compute_block_sizes
from gradserver.worker import StateSnapshot, WorkerClient, state_digest

from .helpers.server import TEST_TIMEOUTS, connect_all

SIZES = compute_block_sizes(8, 4, 16)
TOTAL = sum(SIZES)


class Replica:
    """A toy data-parallel replica: weights and a momentum buffer, one block key per step; its
    gradient depends on its state and its worker id, so a stale replica would diverge."""

    def __init__(self, client: WorkerClient, state: dict[str, np.ndarray] | None = None, step: int = 0) -> None:
        self.client = client
        self.step = step
        if state is None:
            rng = np.random.default_rng(7)
            state = {
                "w": rng.standard_normal(TOTAL).astype(np.float32),
                "m": np.zeros(TOTAL, np.float32),
                "count": np.zeros(1, np.int64),
            }
        self.state = state
        client.offer_state(lambda: StateSnapshot(self.step, self.state, b"position %d" % self.step))

    def run_step(self) -> None:
        w, m = self.state["w"], self.state["m"]
        grad = (np.sin(w * (self.step + 1)) + 0.01 * self.client.worker_id).astype(np.float32)
        self.client.send_block_gradient(self.step, 0, 1, grad, SIZES)
        avg = self.client.receive_averaged_block().gradients
        with self.client.updating_state():
            m *= np.float32(0.9)
            m += avg
            w -= np.float32(0.01) * m
            self.state["count"] += 1
            self.step += 1

    def run_until(self, last: int) -> None:
        while self.step <= last:
            self.run_step()


def _in_threads(*calls: Callable[[], object]) -> list[object]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(60) for f in [pool.submit(c) for c in calls]]


def test_a_replacement_takes_the_state_and_the_replicas_stay_identical(coordinator) -> None:
    server = coordinator(world_size=3, on_worker_loss="continue")
    clients = connect_all(server.address, 3)
    replicas = [Replica(c) for c in clients]
    try:
        _in_threads(*[lambda r=r: r.run_until(2) for r in replicas])
        clients[2].close()  # leaves; the others go on
        survivors = [
            threading.Thread(target=r.run_until, args=(9,), daemon=True) for r in replicas[:2]
        ]
        for t in survivors:
            t.start()
        newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
        assert newcomer.worker_id == 2
        assert newcomer.recovery_step is not None and newcomer.recovery_step >= 3
        got = newcomer.recover()
        assert got.step == newcomer.recovery_step and got.donor in (0, 1)
        assert got.extra == b"position %d" % got.step
        late = Replica(newcomer, {k: np.array(v) for k, v in got.tensors.items()}, got.step)
        late.run_until(9)
        for t in survivors:
            t.join(60)
            assert not t.is_alive()
        everyone = [replicas[0], replicas[1], late]
        for r in everyone[1:]:
            for name in ("w", "m", "count"):
                np.testing.assert_array_equal(r.state[name], everyone[0].state[name])
        assert int(late.state["count"][0]) == 10
        assert len({state_digest(r.state) for r in everyone}) == 1
        newcomer.close()
    finally:
        for c in clients:
            c.close()
