"""Every worker transport, driven through the `Link` interface alone against real coordinators.

Each test runs the same workload over the three links `open_link` can pick: gRPC, shared memory
(one coordinator with a socket directory) and partitioned coordinators (two partitions, each behind a
proxy so the partition map can name them before they start). Whatever carries the bytes, the results,
the errors and the cleanup must be the same.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradserver.common import codec
from gradserver.common import shm as shm_support
from gradserver.common.chunking import chunk_spans
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import GradServerError
from gradserver.common.messages import ChunkHeader, DType, JoinRequestIn, KeyKind, SampleStats, TensorKey
from gradserver.server.config import CoordinatorConfig
from gradserver.worker.joining import join_at
from gradserver.worker.transports import Link, open_link

from .helpers.proxy import FaultProxy
from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_all, run_each

CHUNK_ELEMENTS = 1024
CHUNK_MIB = CHUNK_ELEMENTS * 4 / (1 << 20)
SIZE = 5 * CHUNK_ELEMENTS + 17  # several chunks and a short last one, spread over partitions
WORLD = 2
STEPS = 3
LINKS = ("grpc", "shm", "partitioned")
# Which concrete link `open_link` must have picked for each setup.
LINK_CLASSES = {"grpc": "GrpcLink", "shm": "GrpcLink", "partitioned": "PartitionedLink"}
THREADS_END_WITHIN = 15.0

pytestmark = pytest.mark.skipif(not shm_support.supported(), reason="needs Linux memfd and fd passing")


@dataclasses.dataclass
class Setup:
    """The coordinators of one job (behind proxies when partitioned) and how workers reach them."""

    address: str
    choice: str
    servers: list[ServerThread]
    proxies: list[FaultProxy]

    def stop(self) -> None:
        """Stops everything; safe to call again (the fixture does, in its `finally`)."""
        for server in self.servers:
            server.stop()
        for proxy in self.proxies:
            proxy.stop()


def _config(**overrides: Any) -> CoordinatorConfig:
    settings: dict[str, Any] = {
        "bind": "127.0.0.1:0",
        "world_size": WORLD,
        "heartbeat_timeout": 5.0,
        "step_timeout": 20.0,
        "join_timeout": 20.0,
        "chunk_mib": CHUNK_MIB,
        "max_message_mib": 1.0,
    }
    return CoordinatorConfig(**{**settings, **overrides})


@pytest.fixture
def setups(tmp_path: Path) -> Iterator[Callable[[str], Setup]]:
    """Factory: setups(link) -> started coordinators for that link, stopped in `finally`."""
    made: list[Setup] = []

    def make(link: str) -> Setup:
        if link == "partitioned":
            proxies = [FaultProxy("127.0.0.1", 0).start() for _ in range(2)]
            setup = Setup(proxies[0].address, "auto", [], proxies)
            made.append(setup)
            partition_map = ",".join(p.address for p in proxies)
            for index, proxy in enumerate(proxies):
                server = ServerThread(_config(partition_map=partition_map, partition_index=index))
                setup.servers.append(server)
                server.start()
                proxy.target = ("127.0.0.1", server.server.port if server.server else 0)
            return setup
        shm_dir = tmp_path / f"shm-{len(made)}"
        shm_dir.mkdir()
        server = ServerThread(_config(shm_dir=str(shm_dir)))
        setup = Setup("", link, [server], [])
        made.append(setup)
        setup.address = server.start()
        return setup

    try:
        yield make
    finally:
        for setup in made:
            setup.stop()


def _open(setup: Setup, rank: int) -> Link:
    """Joins as `rank` and opens the link `open_link` picks for this setup."""
    request = JoinRequestIn(f"links-{rank}", 0, "cpu", codec.PROTOCOL_VERSION, None, {}, rank=rank)

    def join(at: str, request: JoinRequestIn) -> Any:
        return join_at(at, request, TEST_TIMEOUTS, None, "", ())

    channel, accepted = join(setup.address, request)

    def join_partition(index: int, at: str) -> Any:
        return join(at, dataclasses.replace(request, rank=accepted.worker_id, partition_index=index))

    link = open_link(
        channel,
        accepted,
        TEST_TIMEOUTS,
        (),
        join_partition,
        choice=setup.choice,
        wire_dtype=DType.FLOAT32,
        shm_arena_mib=4 * CHUNK_MIB,
    )
    try:
        link.control.confirm_open(TEST_TIMEOUTS.connect)
    except BaseException:
        link.close()
        raise
    return link


def _open_all(setup: Setup) -> list[Link]:
    """One link per rank, joined concurrently (a Join returns once the whole world joined)."""
    with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
        futures = [pool.submit(_open, setup, rank) for rank in range(WORLD)]
        links = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in futures]
    for rank, link in enumerate(links):
        assert link.accepted.worker_id == rank
    return links


def _on_each(links: list[Link], fn: Callable[[Link], Any]) -> list[Any]:
    """fn(link) on every link concurrently; each outcome is its result or its exception."""
    with concurrent.futures.ThreadPoolExecutor(len(links)) as pool:
        futures = [pool.submit(fn, link) for link in links]
        outcomes: list[Any] = []
        for future in futures:
            try:
                outcomes.append(future.result(timeout=60))
            except GradServerError as exc:
                outcomes.append(exc)
        return outcomes


def _data(worker: int, step: int) -> np.ndarray:
    return np.random.default_rng([worker, step]).standard_normal(SIZE, dtype=np.float32)


def _average(link: Link, key: TensorKey, data: np.ndarray) -> bytes:
    """Sends `data` as `key` chunk by chunk and waits for its average, through the interface."""
    header = ChunkHeader(DType.FLOAT32, data.size, ())
    link.expect(key, (), data.size, DType.FLOAT32)
    for offset, length in chunk_spans(data.size, link.accepted.chunk_bytes // 4):
        link.send_chunk(key, header, offset, data[offset : offset + length], None)
    return link.wait_result(key).array.tobytes()


def _steps(link: Link) -> list[bytes]:
    """STEPS steps of one key each, every step closed by a barrier."""
    out = []
    for step in range(STEPS):
        key = TensorKey.non_block(step, NonBlockComponent.EMBEDDING)
        out.append(_average(link, key, _data(link.accepted.worker_id, step)))
        link.control.barrier(step, "commit", None)
    return out


def _reference_of(step: int) -> bytes:
    """The coordinator's rule: the float64 sum of every worker's data in worker order, divided."""
    total = sum((_data(w, step).astype(np.float64) for w in range(WORLD)), np.zeros(SIZE))
    return (total / WORLD).astype(np.float32).tobytes()


def _reference() -> list[bytes]:
    return [_reference_of(step) for step in range(STEPS)]


def _run(setup: Setup, fn: Callable[[Link], Any]) -> list[Any]:
    """Opens every rank's link, runs fn on each, and closes them whatever happened."""
    links = _open_all(setup)
    try:
        return _on_each(links, fn)
    finally:
        for link in links:
            link.close()


@pytest.mark.parametrize("name", LINKS)
def test_open_link_picks_the_link_of_each_setup(setups: Callable[[str], Setup], name: str) -> None:
    links = _open_all(setups(name))
    try:
        assert [type(link).__name__ for link in links] == [LINK_CLASSES[name]] * WORLD
        assert [link.transport for link in links] == ["shm" if name == "shm" else "grpc"] * WORLD
    finally:
        for link in links:
            link.close()


def test_every_link_gives_the_same_bytes_for_the_same_inputs(setups: Callable[[str], Setup]) -> None:
    want = _reference()
    results = {name: _run(setups(name), _steps) for name in LINKS}
    for name, per_worker in results.items():
        assert per_worker == [want] * WORLD, f"{name}: averages differ from the reference"


def test_a_failed_step_surfaces_through_every_link_as_the_same_error(
    setups: Callable[[str], Setup],
) -> None:
    """Worker 1 sends a NaN at step 1: each worker's link raises the same class whatever the
    transport (the culprit hears its input refused, the other that the step failed), naming the
    step and the culprit."""
    poisoned_step, culprit = 1, 1

    def work(link: Link) -> GradServerError:
        for step in range(poisoned_step):
            _average(link, TensorKey.non_block(step, NonBlockComponent.EMBEDDING), _data(0, step))
        data = _data(link.accepted.worker_id, poisoned_step)
        if link.accepted.worker_id == culprit:
            data[SIZE - 3] = np.nan
        key = TensorKey.non_block(poisoned_step, NonBlockComponent.EMBEDDING)
        try:
            _average(link, key, data)
        except GradServerError as exc:
            return exc
        raise AssertionError(f"step {poisoned_step} completed despite a NaN")

    classes = {}
    for name in LINKS:
        for rank, error in enumerate(_run(setups(name), work)):
            assert isinstance(error, GradServerError), f"{name} worker {rank}: {error!r}"
            assert error.step == poisoned_step, f"{name} worker {rank}: {error}"
            assert f"worker {culprit}" in error.message and "non-finite" in error.message, error.message
            classes[(name, rank)] = type(error)
    for rank in range(WORLD):
        assert len({classes[(name, rank)] for name in LINKS}) == 1, classes


def _cycle(setups: Callable[[str], Setup], name: str) -> None:
    """Starts the setup's coordinators, runs one step on every link, closes the links, then stops
    the coordinators (so that their own threads end too)."""
    setup = setups(name)
    try:
        key = TensorKey.non_block(0, NonBlockComponent.LM_HEAD)
        _run(setup, lambda link: _average(link, key, _data(link.accepted.worker_id, 0)))
    finally:
        setup.stop()


def _wait_threads_end(threads: set[threading.Thread], within: float) -> list[str]:
    """Joins each thread against one shared deadline; the names of those still alive."""
    deadline = time.monotonic() + within
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in threads if t.is_alive())


@pytest.mark.parametrize("name", LINKS)
def test_closing_a_link_leaves_no_thread_behind(setups: Callable[[str], Setup], name: str) -> None:
    _cycle(setups, name)  # starts gRPC's process-wide threads (the aio poller), kept for good
    before = set(threading.enumerate())
    _cycle(setups, name)
    alive = _wait_threads_end(set(threading.enumerate()) - before, THREADS_END_WITHIN)
    assert not alive, f"{name}: threads still running after close: {alive}"


@pytest.mark.parametrize("name", LINKS)
def test_the_clients_general_calls_and_the_per_kind_ones_mix_over_each_link(
    setups: Callable[[str], Setup], name: str
) -> None:
    """`send`/`receive`/`allocate` are what the per-kind calls wrap: a key sent one way is
    received the other, with the same bytes, sizes and sample statistics."""
    setup = setups(name)
    clients = connect_all(setup.address, WORLD, TEST_TIMEOUTS, transport=setup.choice)
    sizes = (SIZE - 8, 1, 1, 1, 1, 1, 1, 1, 1)

    def work(c: Any) -> tuple[bytes, bytes, tuple[int, ...], TensorKey, SampleStats | None]:
        buffer = c.allocate(SIZE)
        assert buffer.dtype == np.float32 and buffer.shape == (SIZE,) and not buffer.any()
        buffer[:] = _data(c.worker_id, 0)
        c.send(TensorKey.non_block(0, NonBlockComponent.EMBEDDING), buffer)
        c.send_block_gradient(0, 0, 1, _data(c.worker_id, 1), sizes)
        c.send(TensorKey.whole_model(0), np.ones(4, np.float32), stats=SampleStats(2.0, 1, 2))
        non_block = c.receive_averaged_non_block()
        block = c.receive(KeyKind.BLOCK)
        whole = c.receive(KeyKind.WHOLE_MODEL)
        return (
            non_block.gradients.tobytes(),
            block.gradients.tobytes(),
            block.component_sizes,
            block.key,
            whole.stats,
        )

    try:
        assert [c.transport for c in clients] == ["shm" if name == "shm" else "grpc"] * WORLD
        results = run_each(clients, work)
    finally:
        for client in clients:
            client.close()
    want = [_reference_of(0), _reference_of(1), sizes, TensorKey.block(0, 0, 1), SampleStats(2.0, 2, 4)]
    assert [list(r) for r in results] == [want] * WORLD


def test_connect_with_the_old_backend_keyword_warns_and_sends_it_as_the_device_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`backend` was the device type sent at Join; the word is the torch.distributed backend's
    now, so `connect(backend=...)` still works for one release, with a DeprecationWarning."""
    from gradserver.worker import WorkerClient

    caplog.set_level(logging.INFO, "gradserver.server.membership")
    server = ServerThread(_config(world_size=1))
    address = server.start()
    try:
        with pytest.warns(DeprecationWarning, match=r"connect\(backend=\.\.\.\) is deprecated.*device_type"):
            client = WorkerClient.connect(
                address, node_id="old-caller", backend="cuda", timeout=TEST_TIMEOUTS
            )
        client.close()
    finally:
        server.stop()
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(joined) == 1 and "node 'old-caller'" in joined[0] and "device type 'cuda'" in joined[0], joined


# --- pacing (the network links keep a window of unanswered chunks) ---------------------------

NETWORK_LINKS = ("grpc", "partitioned")


def _grpc_links(link: Link) -> list[Any]:
    """The gRPC streams under a network link: itself, or one per partition."""
    return list(getattr(link, "_links", [link]))


def _unanswered(link: Link) -> int:
    return sum(stream.pacer.unanswered_elements() for stream in _grpc_links(link))


@pytest.mark.parametrize("name", NETWORK_LINKS)
def test_workers_sending_the_same_keys_in_opposite_orders_both_finish(
    setups: Callable[[str], Setup], name: str
) -> None:
    """Pacing makes a sender wait for averages, and an average needs every worker's copy: worker 0
    sends key A then B, worker 1 B then A, each key many windows long. Neither may wait on the
    other for good; both get both averages, the same bytes as ever."""
    steps_keys = [
        TensorKey.non_block(0, NonBlockComponent.EMBEDDING),
        TensorKey.non_block(0, NonBlockComponent.LM_HEAD),
    ]
    size = 40 * CHUNK_ELEMENTS

    def data(worker: int, which: int) -> np.ndarray:
        return np.random.default_rng([worker, which, 7]).standard_normal(size, dtype=np.float32)

    def work(link: Link) -> list[bytes]:
        order = [0, 1] if link.accepted.worker_id == 0 else [1, 0]
        header = ChunkHeader(DType.FLOAT32, size, ())
        for which in order:
            key = steps_keys[which]
            link.expect(key, (), size, DType.FLOAT32)
            payload = data(link.accepted.worker_id, which)
            for offset, length in chunk_spans(size, link.accepted.chunk_bytes // 4):
                link.send_chunk(key, header, offset, payload[offset : offset + length], None)
        results = [link.wait_result(key).array.tobytes() for key in steps_keys]
        assert _unanswered(link) == 0
        return results

    want = [
        (sum((data(w, which).astype(np.float64) for w in range(WORLD)), np.zeros(size)) / WORLD)
        .astype(np.float32)
        .tobytes()
        for which in range(2)
    ]
    assert _run(setups(name), work) == [want] * WORLD


@pytest.mark.parametrize("name", NETWORK_LINKS)
def test_no_chunk_stays_counted_as_unanswered_after_averages_refusals_and_failed_steps(
    setups: Callable[[str], Setup], name: str
) -> None:
    """What the window counts is given back whichever way a key ends: its average, its refusal
    (a NaN), its step's failure (the other worker's NaN) or the sender giving it up."""

    def work(link: Link) -> list[int]:
        me = link.accepted.worker_id
        seen = []
        _average(link, TensorKey.non_block(0, NonBlockComponent.EMBEDDING), _data(me, 0))
        seen.append(_unanswered(link))
        poisoned = _data(me, 1)
        if me == 1:
            poisoned[3] = np.nan
        with pytest.raises(GradServerError):
            _average(link, TensorKey.non_block(1, NonBlockComponent.EMBEDDING), poisoned)
        seen.append(_unanswered(link))
        key = TensorKey.non_block(2, NonBlockComponent.LM_HEAD)
        link.expect(key, (), SIZE, DType.FLOAT32)
        link.send_chunk(key, ChunkHeader(DType.FLOAT32, SIZE, ()), 0, _data(me, 2)[:CHUNK_ELEMENTS], None)
        link.forget(key)
        seen.append(_unanswered(link))
        return seen

    assert _run(setups(name), work) == [[0, 0, 0]] * WORLD


@pytest.mark.parametrize("name", NETWORK_LINKS)
def test_a_worker_keeps_at_most_four_chunks_per_stream_unanswered_until_the_others_send_theirs(
    setups: Callable[[str], Setup], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker 0 sends twelve chunks of a key worker 1 has not sent yet: four per stream go (one
    stream, or one per partition: the chunks alternate between the two), then it waits (its
    patience is made long here, so the wait is the window's, not the patience's end); once worker
    1 sends, averages come back and the rest follow, the same bytes as ever."""
    from gradserver.worker.transports import pacing

    monkeypatch.setattr(pacing, "PATIENCE_S", 60.0)
    chunks = 12
    size = chunks * CHUNK_ELEMENTS
    key = TensorKey.non_block(0, NonBlockComponent.EMBEDDING)
    header = ChunkHeader(DType.FLOAT32, size, ())
    data = [np.random.default_rng([w, 11]).standard_normal(size, dtype=np.float32) for w in range(WORLD)]
    links = _open_all(setups(name))
    window = pacing.WINDOW_CHUNKS * len(_grpc_links(links[0]))
    sent = [0] * WORLD
    progressed = threading.Condition()

    def send_all(link: Link) -> bytes:
        me = link.accepted.worker_id
        link.expect(key, (), size, DType.FLOAT32)
        for offset, length in chunk_spans(size, CHUNK_ELEMENTS):
            link.send_chunk(key, header, offset, data[me][offset : offset + length], None)
            with progressed:
                sent[me] += 1
                progressed.notify_all()
        return link.wait_result(key).array.tobytes()

    try:
        with concurrent.futures.ThreadPoolExecutor(WORLD) as pool:
            first = pool.submit(send_all, links[0])
            with progressed:
                assert progressed.wait_for(lambda: sent[0] >= window, timeout=30)
                # The fifth send waits for an answer that needs worker 1's chunk 0, which has
                # not been sent: however long we look, worker 0 stays at the window.
                assert not progressed.wait_for(lambda: sent[0] > window, timeout=1.0), sent
            second = pool.submit(send_all, links[1])
            results = [first.result(timeout=60), second.result(timeout=60)]
    finally:
        for link in links:
            link.close()
    want = ((data[0].astype(np.float64) + data[1].astype(np.float64)) / WORLD).astype(np.float32).tobytes()
    assert results == [want, want]
    assert sent == [chunks, chunks]
