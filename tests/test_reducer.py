"""Averaging off the event loop (server/reducer.py): the reduction table's deferred `Reduce`
requests, averaged on a thread, come back in the order their chunks completed with the very
bytes of the inline path; a result whose step failed meanwhile is dropped."""

from __future__ import annotations

import asyncio

import numpy as np

from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import Status
from gradserver.common.messages import AveragedChunkOut, ChunkHeader, ChunkIn, DType, ErrorOut, TensorKey
from gradserver.server.averaging import Averager
from gradserver.server.outgoing import Outgoing
from gradserver.server.reducer import INLINE_BELOW_BYTES, Reducer, Result
from gradserver.server.reduction import Reduce, ReductionTable

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
    table: ReductionTable, feed: list[ChunkIn], fail_step: int | None = None
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

    reducer = Reducer(Averager(2), finish)
    for chunk in feed:
        sent.extend(table.contribute(chunk))
        for request in table.take_reductions():
            assert request.nbytes >= INLINE_BELOW_BYTES
            waiting += 1
            reducer.submit(table, request)
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
