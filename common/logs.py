"""Log setup shared by the CLIs: one line per event, as text or JSON, with worker and step.

Each line carries the process's role and, where known, the worker id and step: a call can pass
them as `extra={"worker_id": w, "step": s}`; a worker process sets its own once
(`set_log_context`) so every line it writes names it.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

_PROCESS_WORKER: list[int | None] = [None]
_PROCESS_STEP: list[int | None] = [None]

LOG_FORMATS = ("text", "json")


def set_log_context(*, worker_id: int | None = None, step: int | None = None) -> None:
    """Names this process's worker (and current step) on every later log line."""
    if worker_id is not None:
        _PROCESS_WORKER[0] = worker_id
    if step is not None:
        _PROCESS_STEP[0] = step


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "worker_id", None) is None:
            record.worker_id = _PROCESS_WORKER[0]
        if getattr(record, "step", None) is None:
            record.step = _PROCESS_STEP[0]
        return True


class _TextFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(role)s%(where)s] %(name)s: %(message)s")
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        if record.__dict__.get("worker_id") is not None:
            parts.append(f" worker={record.__dict__['worker_id']}")
        if record.__dict__.get("step") is not None:
            parts.append(f" step={record.__dict__['step']}")
        record.role = self.role
        record.where = "".join(parts)
        return super().format(record)


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname,
            "role": self.role,
            "logger": record.name,
            "worker_id": record.__dict__.get("worker_id"),
            "step": record.__dict__.get("step"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, role: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(role) if log_format == "json" else _TextFormatter(role))
    handler.addFilter(_ContextFilter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
