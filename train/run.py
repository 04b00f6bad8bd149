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

With --restart-lost K, a rank that fails or is killed is started again alone (its command, its
environment), and so is a coordinator, on its port: gradserver.torch.ft ranks heal or rejoin and
line up (docs/fault-tolerance.md); each restart is one of the K.

Started by srun as one of several tasks of a SLURM step (`srun gradserver run --workers W -- CMD`,
see gradserver.train.slurm and docs/slurm.md), run starts its share of the job: task t's ranks are
t*W..t*W+W-1 of a world of W times the tasks, with MASTER_ADDR the step's first node; task 0 also
runs the coordinator there, on all interfaces, at a port every task derives from SLURM_JOB_ID (the
torch Store at the next one), and keeps it until every task's ranks left. Only task 0 has the
coordinator's verdicts, so only it names a rank another node lost. `--no-slurm` runs on this
machine alone instead.

It lives in the training application beside `gradserver launch` because it is the same kind of
job supervision, on the same supervisor (gradserver.worker.supervisor) and verdicts
(gradserver.worker.local_coordinator); it starts the user's command and never imports torch itself.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import queue
import re
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
    every_worker_left,
    job_finished,
    loss_of,
    lost_workers,
    remove_leftovers,
    verdict,
)
from gradserver.worker.supervisor import STOP_GRACE_S, Child, start_child, still_running, stop

from .cli import WorkerConfig, available_cores
from .launch import RESTART_LOST_HELP, RUN_TIMEOUT_HELP, WORKERS_HELP, await_coordinator, print_line
from .slurm import NO_SLURM_HELP, OTHER_TASKS_S, SlurmStep, several_tasks, unresponsive_nodes

_START_TIMEOUT_S = 60.0
# A rank's node name holds its process id: HOST/pidPID (gradserver.torch.ft), HOST/pidPID/rankN.
_PID_IN_NODE = re.compile(r"/pid(\d+)(?:/|$)")
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
    no_slurm: bool = dataclasses.field(default=False, metadata={"help": NO_SLURM_HELP})
    replica_group_size: int = dataclasses.field(
        default=0,
        metadata={
            "help": "ranks per replica group, for HSDP with gradserver.torch.ft (0: none): ranks "
            "r*G..r*G+G-1 form replica group r with a torch.distributed environment of their own "
            "(RANK 0..G-1), one coordinator per shard index joins the groups' ranks of that "
            "index, and a lost rank's whole group is restarted (one of --restart-lost)"
        },
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidArgumentError(f"--workers must be at least 1, got {self.workers}")
        if self.replica_group_size < 0 or (
            self.replica_group_size and self.workers % self.replica_group_size
        ):
            raise InvalidArgumentError(
                f"--replica-group-size {self.replica_group_size} must be 0 or divide --workers "
                f"{self.workers} into whole replica groups"
            )
        if self.replica_group_size and self.port:
            raise InvalidArgumentError(
                "--port picks one coordinator's port: with --replica-group-size, leave it 0"
            )
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
            for child in children:
                if child.name.startswith("coordinator"):
                    remove_leftovers(Path(tmp) / "events", child.proc.pid)
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


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where rank r runs: its torch.distributed environment and its coordinator. Without replica
    groups every rank is in one world and joins the one coordinator; with groups of G ranks, rank
    r is rank r % G of replica group r // G (a world of its own) and joins shard r % G's
    coordinator as that group's member."""

    workers: int
    group_size: int  # 0: no replica groups
    # Where this run's ranks sit in the whole job: one machine, or one task of a SLURM step.
    place: SlurmStep = dataclasses.field(default_factory=SlurmStep.alone)

    @property
    def world(self) -> int:
        """Ranks in the whole job, this run's and other SLURM tasks'."""
        return self.place.world(self.workers)

    def global_rank(self, rank: int) -> int:
        """The job's rank of this run's rank `rank` (0..workers-1)."""
        return self.place.first_rank(self.workers) + rank

    @property
    def coordinators(self) -> int:
        return self.group_size or 1

    @property
    def members(self) -> int:
        """Workers per coordinator."""
        return self.workers // self.group_size if self.group_size else self.world

    def group_of(self, rank: int) -> list[int]:
        """The ranks restarted with `rank`: its replica group, or itself alone."""
        if not self.group_size:
            return [rank]
        first = rank - rank % self.group_size
        return list(range(first, first + self.group_size))

    def env(
        self, rank: int, master_port: int, coordinators: list[str], token: str, threads: int
    ) -> dict[str, str | None]:
        env: dict[str, str | None] = {name: None for name in _RANK_ENV_REMOVED}
        shard = rank % self.group_size if self.group_size else 0
        place = self.place
        world_rank, world = (
            (shard, self.group_size) if self.group_size else (self.global_rank(rank), self.world)
        )
        env |= {
            "RANK": str(world_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(place.local_task * self.workers + rank),
            "LOCAL_WORLD_SIZE": str(place.local_tasks * self.workers),
            "GROUP_RANK": str(place.node),
            "MASTER_ADDR": place.first_host,
            "MASTER_PORT": str(master_port),
            "GRADSERVER_COORDINATOR": coordinators[shard],
        }
        if self.group_size:
            env["GRADSERVER_REPLICA_GROUP"] = str(rank // self.group_size)
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
    step = _slurm_step(config)
    layout = _Layout(config.workers, config.replica_group_size, step or SlurmStep.alone())
    # Every coordinator appends its verdicts to the one events file (a line is one write); a
    # lost worker is told apart by its node name, which holds its process id.
    events = tmp / "events"
    options = ["--log-level", "WARNING", "--events-file", str(events)]
    options += ["--heartbeat-timeout", f"{config.heartbeat_timeout:g}"]
    if config.restart_lost:
        options += ["--on-worker-loss", "continue"]  # the others go on while a lost rank restarts
    # The token reaches the coordinator through its environment, never its argv (ps shows that).
    secret: dict[str, str | None] = {"GRADSERVER_AUTH_TOKEN": token} if token else {}
    exits: queue.Queue[Child] = queue.Queue()
    coordinators: list[Child] = []
    addresses: list[str] = []
    master_ports: dict[int, int] = {}  # the first rank of each world -> its torch Store's port
    bind, port = "127.0.0.1", config.port
    if step is not None:
        # Every task knows both ports from the job id alone; only task 0 serves them.
        bind, (port, master_ports[0]) = "0.0.0.0", step.ports(config.port)
        if step.task:
            addresses.append(f"{step.first_host}:{port}")

    def start_coordinator(shard: int, port: int) -> tuple[Child, int]:
        port_file = tmp / f"port{shard}-{len(children)}"
        name = "coordinator" if layout.coordinators == 1 else f"coordinator {shard}"
        argv = coordinator_command(layout.members, port_file, *options, port=port, host=bind)
        coordinator = start_child(argv, name, _print, None, secret)
        children.append(coordinator)
        bound = await_coordinator(coordinator, port_file, min(deadline, time.monotonic() + _START_TIMEOUT_S))
        coordinator.watch(exits)
        return coordinator, bound

    for shard in range(layout.coordinators if not addresses else 0):
        coordinator, bound = start_coordinator(shard, port)
        coordinators.append(coordinator)
        addresses.append(f"{layout.place.first_host}:{bound}")
    threads = max(1, available_cores() // config.workers)
    names: dict[int, str] = {}  # pid -> rank name, of every rank started

    def start(rank: int) -> Child:
        first = layout.group_of(rank)[0] if layout.group_size else 0
        if first not in master_ports or (layout.group_size and first == rank):
            master_ports[first] = _free_port()  # a restarted replica group gets a Store of its own
        env = layout.env(rank, master_ports[first], addresses, token, threads)
        child = start_child(command, f"rank {layout.global_rank(rank)}", _print, threads, env)
        children.append(child)
        names[child.proc.pid] = child.name
        child.watch(exits)
        return child

    def rank_name(lost: LostWorker) -> str:
        """Under the torch backend a rank joins as worker id = its rank; under replica groups
        the node name says which process it was."""
        pid = _lost_pid(lost)
        if layout.group_size and pid in names:
            return names[pid]
        return f"rank {lost.worker}"

    def restart_coordinator(lost: Child) -> Child:
        """The one coordinator again, on the port its ranks know."""
        return start_coordinator(0, int(addresses[0].rsplit(":", 1)[1]))[0]

    ranks = [start(rank) for rank in range(config.workers)]
    # Several coordinators (replica groups) are not restarted: their ranks end when one is lost.
    again = restart_coordinator if len(coordinators) == 1 else None
    restarts = _Restarts(config.restart_lost, start, events, layout, rank_name, again)
    # Asked at once, while the ranks end on the signal: srun gives a task KillWait seconds.
    why = functools.partial(_why_slurm_stopped, step, config.workers) if step is not None else str
    return _watch(coordinators, ranks, exits, deadline, received, restarts, why)


def _why_slurm_stopped(step: SlurmStep, workers: int) -> str:
    """After srun stopped this task: the nodes SLURM holds down, with the ranks that ran there,
    since the coordinator may never have heard of their loss (a node whose slurmd died keeps its
    ranks running until SLURM cancels the job)."""
    named = []
    for host in unresponsive_nodes(step):
        ranks = step.ranks_on(host, workers)
        there = ""
        if ranks:
            there = (
                f" (rank {ranks[0]} ran there)"
                if len(ranks) == 1
                else f" (ranks {ranks[0]}-{ranks[-1]} ran there)"
            )
        named.append(f"{host}{there}")
    return f"; SLURM reports node {', '.join(named)} down or not responding" if named else ""


def _slurm_step(config: RunConfig) -> SlurmStep | None:
    """The SLURM step task this run is, when it is one of several (a one-task step is a run on
    one machine like any other)."""
    step = None if config.no_slurm else several_tasks()
    if step is None:
        return None
    if config.replica_group_size:
        raise InvalidArgumentError(
            f"--replica-group-size runs replica groups on one machine, and this SLURM step has "
            f"{step.tasks} tasks: start one task, or give --no-slurm"
        )
    return step


def _lost_pid(lost: LostWorker) -> int | None:
    """The process id a lost worker's node name holds, if it holds one and names this machine
    (a process of another SLURM node is none of this run's, whatever its number)."""
    found = _PID_IN_NODE.search(lost.node)
    if not found or lost.node[: found.start()] != os.uname().nodename:
        return None
    return int(found[1])


@dataclasses.dataclass
class _Restarts:
    """`--restart-lost`: how many restarts are left, how to start rank r again, and the losses
    (events-file positions) that restarts answered, which are never a later failure's cause."""

    left: int
    start: Callable[[int], Child]
    events: Path
    layout: _Layout
    name: Callable[[LostWorker], str]
    start_coordinator: Callable[[Child], Child] | None = None  # None: a lost one is not restarted
    answered: set[int] = dataclasses.field(default_factory=set)
    stopped: set[Child] = dataclasses.field(default_factory=set)  # stopped here: their exits are not failures
    replacements: set[Child] = dataclasses.field(default_factory=set)  # ranks started again
    # Replacements that found the job finished (their ends are no failure).
    too_late: list[Child] = dataclasses.field(default_factory=list)

    def stop_lost(self, ranks: list[Child]) -> None:
        """A rank a coordinator declared lost that still runs (stopped, hung, cut off) is
        stopped, so that it is restarted like one that died, while restarts are left."""
        if self.left <= 0:
            return
        for lost in lost_workers(self.events, answered=self.answered):
            name = self.name(lost)
            # The very process that was lost (its node name holds its pid), never a restarted
            # one that took its name; by name only when the node does not say.
            pid = _lost_pid(lost)
            alive = [c for c in ranks if c.proc.poll() is None and c not in self.stopped]
            if pid is not None:
                child = next((c for c in alive if c.proc.pid == pid), None)
            else:
                child = next((c for c in alive if c.name == name), None)
            if child is not None:
                _print("run:", f"{name} was lost ({lost.reason}); stopping it")
                child.proc.kill()

    def restart_coordinator(self, lost: Child, coordinators: list[Child]) -> bool:
        """Starts a coordinator that failed or was killed again, on the same port, if restarts
        are left (gradserver.torch.ft ranks rejoin it and line up; other ranks fail as before);
        whether it did."""
        if self.left <= 0 or self.start_coordinator is None or lost.proc.returncode == 0:
            return False
        self.left -= 1
        _print("run:", f"{lost.failure()}; starting it again on its port ({self.left} restart(s) left)")
        coordinators[coordinators.index(lost)] = self.start_coordinator(lost)
        return True

    def _is(self, name: str, lost: LostWorker) -> bool:
        return self.name(lost) == name

    def restart(self, child: Child, ranks: list[Child]) -> list[Child]:
        """Starts the rank of `child` (which failed) again, with the rest of its replica group
        (stopped first), if restarts are left; the ranks started."""
        if self.left <= 0 or job_finished(self.events) is not None:
            return []
        self.left -= 1
        index = ranks.index(child)
        group = self.layout.group_of(index)
        # Every other rank of the group goes, also one that already ended on its own (its
        # group's collective failed): none of their exits is a failure of its own.
        siblings = [ranks[i] for i in group if i != index]
        for sibling in siblings:
            self.stopped.add(sibling)
            if sibling.proc.poll() is None:
                sibling.proc.kill()
        for sibling in siblings:
            with contextlib.suppress(subprocess.TimeoutExpired):
                sibling.proc.wait(STOP_GRACE_S)
        for gone in [child, *siblings]:
            position = loss_of(self.events, functools.partial(self._is, gone.name), self.answered, 1.0)
            if position is not None:
                self.answered.add(position)
        again = f" with its replica group (ranks {group[0]}-{group[-1]})" if len(group) > 1 else ""
        _print("run:", f"{child.failure()}; starting it again{again} ({self.left} restart(s) left)")
        started = []
        for i in group:
            ranks[i] = self.start(i)
            started.append(ranks[i])
        self.replacements.update(started)
        return started

    def found_finished(self, child: Child) -> bool:
        """Whether `child`, which ended with an error, is a replacement that came too late: the
        job finished (every rank that took part left) before it could take part, so its end
        is no failure and it is not started again."""
        if child not in self.replacements or job_finished(self.events) is None:
            return False
        self.too_late.append(child)
        return True

    def stop_too_late(self, running: set[Child]) -> None:
        """The job finished and its coordinator stopped: a replacement still running either took
        part and is on its way out, or is still joining or healing with nothing left to join.
        Each gets SURVIVOR_GRACE_S to end by itself (exit 0: it finished like the others); one
        that does not is stopped and counted as too late."""
        late = still_running(running & self.replacements, SURVIVOR_GRACE_S)
        for child in late:
            self.stopped.add(child)
            self.too_late.append(child)
            _print("run:", f"{child.name}, started again, found the job finished; stopping it")
        stop(late)

    def finished_note(self) -> str:
        """For the last line of a finished job: each rank lost on the way, when, and that its
        replacement found the job finished ('' when none)."""
        notes = []
        for child in self.too_late:
            loss = next((w for w in lost_workers(self.events) if self.name(w) == child.name), None)
            if loss is None:
                notes.append(f"{child.name} ended and its replacement found the job finished")
                continue
            at = f" at operation {loss.step}" if loss.step is not None else ""
            notes.append(
                f"{child.name} was lost{at} ({loss.reason}) and its replacement found the job finished"
            )
        return "".join(f"; {note}" for note in notes)


def _watch(
    coordinators: list[Child],
    ranks: list[Child],
    exits: queue.Queue[Child],
    deadline: float,
    received: list[int],
    restarts: _Restarts,
    stopped_why: Callable[[], str] = str,
) -> tuple[int, str]:
    events = restarts.events
    running = set(ranks)
    while running:
        if received:
            return _after_signal(ranks, received[0], stopped_why())
        if time.monotonic() >= deadline:
            raise DeadlineExceededError("the run did not finish within --run-timeout")
        try:
            child = exits.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            restarts.stop_lost(ranks)
            continue
        if received:  # this exit is the forwarded signal's doing, not the rank's failure
            return _after_signal(ranks, received[0], stopped_why())
        code = child.proc.returncode
        if child in coordinators:
            child.finish_output()
            if code == 0 and job_finished(events) is not None:
                # Every rank that took part left: what still runs is a replacement with nothing to
                # join, or a rank on its way out.
                restarts.stop_too_late(running)
                running.difference_update(restarts.stopped)
                continue
            if restarts.restart_coordinator(child, coordinators):
                continue
            _let_survivors_end(running)
            if code:
                return 1, f"the {coordinator_failure(child, events)}"
            return 1, f"the {child.name} ended before the ranks"
        if child in restarts.stopped:  # stopped with its replica group, which starts again
            running.discard(child)
            continue
        running.discard(child)
        if code != 0:
            child.finish_output()
            if restarts.found_finished(child):
                continue
            again = restarts.restart(child, ranks)
            if again:
                running.difference_update(restarts.stopped)
                running.update(again)
                continue
            name = restarts.name
            culprit, line = verdict(child, events, name, ranks, unit="operation", answered=restarts.answered)
            lost = {name(w) for w in lost_workers(events, answered=restarts.answered)}
            _let_survivors_end({c for c in running if c.name not in lost})
            code = culprit.proc.returncode
            return (code if code > 0 else 128 - code), line
    place = restarts.layout.place
    every = f"all {len(ranks)} ranks" if len(ranks) > 1 else "the 1 rank"
    if place.tasks == 1:
        return _end_coordinators(coordinators, f"{every} finished{restarts.finished_note()}")
    if coordinators:
        why = _await_other_tasks(coordinators[0], restarts, deadline)
        if why:
            return 1, why
    return _end_coordinators(coordinators, f"{every} of SLURM task {place.task} finished")


def _await_other_tasks(coordinator: Child, restarts: _Restarts, deadline: float) -> str:
    """Task 0 of a SLURM step, its own ranks done: its coordinator still serves the other tasks'
    ranks, so it stays until every one of them left (or one was lost, or OTHER_TASKS_S passed);
    '' when they all left, else why not."""
    end = min(deadline, time.monotonic() + OTHER_TASKS_S)
    # Losses before now were answered, if at all, by the run of the lost rank's task (a restart).
    earlier = len(lost_workers(restarts.events))
    while time.monotonic() < end:
        if every_worker_left(restarts.events):
            return ""
        lost = lost_workers(restarts.events)[earlier:]
        if lost:
            return f"{restarts.name(lost[0])} was lost after this task's ranks finished ({lost[0].reason})"
        if coordinator.proc.poll() is not None:
            coordinator.finish_output()
            return f"the {coordinator_failure(coordinator, restarts.events)} while other tasks' ranks ran"
        time.sleep(_POLL_S)
    return (
        f"the other SLURM tasks' ranks did not leave the coordinator within {OTHER_TASKS_S:g} s "
        "of this task's"
    )


def _let_survivors_end(running: set[Child]) -> None:
    """Gives the ranks still running SURVIVOR_GRACE_S to exit by themselves, so that each prints
    its own error; the caller stops those that do not."""
    still_running(running, SURVIVOR_GRACE_S)


def _after_signal(ranks: list[Child], signum: int, why: str = "") -> tuple[int, str]:
    """The signal went to every rank: give them the grace period to exit on it. `why`: what
    else is known of the stop, appended to the line."""
    still_running(ranks, STOP_GRACE_S)
    return 128 + signum, f"stopped by {signal.Signals(signum).name}{why}"


def _end_coordinators(coordinators: list[Child], finished: str) -> tuple[int, str]:
    """Every rank exited 0: a coordinator has no end of its own here (no step count), so each is
    asked to stop. One slow to stop is killed (by the caller) and named in a warning: the
    training finished, and that is what the exit status says."""
    for coordinator in coordinators:
        coordinator.proc.terminate()
    for coordinator in coordinators:
        try:
            code = coordinator.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _print(
                "run:",
                f"warning: the {coordinator.name} did not stop within {STOP_GRACE_S:g} s of SIGTERM "
                "after every rank finished; killing it",
            )
            coordinator.proc.kill()
            continue
        if code not in (0, -signal.SIGTERM):
            coordinator.finish_output()
            return 1, f"every rank finished, but the {coordinator.failure()}"
    return 0, finished
