"""How many cores this process may use: what sizes thread pools and decides whether to spin.

`os.cpu_count()` is the machine's count, not this process's: a container or a batch job often
runs on fewer, by a CPU set (the affinity mask) or by a CPU quota (a cgroup's `cpu.max`, what
`docker run --cpus` and Kubernetes' CPU limits set), and a pool sized for 16 cores on a 2-core
quota only makes its threads wait for each other. Both limits count here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def affinity_cores() -> int:
    """The cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cpu_quota_cores() -> float | None:
    """This process's cgroup CPU limit in cores (v2 `cpu.max`, else v1's CFS quota); None when
    there is none or it cannot be read."""
    try:
        quota, period = _CGROUP_V2_MAX.read_text().split()[:2]
        return None if quota == "max" else _cores_of(int(quota), int(period))
    except (OSError, ValueError):
        pass
    try:
        return _cores_of(int(_CGROUP_V1_QUOTA.read_text()), int(_CGROUP_V1_PERIOD.read_text()))
    except (OSError, ValueError):
        return None


def _cores_of(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def available_cores() -> int:
    """The cores this process can keep busy at once: its affinity, bounded by a CPU quota
    (rounded up: a quota of 1.5 cores still runs two threads part of the time)."""
    cores = affinity_cores()
    quota = cpu_quota_cores()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores
