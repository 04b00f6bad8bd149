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

It lives in the training application beside `gradserver launch` because it is the same job
supervision (gradserver.train.supervision: the watch loop, the restarts, the SLURM placement), on
the same supervisor (gradserver.worker.supervisor) and verdicts (gradserver.worker.local_coordinator);
this module says what run starts: the coordinators, and each rank's command and torchrun
environment (`_Layout`). It starts the user's command and never imports torch itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

from gradserver.common.config import add_config_arguments, config_from_sources, deprecated_names_of
from gradserver.common.cores import available_cores
from gradserver.common.errors import InvalidArgumentError
from gradserver.worker.local_coordinator import LostWorker
from gradserver.worker.supervisor import Child, start_child

from .cli import WorkerConfig
from .slurm import NO_SLURM_HELP, SlurmStep
from .supervision import (
    RESTART_LOST_HELP,
    RUN_TIMEOUT_HELP,
    WORKERS_HELP,
    Ending,
    FrontEnd,
    Supervision,
    print_prefixed,
    supervised,
)
from .supervision_placement import coordinator_place, free_port, job_step, why_slurm_stopped
from .supervision_restarts import lost_pid

# Old names a worker still reads for one release, which now are the coordinator's alone: under
# run they are the coordinator's, so a rank must not take them for its own.
_COORDINATORS_NOW = tuple(name for name in deprecated_names_of(WorkerConfig) if not name.startswith("--"))
_RANK_ENV_REMOVED = (*_COORDINATORS_NOW, "GRADSERVER_JOIN_TIMEOUT")
_FRONT = FrontEnd(
    prefix="run:",
    sink=print_prefixed,
    unit="operation",  # a rank's number is its torch collective's sequence number
    restarting="starting it again",
    timeout_error="the run did not finish within --run-timeout",
)


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
    groups_here = (
        "--replica-group-size runs replica groups on one machine" if config.replica_group_size else ""
    )
    step = job_step(config.no_slurm, groups_here)
    with supervised(_FRONT, config.run_timeout, config.restart_lost, "gradserver-run-") as supervision:
        ending = _supervise(config, command, token, step, supervision)
    # Last, after the other processes' final lines: the one line that says how the run ended.
    print(f"run: {ending.line}", file=sys.stderr if ending.code else sys.stdout, flush=True)
    return ending.code


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


def _supervise(
    config: RunConfig, command: list[str], token: str, step: SlurmStep | None, supervision: Supervision
) -> Ending:
    """Starts the coordinators (this node's) and the ranks and watches them; the caller stops
    whatever still runs."""
    layout = _Layout(config.workers, config.replica_group_size, step or SlurmStep.alone())
    place = coordinator_place(step, config.port)
    # The token reaches the coordinator through its environment, never its argv (ps shows that).
    secret: dict[str, str | None] = {"GRADSERVER_AUTH_TOKEN": token} if token else {}
    options = ["--heartbeat-timeout", f"{config.heartbeat_timeout:g}"]
    addresses: list[str] = []
    if place.here:
        for shard in range(layout.coordinators):
            name = "coordinator" if layout.coordinators == 1 else f"coordinator {shard}"
            bound = supervision.start_coordinator(
                name, layout.members, place.bind, place.port, options, secret
            )
            addresses.append(place.address(bound))
    else:  # every task knows task 0's ports from the job id alone
        addresses.append(place.address())
    # The first rank of each world -> its torch Store's port (in a SLURM step, derived by every task).
    master_ports: dict[int, int] = {} if place.store_port is None else {0: place.store_port}
    threads = max(1, available_cores() // config.workers)
    names: dict[int, str] = {}  # pid -> rank name, of every rank started

    def start(rank: int) -> Child:
        first = layout.group_of(rank)[0] if layout.group_size else 0
        if first not in master_ports or (layout.group_size and first == rank):
            master_ports[first] = free_port()  # a restarted replica group gets a Store of its own
        env = layout.env(rank, master_ports[first], addresses, token, threads)
        name = f"rank {layout.global_rank(rank)}"
        child = supervision.adopt(start_child(command, name, print_prefixed, threads, env))
        names[child.proc.pid] = child.name
        return child

    def rank_name(lost: LostWorker) -> str:
        """Under the torch backend a rank joins as worker id = its rank; under replica groups
        the node name says which process it was."""
        pid = lost_pid(lost)
        if layout.group_size and pid in names:
            return names[pid]
        return f"rank {lost.worker}"

    supervision.ranks.extend(start(rank) for rank in range(config.workers))
    # Several coordinators (replica groups) are not restarted: their ranks end when one is lost.
    one_coordinator = len(supervision.coordinators) == 1
    restarts = supervision.restarts(
        start, rank_name, restart_coordinators=one_coordinator, group_of=layout.group_of
    )
    # Asked at once, while the ranks end on the signal: srun gives a task KillWait seconds.
    why = functools.partial(why_slurm_stopped, step, config.workers) if step is not None else str
    ending = supervision.watch(restarts, why)
    if ending is not None:
        return ending
    every = f"all {config.workers} ranks" if config.workers > 1 else "the 1 rank"
    if layout.place.tasks == 1:
        return supervision.end_coordinators(f"{every} finished{restarts.finished_note()}")
    if supervision.coordinators:
        why_not = supervision.await_other_tasks(restarts)
        if why_not:
            return Ending(1, why_not)
    return supervision.end_coordinators(f"{every} of SLURM task {layout.place.task} finished")
