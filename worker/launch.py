"""`gradserver launch`: a coordinator and N workers on this machine, as separate processes.

The coordinator binds 127.0.0.1 on a free port and writes it to a file; the workers are started
once it exists. Output of every process is relayed with a prefix. The launch fails (exit 1) if
any process fails or the whole run exceeds --timeout; every process is stopped on the way out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from gradserver.common.errors import DeadlineExceededError, InvalidArgumentError


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "launch",
        help="run a coordinator and N workers on this machine",
        description=__doc__,
    )
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes")
    parser.add_argument("--steps", type=int, default=3, help="steps every worker runs")
    parser.add_argument("--model", default="tiny", help="gradient shape preset for the workers")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument(
        "worker_args", nargs=argparse.REMAINDER, help="after --, extra flags for every worker"
    )
    parser.set_defaults(run=run)


def gradserver_command(*args: str) -> list[str]:
    """The argv that runs `gradserver ARGS` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "gradserver.common.cli", *args]


def _relay(prefix: str, stream: IO[str]) -> None:
    for line in stream:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def _start(argv: list[str], prefix: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )
    assert proc.stdout is not None
    threading.Thread(target=_relay, args=(prefix, proc.stdout), daemon=True).start()
    return proc


def run(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.steps < 1:
        raise InvalidArgumentError("--workers and --steps must be at least 1")
    extra = [a for a in args.worker_args if a != "--"]
    deadline = time.monotonic() + args.timeout
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="gradserver-launch-") as tmp:
        port_file = Path(tmp) / "port"
        try:
            coordinator = _start(
                gradserver_command(
                    "coordinator",
                    "--bind",
                    "127.0.0.1:0",
                    "--world-size",
                    str(args.workers),
                    "--max-steps",
                    str(args.steps),
                    "--port-file",
                    str(port_file),
                ),
                "[coordinator]",
            )
            procs.append(coordinator)
            while not port_file.exists():
                if coordinator.poll() is not None:
                    print("launch: the coordinator exited before it was ready", file=sys.stderr)
                    return 1
                if time.monotonic() > deadline:
                    raise DeadlineExceededError("the coordinator did not start in time")
                time.sleep(0.05)
            address = f"127.0.0.1:{port_file.read_text().strip()}"
            print(f"launch: coordinator at {address}, starting {args.workers} worker(s)", flush=True)
            workers = [
                _start(
                    gradserver_command(
                        "worker",
                        "--coordinator",
                        address,
                        "--node-id",
                        f"local-{i}",
                        "--steps",
                        str(args.steps),
                        "--model",
                        args.model,
                        *extra,
                    ),
                    f"[local-{i}]",
                )
                for i in range(args.workers)
            ]
            procs.extend(workers)
            failed = 0
            for proc in [*workers, coordinator]:
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    code = proc.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    raise DeadlineExceededError(
                        f"the run did not finish within --timeout {args.timeout:g} s"
                    ) from None
                failed += code != 0
            print(f"launch: {'all processes finished' if not failed else f'{failed} process(es) failed'}")
            return 1 if failed else 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
