"""Supervision of a job's processes on this node, one for `gradserver run` and `gradserver launch`:
the front ends parse their arguments and say what each rank runs; this starts their coordinator
(`Supervision.start_coordinator`), watches the processes (`Supervision.watch`) and ends them.

The watch loop ends the job at the first rank that exits non-zero or is killed, naming it from
the coordinator's verdict (its --events-file: a worker it lost before the survivor that exited);
with `--restart-lost K` (gradserver.train.supervision_restarts) it starts such a rank again, stops
a rank the coordinator declared lost while it still runs so that it restarts, and starts a lost
coordinator again on its port where the front end says its ranks rejoin one. SIGINT and SIGTERM
are forwarded to every process (`supervised`) and end the job with 128 + the signal. Where the
processes run (this machine, or one task of a SLURM step) is gradserver.train.supervision_placement.
What the front ends differ in (their prefix, words and waits) is their `FrontEnd`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType

from gradserver.common.errors import DeadlineExceededError
from gradserver.worker.local_coordinator import (
    LostWorker,
    coordinator_command,
    coordinator_failure,
    every_worker_left,
    job_finished,
    lost_workers,
    remove_leftovers,
    verdict,
)
from gradserver.worker.supervisor import (
    STOP_GRACE_S,
    Child,
    Sink,
    await_port,
    start_child,
    still_running,
    stop,
)

from .slurm import OTHER_TASKS_S
from .supervision_restarts import Restarts

# The help of the flags run and launch share, one meaning for both.
WORKERS_HELP = "number of worker processes (ranks) to start"
RUN_TIMEOUT_HELP = "seconds for the whole run, a last resort (0: none)"
RESTART_LOST_HELP = (
    "start a worker or rank that fails or is killed again, alone, with its command, up to this many "
    "times in all (0: a loss ends the job); the coordinator then lets the others go on, and the "
    "restarted one takes the state of a live one (launch: the trainer; run: gradserver.torch.ft programs); "
    "a lost coordinator is started again on its port too where its ranks rejoin one (run: unless there "
    "are several; launch: with the workers' --reconnect-timeout)"
)

_POLL_S = 0.5  # how often the watch loop looks at a forwarded signal and at lost ranks
_FORWARDED = (signal.SIGINT, signal.SIGTERM)
_STDOUT_LOCK = threading.Lock()


def print_line(text: str) -> None:
    """Writes one whole line to stdout. Several relay threads print at once, and `print` writes
    the text and its newline separately, so two ranks' lines could otherwise run together."""
    with _STDOUT_LOCK:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def print_prefixed(prefix: str, line: str) -> None:
    """A `Sink` that prints each line whole, after its prefix."""
    print_line(f"{prefix} {line.rstrip()}")


@dataclasses.dataclass(frozen=True)
class FrontEnd:
    """What run and launch differ in while supervising: their words and their waits."""

    prefix: str  # before the supervisor's own lines: "run:"
    sink: Sink  # where every line goes, the processes' and the supervisor's
    unit: str  # what a lost worker's number counts: "operation" (torch collectives) or "step"
    restarting: str  # how a rank's restart is said: "starting it again"
    timeout_error: str  # the error past --run-timeout
    coordinator_article: str = "the "  # before a coordinator's name in the line it ends the job with
    # After the first failure the ranks still running get this long to end by themselves (a lost
    # rank or coordinator fails their next collective within moments, and each prints its own
    # error) before they are stopped.
    survivor_grace_s: float = 5.0
    # Whether a coordinator's exit 0 is its own end (launch: --max-steps), not one before the ranks.
    coordinator_ends_itself: bool = False
    coordinator_start_s: float = 60.0  # for a coordinator to listen (and --run-timeout at most)


@dataclasses.dataclass(frozen=True)
class Ending:
    """How the job ended: the exit code and the last line (without the front end's prefix)."""

    code: int
    line: str


@contextlib.contextmanager
def forwarded_signals(children: list[Child]) -> Iterator[list[int]]:
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


@contextlib.contextmanager
def supervised(
    front: FrontEnd, run_timeout: float, restart_lost: int, tmp_prefix: str
) -> Iterator[Supervision]:
    """A Supervision with signals forwarded and a temporary directory (its events file, port
    files); on the way out whatever still runs is stopped and every process's output relayed."""
    children: list[Child] = []
    with forwarded_signals(children) as received, tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
        supervision = Supervision(front, Path(tmp), run_timeout, restart_lost, children, received)
        try:
            yield supervision
        finally:
            supervision.close()
    for child in children:
        child.finish_output()


def await_coordinator(coordinator: Child, port_file: Path, deadline: float) -> int:
    """The port the started coordinator listens on; stops it and raises if it exits first or does
    not listen by `deadline`."""
    timeout_s = max(0.0, deadline - time.monotonic())
    try:
        return await_port(coordinator, port_file, timeout_s)
    except DeadlineExceededError:
        raise DeadlineExceededError("the coordinator did not start within --run-timeout") from None


@dataclasses.dataclass(frozen=True)
class _CoordinatorArgs:
    """What a coordinator was started with, to start it again the same way."""

    name: str
    world_size: int
    bind: str
    port: int
    options: tuple[str, ...]
    env: Mapping[str, str | None] | None


class Supervision:
    """One job's processes on this node: the coordinators it started, its ranks (`ranks`, index
    i: the front end's rank i, replaced by a restart), every process started (`children`) and
    their exits, the coordinator's events file, the deadline and the signals received."""

    def __init__(
        self,
        front: FrontEnd,
        tmp: Path,
        run_timeout: float,
        restart_lost: int,
        children: list[Child],
        received: list[int],
    ) -> None:
        self.front = front
        self.tmp = tmp
        # Every coordinator appends its verdicts to the one events file (a line is one write).
        self.events = tmp / "events"
        self.deadline = time.monotonic() + (run_timeout or float("inf"))
        self.restart_lost = restart_lost
        self.children = children
        self.received = received
        self.exits: queue.Queue[Child] = queue.Queue()
        self.coordinators: list[Child] = []
        self.ranks: list[Child] = []
        self._started_as: dict[Child, _CoordinatorArgs] = {}

    def say(self, line: str) -> None:
        """One line of the supervisor's own."""
        self.front.sink(self.front.prefix, line)

    def adopt(self, child: Child) -> Child:
        """Watches a started rank (stopped on the way out)."""
        self.children.append(child)
        child.watch(self.exits)
        return child

    def start_coordinator(
        self,
        name: str,
        world_size: int,
        bind: str,
        port: int,
        options: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
    ) -> int:
        """Starts a coordinator for `world_size` workers on `bind`:`port` (0: any free port) with
        the supervision's own flags and `options`; the port it listens on. `env` reaches it
        through its environment (a token, never on its argv: ps shows that)."""
        coordinator, bound = self._start_coordinator(
            _CoordinatorArgs(name, world_size, bind, port, tuple(options), env)
        )
        self.coordinators.append(coordinator)
        return bound

    def _start_coordinator(self, args: _CoordinatorArgs) -> tuple[Child, int]:
        port_file = self.tmp / f"port-{len(self.children)}"
        own = ["--log-level", "WARNING", "--events-file", str(self.events)]
        if self.restart_lost:
            own += ["--on-worker-loss", "continue"]  # the others go on while a lost rank restarts
        argv = coordinator_command(
            args.world_size, port_file, *own, *args.options, port=args.port, host=args.bind
        )
        coordinator = start_child(argv, args.name, self.front.sink, None, args.env)
        self.children.append(coordinator)
        self._started_as[coordinator] = args
        start_by = min(self.deadline, time.monotonic() + self.front.coordinator_start_s)
        bound = await_coordinator(coordinator, port_file, start_by)
        coordinator.watch(self.exits)
        self._started_as[coordinator] = dataclasses.replace(args, port=bound)
        return coordinator, bound

    def _start_again(self, lost: Child) -> Child:
        """A coordinator again as it was started, on the port it had, which its ranks know."""
        return self._start_coordinator(self._started_as[lost])[0]

    def restarts(
        self,
        start: Callable[[int], Child],
        name: Callable[[LostWorker], str],
        restart_coordinators: bool,
        group_of: Callable[[int], list[int]] | None = None,
    ) -> Restarts:
        """The restart policy of these ranks: `start` starts rank i again, `name` names a lost
        worker as its process is named, `group_of` (default: itself) the ranks restarted with i;
        a lost coordinator is started again if `restart_coordinators` (its ranks rejoin one)."""
        return Restarts(
            self.restart_lost,
            self.events,
            self.say,
            name,
            start,
            unit=self.front.unit,
            restarting=self.front.restarting,
            group_of=group_of,
            start_coordinator=self._start_again if restart_coordinators else None,
        )

    def watch(self, restarts: Restarts, stopped_why: Callable[[], str] = str) -> Ending | None:
        """Watches the ranks until every one of them ended well (None), or the job ended
        otherwise: its Ending. `stopped_why`: what else is known of a stop by signal, asked at
        once. Raises DeadlineExceededError past the deadline; the caller stops what still runs."""
        ranks = self.ranks
        running = set(ranks)
        while running:
            if self.received:
                return self._after_signal(stopped_why())
            if time.monotonic() >= self.deadline:
                raise DeadlineExceededError(self.front.timeout_error)
            try:
                child = self.exits.get(timeout=min(_POLL_S, max(0.0, self.deadline - time.monotonic())))
            except queue.Empty:
                restarts.stop_lost(ranks)
                continue
            if self.received:  # this exit is the forwarded signal's doing, not the rank's failure
                return self._after_signal(stopped_why())
            if child in self.coordinators:
                ending = self._coordinator_exited(child, running, restarts)
                if ending is not None:
                    return ending
                continue
            running.discard(child)
            if child in restarts.stopped or child.proc.returncode == 0:
                continue  # stopped here (its group starts again), or done
            child.finish_output()
            if restarts.found_finished(child):
                continue
            again = restarts.restart(child, ranks)
            if again:
                running.difference_update(restarts.stopped)
                running.update(again)
                continue
            return self._rank_failed(child, running, restarts)
        return None

    def _coordinator_exited(self, child: Child, running: set[Child], restarts: Restarts) -> Ending | None:
        """A coordinator exited: None when the job goes on (it finished its job, or it was
        started again), else the job's Ending."""
        child.finish_output()
        code = child.proc.returncode
        if code == 0 and job_finished(self.events) is not None:
            # Every rank that took part left: what still runs is a replacement with nothing to
            # join, or a rank on its way out.
            restarts.stop_too_late(running)
            running.difference_update(restarts.stopped)
            return None
        if restarts.restart_coordinator(child, self.coordinators):
            return None
        if code == 0 and self.front.coordinator_ends_itself:
            return None  # done with its steps; the ranks finish (or fail) on their own
        still_running(running, self.front.survivor_grace_s)
        the = self.front.coordinator_article
        if code:
            return Ending(1, f"{the}{coordinator_failure(child, self.events)}")
        return Ending(1, f"{the}{child.name} ended before the ranks")

    def _rank_failed(self, child: Child, running: set[Child], restarts: Restarts) -> Ending:
        """`child` failed and is not started again: the Ending names what ended the job, after
        the ranks still running (but those the coordinator lost) had their grace to end."""
        name = restarts.name
        culprit, line = verdict(
            child, self.events, name, self.ranks, unit=self.front.unit, answered=restarts.answered
        )
        lost = {name(w) for w in lost_workers(self.events, answered=restarts.answered)}
        still_running({c for c in running if c.name not in lost}, self.front.survivor_grace_s)
        code = culprit.proc.returncode
        return Ending(code if code > 0 else 128 - code, line)

    def _after_signal(self, why: str) -> Ending:
        """The signal went to every process: the ranks get the grace period to exit on it. `why`:
        what else is known of the stop, appended to the line."""
        signum = self.received[0]
        still_running(self.ranks, STOP_GRACE_S)
        return Ending(128 + signum, f"stopped by {signal.Signals(signum).name}{why}")

    def end_coordinators(self, finished: str) -> Ending:
        """Every rank exited 0 and the coordinators have no end of their own (no step count):
        each is asked to stop. One slow to stop is killed and named in a warning: the training
        finished, and that is what the exit status says (`finished` is the line)."""
        for coordinator in self.coordinators:
            coordinator.proc.terminate()
        for coordinator in self.coordinators:
            try:
                code = coordinator.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.say(
                    f"warning: the {coordinator.name} did not stop within {STOP_GRACE_S:g} s of SIGTERM "
                    "after every rank finished; killing it"
                )
                coordinator.proc.kill()
                continue
            if code not in (0, -signal.SIGTERM):
                coordinator.finish_output()
                return Ending(1, f"every rank finished, but the {coordinator.failure()}")
        return Ending(0, finished)

    def await_coordinators_end(self, wait_s: float) -> Ending:
        """Every rank is done and each coordinator exits by itself once its job finished
        (--max-steps is the absolute last step, so resumed jobs end too); one that has not after
        `wait_s` (the ranks left early) is asked to stop."""
        for coordinator in self.coordinators:
            try:
                code = coordinator.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                coordinator.proc.terminate()
                try:
                    code = coordinator.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    return Ending(1, f"{coordinator.name} did not stop within {STOP_GRACE_S:g} s of SIGTERM")
                if code == -signal.SIGTERM:
                    continue
            if code != 0:
                return Ending(1, coordinator_failure(coordinator, self.events))
        return Ending(0, "")

    def await_other_tasks(self, restarts: Restarts) -> str:
        """Task 0 of a SLURM step, its own ranks done: its coordinator still serves the other
        tasks' ranks, so it stays until every one of them left (or one was lost, or OTHER_TASKS_S
        passed); '' when they all left, else why not."""
        coordinator = self.coordinators[0]
        end = min(self.deadline, time.monotonic() + OTHER_TASKS_S)
        # Losses before now were answered, if at all, by the run of the lost rank's task (a restart).
        earlier = len(lost_workers(self.events))
        while time.monotonic() < end:
            if every_worker_left(self.events):
                return ""
            lost = lost_workers(self.events)[earlier:]
            if lost:
                return (
                    f"{restarts.name(lost[0])} was lost after this task's ranks finished ({lost[0].reason})"
                )
            if coordinator.proc.poll() is not None:
                coordinator.finish_output()
                return f"the {coordinator_failure(coordinator, self.events)} while other tasks' ranks ran"
            time.sleep(_POLL_S)
        return (
            f"the other SLURM tasks' ranks did not leave the coordinator within {OTHER_TASKS_S:g} s "
            "of this task's"
        )

    def close(self) -> None:
        """Stops whatever still runs and removes what a SIGKILLed coordinator left."""
        stop(self.children)
        for coordinator in self._started_as:
            remove_leftovers(self.events, coordinator.proc.pid)
