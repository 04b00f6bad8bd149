"""Where this process is in a SLURM job step: which task of how many, on which node, and where
task 0 (which runs the coordinator) can be reached.

`gradserver run` started by `srun` on every node of an allocation reads it here:

    srun --ntasks-per-node=1 gradserver run --workers 4 -- python train.py

Task t of T starts `--workers` W ranks, global ranks t*W .. t*W+W-1 of a world of T*W; task 0
(always on the step's first node, with SLURM's block and cyclic distributions alike) also starts
the coordinator, on all interfaces, at a port every task derives from the job id, so no task has
to tell another anything. The step's own variables are read (SLURM_STEP_NUM_TASKS,
SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE), falling back to the job's (SLURM_NTASKS,
SLURM_NODELIST, SLURM_TASKS_PER_NODE). Outside a step (no SLURM_STEP_ID: a plain shell, or an
sbatch script itself, which is not a task of a step) there is nothing to read, and run stays on
one machine.

Host lists (`node[01-04,7],gpu-a`) are expanded here as `scontrol show hostnames` does, so a node
needs no SLURM client to run a rank; tests/test_slurm.py checks the two agree.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from collections.abc import Mapping

from gradserver.common.errors import InvalidArgumentError

__all__ = [
    "NO_SLURM_HELP",
    "OTHER_TASKS_S",
    "SlurmStep",
    "expand_hostlist",
    "expand_tasks_per_node",
    "several_tasks",
    "slurm_step",
    "unresponsive_nodes",
]

NO_SLURM_HELP = (
    "inside a SLURM job step (srun), run on this machine alone instead of as one task of the step's "
    "job (see docs/slurm.md)"
)
# How long task 0's coordinator waits for the other tasks' workers to leave once its own
# finished (they passed the same last step, so only their own ending is left).
OTHER_TASKS_S = 60.0

# Ports derived from the job id: two per job (coordinator, torch Store), in a range that Linux
# does not hand out as ephemeral ports (32768-60999) and that torchrun's 29500 does not hit.
_PORT_BASE = 10000
_PORT_JOBS = 9000  # jobs before the ports repeat: 10000 + 2 * 8999 + 1 = 27999


@dataclasses.dataclass(frozen=True)
class SlurmStep:
    """This task of a SLURM job step (see the module docstring)."""

    job_id: int
    tasks: int  # in the step
    task: int  # SLURM_PROCID
    node: int  # SLURM_NODEID: index of this node in `hosts`
    local_task: int  # SLURM_LOCALID: index of this task among its node's
    tasks_per_node: tuple[int, ...]  # tasks on each node of the step, in `hosts` order
    hosts: tuple[str, ...]  # the step's nodes

    def __post_init__(self) -> None:
        if not 0 <= self.task < self.tasks:
            raise InvalidArgumentError(f"SLURM_PROCID {self.task} is not a task of {self.tasks}")
        if len(self.tasks_per_node) != len(self.hosts):
            raise InvalidArgumentError(
                f"the step's tasks per node ({len(self.tasks_per_node)} nodes) and its node list "
                f"({len(self.hosts)} nodes) disagree"
            )
        if sum(self.tasks_per_node) != self.tasks:
            raise InvalidArgumentError(
                f"the step's tasks per node add up to {sum(self.tasks_per_node)}, not its {self.tasks} tasks"
            )
        if not 0 <= self.node < len(self.hosts):
            raise InvalidArgumentError(f"SLURM_NODEID {self.node} is not a node of {', '.join(self.hosts)}")
        if not 0 <= self.local_task < self.tasks_per_node[self.node]:
            raise InvalidArgumentError(
                f"SLURM_LOCALID {self.local_task} is not a task of the {self.tasks_per_node[self.node]} "
                f"on {self.hosts[self.node]}"
            )
        if self.task == 0 and self.node != 0:
            # The other tasks look for task 0's coordinator on the first node.
            raise InvalidArgumentError(
                f"task 0 runs on {self.hosts[self.node]}, not the step's first node {self.hosts[0]}: "
                "use srun's block or cyclic distribution (the default)"
            )

    @classmethod
    def alone(cls) -> SlurmStep:
        """A job on this machine alone, as a step of one task would be."""
        return cls(job_id=0, tasks=1, task=0, node=0, local_task=0, tasks_per_node=(1,), hosts=("127.0.0.1",))

    def first_rank(self, workers: int) -> int:
        """The job's rank of this task's first rank, every task starting `workers`."""
        return self.task * workers

    def world(self, workers: int) -> int:
        """Ranks in the job, every task starting `workers`."""
        return self.tasks * workers

    @property
    def first_host(self) -> str:
        """Where task 0 runs, and with it the coordinator and rank 0's torch Store."""
        return self.hosts[0]

    @property
    def local_tasks(self) -> int:
        """Tasks of the step on this node."""
        return self.tasks_per_node[self.node]

    def ranks_on(self, host: str, workers: int) -> range | None:
        """The job's ranks on `host` when every node runs one task of `workers` ranks (else
        None: which task runs where then depends on the distribution)."""
        if host not in self.hosts or any(count != 1 for count in self.tasks_per_node):
            return None
        first = self.hosts.index(host) * workers
        return range(first, first + workers)

    def ports(self, coordinator_port: int = 0) -> tuple[int, int]:
        """(coordinator, torch Store) ports: `coordinator_port` and the next one when given,
        else two derived from the job id, the same in every task."""
        base = coordinator_port or _PORT_BASE + 2 * (self.job_id % _PORT_JOBS)
        if base > 65534:
            raise InvalidArgumentError(
                f"--port {base}: the torch Store takes the next port, and {base + 1} is none"
            )
        return base, base + 1


def slurm_step(environ: Mapping[str, str] | None = None) -> SlurmStep | None:
    """This process's task of a SLURM job step (from `environ`, this process's environment by
    default), or None outside one (no SLURM_STEP_ID); an error naming the variable when one is
    missing or malformed."""
    environ = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in environ:
        return None

    def read(*names: str) -> str:
        for name in names:
            if environ.get(name):
                return environ[name]
        raise InvalidArgumentError(f"in a SLURM step but {' / '.join(names)} is not set")

    def number(*names: str) -> int:
        text = read(*names)
        try:
            return int(text)
        except ValueError:
            raise InvalidArgumentError(f"{names[0]}={text!r} is not a whole number") from None

    return SlurmStep(
        job_id=number("SLURM_JOB_ID", "SLURM_JOBID"),
        tasks=number("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        task=number("SLURM_PROCID"),
        node=number("SLURM_NODEID"),
        local_task=number("SLURM_LOCALID"),
        tasks_per_node=expand_tasks_per_node(read("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")),
        hosts=expand_hostlist(read("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")),
    )


def several_tasks(environ: Mapping[str, str] | None = None) -> SlurmStep | None:
    """This process's task of a SLURM step of more than one task; None outside a step or in a
    one-task step (a run on one machine like any other)."""
    step = slurm_step(environ)
    return step if step is not None and step.tasks > 1 else None


_SINFO_TIMEOUT_S = 3.0  # within srun's KillWait, which follows its SIGTERM


def unresponsive_nodes(step: SlurmStep) -> list[str]:
    """The step's nodes that SLURM holds down, failed or not responding (`sinfo`), for saying
    why SLURM stopped a task; [] when sinfo is missing or does not answer in time."""
    argv = ["sinfo", "--noheader", "--Node", f"--nodes={','.join(step.hosts)}", "--format=%N %T"]
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=_SINFO_TIMEOUT_S, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.splitlines():
        host, _, state = line.partition(" ")
        # A trailing * is SLURM's mark of a node that does not respond.
        if any(word in state for word in ("down", "fail")) or state.endswith("*"):
            found.append(host)
    return [host for host in step.hosts if host in found]


_TASK_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_tasks_per_node(text: str) -> tuple[int, ...]:
    """`2(x3),1` -> (2, 2, 2, 1): SLURM's tasks-per-node notation."""
    counts: list[int] = []
    for part in text.split(","):
        found = _TASK_COUNT.fullmatch(part.strip())
        if not found:
            raise InvalidArgumentError(f"SLURM_TASKS_PER_NODE={text!r}: cannot read {part!r}")
        counts += [int(found[1])] * int(found[2] or 1)
    return tuple(counts)


def expand_hostlist(text: str) -> tuple[str, ...]:
    """`node[01-03,7],gpu-a` -> (node01, node02, node03, node7, gpu-a), as `scontrol show
    hostnames` expands a SLURM host list: ranges keep the lower bound's zero padding, and several
    bracket groups in one name give every combination."""
    hosts: list[str] = []
    for name in _split_top_level(text):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", name):
            if not literal and not ranges:
                continue
            choices = _expand_ranges(ranges, text) if ranges else [""]
            expanded = [head + literal + choice for head in expanded for choice in choices]
        hosts += expanded
    if not hosts or any(not host or "[" in host or "]" in host for host in hosts):
        raise InvalidArgumentError(f"SLURM node list {text!r} is not a host list")
    return tuple(hosts)


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise InvalidArgumentError(f"SLURM node list {text!r} has an unmatched ]")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise InvalidArgumentError(f"SLURM node list {text!r} has an unmatched [")
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _expand_ranges(ranges: str, text: str) -> list[str]:
    out: list[str] = []
    for item in ranges.split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise InvalidArgumentError(f"SLURM node list {text!r}: cannot read the range {item!r}")
        if not high:
            out.append(low)
            continue
        if int(high) < int(low):
            raise InvalidArgumentError(f"SLURM node list {text!r}: the range {item!r} runs backwards")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out
