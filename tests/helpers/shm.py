"""What shared memory this host and this process hold, for tests that check nothing is left."""

from __future__ import annotations

import gc
import os
import time


def dev_shm() -> set[str]:
    """The names in /dev/shm (empty where the host has none)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def memfd_mappings() -> list[str]:
    """The lines of this process's memory map that map gradserver's memfd arenas."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "memfd:gradserver" in line]


def assert_nothing_mapped(within: float = 10.0, what: str = "memfd:gradserver") -> None:
    """No gradserver memory (lines of the map naming `what`) is mapped in this process once the
    clients' last references go: a mapping is released when the last array viewing it is
    collected, which a helper thread of a closed client may still hold for a moment on a loaded
    machine (bounded here)."""
    deadline = time.monotonic() + within
    while True:
        gc.collect()
        left = [line for line in memfd_mappings() if what in line]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == [], f"still mapped after {within:g} s: {left}"
