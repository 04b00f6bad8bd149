"""When the collective lane wakes a word and when it spins: a worker's `posted`/`taken` store wakes
the word only for a worker that announced a sleep on it (`LaneMemory._wake_sleepers`), and a
waiter does not spin while the machine is crowded (`futex.crowded`).
"""

from __future__ import annotations

import mmap
import threading
import time
from pathlib import Path

import pytest

from gradserver.common import futex
from gradserver.common import lane as shared
from gradserver.common.lane import LaneLayout, LaneMemory

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shared.supported(), reason="the lane needs Linux futexes on x86-64"),
]


def _memory() -> LaneMemory:
    layout = LaneLayout(2, mmap.PAGESIZE)
    return LaneMemory.create(mmap.mmap(-1, layout.size), layout)


def test_a_store_wakes_only_a_word_someone_announced_a_sleep_on(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = _memory()
    woken: list[int] = []
    wake = shared.futex_wake
    monkeypatch.setattr(shared, "futex_wake", lambda address: (woken.append(address), wake(address)))
    memory.set_posted(0, 1)
    memory.set_taken(0, 1)
    assert woken == []  # worker 1 announced nothing: no system call
    memory.set_sleeping(1, memory.taken_address(0))
    memory.set_posted(0, 2)
    assert woken == []  # it sleeps on another word
    memory.set_taken(0, 2)
    assert woken == [memory.taken_address(0)]
    memory.set_sleeping(1, 0)
    memory.set_taken(0, 3)
    assert woken == [memory.taken_address(0)]


def test_a_waiter_asleep_on_a_posted_word_is_woken_at_once() -> None:
    """The waiter sleeps in one 20 s slice: only the wake its announcement asks for ends it
    before that (no spin: the waiter sleeps at once)."""
    memory = _memory()
    returned: list[float] = []

    def announce(address: int) -> None:
        memory.set_sleeping(1, address)

    def posted() -> int:
        return memory.posted(0)

    def wait() -> None:
        deadline = time.monotonic() + 40
        address = memory.posted_address(0)
        assert shared.wait_word(posted, address, 1, deadline, lambda: None, slice_s=20, announce=announce)
        returned.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    end = time.monotonic() + 10
    while not memory.words[memory._sleeping[1]]:  # the waiter's announcement, bounded
        assert time.monotonic() < end, "the waiter never announced its sleep"
    posted_at = time.monotonic()
    memory.set_posted(0, 1)
    waiter.join(30)
    assert returned and returned[0] - posted_at < 5
    assert not memory.words[memory._sleeping[1]]  # withdrawn after the sleep


def test_crowded_follows_the_kernels_count_of_runnable_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = tmp_path / "loadavg"
    monkeypatch.setattr(futex, "_LOAD_FILE", str(load))
    monkeypatch.setattr(futex, "available_cores", lambda: 2)

    def crowded_with(text: str | None) -> bool:
        if text is None:
            load.unlink(missing_ok=True)
        else:
            load.write_text(text)
        monkeypatch.setattr(futex, "_crowd_seen", [-1.0, 0.0])  # a fresh sample
        return futex.crowded()

    assert crowded_with("3.50 2.00 1.00 4/210 12345\n")  # 4 runnable on 2 cores
    assert not crowded_with("3.50 2.00 1.00 3/210 12345\n")  # one to spare
    assert not crowded_with("0.10 0.20 0.30 1/90 12345\n")
    assert not crowded_with("garbage\n")
    assert not crowded_with(None)
    # Sampled at most every 0.1 s: a change within that is seen only at the next sample.
    load.write_text("3.50 2.00 1.00 9/210 12345\n")
    monkeypatch.setattr(futex, "_crowd_seen", [time.monotonic() + 3600, 0.0])
    assert not futex.crowded()
