"""The coordinator's verdicts as JSON lines (`--events-file`), for the process that supervises it.

`gradserver run`, `gradserver launch` and the torch backend's embedded coordinator start a
coordinator and must say, when a job fails, which worker was lost and why: they read this file
instead of parsing the coordinator's log. One object per line, appended and flushed:

    {"event": "serving", "port": 40123, "shm_socket": "/tmp/gradserver-shm-4711-k2v9x1y2/sock"}
    {"event": "worker_lost", "worker": 1, "node": "host/pid12/rank1", "reason": "lost: no message ...",
     "step": 25}
    {"event": "every_worker_left"}
    {"event": "job_ended", "state": "failed", "reason": "..."}

`step` is the lowest step in flight when the worker was lost (the torch backend's operation
number), null when none was. `every_worker_left`: the last member left with a goodbye (earlier ones
may have been lost and replaced): `gradserver run` as task 0 of a SLURM step keeps its coordinator
until then for the other tasks' ranks.

A worker_lost line is written before the other workers are told their step failed, so a
supervisor that sees a survivor exit already finds the verdict. A failed write is logged once and
never stops the coordinator.
"""

from __future__ import annotations

import json
import logging
from typing import IO, Any

log = logging.getLogger("gradserver.server.events")


class EventLog:
    """Appends events to a file; with no path it writes nothing."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._file: IO[str] | None = None
        self._failed = False

    def write(self, event: str, **fields: Any) -> None:
        if not self._path or self._failed:
            return
        try:
            if self._file is None:
                self._file = open(self._path, "a", encoding="utf-8")  # noqa: SIM115 - held open
            self._file.write(json.dumps({"event": event, **fields}) + "\n")
            self._file.flush()
        except OSError as exc:
            self._failed = True
            log.warning("cannot write the events file %s (no more events go there): %r", self._path, exc)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
