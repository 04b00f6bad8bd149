"""common.futex: the futex calls, the bells built on them, and the spin sized from the wake cost."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from gradserver.common import futex
from gradserver.common.lane import supported

pytestmark = pytest.mark.skipif(not supported(), reason="needs Linux futexes on x86-64")


@pytest.fixture
def fresh_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forgets this process's measured wake latency for the test (and after it)."""
    monkeypatch.setattr(futex, "_measured", None)


def test_a_bell_rung_by_another_thread_wakes_its_sleeper() -> None:
    words = np.zeros(64, dtype=np.uint32)
    sleeper = futex.Bells(words, lambda member: 16 * member, position=1)
    ringer = futex.Bells(words, lambda member: 16 * member, position=0)
    seen = sleeper.value()
    woke = threading.Event()

    def sleep() -> None:
        while sleeper.value() == seen:
            sleeper.sleep(seen, 5.0)
        woke.set()

    thread = threading.Thread(target=sleep, daemon=True)
    thread.start()
    ringer.ring(1)
    assert woke.wait(5.0)
    thread.join(5.0)
    # The ringer's position and its count: a value no other member writes.
    assert sleeper.value() == (0 + 1) << 24 | 1
    assert words[0] == 0, "ringing member 1 touched member 0's bell"


def test_a_sleep_on_a_bell_that_already_changed_returns_at_once() -> None:
    words = np.zeros(16, dtype=np.uint32)
    bells = futex.Bells(words, lambda member: member, position=0)
    seen = bells.value()
    bells.ring(0)
    started = time.monotonic()
    bells.sleep(seen, 5.0)
    assert time.monotonic() - started < 1.0


def test_the_wake_latency_is_measured_once_and_bounded(fresh_measure: None) -> None:
    started = time.monotonic()
    cores = os.sched_getaffinity(0)
    first = futex.wake_latency_s()
    assert os.sched_getaffinity(0) == cores, "the measure pins this thread to one core and must restore it"
    assert time.monotonic() - started < 2.0
    assert 0 < first < 0.05, first
    assert futex.wake_latency_s() == first, "measured again"


@pytest.mark.parametrize(("wake_s", "budget"), [(0.0, 10e-6), (2e-6, 10e-6), (60e-6, 120e-6), (1e-3, 300e-6)])
def test_the_spin_is_twice_the_wake_within_its_bounds(
    monkeypatch: pytest.MonkeyPatch, wake_s: float, budget: float
) -> None:
    monkeypatch.setattr(futex, "_measured", wake_s)
    monkeypatch.setattr(futex, "available_cores", lambda: 8)
    assert futex.spin_for(2).budget_s == pytest.approx(budget)


def test_no_spin_where_the_processes_share_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(futex, "available_cores", lambda: 2)
    assert futex.spin_for(3) == futex.NO_SPIN
    assert futex.spin_for(2).budget_s > 0


def test_a_spin_ends_when_its_condition_holds_or_its_budget_is_spent() -> None:
    looks = 0

    def third_look() -> bool:
        nonlocal looks
        looks += 1
        return looks == 3

    assert futex.Spin(1.0).until(third_look)
    assert looks == 3
    started = time.perf_counter()
    assert not futex.Spin(0.002).until(lambda: False)
    assert 0.002 <= time.perf_counter() - started < 1.0
    assert not futex.NO_SPIN.until(lambda: False)


def test_released_bells_let_their_mapping_close() -> None:
    import mmap

    mapping = mmap.mmap(-1, 4096)
    bells = futex.Bells(np.frombuffer(mapping, dtype=np.uint32), lambda member: member, position=0)
    bells.release()
    mapping.close()  # BufferError if the bells still held a view
    assert mapping.closed


def test_a_spin_grows_to_cover_short_waits_and_falls_back_for_long_ones() -> None:
    spin = futex.Spin(20e-6, 1e-3)
    assert spin.budget_s == 20e-6
    for _ in range(60):
        spin.observe(200e-6)  # the other rank posts ~200 us after this one waits
    assert spin.budget_s == pytest.approx(400e-6, rel=0.05), "twice the typical wait"
    for _ in range(60):
        spin.observe(0.05)  # now it waits for a backward pass
    assert spin.budget_s == 20e-6, "waits past the cap are slept, the spin back at its floor"
    for _ in range(150):
        spin.observe(0.0)
    assert spin.budget_s == 20e-6, "never below the floor"
    futex.NO_SPIN.observe(1e-4)
    assert futex.NO_SPIN.budget_s == 0
