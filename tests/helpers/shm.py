"""What shared memory this host and this process hold, for tests that check nothing is left."""

from __future__ import annotations

import os


def dev_shm() -> set[str]:
    """The names in /dev/shm (empty where the host has none)."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def memfd_mappings() -> list[str]:
    """The lines of this process's memory map that map gradserver's memfd arenas."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "memfd:gradserver" in line]
