"""A `gradserver coordinator` child process on this machine, and the port it listens on.

One helper for everything that starts its own coordinator: `gradserver launch` and `gradserver
run` (gradserver.train) and the torch backend's embedded coordinator (gradserver.torch). The child
binds 127.0.0.1 (port 0: any free port) and writes the port it got to a file once it serves; that
file is the only readiness signal it gives. Torch-free, and it imports nothing of the server: the
coordinator is a separate process started by its command.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gradserver.common.errors import DeadlineExceededError

_POLL_S = 0.05


def coordinator_command(world_size: int, port_file: Path, *options: str, port: int = 0) -> list[str]:
    """The argv of a coordinator for `world_size` workers on 127.0.0.1:`port` that reports its
    port in `port_file`; `options` are further `gradserver coordinator` flags."""
    return [
        sys.executable,
        "-m",
        "gradserver.cli",
        "coordinator",
        "--bind",
        f"127.0.0.1:{port}",
        "--world-size",
        str(world_size),
        "--port-file",
        str(port_file),
        *options,
    ]


def wait_for_port(process: subprocess.Popen[Any], port_file: Path, timeout_s: float) -> int | None:
    """The port `process` wrote to `port_file`, or None if it exited before it did; raises
    DeadlineExceededError if neither happens within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        # The coordinator replaces the file atomically: it is absent or holds the whole line.
        with contextlib.suppress(FileNotFoundError, ValueError):
            text = port_file.read_text().strip()
            if text:
                return int(text.rsplit(":", 1)[-1])
        if process.poll() is not None:
            return None
        if time.monotonic() >= deadline:
            raise DeadlineExceededError(
                f"the coordinator (pid {process.pid}) did not listen within {timeout_s:g} s"
            )
        time.sleep(_POLL_S)
