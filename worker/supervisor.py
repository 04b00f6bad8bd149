"""Child processes, started and watched one way: by `gradserver launch` and `gradserver run`, by the
torch backend's embedded coordinator, and by the tests.

A `Child` is a started process with its output relayed line by line to a sink (or left on this
process's own stdout/stderr when there is no sink), its last lines kept for the error it ended
with. `stop` ends processes (SIGTERM, then SIGKILL after a grace period); `wait_for_port` and
`start_coordinator` cover the one readiness signal a coordinator gives: the port it writes to its
--port-file once it serves. Torch-free, and it imports nothing of the server.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gradserver.common.errors import DeadlineExceededError, FailedPreconditionError

STOP_GRACE_S = 5.0
_TAIL_LINES = 200
_RELAY_GRACE_S = 5.0
_POLL_S = 0.05
# The line `gradserver` prints for an error of the hierarchy (cli/main.py).
_ONE_LINE_ERROR = re.compile(r"^gradserver \w+: ")
# torch.distributed (torchrun's error handler) prefixes every line a rank prints on a failure.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")

# Where a child's output lines go: (prefix naming the child, line).
Sink = Callable[[str, str], None]


class Child:
    """A started process: its output relayed to `sink` with a prefix (inherited when `sink` is
    None), its last lines kept for the error. An `env` value of None removes that variable."""

    def __init__(
        self,
        argv: list[str],
        name: str,
        sink: Sink | None,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if sink is not None else None,
            stderr=subprocess.STDOUT if sink is not None else None,
            stdin=subprocess.DEVNULL,
            text=True,
            env={k: v for k, v in merged.items() if v is not None},
            cwd=cwd,
            pass_fds=pass_fds,
        )
        self._relay: threading.Thread | None = None
        if sink is not None:
            self._relay = threading.Thread(target=self._read, args=(sink,), daemon=True)
            self._relay.start()

    def _read(self, sink: Sink) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            sink(f"[{self.name}]", line)

    @property
    def relaying(self) -> bool:
        """Whether output may still come (the process or its output pipe is open)."""
        return self._relay is not None and self._relay.is_alive()

    def watch(self, exits: queue.Queue[Child]) -> None:
        """Reports this child on `exits` once it has exited and its output is read."""

        def wait() -> None:
            self.proc.wait()
            self.finish_output()
            exits.put(self)

        threading.Thread(target=wait, daemon=True).start()

    def finish_output(self) -> None:
        """Waits (bounded) until the output of an exited child has been relayed."""
        if self._relay is not None:
            self._relay.join(_RELAY_GRACE_S)

    def failure(self) -> str:
        """One line: which process, how it ended, and its error."""
        code = self.proc.returncode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        error = error_line(list(self.tail))
        return f"{self.name} {how}" + (f": {error}" if error else "")


def start_child(
    argv: list[str],
    name: str,
    sink: Sink | None,
    threads: int | None = None,
    env: Mapping[str, str | None] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> Child:
    """Starts `argv` as `name`, says so on `sink`; `threads` sets OMP_NUM_THREADS unless it is set;
    `pass_fds` are inherited by the child (a structured channel such as a worker's --progress-fd)."""
    extra: dict[str, str | None] = dict(env or {})
    if threads is not None and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in extra:
        # N processes each using every core for torch's intra-op threads oversubscribe the
        # machine and stall at random; like torchrun, share the cores out unless told otherwise.
        # The worker applies the same rule itself when started by hand (train/cli.py).
        extra["OMP_NUM_THREADS"] = str(threads)
    child = Child(argv, name, sink, extra, pass_fds=pass_fds)
    if sink is not None:
        sink("[launch]", f"started {name} (pid {child.proc.pid})")
    return child


def error_line(lines: list[str]) -> str:
    """A process's error from the end of its output: the exception line of its last traceback,
    else the one line `gradserver` prints for a GradServerError, else ''. torch's `[rankN]: `
    prefix is read through."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            for line in lines[i + 1 :]:
                if line and not line[0].isspace():
                    return line.strip()
            return ""
    for line in reversed(lines):
        if _ONE_LINE_ERROR.match(line):
            return line.strip()
    return ""


def still_running(children: Iterable[Child], grace_s: float) -> list[Child]:
    """Gives `children` `grace_s` (together) to end by themselves; those still running then."""
    children = list(children)
    end = time.monotonic() + grace_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(max(0.0, end - time.monotonic()))
    return [child for child in children if child.proc.poll() is None]


def stop(children: Iterable[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every process still running, SIGKILL to those alive after `grace_s`."""
    alive = [c for c in children if c.proc.poll() is None]
    for child in alive:
        with contextlib.suppress(ProcessLookupError):
            child.proc.terminate()
            child.proc.send_signal(signal.SIGCONT)  # a stopped process takes the SIGTERM now
    grace_end = time.monotonic() + grace_s
    for child in alive:
        try:
            child.proc.wait(max(0.0, grace_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(grace_s)  # SIGKILL cannot be refused; this only reaps


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


def await_port(coordinator: Child, port_file: Path, timeout_s: float) -> int:
    """The port the started `coordinator` listens on; stops it and raises naming how it ended if
    it exits first, or that it did not listen within `timeout_s`."""
    try:
        port = wait_for_port(coordinator.proc, port_file, timeout_s)
        if port is None:
            coordinator.finish_output()
            raise FailedPreconditionError(f"the {coordinator.failure()} before it was ready")
    except BaseException:
        stop([coordinator])
        raise
    return port
