"""Real processes for tests: the CLIs and scripted workers, with fault injection.

`ProcessGroup` owns every process a test starts and ends them all in its `close()` (the fixture's
`finally`). Each is a child of the project's one process supervisor (gradserver.worker.supervisor,
as under `launch` and `run`), its output relayed into a list so a test can wait for a line
(bounded) and inject a fault when a given worker reaches a given step: `kill`, `stop` (SIGSTOP),
`resume`, `slow` (stopped for a while, then resumed). An `env` value of None removes that variable.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gradserver.common.errors import DeadlineExceededError
from gradserver.worker.supervisor import Child, wait_for_port

ROOT = Path(__file__).resolve().parents[2]


class ManagedProcess:
    def __init__(self, argv: list[str], name: str, env: dict[str, str | None] | None = None) -> None:
        self.name = name
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.child = Child(argv, name, self._line, env, cwd=ROOT)
        self.proc = self.child.proc

    def _line(self, prefix: str, line: str) -> None:
        with self._cond:
            self.lines.append(line.rstrip("\n"))
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """The first output line matching `pattern`; fails with the output if none comes."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self.child.relaying):
                    raise AssertionError(
                        f"{self.name}: no line matching {pattern!r} within {timeout} s "
                        f"(exit {self.proc.poll()}); output:\n{self.output}"
                    )
                self._cond.wait(min(remaining, 0.5))

    def wait(self, timeout: float = 30.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout} s:\n{self.output}") from None
        self.child.finish_output()
        return code

    # --- faults ---------------------------------------------------------------------------------

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def slow(self, seconds: float) -> None:
        self.stop()
        timer = threading.Timer(seconds, self.resume)
        timer.daemon = True
        timer.start()

    def ensure_ended(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


class ProcessGroup:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[ManagedProcess] = []

    def start(self, argv: list[str], name: str, env: dict[str, str | None] | None = None) -> ManagedProcess:
        proc = ManagedProcess(argv, name, env)
        self.procs.append(proc)
        return proc

    def gradserver(self, *args: str, name: str, env: dict[str, str | None] | None = None) -> ManagedProcess:
        return self.start([sys.executable, "-m", "gradserver.cli", *args], name, env)

    def coordinator(self, *args: str, env: dict[str, str | None] | None = None) -> tuple[ManagedProcess, str]:
        """Starts `gradserver coordinator` on 127.0.0.1:0 and returns it with its address."""
        port_file = self.tmp / f"port-{len(self.procs)}"
        proc = self.gradserver(
            "coordinator",
            "--bind",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            *args,
            name="coordinator",
            env=env,
        )
        try:
            port = wait_for_port(proc.proc, port_file, 30.0)
        except DeadlineExceededError:
            port = None
        if port is None:
            raise AssertionError(f"coordinator did not start:\n{proc.output}")
        return proc, f"127.0.0.1:{port}"

    def restart_coordinator(self, killed: ManagedProcess, address: str, *args: str) -> ManagedProcess:
        """SIGKILLs the coordinator `killed` and starts `gradserver coordinator *args` again on
        its port (`address`), as a supervisor that restarts it in place does."""
        killed.kill()
        killed.wait(30)
        port = address.rsplit(":", 1)[1]
        return self.gradserver("coordinator", "--bind", f"127.0.0.1:{port}", *args, name="restarted")

    def scripted_worker(
        self, address: str, *args: str, name: str, env: dict[str, str | None] | None = None
    ) -> ManagedProcess:
        """A worker driven by tests/helpers/scripted_worker.py (full steps, then a fault point)."""
        argv = [sys.executable, "-m", "tests.helpers.scripted_worker", "--coordinator", address, *args]
        return self.start(argv, name, env)

    def wait_any(self, procs: list[ManagedProcess], timeout: float) -> ManagedProcess:
        """The first of `procs` to exit (its output read); fails naming them if none does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in procs:
                try:
                    proc.proc.wait(0.2)
                except subprocess.TimeoutExpired:
                    continue
                proc.child.finish_output()
                return proc
        outputs = "\n".join(f"--- {p.name}:\n{p.output}" for p in procs)
        raise AssertionError(f"none of {[p.name for p in procs]} exited within {timeout} s\n{outputs}")

    def close(self) -> None:
        for proc in self.procs:
            proc.ensure_ended()


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every living descendant of `pid` (read from /proc)."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    found[child] = (Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")).decode()
                except OSError:
                    continue
                todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (an exited child nobody reaped yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] not in ("Z", "X")
