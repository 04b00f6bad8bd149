"""The torch backend's process group in one process: two groups (ranks 0 and 1) joined to a real
coordinator, driven from threads. What a torch.distributed caller relies on besides the results:
the Work's wait and future, callbacks that issue collectives, and the caller's tensors left as
they were.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from collections.abc import Callable

import pytest
import torch

from gradserver.common.errors import DeadlineExceededError, GradServerError
from gradserver.torch._collective import CollectiveClient
from gradserver.torch.backend import ProcessGroupGradServer

from .helpers.server import TEST_TIMEOUTS, ServerThread

pytestmark = pytest.mark.timeout(120)


def _groups(address: str) -> list[ProcessGroupGradServer]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        joins = [
            pool.submit(CollectiveClient.connect_as_rank, address, r, timeout=TEST_TIMEOUTS) for r in (0, 1)
        ]
        return [ProcessGroupGradServer(f.result(timeout=TEST_TIMEOUTS.join + 5)) for f in joins]


def test_wait_honours_its_timeout_and_the_collective_completes_later(
    coordinator: Callable[..., ServerThread],
) -> None:
    groups = _groups(coordinator(world_size=2).address)
    try:
        tensors = [torch.full((4,), float(rank + 1)) for rank in range(2)]
        work = groups[0].allreduce([tensors[0]])
        started = time.monotonic()
        with pytest.raises(
            DeadlineExceededError,
            match=r"rank 0: gradserver allreduce \(operation 0\) did not complete within the 0.3 s",
        ):
            work.wait(datetime.timedelta(seconds=0.3))
        assert 0.3 <= time.monotonic() - started < 5
        assert not work.is_completed()
        assert groups[1].allreduce([tensors[1]]).wait(datetime.timedelta(seconds=30))
        assert work.wait(datetime.timedelta(seconds=30))
        assert work.is_completed()
        torch.testing.assert_close(tensors[0], torch.full((4,), 3.0), rtol=0, atol=0)
    finally:
        for group in groups:
            group.shutdown()


def test_a_failed_collective_fails_the_future_cpp_reads_not_only_pythons(
    coordinator: Callable[..., ServerThread],
) -> None:
    """DDP's reducer reads the Work's future in C++: torch's Python `set_exception` left it a
    success holding an exception object, and DDP segfaulted reading tensors from it."""
    groups = _groups(coordinator(world_size=2, heartbeat_timeout=2.0).address)
    try:
        work = groups[0].allreduce([torch.ones(4)])
        groups[1].shutdown()  # rank 1 leaves without contributing
        with pytest.raises(
            GradServerError, match=r"rank 0: gradserver allreduce \(operation 0\) failed: .*worker 1"
        ):
            work.wait(datetime.timedelta(seconds=30))
        # A failed C++ future: Python sees the RuntimeError C++ raises, carrying the message (the
        # old future raised the library's error only through a Python unwrap function).
        with pytest.raises(
            RuntimeError, match=r"gradserver allreduce \(operation 0\) failed: .*worker 1"
        ) as info:
            work.get_future().wait()
        assert not isinstance(info.value, GradServerError)
    finally:
        for group in groups:
            group.shutdown()


def _both(
    groups: list[ProcessGroupGradServer], call: Callable[[int, ProcessGroupGradServer], object]
) -> list[object]:
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(call, rank, group) for rank, group in enumerate(groups)]
        return [f.result(timeout=60) for f in futures]


def test_a_callback_may_issue_a_collective_and_wait_for_it(coordinator: Callable[..., ServerThread]) -> None:
    """What PowerSGD's DDP hook does: inside a future's callback, issue the next collective on
    the same group and wait for it. The callback used to run on the group's only thread, which
    then waited for itself."""
    groups = _groups(coordinator(world_size=2).address)
    try:

        def chained(rank: int, group: ProcessGroupGradServer) -> list[float]:
            first = torch.full((3,), float(rank + 1))
            second = torch.full((3,), float(10 * (rank + 1)))

            def then(future: torch.futures.Future[list[torch.Tensor]]) -> list[float]:
                nested = group.allreduce([second]).get_future()
                return [float(future.value()[0][0]), float(nested.wait()[0][0])]

            values: list[float] = group.allreduce([first]).get_future().then(then).wait()
            return values

        assert _both(groups, chained) == [[3.0, 30.0], [3.0, 30.0]]
    finally:
        for group in groups:
            group.shutdown()


def test_the_callers_tensors_stay_resizable_after_every_collective(
    coordinator: Callable[..., ServerThread],
) -> None:
    """gloo leaves a caller's storage alone; `Tensor.numpy()` marked it not resizable for good."""
    groups = _groups(coordinator(world_size=2).address)
    try:

        def touch_all(rank: int, group: ProcessGroupGradServer) -> list[torch.Tensor]:
            summed = torch.full((4,), float(rank))
            widened = torch.full((4,), float(rank), dtype=torch.float64)
            broadcast = torch.full((4,), float(rank))
            mine = torch.full((2,), float(rank))
            gathered = [torch.zeros(2), torch.zeros(2)]
            group.allreduce([summed]).wait()
            group.allreduce([widened]).wait()
            options = torch.distributed.BroadcastOptions()
            options.rootRank = 1
            group.broadcast([broadcast], options).wait()
            group.allgather([gathered], [mine]).wait()
            touched = [summed, widened, broadcast, mine, *gathered]
            results = [t.clone() for t in touched]
            for tensor in touched:
                tensor.resize_(64)  # raised "Trying to resize storage that is not resizable"
            return results

        for rank, results in enumerate(_both(groups, touch_all)):
            assert isinstance(results, list)
            expected = [[1.0] * 4, [1.0] * 4, [1.0] * 4, [float(rank)] * 2, [0.0] * 2, [1.0] * 2]
            assert [t.tolist() for t in results] == expected
    finally:
        for group in groups:
            group.shutdown()


def test_shutdown_ends_the_works_of_operations_that_never_ran(
    coordinator: Callable[..., ServerThread],
) -> None:
    groups = _groups(coordinator(world_size=2).address)
    try:
        first = groups[0].allreduce([torch.ones(2)])  # runs, waiting for rank 1
        queued = groups[0].allreduce([torch.ones(2)])  # waits behind it; shutdown cancels it
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stopping = pool.submit(groups[0].shutdown)  # waits for `first`
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # until the shutdown has begun
                try:
                    groups[0].barrier()
                except RuntimeError:
                    break
                time.sleep(0.01)
            groups[1].shutdown()  # now `first` fails and the shutdown goes on
            stopping.result(timeout=60)
        for work in (first, queued):
            with pytest.raises((GradServerError, RuntimeError)):
                work.wait(datetime.timedelta(seconds=30))
            assert work.is_completed()
    finally:
        for group in groups:
            group.shutdown()
