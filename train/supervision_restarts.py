"""The restart policy of a supervised job (`--restart-lost K` of `gradserver run` and `gradserver
launch`): how many restarts are left, a failed rank (with its replica group) or a lost coordinator
started again, a rank the coordinator declared lost while it still runs stopped so that it
restarts, a replacement that found the job finished (no failure), and the one note that says so.

The losses (positions in the coordinator's --events-file) that restarts answered are kept, so
that a later failure's verdict never names them as its cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

from gradserver.worker.local_coordinator import LostWorker, job_finished, loss_of, lost_workers
from gradserver.worker.supervisor import STOP_GRACE_S, Child, still_running, stop

# A rank's node name holds its process id: HOST/pidPID (gradserver.torch.ft), HOST/pidPID/rankN.
_PID_IN_NODE = re.compile(r"/pid(\d+)(?:/|$)")
# For the coordinator to record the loss a restart answers (a process can exit a moment before
# the coordinator's line about it is written).
_RESTART_WAIT_S = 1.0
# After the job finished, a replacement that took part ends by itself this soon; one still
# joining or healing is stopped then.
LATE_GRACE_S = 5.0


def lost_pid(lost: LostWorker) -> int | None:
    """The process id a lost worker's node name holds, if it holds one and names this machine
    (a process of another SLURM node is none of this node's, whatever its number)."""
    found = _PID_IN_NODE.search(lost.node)
    if not found or lost.node[: found.start()] != os.uname().nodename:
        return None
    return int(found[1])


def replacement_note(name: str, loss: LostWorker | None, unit: str) -> str:
    """The one way to say that the replacement of `name` found the job finished: with the loss
    that made it a replacement (`unit`: what the loss's number counts), when the coordinator
    recorded one."""
    if loss is None:
        return f"{name} ended and its replacement found the job finished"
    at = f" at {unit} {loss.step}" if loss.step is not None else ""
    return f"{name} was lost{at} ({loss.reason}) and its replacement found the job finished"


@dataclasses.dataclass
class Restarts:
    """How many restarts are left and how to start rank r (an index into the ranks) again, the
    ranks restarted with it (`group_of`: its replica group) and a coordinator; `say` writes one
    line of the supervisor's own, `name` names a lost worker as its process is named."""

    left: int
    events: Path
    say: Callable[[str], None]
    name: Callable[[LostWorker], str]
    start: Callable[[int], Child]
    unit: str = "operation"
    restarting: str = "starting it again"  # how a restart of a rank is said
    group_of: Callable[[int], list[int]] | None = None  # None: each rank alone
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
            pid = lost_pid(lost)
            alive = [c for c in ranks if c.proc.poll() is None and c not in self.stopped]
            if pid is not None:
                child = next((c for c in alive if c.proc.pid == pid), None)
            else:
                child = next((c for c in alive if c.name == name), None)
            if child is not None:
                self.say(f"{name} was lost ({lost.reason}); stopping it")
                child.proc.kill()

    def restart_coordinator(self, lost: Child, coordinators: list[Child]) -> bool:
        """Starts a coordinator that failed or was killed again, on the same port, if restarts
        are left (ranks that rejoin a lost coordinator line up in it; others fail as before);
        whether it did."""
        if self.left <= 0 or self.start_coordinator is None or lost.proc.returncode == 0:
            return False
        self.left -= 1
        self.say(f"{lost.failure()}; starting it again on its port ({self.left} restart(s) left)")
        coordinators[coordinators.index(lost)] = self.start_coordinator(lost)
        return True

    def _is(self, name: str, lost: LostWorker) -> bool:
        return self.name(lost) == name

    def restart(self, child: Child, ranks: list[Child]) -> list[Child]:
        """Starts the rank of `child` (which failed) again, with the rest of its group (stopped
        first), if restarts are left and the job has not finished; the ranks started. The same
        command: it joins the running job in its old place and takes the state of a live rank
        (docs/RELIABILITY.md "Live recovery")."""
        if self.left <= 0 or job_finished(self.events) is not None:
            return []
        self.left -= 1
        index = ranks.index(child)
        group = self.group_of(index) if self.group_of is not None else [index]
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
            matches = functools.partial(self._is, gone.name)
            position = loss_of(self.events, matches, self.answered, _RESTART_WAIT_S)
            if position is not None:
                self.answered.add(position)
        again = f" with its replica group (ranks {group[0]}-{group[-1]})" if len(group) > 1 else ""
        self.say(f"{child.failure()}; {self.restarting}{again} ({self.left} restart(s) left)")
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
        """The job finished and its coordinator ended: a replacement still running either took
        part and is on its way out, or is still joining or healing with nothing left to join.
        Each gets LATE_GRACE_S to end by itself (exit 0: it finished like the others); one that
        does not is stopped and counted as too late."""
        late = still_running(running & self.replacements, LATE_GRACE_S)
        for child in late:
            self.stopped.add(child)
            self.too_late.append(child)
            self.say(f"{child.name}, started again, found the job finished; stopping it")
        stop(late)

    def finished_note(self) -> str:
        """For the last line of a finished job: each rank lost on the way, when, and that its
        replacement found the job finished ('' when none)."""
        notes = []
        for child in self.too_late:
            loss = next((w for w in lost_workers(self.events) if self.name(w) == child.name), None)
            notes.append(replacement_note(child.name, loss, self.unit))
        return "".join(f"; {note}" for note in notes)
