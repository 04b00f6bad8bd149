"""The small-call path of the torch backend's allreduce (one contiguous float32 host tensor, SUM
or AVG: no staging, no flattening, a future made only when asked for) in one process: two groups
joined to a real coordinator, driven from threads. It must keep its place among queued async
operations of the general path, name the rank and operation in its errors, and give a future
whether it is asked for before or after the call completed.
"""

from __future__ import annotations

import concurrent.futures
import datetime
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from gradserver.common.errors import GradServerError
from gradserver.torch._collective import CollectiveClient
from gradserver.torch.backend import ProcessGroupGradServer

from .helpers.server import TEST_TIMEOUTS, ServerThread

pytestmark = pytest.mark.timeout(120)
_WAIT = datetime.timedelta(seconds=30)


def _groups(address: str, *, check_finite: bool = False) -> list[ProcessGroupGradServer]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joins = [
            pool.submit(CollectiveClient.connect_as_rank, address, r, timeout=TEST_TIMEOUTS) for r in (0, 1)
        ]
        clients = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in joins]
    return [ProcessGroupGradServer(c, check_finite=check_finite) for c in clients]


def _on_both(
    groups: list[ProcessGroupGradServer], body: Callable[[int, ProcessGroupGradServer], object]
) -> list[object]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(body, rank, group) for rank, group in enumerate(groups)]
        return [f.result(timeout=60) for f in futures]


def test_a_small_call_runs_after_the_async_operations_issued_before_it(
    coordinator: Callable[..., ServerThread],
) -> None:
    """Async general-path operations (float64 goes by all-gather, a large float32 one eagerly)
    issued first, then small synchronous ones: each rank's waits run them in issue order, so
    both ranks agree on every operation's number and each result is its own."""
    groups = _groups(coordinator(world_size=2).address)

    def body(rank: int, group: ProcessGroupGradServer) -> list[torch.Tensor]:
        wide = torch.full((3,), float(rank + 1), dtype=torch.float64)
        large = torch.full((300_000,), float(rank + 1))  # above the small path's 1 MiB
        small = [torch.full((1,), float(10 * (i + 1) + rank)) for i in range(3)]
        pending = [group.allreduce([wide]), group.allreduce([large])]
        for tensor in small:
            group.allreduce([tensor]).wait()
        for work in pending:
            work.wait(_WAIT)
        return [wide, large[:2], *small]

    try:
        for wide, large, *small in _on_both(groups, body):  # type: ignore[misc]
            torch.testing.assert_close(wide, torch.full((3,), 3.0, dtype=torch.float64), rtol=0, atol=0)
            torch.testing.assert_close(large, torch.full((2,), 3.0), rtol=0, atol=0)
            expected = [torch.tensor([21.0]), torch.tensor([41.0]), torch.tensor([61.0])]
            for got, want in zip(small, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        for group in groups:
            group.shutdown()


def test_a_small_calls_future_is_made_before_or_after_it_completes(
    coordinator: Callable[..., ServerThread],
) -> None:
    groups = _groups(coordinator(world_size=2).address)

    def body(rank: int, group: ProcessGroupGradServer) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        early = torch.full((2,), float(rank + 1))
        work = group.allreduce([early], dist.ReduceOp.AVG)
        asked_first = work.get_future()  # before it ran: completed by the group's threads
        values_first = asked_first.wait()
        late = torch.full((2,), float(rank + 5))
        done = group.allreduce([late])
        done.wait()
        completed = done.is_completed()
        values_after = done.get_future().wait()  # made after completion: already set
        return [*values_first, early], [*values_after, late], completed

    try:
        for first, after, completed in _on_both(groups, body):  # type: ignore[misc]
            assert completed
            assert first[0] is first[1]  # the Work's value is the caller's own tensor
            torch.testing.assert_close(first[1], torch.full((2,), 1.5), rtol=0, atol=0)
            assert after[0] is after[1]
            torch.testing.assert_close(after[1], torch.full((2,), 11.0), rtol=0, atol=0)
    finally:
        for group in groups:
            group.shutdown()


def test_a_small_calls_error_names_the_rank_and_the_operation(
    coordinator: Callable[..., ServerThread],
) -> None:
    """With the NaN check, a NaN fails the small call on both ranks: wait() raises the library's
    error and the future fails as C++ sees it, both naming the rank and the operation."""
    groups = _groups(coordinator(world_size=2).address, check_finite=True)

    def body(rank: int, group: ProcessGroupGradServer) -> tuple[str, str]:
        group.allreduce([torch.ones(1)]).wait()  # operation 0 succeeds
        tensor = torch.tensor([float("nan") if rank == 1 else 1.0])
        work = group.allreduce([tensor])
        with pytest.raises(GradServerError) as waited:
            work.wait()
        with pytest.raises(RuntimeError) as from_future:
            work.get_future().wait()
        assert not isinstance(from_future.value, GradServerError)
        return str(waited.value), str(from_future.value)

    try:
        for rank, (waited, from_future) in enumerate(_on_both(groups, body)):  # type: ignore[misc]
            prefix = f"rank {rank}: gradserver allreduce (operation 1) failed"
            assert prefix in waited, waited
            assert prefix in from_future, from_future
            assert "non-finite" in waited and "worker 1" in waited, waited
    finally:
        for group in groups:
            group.shutdown()


@pytest.mark.parametrize("root", [0, 1])
def test_a_small_broadcast_gives_the_roots_bytes_in_place_for_any_dtype_and_keeps_its_place(
    coordinator: Callable[..., ServerThread], root: int
) -> None:
    """The short broadcast path (one small contiguous host tensor): the root's bytes land in every
    rank's own tensor (bool, int64, bfloat16, a 0-d float32), the root's tensor is unchanged,
    and calls after an async general-path broadcast (a list of two) keep their order. A
    non-contiguous tensor takes the general path and gets the same bytes."""
    groups = _groups(coordinator(world_size=2).address)

    def body(rank: int, group: ProcessGroupGradServer) -> list[torch.Tensor]:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        pair = [torch.full((3,), float(rank + 1)), torch.full((2,), float(rank + 7))]
        pending = group.broadcast(pair, opts)
        small = [
            torch.tensor([rank == 0, rank == 1, True]),
            torch.arange(5, dtype=torch.int64) * (rank + 1),
            torch.full((4,), 1.5 + rank, dtype=torch.bfloat16),
            torch.tensor(3.25 + rank),
        ]
        originals = [id(t) for t in small]
        for tensor in small:
            work = group.broadcast([tensor], opts)
            work.wait()
            assert work.get_future().wait()[0] is tensor  # the caller's own tensor, written in place
        strided = torch.arange(8, dtype=torch.float32).reshape(2, 4).t() * (rank + 1)
        group.broadcast([strided], opts).wait()
        pending.wait(_WAIT)
        assert [id(t) for t in small] == originals
        return [*pair, *small, strided]

    try:
        results = [list(r) for r in _on_both(groups, body)]  # type: ignore[call-overload]
        for got in results:
            for a, b in zip(got, results[root], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        roots: list[torch.Tensor] = results[root]
        torch.testing.assert_close(roots[0], torch.full((3,), float(root + 1)), rtol=0, atol=0)
        torch.testing.assert_close(roots[3], torch.arange(5, dtype=torch.int64) * (root + 1), rtol=0, atol=0)
        torch.testing.assert_close(roots[5], torch.tensor(3.25 + root), rtol=0, atol=0)
        want = torch.arange(8, dtype=torch.float32).reshape(2, 4).t() * (root + 1)
        torch.testing.assert_close(roots[6], want, rtol=0, atol=0)
    finally:
        for group in groups:
            group.shutdown()


def test_a_conjugate_view_is_broadcast_by_its_value_not_its_memory(
    coordinator: Callable[..., ServerThread],
) -> None:
    """A complex tensor viewed through `conj()` holds the conjugate of what its memory holds: it
    is staged through a host buffer (its value copied in, the result copied back through the
    view), so a broadcast gives every rank the root's values; so is a negative view (the
    imaginary part of a conjugate view), whose allreduce sums its values."""
    groups = _groups(coordinator(world_size=2).address)

    def body(rank: int, group: ProcessGroupGradServer) -> list[torch.Tensor]:
        tensor = (torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)).conj()
        other = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (rank + 1)
        summed = other.conj().imag  # a negative view: its values are -other.imag
        assert tensor.is_conj() and summed.is_neg()
        group.broadcast([tensor], dist.BroadcastOptions()).wait()
        group.allreduce([summed]).wait()
        return [tensor.resolve_conj(), other.imag.clone()]

    try:
        for got in _on_both(groups, body):
            broadcast, summed = got  # type: ignore[misc]
            torch.testing.assert_close(broadcast, torch.tensor([1 - 2j, 3 + 1j]), rtol=0, atol=0)
            # The sum of the values (-2, 1) and (-4, 2), written back through the view.
            torch.testing.assert_close(summed, torch.tensor([6.0, -3.0]), rtol=0, atol=0)
    finally:
        for group in groups:
            group.shutdown()
