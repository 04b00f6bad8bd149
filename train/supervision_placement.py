"""Where a supervised job's processes run, for `gradserver run` and `gradserver launch` alike: on
this machine alone, or as one task of a SLURM step (gradserver.train.slurm), whose task 0 runs the
coordinator for every task's ranks.

`job_step` reads the step (or refuses a setting that only works on one machine), `coordinator_place`
says whether this node starts the coordinator, on which interface and port, and how the ranks reach
it, and `why_slurm_stopped` names the nodes SLURM holds down when srun stopped this task.
"""

from __future__ import annotations

import dataclasses
import socket

from gradserver.common.errors import InvalidArgumentError

from .slurm import SlurmStep, several_tasks, unresponsive_nodes

_LOOPBACK = "127.0.0.1"
_EVERY_INTERFACE = "0.0.0.0"  # the other tasks' nodes join task 0's coordinator


def job_step(no_slurm: bool, one_machine_only: str = "") -> SlurmStep | None:
    """The SLURM step task this process is, when it is one of several (a one-task step is a job on
    one machine like any other); None with `no_slurm` or outside a step. `one_machine_only`, when
    given, says why a setting in use needs one machine (e.g. '--in-process runs every worker in one
    process'): a step of several tasks is then refused with it."""
    step = None if no_slurm else several_tasks()
    if step is not None and one_machine_only:
        raise InvalidArgumentError(
            f"{one_machine_only}, and this SLURM step has {step.tasks} tasks: start one task, or give "
            "--no-slurm"
        )
    return step


@dataclasses.dataclass(frozen=True)
class CoordinatorPlace:
    """The job's coordinator seen from this node: whether it starts it (`here`), the interface it
    binds and the port it asks for (0: any free one), the host the ranks reach it at, and the
    torch Store's port when every task derives it (None: this node picks a free one)."""

    here: bool
    bind: str
    port: int
    host: str
    store_port: int | None

    def address(self, port: int | None = None) -> str:
        """host:port of the coordinator: `port` is the one it bound (default: the one asked for)."""
        return f"{self.host}:{self.port if port is None else port}"


def coordinator_place(step: SlurmStep | None, port: int = 0) -> CoordinatorPlace:
    """On one machine: 127.0.0.1, `port` (0: any). In a SLURM step: task 0 binds every interface
    at `port`, or at a port every task derives from the job id, with the torch Store at the next
    one; the ranks of every task reach it on the step's first node."""
    if step is None:
        return CoordinatorPlace(here=True, bind=_LOOPBACK, port=port, host=_LOOPBACK, store_port=None)
    coordinator, store = step.ports(port)
    return CoordinatorPlace(
        here=step.task == 0, bind=_EVERY_INTERFACE, port=coordinator, host=step.first_host, store_port=store
    )


def free_port() -> int:
    """A port free on 127.0.0.1 now. Like torchrun's standalone mode: the torch Store binds it
    moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_LOOPBACK, 0))
        return int(sock.getsockname()[1])


def why_slurm_stopped(step: SlurmStep, workers: int) -> str:
    """After srun stopped this task: the nodes SLURM holds down, with the ranks that ran there,
    since the coordinator may never have heard of their loss (a node whose slurmd died keeps its
    ranks running until SLURM cancels the job); '' when SLURM names none."""
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
