"""`gradserver run`: any training script on this machine, its ranks averaging through a coordinator.

    gradserver run --workers 2 -- python my_train.py --epochs 3

starts a coordinator (127.0.0.1, --port or any free port) and N copies of the command with the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
a free port for the torch Store), GRADSERVER_COORDINATOR (so `init_process_group("gradserver")`
joins it), GRADSERVER_AUTH_TOKEN from --token-file, and OMP_NUM_THREADS = cores // N unless set.
Each rank's output is relayed with a prefix ([rank 0], ...). SIGINT and SIGTERM are forwarded to
every rank; run then stops what is left and exits 128 + the signal. The first rank that exits
non-zero (or is killed) ends the run: the other ranks get 5 s to end by themselves (a lost rank
fails their collectives, and each prints its own error), then they and the coordinator are
stopped (SIGTERM, then SIGKILL after a grace period). The last line says why, from the
coordinator's verdict (its --events-file) rather than from whichever rank exited first:
`run: rank 1 was lost at operation 25 (lost: no message for 10.0 s ...); rank 0 exited with code
1: <its error>` for a rank the coordinator lost while it still ran (stopped, hung, cut off; the
operation is its collective's sequence number), or `run: rank 1 was killed by SIGKILL`, or
`run: rank 1 exited with code 3: RuntimeError: boom` for a rank that ended itself (the exception
line of its traceback, torch's `[rank1]: ` prefix read through).
Exit codes: 0 when every rank exited 0 and the coordinator was stopped; the failing rank's code
(128 + N for a rank killed by signal N; for a lost rank, which has none, the first survivor's);
1 when the coordinator failed or ended first; 128 + N when run itself got signal N; 2 for bad
arguments. The script's default process group uses this coordinator; each `dist.new_group`
sub-group starts an embedded coordinator of its own (gradserver.torch). The coordinator
takes its other settings from the environment as always (GRADSERVER_STEP_TIMEOUT,
GRADSERVER_JOIN_TIMEOUT, GRADSERVER_TLS_CERT, ...), the ranks theirs (GRADSERVER_TLS_CA,
GRADSERVER_TLS_CLIENT_CERT, ...): every variable means one thing to every process, so one
environment serves both. The old names a rank would read as its own for one more release
(GRADSERVER_TLS_CERT/_KEY, GRADSERVER_JOIN_TIMEOUT: now the coordinator's alone) are removed from
the ranks' environment. Settings: `RunConfig` (flag, GRADSERVER_ variable, default; the old
`--timeout` is `--run-timeout`).

It lives in the training application beside `gradserver launch` because it is the same kind of
job supervision, on the same supervisor (gradserver.worker.supervisor) and verdicts
(gradserver.worker.local_coordinator); it starts the user's command and never imports torch itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from gradserver.common.config import add_config_arguments, config_from_sources, deprecated_names_of
from gradserver.common.errors import DeadlineExceededError, InvalidArgumentError
from gradserver.worker.local_coordinator import (
    LostWorker,
    coordinator_command,
    coordinator_failure,
    coordinator_pid,
    loss_of,
    lost_workers,
    remove_leftovers,
    verdict,
)
from gradserver.worker.supervisor import STOP_GRACE_S, Child, start_child, stop

from .cli import WorkerConfig, available_cores
from .launch import RESTART_LOST_HELP, RUN_TIMEOUT_HELP, WORKERS_HELP, await_coordinator, print_line

_START_TIMEOUT_S = 60.0
_POLL_S = 0.5  # how often the supervision loop looks at a forwarded signal
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
# After the first failure the other ranks get this long to end on their own (a lost rank or
# coordinator fails their next collective within moments, and each prints its own error) before
# they are stopped.
SURVIVOR_GRACE_S = 5.0
# Old names a worker still reads for one release, which now are the coordinator's alone: under
# run they are the coordinator's, so a rank must not take them for its own.
_COORDINATORS_NOW = tuple(name for name in deprecated_names_of(WorkerConfig) if not name.startswith("--"))
_RANK_ENV_REMOVED = (*_COORDINATORS_NOW, "GRADSERVER_JOIN_TIMEOUT")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """run's settings; see `gradserver run --help`."""

    workers: int = dataclasses.field(default=0, metadata={"help": WORKERS_HELP})
    port: int = dataclasses.field(
        default=0, metadata={"help": "coordinator port on 127.0.0.1 (0: any free port)"}
    )
    token_file: str = dataclasses.field(
        default="", metadata={"help": "file holding the job's shared token (never on a command line)"}
    )
    # The coordinator's own setting, passed on to it: the same name, meaning and default.
    heartbeat_timeout: float = dataclasses.field(
        default=10.0, metadata={"help": "seconds of silence after which a worker counts as lost"}
    )
    run_timeout: float = dataclasses.field(
        default=0.0, metadata={"help": RUN_TIMEOUT_HELP, "deprecated_flag": "--timeout"}
    )
    restart_lost: int = dataclasses.field(default=0, metadata={"help": RESTART_LOST_HELP})

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidArgumentError(f"--workers must be at least 1, got {self.workers}")
        if self.restart_lost < 0:
            raise InvalidArgumentError(f"--restart-lost must not be negative, got {self.restart_lost}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"--port must be in 0..65535, got {self.port}")
        if self.heartbeat_timeout <= 0 or self.run_timeout < 0:
            raise InvalidArgumentError(
                "--heartbeat-timeout must be positive and --run-timeout not negative, got "
                f"{self.heartbeat_timeout:g} and {self.run_timeout:g}"
            )


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "run",
        help="run any training script with N ranks through a coordinator (like torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, RunConfig)
    # Not "command": that is the dispatcher's name for the subcommand (cli/main.py).
    parser.add_argument(
        "argv", metavar="command", nargs=argparse.REMAINDER, help="after --, the command every rank runs"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    command = [a for a in args.argv[:1] if a != "--"] + args.argv[1:]
    if not command:
        raise InvalidArgumentError("no command to run: give it after --, e.g. -- python train.py")
    config: RunConfig = config_from_sources(RunConfig, args)
    token = _read_token(config.token_file)
    children: list[Child] = []
    with (
        _forwarded_signals(children) as received,
        tempfile.TemporaryDirectory(prefix="gradserver-run-") as tmp,
    ):
        try:
            code, message = _supervise(config, command, token, Path(tmp), children, received)
        finally:
            stop(children)
            remove_leftovers(Path(tmp) / "events", coordinator_pid(children))
    for child in children:
        child.finish_output()
    # Last, after the other processes' final lines: the one line that says how the run ended.
    print(f"run: {message}", file=sys.stderr if code else sys.stdout, flush=True)
    return code


def _read_token(path: str) -> str:
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidArgumentError(f"--token-file {path}: cannot read it ({exc.strerror})") from None
    if not token:
        raise InvalidArgumentError(f"--token-file {path} is empty")
    return token


@contextlib.contextmanager
def _forwarded_signals(children: list[Child]) -> Iterator[list[int]]:
    """While active, SIGINT/SIGTERM go to every running child and are recorded in the list."""
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for child in children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _free_port() -> int:
    # Like torchrun's standalone mode: the port is free now; the Store binds it moments later.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_env(rank: int, world: int, master_port: int, coordinator: str, token: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {name: None for name in _RANK_ENV_REMOVED}
    env |= {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "GRADSERVER_COORDINATOR": coordinator,
    }
    if token:
        env["GRADSERVER_AUTH_TOKEN"] = token
    return env


def _print(prefix: str, line: str) -> None:
    print_line(f"{prefix} {line.rstrip()}")


def _supervise(
    config: RunConfig,
    command: list[str],
    token: str,
    tmp: Path,
    children: list[Child],
    received: list[int],
) -> tuple[int, str]:
    """Starts the coordinator and the ranks and watches them; returns (exit code, last line). The
    caller stops whatever still runs."""
    deadline = time.monotonic() + (config.run_timeout or float("inf"))
    port_file = tmp / "port"
    events = tmp / "events"
    options = ["--log-level", "WARNING", "--events-file", str(events)]
    options += ["--heartbeat-timeout", f"{config.heartbeat_timeout:g}"]
    if config.restart_lost:
        options += ["--on-worker-loss", "continue"]  # the others go on while a lost rank restarts
    # The token reaches the coordinator through its environment, never its argv (ps shows that).
    secret: dict[str, str | None] = {"GRADSERVER_AUTH_TOKEN": token} if token else {}
    coordinator = start_child(
        coordinator_command(config.workers, port_file, *options, port=config.port),
        "coordinator",
        _print,
        None,
        secret,
    )
    children.append(coordinator)
    port = await_coordinator(coordinator, port_file, min(deadline, time.monotonic() + _START_TIMEOUT_S))
    exits: queue.Queue[Child] = queue.Queue()
    coordinator.watch(exits)
    threads = max(1, available_cores() // config.workers)
    master_port = _free_port()
    ranks = []

    def start(rank: int) -> Child:
        env = _rank_env(rank, config.workers, master_port, f"127.0.0.1:{port}", token)
        child = start_child(command, f"rank {rank}", _print, threads, env)
        children.append(child)
        child.watch(exits)
        return child

    for rank in range(config.workers):
        ranks.append(start(rank))
    restarts = _Restarts(config.restart_lost, start, events)
    return _watch(coordinator, ranks, exits, deadline, received, events, restarts)


@dataclasses.dataclass
class _Restarts:
    """`--restart-lost`: how many restarts are left, how to start rank r again, and the losses
    (events-file positions) that restarts answered, which are never a later failure's cause."""

    left: int
    start: Callable[[int], Child]
    events: Path
    answered: set[int] = dataclasses.field(default_factory=set)

    def restart(self, child: Child, ranks: list[Child]) -> Child | None:
        """Starts the rank of `child` (which failed) again, if restarts are left."""
        if self.left <= 0:
            return None
        self.left -= 1
        position = loss_of(self.events, lambda w: _rank_name(w) == child.name, self.answered, 1.0)
        if position is not None:
            self.answered.add(position)
        index = ranks.index(child)
        _print("run:", f"{child.failure()}; starting it again ({self.left} restart(s) left)")
        again = self.start(index)
        ranks[index] = again
        return again


def _watch(
    coordinator: Child,
    ranks: list[Child],
    exits: queue.Queue[Child],
    deadline: float,
    received: list[int],
    events: Path,
    restarts: _Restarts,
) -> tuple[int, str]:
    running = set(ranks)
    while running:
        if received:
            return _after_signal(ranks, received[0])
        if time.monotonic() >= deadline:
            raise DeadlineExceededError("the run did not finish within --run-timeout")
        try:
            child = exits.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            continue
        if received:  # this exit is the forwarded signal's doing, not the rank's failure
            return _after_signal(ranks, received[0])
        code = child.proc.returncode
        if child is coordinator:
            child.finish_output()
            _let_survivors_end(running)
            if code:
                return 1, f"the {coordinator_failure(child, events)}"
            return 1, "the coordinator ended before the ranks"
        running.discard(child)
        if code != 0:
            child.finish_output()
            again = restarts.restart(child, ranks)
            if again is not None:
                running.add(again)
                continue
            culprit, line = verdict(
                child, events, _rank_name, ranks, unit="operation", answered=restarts.answered
            )
            lost = {_rank_name(w) for w in lost_workers(events, answered=restarts.answered)}
            _let_survivors_end({c for c in running if c.name not in lost})
            code = culprit.proc.returncode
            return (code if code > 0 else 128 - code), line
    return _end_coordinator(coordinator, len(ranks))


def _rank_name(lost: LostWorker) -> str:
    """Under the torch backend a rank joins as worker id = its rank."""
    return f"rank {lost.worker}"


def _let_survivors_end(running: set[Child]) -> None:
    """Gives the ranks still running SURVIVOR_GRACE_S to exit by themselves, so that each prints
    its own error; the caller stops those that do not."""
    end = time.monotonic() + SURVIVOR_GRACE_S
    for child in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(max(0.0, end - time.monotonic()))


def _after_signal(ranks: list[Child], signum: int) -> tuple[int, str]:
    """The signal went to every rank: give them the grace period to exit on it."""
    grace_end = time.monotonic() + STOP_GRACE_S
    for child in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(max(0.0, grace_end - time.monotonic()))
    return 128 + signum, f"stopped by {signal.Signals(signum).name}"


def _end_coordinator(coordinator: Child, ranks: int) -> tuple[int, str]:
    """Every rank exited 0: the coordinator has no end of its own here (no step count), so it is
    asked to stop, and must."""
    coordinator.proc.terminate()
    try:
        code = coordinator.proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:  # the caller kills it
        return 1, f"the coordinator did not stop within {STOP_GRACE_S:g} s of SIGTERM"
    if code not in (0, -signal.SIGTERM):
        coordinator.finish_output()
        return 1, f"every rank finished, but the {coordinator.failure()}"
    return 0, f"all {ranks} ranks finished"
