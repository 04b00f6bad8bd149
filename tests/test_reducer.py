"""Averaging off the event loop (server/reducer.py): the reduction table's deferred `Reduce`
requests, averaged on a thread, come back in the order their chunks completed with the very
bytes of the inline path; a result whose step failed meanwhile is dropped. While every stream is
a shared-memory worker's and no core is left for the thread, large averages run on the loop
(the same bytes, still in order)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from gradserver.common import shm as shm_support
from gradserver.common.averaging import Averager, InPlace
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import Status
from gradserver.common.messages import AveragedChunkOut, ChunkHeader, ChunkIn, DType, ErrorOut, TensorKey
from gradserver.server import GradientServer
from gradserver.server.outgoing import Outgoing
from gradserver.server.reducer import INLINE_BELOW_BYTES, Reducer, Result, average_on_loop
from gradserver.server.reduction import Reduce, ReductionTable
from gradserver.worker import WorkerClient

from .helpers.server import TEST_TIMEOUTS, ServerThread, run_each

CHUNK = 128 * 1024  # elements: 512 KiB per contribution, above the inline threshold
WORLD = 3


def _chunks(step: int, chunks: int, seed: int, component: NonBlockComponent) -> list[ChunkIn]:
    rng = np.random.default_rng(seed)
    key = TensorKey.non_block(step, component)
    header = ChunkHeader(DType.FLOAT32, chunks * CHUNK, ())
    return [
        ChunkIn(w, key, header, i * CHUNK, rng.standard_normal(CHUNK).astype("<f4").tobytes())
        for i in range(chunks)
        for w in range(WORLD)
    ]


def _table(*, defer: bool) -> ReductionTable:
    return ReductionTable(WORLD, CHUNK, 60.0, lambda: 0.0, averager=Averager(2), defer_reductions=defer)


def _averages(out: list[Outgoing]) -> list[tuple[int, bytes]]:
    return [(o.event.offset, bytes(o.event.data)) for o in out if isinstance(o.event, AveragedChunkOut)]


async def _reduce_all(
    table: ReductionTable,
    feed: list[ChunkIn],
    fail_step: int | None = None,
    on_loop: Callable[[], bool] = lambda: False,
) -> list[Outgoing]:
    sent: list[Outgoing] = []
    finished = asyncio.Event()
    waiting = 0

    def finish(t: ReductionTable, request: Reduce, result: Result) -> list[Outgoing]:
        nonlocal waiting
        out = t.reduced(request, *result)
        sent.extend(out)
        waiting -= 1
        if waiting == 0:
            finished.set()
        return out

    reducer = Reducer(Averager(2), finish, on_loop)
    for chunk in feed:
        sent.extend(table.contribute(chunk))
        for request in table.take_reductions():
            assert request.nbytes >= INLINE_BELOW_BYTES
            waiting += 1
            reducer.submit(table, request)
    if waiting == 0:
        finished.set()  # every one was averaged on the loop
    if fail_step is not None:
        sent.extend(table.fail_step(fail_step, f"step {fail_step} failed by the test", Status.ABORTED))
    await asyncio.wait_for(finished.wait(), 30)
    await reducer.close()
    return sent


def test_deferred_averages_are_the_inline_bytes_in_completion_order() -> None:
    # Two keys, each with its own slot: a worker sends a key's next step only once it has that
    # key's averages, so one slot never holds two steps.
    feed = _chunks(0, 6, 1, NonBlockComponent.LM_HEAD) + _chunks(1, 3, 2, NonBlockComponent.FINAL_NORM)
    inline = _table(defer=False)
    expected = _averages([o for chunk in feed for o in inline.contribute(chunk)])
    deferred = _table(defer=True)
    got = _averages(asyncio.run(_reduce_all(deferred, feed)))
    assert [offset for offset, _ in got] == [offset for offset, _ in expected]
    assert got == expected
    assert not deferred.has_pending() and deferred.keys_reduced == inline.keys_reduced == 2


def test_an_average_whose_step_failed_while_it_was_computed_is_dropped() -> None:
    table = _table(defer=True)
    sent = asyncio.run(_reduce_all(table, _chunks(0, 2, 3, NonBlockComponent.LM_HEAD), fail_step=0))
    assert _averages(sent) == []
    assert [o.event.step for o in sent if isinstance(o.event, ErrorOut) and o.event.step_failed] == [0]
    assert all(table.buffered_bytes(w) == 0 for w in range(WORLD))
    assert not table.has_pending()


def test_averages_on_the_loop_are_the_same_bytes_in_the_same_order_and_switching_keeps_it() -> None:
    first = _chunks(0, 4, 1, NonBlockComponent.LM_HEAD)
    second = _chunks(0, 3, 2, NonBlockComponent.FINAL_NORM)
    third = _chunks(1, 3, 3, NonBlockComponent.FINAL_NORM)
    inline = _table(defer=False)
    expected = _averages([o for chunk in first + second + third for o in inline.contribute(chunk)])
    assert (
        _averages(asyncio.run(_reduce_all(_table(defer=True), first + second + third, on_loop=lambda: True)))
        == expected
    )

    async def switching() -> list[Outgoing]:
        table, sent, on_loop = _table(defer=True), [], [False]

        def finish(t: ReductionTable, request: Reduce, result: Result) -> list[Outgoing]:
            out = t.reduced(request, *result)
            sent.extend(out)
            return out

        def feed(chunks: list[ChunkIn]) -> None:
            for chunk in chunks:
                sent.extend(table.contribute(chunk))
                for request in table.take_reductions():
                    reducer.submit(table, request)

        reducer = Reducer(Averager(2), finish, lambda: on_loop[0])
        feed(first)  # on the thread
        on_loop[0] = True
        feed(second)  # behind them, though the loop may average now
        assert _averages(sent) == []
        for _ in range(3000):  # 30 s at most
            if len(_averages(sent)) == 7:
                break
            await asyncio.sleep(0.01)
        feed(third)  # nothing waits: averaged at once, on the loop
        assert len(_averages(sent)) == 10
        await reducer.close()
        return sent

    assert _averages(asyncio.run(switching())) == expected


def test_large_averages_run_on_the_loop_only_for_shared_memory_workers_without_a_core_to_spare() -> None:
    shm = {0, 1}.__contains__
    assert average_on_loop([0, 1], shm, cores=2)  # two workers and the loop fill two cores
    assert average_on_loop([0, 1], shm, cores=3)
    assert not average_on_loop([0, 1], shm, cores=4)  # one core is left for the thread
    assert not average_on_loop([0, 1, 2], shm, cores=2)  # worker 2's payloads come over gRPC
    assert not average_on_loop([], shm, cores=1)


@pytest.mark.skipif(not shm_support.supported(), reason="needs Linux memfd and fd passing")
@pytest.mark.parametrize("transports", [("shm", "shm"), ("shm", "grpc")])
def test_the_coordinator_averages_on_its_loop_only_when_every_worker_uses_shared_memory(
    coordinator: Callable[..., ServerThread], transports: tuple[str, str]
) -> None:
    server = coordinator(world_size=2, chunk_mib=1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joining = [
            pool.submit(
                WorkerClient.connect, server.address, node_id=f"t{i}", timeout=TEST_TIMEOUTS, transport=t
            )
            for i, t in enumerate(transports)
        ]
        clients = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in joining]
    try:
        assert sorted(c.transport for c in clients) == sorted(transports)

        def decisions(s: GradientServer) -> list[bool]:
            transport = s.features["shm"]
            cores, got = transport.cores, []
            for assumed in (2, 4):  # this host's workers fill it, or one core is left for the thread
                transport.cores = assumed
                got.append(s._lifecycle.average_on_loop())
            transport.cores = cores
            return got

        assert server.call(decisions) == ([True, False] if transports == ("shm", "shm") else [False, False])
        # The same averages either way (tests/test_shm.py compares them with gRPC's in detail).
        data = [np.full(300_000, c.worker_id + 1, dtype=np.float32) for c in clients]
        run_each(
            clients, lambda c: c.send_non_block_gradient(0, NonBlockComponent.LM_HEAD, data[c.worker_id])
        )
        got = run_each(clients, lambda c: c.receive_averaged_non_block().gradients)
        assert all(np.array_equal(g, np.full(300_000, 1.5, dtype=np.float32)) for g in got)
    finally:
        for c in clients:
            c.close()


class _OverInputs:
    """Output buffers whose every average is wanted "in place" (here: in fresh buffers per
    request, so what was written when can be seen)."""

    def __init__(self) -> None:
        self.targets: list[tuple[memoryview, ...]] = []

    def take(self, nbytes: int) -> memoryview | None:
        return None

    def in_place(self, contributions: Sequence[bytes | memoryview]) -> InPlace | None:
        targets = tuple(memoryview(bytearray(len(c))) for c in contributions)
        self.targets.append(targets)
        return InPlace(targets)

    def give_back(self, view: memoryview) -> None:
        pass


def test_an_average_over_the_workers_own_memory_is_written_on_the_loop_and_still_sent_in_order() -> None:
    """With the thread busy (an average queued on it), an in-place average is written before
    `submit` returns, so no step failure the loop sends later can overtake a write into memory a
    worker may then reuse; its result still goes out after the one queued before it."""
    first = _chunks(0, 1, 1, NonBlockComponent.LM_HEAD)
    second = _chunks(0, 2, 2, NonBlockComponent.FINAL_NORM)
    inline = _table(defer=False)
    expected = _averages([o for chunk in first + second for o in inline.contribute(chunk)])

    async def run() -> list[Outgoing]:
        table, sent = _table(defer=True), []
        averager, buffers = Averager(2), _OverInputs()

        def finish(t: ReductionTable, request: Reduce, result: Result) -> list[Outgoing]:
            out = t.reduced(request, *result)
            sent.extend(out)
            return out

        reducer = Reducer(averager, finish)
        for chunk in first:  # on the thread: nothing wants it in place yet
            sent.extend(table.contribute(chunk))
            for request in table.take_reductions():
                reducer.submit(table, request)
        averager.output_buffers = buffers
        for chunk in second:
            sent.extend(table.contribute(chunk))
            for request in table.take_reductions():
                reducer.submit(table, request)
                averaged = buffers.targets[-1]
                assert all(bytes(t) == bytes(averaged[0]) != bytes(len(t)) for t in averaged)
        for _ in range(3000):  # 30 s at most
            if len(_averages(sent)) == 3:
                break
            await asyncio.sleep(0.01)
        await reducer.close()
        return sent

    assert _averages(asyncio.run(run())) == expected
