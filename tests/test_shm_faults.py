"""Fault-matrix rows of the shared-memory path over real processes (docs/RELIABILITY.md, rows S1-S3)."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import numpy as np
import pytest

from gradserver.common import shm as shm_support
from gradserver.common.errors import AbortedError, UnavailableError
from gradserver.server import GradientServer
from gradserver.server.shm import ShmHub, remove_stale_dirs
from gradserver.worker import WorkerClient

from .helpers.server import TEST_TIMEOUTS
from .helpers.shm import assert_nothing_mapped, dev_shm

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(not shm_support.supported(), reason="needs Linux memfd and fd passing"),
]

HEARTBEAT = 2.0
MARGIN = 10.0  # a loaded machine; far below the step timeout
SIZE = 300_000  # elements: a few chunks of the default size would be slow; one is enough

# A worker that contributes block 0 of 2 from its shared arena, then keeps rewriting a second
# gradient buffer (as a backward pass would) without ever naming it, until it is killed.
_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from gradserver.worker import Timeouts, WorkerClient
    from gradserver.common import compute_block_sizes

    client = WorkerClient.connect(sys.argv[1], timeout=Timeouts(receive=60.0), transport="shm")
    sizes = compute_block_sizes(64, 32, 128)
    done = client.gradient_buffer(sum(sizes))
    done[:] = 1.0
    client.send_block_gradient(0, 0, 2, done, sizes)
    busy = client.gradient_buffer(sum(sizes))
    print(f"WRITING worker {client.worker_id}", flush=True)
    value = 0.0
    while True:
        value += 1.0
        busy[:] = value
    """
)


def _hub(coordinator: GradientServer) -> ShmHub | None:
    """The coordinator's shared-memory hub (None: it does not offer shared memory)."""
    hub: ShmHub | None = coordinator.features["shm"].hub
    return hub


def test_row_s1_a_worker_killed_while_writing_its_arena_fails_the_step_naming_it(
    processes, coordinator, tmp_path
) -> None:
    before = dev_shm()
    server = coordinator(world_size=2, heartbeat_timeout=HEARTBEAT, step_timeout=120.0, shm_dir=str(tmp_path))
    proc = processes.start([sys.executable, "-c", _WRITER, server.address], "writer")
    client = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS, transport="shm")
    try:
        victim = int(proc.wait_for(r"WRITING worker (\d)").group(1))
        from gradserver.common import compute_block_sizes

        sizes = compute_block_sizes(64, 32, 128)
        client.send_block_gradient(0, 0, 2, np.full(sum(sizes), 3.0, np.float32), sizes)
        block = client.receive_averaged_block()
        assert block.num_contributors == 2 and np.all(block.gradients == 2.0)
        proc.kill()
        started = time.monotonic()
        client.send_block_gradient(0, 1, 2, np.ones(sum(sizes), np.float32), sizes)
        with pytest.raises(AbortedError, match=rf"step 0 .*worker {victim} "):
            client.receive_averaged_block()
        assert time.monotonic() - started < HEARTBEAT + MARGIN
        # Its arena is never read again: the coordinator dropped it.
        assert not server.call(lambda s: _hub(s).registered(victim) if _hub(s) else True)
    finally:
        client.close()
    assert dev_shm() == before


def test_row_s2_a_killed_coordinator_ends_shm_workers_without_a_hang(processes, tmp_path) -> None:
    before = dev_shm()
    proc, address = processes.coordinator(
        "--world-size", "1", "--heartbeat-timeout", str(HEARTBEAT), "--shm-dir", str(tmp_path)
    )
    client = WorkerClient.connect(address, timeout=TEST_TIMEOUTS, transport="shm")
    try:
        assert client.transport == "shm"
        data = np.arange(SIZE, dtype=np.float32)
        client.send_non_block_gradient(0, 0, data)
        assert np.array_equal(client.receive_averaged_non_block().gradients, data)
        # Its socket directory carries its pid, so that what it leaves is known as a dead one's.
        assert [p for p in tmp_path.iterdir() if p.name.startswith(f"gradserver-shm-{proc.proc.pid}-")]
        proc.kill()
        started = time.monotonic()

        def next_step(c: WorkerClient) -> None:
            c.send_non_block_gradient(1, 0, data)
            c.receive_averaged_non_block(timeout=HEARTBEAT + MARGIN)

        with pytest.raises(UnavailableError, match="lost the connection to the coordinator"):
            next_step(client)
        assert time.monotonic() - started < HEARTBEAT + MARGIN
    finally:
        client.close()
    del client
    assert_nothing_mapped()  # nothing of the dead coordinator's memory is held here
    assert dev_shm() == before
    # SIGKILL left the socket directory; the worker, which saw the socket end, removed it.
    deadline = time.monotonic() + 10
    while any(p.name.startswith("gradserver-shm-") for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline, sorted(tmp_path.iterdir())
        time.sleep(0.05)
    # One that no worker removed (say none used it): the next coordinator removes it once it is
    # old enough that it cannot be a coordinator still starting, and leaves a live one's alone.
    left = tmp_path / "gradserver-shm-abandoned"
    left.mkdir(mode=0o700)
    assert remove_stale_dirs(str(tmp_path)) == []  # too recent
    hour_ago = time.time() - 3600
    os.utime(left, (hour_ago, hour_ago))
    processes.coordinator("--world-size", "1", "--shm-dir", str(tmp_path))
    assert not left.exists()
    (live,) = [p for p in tmp_path.iterdir() if p.name.startswith("gradserver-shm-")]
    os.utime(live, (hour_ago, hour_ago))
    assert remove_stale_dirs(str(tmp_path)) == []
    assert live.exists()
