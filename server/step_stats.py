"""Per-step statistics of the reduction table, logged at DEBUG when a later step opens.

Counts the keys opened and the bytes received per step and, once a later step's first key opens,
logs one line per earlier step (done or failed, keys, MiB in, seconds) and forgets it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Container

# The table's logger: these lines are part of its story.
log = logging.getLogger("gradserver.server.reduction")


@dataclasses.dataclass
class _StepStats:
    keys: int = 0
    bytes_in: int = 0
    started: float = 0.0


class StepStatistics:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._steps: collections.OrderedDict[int, _StepStats] = collections.OrderedDict()

    def key_opened(self, step: int, failed: Container[int]) -> None:
        """Counts a key of `step`; the first key of a new step logs and drops the earlier ones."""
        if step not in self._steps:
            self._log_previous_steps(step, failed)
            self._steps[step] = _StepStats(started=self._clock())
        self._stats_for(step).keys += 1

    def bytes_received(self, step: int, nbytes: int) -> None:
        self._stats_for(step).bytes_in += nbytes

    def _stats_for(self, step: int) -> _StepStats:
        stats = self._steps.get(step)
        if stats is None:
            stats = self._steps[step] = _StepStats(started=self._clock())
        return stats

    def _log_previous_steps(self, new_step: int, failed: Container[int]) -> None:
        for step in [s for s in self._steps if s < new_step]:
            stats = self._steps.pop(step)
            if log.isEnabledFor(logging.DEBUG):
                state = "failed" if step in failed else "done"
                log.debug(
                    "step %d %s: %d keys, %.1f MiB in, %.3f s",
                    step,
                    state,
                    stats.keys,
                    stats.bytes_in / 2**20,
                    self._clock() - stats.started,
                )
