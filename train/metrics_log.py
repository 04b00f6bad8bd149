"""DIR/metrics.jsonl: one JSON line per step and worker, appended.

Several workers may share DIR (launch, a compose volume): each line is one small append, which
the operating system keeps whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO


def open_metrics_log(out: str) -> IO[str] | None:
    if not out:
        return None
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return (directory / "metrics.jsonl").open("a", encoding="utf-8", buffering=1)
