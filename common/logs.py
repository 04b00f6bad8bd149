"""Log setup shared by the CLIs: one line per event, with the process's role in each line."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
