"""Futexes on 32-bit words of shared memory, the bell built on them, and how long to spin first.

Every one-host path (the collective lane, the host arena, the peer rings and the mailbox that
reads them) waits the same way: look at a word, and when it has not changed, sleep on it with a
futex until the process that changes it wakes the word. This module is that mechanism, once:

- `futex_wait` / `futex_wake`: the two system calls (Linux, x86-64), on words that other
  processes map too (so not FUTEX_PRIVATE).
- `Bells`: one wake-up word per member of a shared mapping. A member that may wait reads its
  bell, looks for what it waits for, and sleeps while the bell still reads the same; whoever
  changes something that member may wait for rings its bell with a value nobody else writes
  (the ringer's position and its own count), so a sleep on the old value always returns.
- `Spin`: how long to look at a word before sleeping on it. A futex sleep costs the waiter the
  time the kernel takes to run it again after the wake, and that differs by an order of
  magnitude between machines (docs/PERFORMANCE.md: a wake round trip of 9-17 µs on a busy
  2-core machine, 117-134 µs on a quiet one of the same kind, whose idle cores sleep deeply).
  A fixed spin tuned on one is wrong on the other, so the budget is sized from this process's
  own measure of a wake (`wake_latency_s`, measured once, in about a millisecond): spinning
  for as long as a wake would cost before sleeping is the classic rule that is never worse than
  twice the best choice made knowing the wait in advance; we spin twice that, since the waker
  also pays for the wake. No spin at all where the processes the wait needs cannot each have a
  core: a spinning process would only delay the one it waits for.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from .cores import available_cores

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the words are shared between processes
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall: object = None


def libc_syscall() -> object:
    """libc's `syscall`, or None where there is none (the futex paths are then not offered)."""
    global _syscall  # noqa: PLW0603 - loaded once, on first use
    if _syscall is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            function = libc.syscall
        except (OSError, AttributeError):
            return None
        function.restype = ctypes.c_long
        _syscall = function
    return _syscall


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleeps while the 32-bit word at `address` holds `expected`, at most `timeout_s` (a wake,
    a changed word, a signal or the timeout all return; callers look at the word again)."""
    seconds = max(timeout_s, 0.0)
    spec = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    libc_syscall()(  # type: ignore[operator]
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_uint32(expected),
        ctypes.byref(spec),
        None,
        0,
    )


def futex_wake(address: int) -> None:
    """Wakes every thread of every process sleeping on the word at `address`."""
    libc_syscall()(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)  # type: ignore[operator]


# --- bells ---------------------------------------------------------------------------------------


class Bells:
    """The wake-up words of the members of one shared mapping, as member `position` uses them.
    `words` is the mapping's uint32 view, `index_of(member)` the index of that member's bell."""

    def __init__(self, words: np.ndarray, index_of: Callable[[int], int], position: int) -> None:
        self._words = words
        self._base = int(words.__array_interface__["data"][0])
        self._index_of = index_of
        self._position = position
        self._lock = threading.Lock()
        self._rings = 0

    def address(self, member: int) -> int:
        return self._base + 4 * self._index_of(member)

    def release(self) -> None:
        """Lets go of the mapping's view (so the mapping can close). A sleep after this returns at
        once: its futex call finds the address unmapped."""
        self._words = np.zeros(0, np.uint32)

    def value(self) -> int:
        """This member's bell: read it before looking for what it waits for, then `sleep`."""
        return int(self._words[self._index_of(self._position)])

    def ring(self, member: int) -> None:
        """Tells `member` that something it may wait for changed: a value no one else writes
        (this member's position and count), so its sleep on the old value always returns."""
        index = self._index_of(member)
        with self._lock:
            self._rings = (self._rings + 1) & 0xFFFFFF
            self._words[index] = (self._position + 1) << 24 | self._rings
        futex_wake(self._base + 4 * index)

    def sleep(self, seen: int, timeout_s: float) -> None:
        """Sleeps while this member's bell still reads `seen`, at most `timeout_s`."""
        futex_wait(self.address(self._position), seen, timeout_s)


# --- how long to spin ----------------------------------------------------------------------------

_SPIN_MIN_S = 10e-6  # below this a spin is a handful of looks: not worth a clock read
_SPIN_MAX_S = 300e-6  # the floor's bound: a wake-up slower than this is not the usual case
_SPIN_CAP_S = 1e-3  # waits typically longer than this are slept, not spun
_SPIN_AVERAGE_OVER = 8  # waits: how fast a waiter's typical wait follows its recent ones
_DEFAULT_WAKE_S = 20e-6  # if the measure fails: a busy machine's one-way wake
_MEASURE_ROUNDS = 24
_MEASURE_LIMIT_S = 0.25

_measured: float | None = None
_measure_lock = threading.Lock()


def wake_latency_s() -> float:
    """How long, on this machine, a thread sleeping on a futex takes to run again once woken:
    half the median round trip of two threads waking each other from two cores (measured once
    per process, on first use). Two threads of one process on different cores stand in for two
    processes: the cost is the kernel's and the hypervisor's (rousing an idle core and scheduling
    onto it); the handoff of the GIL adds a little, which only lengthens the spin."""
    global _measured  # noqa: PLW0603 - measured once, on first use
    with _measure_lock:
        if _measured is None:
            try:
                _measured = _measure_wake_s()
            except (OSError, RuntimeError):
                _measured = _DEFAULT_WAKE_S
        return _measured


def _measure_wake_s() -> float:
    """Half the median round trip of a ping-pong between this thread and another over futexes,
    each pinned to a core of its own while it runs (where there are two): left to itself the
    scheduler wakes a thread on its waker's core, which has no idle core to rouse and measured
    7 µs one way on a quiet machine whose processes wake each other in 42 µs."""
    if libc_syscall() is None:
        raise RuntimeError("no futexes here")
    with _on_cores() as pin_other:
        return _ping_pong_s(pin_other)


@contextlib.contextmanager
def _on_cores() -> Iterator[Callable[[], None]]:
    """Pins this thread to one of its cores for the block and gives a function that pins the
    calling thread to another (both no-ops with one core, or where affinity cannot be set);
    this thread's affinity is restored after."""
    try:
        allowed = os.sched_getaffinity(0)  # on Linux, pid 0 is the calling thread
    except (AttributeError, OSError):
        allowed = set()
    cores = sorted(allowed)
    if len(cores) < 2:
        yield lambda: None
        return

    def pin_other() -> None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cores[1]})

    try:
        os.sched_setaffinity(0, {cores[0]})
    except OSError:
        yield lambda: None
        return
    try:
        yield pin_other
    finally:
        os.sched_setaffinity(0, allowed)


def _ping_pong_s(pin_other: Callable[[], None]) -> float:
    words = np.zeros(32, dtype=np.uint32)  # ping and pong on separate cache lines
    ping, pong = 0, 16
    base = int(words.__array_interface__["data"][0])
    deadline = time.monotonic() + _MEASURE_LIMIT_S

    def echo() -> None:
        pin_other()
        seen = 0
        while time.monotonic() < deadline:
            value = int(words[ping])
            if value == seen:
                futex_wait(base + 4 * ping, value, 0.01)
                continue
            seen = value
            words[pong] = value
            futex_wake(base + 4 * pong)
            if value == _MEASURE_ROUNDS + 2:
                return

    thread = threading.Thread(target=echo, name="gradserver-wake-measure", daemon=True)
    thread.start()
    trips: list[float] = []
    try:
        for value in range(1, _MEASURE_ROUNDS + 3):
            started = time.perf_counter()
            words[ping] = value
            futex_wake(base + 4 * ping)
            while (seen := int(words[pong])) != value:
                if time.monotonic() > deadline:
                    raise RuntimeError("the wake measure did not finish in time")
                futex_wait(base + 4 * pong, seen, 0.01)
            if value > 2:  # the first two start the thread's loop
                trips.append(time.perf_counter() - started)
    finally:
        words[ping] = _MEASURE_ROUNDS + 2
        futex_wake(base + 4 * ping)
        thread.join(_MEASURE_LIMIT_S)
    return statistics.median(trips) / 2


class Spin:
    """How long one waiter looks at a word before it sleeps on it, learnt from its own waits.

    At least `floor_s` (twice the machine's wake-up: a sleep would cost that much), and as long
    as twice the waiter's typical wait (a running average of how long its recent waits took,
    `observe`) when that is within `cap_s`: a collective's ranks arrive a few hundred µs apart,
    more than a wake-up, and a spin that ends just before the other rank posts pays the wake-up
    anyway. Waits typically longer than `cap_s` (a rank computing its backward pass) get the
    floor only: spinning would burn a core for nothing. A budget of 0 sleeps at once."""

    def __init__(self, floor_s: float = 0.0, cap_s: float = 0.0) -> None:
        self._floor = floor_s
        self._cap = max(cap_s, floor_s)
        self._typical = floor_s
        self.budget_s = floor_s

    def observe(self, waited_s: float) -> None:
        """One wait of this waiter took `waited_s` (spin and sleep together)."""
        if self._floor <= 0:
            return
        self._typical += (waited_s - self._typical) / _SPIN_AVERAGE_OVER
        typical = self._typical
        self.budget_s = self._floor if typical > self._cap else min(self._cap, max(self._floor, 2 * typical))

    def until(self, done: Callable[[], bool]) -> bool:
        """Looks at `done()` until it holds (True) or the budget is spent (False)."""
        if self.budget_s <= 0:
            return done()
        end = time.perf_counter() + self.budget_s
        while True:
            if done():
                return True
            if time.perf_counter() > end:
                return False


NO_SPIN = Spin()

_LOAD_FILE = "/proc/loadavg"
_CROWD_EVERY_S = 0.1  # how often a process looks again at how many threads are runnable
_crowd_seen = [-1.0, 0.0]  # [when, whether crowded]: a sample shared by the process's waiters


def crowded() -> bool:
    """Whether the machine has more runnable threads than cores can run, with one to spare:
    the kernel's count of runnable threads right now (`/proc/loadavg`'s fourth field, this
    process's own running thread included), sampled at most every 0.1 s. A waiter then sleeps
    at once rather than spin: the process it waits for is likely not running (other work
    holds the cores), and a spin would only take a core from it. On the 2-vCPU machine of
    docs/PERFORMANCE.md at load 3.5, back-to-back 4-byte all_reduces took 0.89 ms spinning and
    0.56 ms without. False where the count cannot be read."""
    now = time.monotonic()
    if now - _crowd_seen[0] < _CROWD_EVERY_S:
        return bool(_crowd_seen[1])
    try:
        with open(_LOAD_FILE, "rb") as load:
            runnable = int(load.read().split()[3].split(b"/")[0])
        crowded_now = runnable > available_cores() + 1
    except (OSError, ValueError, IndexError):
        crowded_now = False
    _crowd_seen[0], _crowd_seen[1] = now, float(crowded_now)
    return crowded_now


def spin_for(processes: int) -> Spin:
    """A new waiter's spin, for a wait that needs `processes` running for the awaited word to
    change (the workers, plus the coordinator when it serves the round): from twice this
    machine's wake latency (within [10 µs, 300 µs]) up to 1 ms as its waits show, when each of
    them can have a core; none when they share cores (the waiter is its own, not shared)."""
    if available_cores() < processes:
        return NO_SPIN
    return Spin(min(max(2 * wake_latency_s(), _SPIN_MIN_S), _SPIN_MAX_S), _SPIN_CAP_S)
