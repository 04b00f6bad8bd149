"""Wait for a log line of the in-process coordinator: an event to synchronise on, not a sleep.

`LogWaiter` is a logging handler on the `gradserver` logger: `wait_for(pattern, timeout)` returns
the first record whose message matches (already logged or logged later) and fails with every
message seen when none comes in time.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class LogWaiter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._cond = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._cond:
            self.records.append(record)
            self._cond.notify_all()

    def messages(self) -> list[str]:
        with self._cond:
            return [r.getMessage() for r in self.records]

    def matching(self, pattern: str) -> list[logging.LogRecord]:
        regex = re.compile(pattern)
        with self._cond:
            return [r for r in self.records if regex.search(r.getMessage())]

    def wait_for(self, pattern: str, timeout: float = 30.0) -> logging.LogRecord:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for record in self.records[seen:]:
                    if regex.search(record.getMessage()):
                        return record
                seen = len(self.records)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    lines = "\n".join(r.getMessage() for r in self.records)
                    raise AssertionError(f"no log line matching {pattern!r} within {timeout} s:\n{lines}")
                self._cond.wait(remaining)


@contextmanager
def log_waiter(name: str = "gradserver") -> Iterator[LogWaiter]:
    """Attaches a LogWaiter (DEBUG and up) to logger `name` for the block."""
    logger = logging.getLogger(name)
    waiter = LogWaiter()
    old_level = logger.level
    logger.addHandler(waiter)
    logger.setLevel(logging.DEBUG)
    try:
        yield waiter
    finally:
        logger.removeHandler(waiter)
        logger.setLevel(old_level)
