"""`gradserver launch`: the main job on this machine: train (or run the synthetic exchange) with
N workers, and leave metrics, checkpoints and a loss plot in --out.

Engines (--engine): `remote` starts a coordinator process and N worker processes (node ids local-0..N-1);
`gloo` (or `nccl`) starts N worker processes joined by torch.distributed; `--in-process` runs N
workers as threads of this process. A progress bar shows step, loss, tokens/s and all-reduce time
(from rank 0); other output of the processes is relayed with a prefix. At the end:
DIR/metrics.jsonl (per step, per worker), DIR/checkpoint-local-{i}.pt (checkpoint-rank{r}.pt with
--in-process) and DIR/loss.png.

The workers' arguments are checked before anything starts (exit 2, one line). Launch ends when
the job ends: the first worker (or the coordinator) that exits non-zero or is killed stops every
other process (SIGTERM, then SIGKILL after a grace period) and launch exits 1 with one line that
names it and its error. When the coordinator had lost another worker first (one stopped, hung or
cut off, whose step then failed for the others), the line names that one, from the coordinator's
--events-file: `launch: local-1 was lost at step 12 (lost: no message for 10.2 s ...); local-0
exited with code 1: ...`. `--run-timeout` is only a last resort for a job that stops making progress.

Settings (`LaunchConfig`, and the worker's own fields for what launch shares with the worker:
--job, --model, --steps, --engine, --batch-size, --lr, --out, --timeout, with the worker's
defaults, choices and meanings, read from the same GRADSERVER_ variables): a shared flag given to
launch is passed on to every worker; the flags after `--` go to every worker as they are.
`--in-process` replaces the old `--backend local`, and `--engine` the old `--backend` (both still
accepted, with a warning).

Started by srun as one of several tasks of a SLURM step (gradserver.train.slurm), launch starts
its share of the job: task t's workers are the job's ranks t*N..t*N+N-1, with node ids
`worker-<rank>`; task 0 (on the first node) runs the coordinator on all interfaces at a port every
task derives from the job id (with `--engine gloo`, rank 0's torch Store at the next port), and
alone clears and plots --out's metrics. `--no-slurm` runs on this machine alone instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradserver.common.config import add_config_arguments, config_from_sources, deprecated_names_of, flag_name
from gradserver.common.errors import DeadlineExceededError, InvalidArgumentError
from gradserver.worker.local_coordinator import (
    LostWorker,
    coordinator_command,
    coordinator_failure,
    coordinator_pid,
    job_finished,
    loss_of,
    lost_workers,
    remove_leftovers,
    verdict,
)
from gradserver.worker.supervisor import STOP_GRACE_S, Child, await_port, start_child, still_running, stop

from .cli import WorkerConfig, available_cores, worker_parser
from .extra import require_training_extra
from .plots import plot_metrics
from .slurm import NO_SLURM_HELP, OTHER_TASKS_S, SlurmStep, several_tasks

log = logging.getLogger("gradserver.launch")

_COORDINATOR_EXIT_S = 10.0
_RESTART_WAIT_S = 1.0  # for the coordinator to record the loss a restart answers
# A replacement that took part ends by itself this soon after the job finished; one still
# joining is stopped then.
_LATE_GRACE_S = 5.0
_STDOUT_LOCK = threading.Lock()

# The worker's settings launch takes as its own flags: the worker's fields themselves, so they
# have the worker's defaults, choices and meanings.
SHARED_WITH_WORKER = ("job", "model", "steps", "engine", "batch_size", "lr", "out", "timeout")
WORKERS_HELP = "number of worker processes (ranks) to start"
RUN_TIMEOUT_HELP = "seconds for the whole run, a last resort (0: none)"
RESTART_LOST_HELP = (
    "start a worker or rank that fails or is killed again, alone, with its command, up to this many "
    "times in all (0: a loss ends the job); the coordinator then lets the others go on, and the "
    "restarted one takes the state of a live one (launch: the trainer; run: gradserver.torch.ft programs, "
    "and run restarts their lost coordinator too, on its port, unless there are several)"
)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """launch's own settings; see `gradserver launch --help`."""

    workers: int = dataclasses.field(default=2, metadata={"help": WORKERS_HELP})
    run_timeout: float = dataclasses.field(default=1800.0, metadata={"help": RUN_TIMEOUT_HELP})
    no_progress: bool = dataclasses.field(
        default=False, metadata={"help": "plain lines instead of a progress bar"}
    )
    in_process: bool = dataclasses.field(
        default=False,
        metadata={"help": "run the workers as threads of this process (no coordinator, no processes)"},
    )
    restart_lost: int = dataclasses.field(default=0, metadata={"help": RESTART_LOST_HELP})
    no_slurm: bool = dataclasses.field(default=False, metadata={"help": NO_SLURM_HELP})

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidArgumentError(f"--workers must be at least 1, got {self.workers}")
        if self.restart_lost < 0:
            raise InvalidArgumentError(f"--restart-lost must not be negative, got {self.restart_lost}")
        if self.run_timeout < 0:
            raise InvalidArgumentError(f"--run-timeout must not be negative, got {self.run_timeout:g}")


def print_line(text: str) -> None:
    """Writes one whole line to stdout. Several relay threads print at once, and `print` writes
    the text and its newline separately, so two ranks' lines could otherwise run together."""
    with _STDOUT_LOCK:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "launch",
        help="run the main job with N workers on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launch_arguments(parser)
    parser.set_defaults(run=run)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """launch's flags: its own, and the worker's that it shares."""
    add_config_arguments(parser, LaunchConfig)
    add_config_arguments(parser, WorkerConfig, only=SHARED_WITH_WORKER)
    parser.add_argument(
        "worker_args", nargs=argparse.REMAINDER, help="after --, extra flags for every worker"
    )


def gradserver_command(*args: str) -> list[str]:
    """The argv that runs `gradserver ARGS` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "gradserver.cli", *args]


_STEP_LINE = re.compile(r"worker \d+ step \d+: loss")


@dataclasses.dataclass(frozen=True)
class _Job:
    """What launch runs: its own settings, the workers' flags and the settings they resolve to
    (launch's view of a worker, e.g. the steps the coordinator's --max-steps must match)."""

    launch: LaunchConfig
    worker_flags: tuple[str, ...]
    worker: WorkerConfig
    step: SlurmStep | None = None  # this launch as one task of a SLURM step

    @property
    def processes(self) -> bool:
        return not self.launch.in_process

    @property
    def first(self) -> int:
        """The job's rank of this launch's first worker (0 but in a SLURM step)."""
        return self.step.first_rank(self.launch.workers) if self.step else 0

    @property
    def world(self) -> int:
        return self.step.world(self.launch.workers) if self.step else self.launch.workers

    @property
    def task_zero(self) -> bool:
        """Whether this launch runs the coordinator, the progress bar and the plot."""
        return self.step is None or self.step.task == 0

    def node_id(self, i: int) -> str:
        # Checkpoints are found by it on --resume, not by join order: in a SLURM step by the
        # job's rank, the same whichever nodes the next allocation has.
        return f"worker-{self.first + i}" if self.step else f"local-{i}"

    def argvs(self, target: str) -> list[list[str]]:
        """Each worker's `gradserver worker` arguments; `target` is the coordinator's address
        (remote) or the torch.distributed init method (gloo, nccl)."""
        argvs = []
        for i in range(self.launch.workers):
            own = ["--node-id", self.node_id(i)]
            if self.worker.engine == "remote":
                own += ["--coordinator", target]
            else:
                own += ["--dist-rank", str(self.first + i), "--dist-world-size", str(self.world)]
                own += ["--dist-init", target]
            argvs.append([*own, *self.worker_flags])
        return argvs


def _job(args: argparse.Namespace) -> _Job:
    """launch's settings from its flags and the environment; the workers' settings checked as
    each worker will check them, before anything starts (a checkpoint to resume is each
    worker's own, checked by it before it connects)."""
    if getattr(args, "deprecated_engine", None) == "local":
        log.warning("launch --backend local is deprecated and goes in the next release: use --in-process")
        args.deprecated_engine, args.in_process = None, "true"
    config: LaunchConfig = config_from_sources(LaunchConfig, args)
    shared: list[str] = []
    renamed = {new: old for old, new in deprecated_names_of(WorkerConfig).items()}
    for name in SHARED_WITH_WORKER:
        value = getattr(args, name, None)
        old = getattr(args, f"deprecated_{name}", None)
        if value is None and old is not None:
            # Passed on under its new name, so the workers do not warn again.
            log.warning(
                "%s is deprecated and goes in the next release: use %s",
                renamed[flag_name(name)],
                flag_name(name),
            )
            value = old
        if value is not None:
            shared += [flag_name(name), str(value)]
    flags = (*shared, *(a for a in args.worker_args if a != "--"))
    worker: WorkerConfig = config_from_sources(WorkerConfig, worker_parser().parse_args(list(flags)))
    step = None if config.no_slurm else several_tasks()
    if step is not None and config.in_process:
        raise InvalidArgumentError(
            f"--in-process runs every worker in one process, and this SLURM step has {step.tasks} "
            "tasks: start one task, or give --no-slurm"
        )
    job = _Job(config, flags, worker, step)
    if worker.steps < 1:
        raise InvalidArgumentError(f"--steps must be at least 1, got {worker.steps}")
    if (worker.engine != "remote" or config.in_process) and worker.job != "train":
        raise InvalidArgumentError("--job synthetic needs --engine remote (it exercises the coordinator)")
    if config.restart_lost and (worker.engine != "remote" or config.in_process or worker.job != "train"):
        raise InvalidArgumentError(
            "--restart-lost needs worker processes that train through a coordinator (--engine remote, "
            "--job train, not --in-process): only they can take a live worker's state"
        )
    from .cli import check_synthetic, check_training

    placeholder = "127.0.0.1:0" if worker.engine == "remote" else "file:///dev/null"
    argv = job.argvs(placeholder)[0]  # the others differ only in their ids
    checked: WorkerConfig = config_from_sources(WorkerConfig, worker_parser().parse_args(argv))
    if worker.job == "synthetic":
        check_synthetic(checked)
    else:
        check_training(checked, checkpoint=False)
    return job


class _Progress:
    """A tqdm bar fed by rank 0's progress channel (its --progress-fd, one JSON object per step);
    the processes' output is printed above it."""

    def __init__(self, steps: int, enabled: bool) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, unit="step", dynamic_ncols=True, file=sys.stderr)

    def follow(self, channel: int) -> None:
        """Reads a worker's progress channel (the read end of its --progress-fd) until it closes."""

        def read() -> None:
            with os.fdopen(channel, encoding="utf-8") as lines:
                for line in lines:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        self._progress(json.loads(line))

        threading.Thread(target=read, daemon=True).start()

    def line(self, prefix: str, line: str) -> None:
        if self._bar is not None and _STEP_LINE.search(line):
            return  # the bar shows it; metrics.jsonl keeps every step of every worker
        with self._lock:
            text = f"{prefix} {line.rstrip()}"
            if self._bar is not None:
                self._bar.write(text)
            else:
                print_line(text)

    def _progress(self, entry: dict[str, Any]) -> None:
        if self._bar is None or entry.get("worker_id") != 0:
            return
        with self._lock:
            self._bar.set_postfix(
                loss=f"{entry['loss']:.3f}",
                tok_s=f"{entry['tokens_per_s']:.0f}",
                allreduce_ms=f"{entry['allreduce_ms']:.0f}",
            )
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run(args: argparse.Namespace) -> int:
    job = _job(args)
    worker = job.worker
    if worker.job == "train":
        require_training_extra()
    if worker.out:
        Path(worker.out).mkdir(parents=True, exist_ok=True)
        if job.task_zero:  # before its coordinator starts, so before any worker of any task writes
            (Path(worker.out) / "metrics.jsonl").unlink(missing_ok=True)
    # Not in a SLURM step: its output goes to a file, and worker 0, whose progress the bar shows
    # (the coordinator numbers workers in join order), may be another task's.
    bar = worker.job == "train" and not job.launch.no_progress and job.step is None
    progress = _Progress(worker.steps, enabled=bar)
    started = time.monotonic()
    try:
        code = _run_processes(job, progress) if job.processes else _run_in_process(job)
    finally:
        progress.close()
    elapsed = time.monotonic() - started
    if code != 0:
        return code
    if worker.out and worker.job == "train" and job.task_zero:
        plot = plot_metrics(Path(worker.out) / "metrics.jsonl", Path(worker.out) / "loss.png")
        print(f"launch: {worker.steps} steps in {elapsed:.1f} s; {plot}")
    print("launch: all processes finished")
    return 0


def _deadline(job: _Job) -> float:
    return time.monotonic() + (job.launch.run_timeout or float("inf"))


def _run_in_process(job: _Job) -> int:
    from .engines import LocalEngine, LocalHub
    from .training import TrainConfig, train

    workers, worker = job.launch.workers, job.worker
    hub = LocalHub(workers)
    config = TrainConfig(
        model=worker.model, steps=worker.steps, batch_size=worker.batch_size, lr=worker.lr, out=worker.out
    )
    errors: list[BaseException] = []

    def run_worker(rank: int) -> None:
        try:
            train(
                LocalEngine(hub, rank),
                config,
                lambda r: print_line(
                    f"worker {rank} step {r.step}: loss {r.loss:.4f}, global loss {r.global_loss:.4f}"
                ),
            )
        except BaseException as exc:  # noqa: BLE001 - reported below, in this thread
            errors.append(exc)

    threads = [threading.Thread(target=run_worker, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    deadline = _deadline(job)
    for t in threads:
        t.join(None if deadline == float("inf") else max(0.0, deadline - time.monotonic()))
    for error in errors:
        print(f"launch: worker failed: {error!r}", file=sys.stderr)
    return 1 if errors or any(t.is_alive() for t in threads) else 0


def _run_processes(job: _Job, progress: _Progress) -> int:
    deadline = _deadline(job)
    children: list[Child] = []
    failure = ""
    with tempfile.TemporaryDirectory(prefix="gradserver-launch-") as tmp:
        try:
            failure = _supervise(job, progress, Path(tmp), deadline, children)
        finally:
            stop(children)
            remove_leftovers(Path(tmp) / "events", coordinator_pid(children))
    for child in children:
        child.finish_output()
    if failure:
        # Last, after the other processes' final lines: the one line that says what went wrong.
        print(f"launch: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _supervise(job: _Job, progress: _Progress, tmp: Path, deadline: float, children: list[Child]) -> str:
    """Starts the processes and watches them until the job ends; returns '' on success, else the
    first failure (the caller stops whatever still runs)."""
    exits: queue.Queue[Child] = queue.Queue()
    coordinator = None
    step = job.step
    if job.worker.engine == "remote" and job.task_zero:
        coordinator, target = _start_coordinator(job, progress, tmp, deadline)
        children.append(coordinator)
        coordinator.watch(exits)
    elif step is None:
        target = f"file://{tmp}/dist-store"
    elif job.worker.engine == "remote":  # every task knows the ports from the job id
        target = f"{step.first_host}:{step.ports()[0]}"
    else:  # rank 0's torch Store, on the first node
        target = f"tcp://{step.first_host}:{step.ports()[1]}"
    threads = max(1, available_cores() // job.launch.workers)
    argvs = job.argvs(target)
    workers = [_start_worker(argv, job.node_id(i), progress, threads) for i, argv in enumerate(argvs)]
    children.extend(workers)
    for child in workers:
        child.watch(exits)
    running = set(workers)
    restarts_left = job.launch.restart_lost
    answered: set[int] = set()  # losses (events-file positions) a restart answered
    replacements: set[Child] = set()  # workers started again
    while running:
        child = next_exit(exits, deadline, job.launch.run_timeout)
        if child is coordinator:
            if child.proc.returncode != 0:
                return coordinator_failure(child, tmp / "events")
            if job_finished(tmp / "events") is not None:
                # Every step done and every worker that took part left: a replacement that took
                # part ends by itself; one still joining has nothing left to join.
                for late in still_running(running & replacements, _LATE_GRACE_S):
                    _too_late(late, tmp / "events", progress)
                    late.proc.terminate()
                    running.discard(late)
            continue  # done with its steps; the workers finish (or fail) on their own
        running.discard(child)
        if child in replacements and job_finished(tmp / "events") is not None:
            if child.proc.returncode != 0:
                _too_late(child, tmp / "events", progress)
            continue
        if child.proc.returncode != 0:
            if coordinator is None:
                return child.failure()
            if restarts_left > 0 and coordinator.proc.poll() is None:
                # The same command: it joins the running job in its old place and takes the state
                # of a live worker (docs/RELIABILITY.md "Live recovery").
                restarts_left -= 1
                position = loss_of(tmp / "events", _named(child.name), answered, _RESTART_WAIT_S)
                if position is not None:
                    answered.add(position)
                index = workers.index(child)
                progress.line(
                    "launch:",
                    f"{child.failure()}; restarting it ({restarts_left} restart(s) left)",
                )
                again = _start_worker(argvs[index], child.name, progress, threads)
                replacements.add(again)
                workers[index] = again
                children.append(again)
                again.watch(exits)
                running.add(again)
                continue
            return verdict(child, tmp / "events", _node_name, workers, answered=answered)[1]
    if coordinator is not None:
        # In a SLURM step it also waits for the other tasks' workers to leave.
        return _end_coordinator(coordinator, tmp / "events", OTHER_TASKS_S if step else _COORDINATOR_EXIT_S)
    return ""


def _too_late(child: Child, events: Path, progress: _Progress) -> None:
    """Says that `child`, a worker started again, found the job finished (no failure)."""
    loss = next((w for w in lost_workers(events) if w.node == child.name), None)
    lost = f"{child.name} was lost ({loss.reason})" if loss is not None else f"{child.name} ended"
    progress.line("launch:", f"{lost} and its replacement found the job finished")


def _start_worker(argv: list[str], name: str, progress: _Progress, threads: int) -> Child:
    """Starts one worker with a pipe as its --progress-fd, followed by `progress`."""
    channel, own_end = os.pipe()
    try:
        command = gradserver_command("worker", *argv, "--progress-fd", str(own_end))
        child = start_child(command, name, progress.line, threads, pass_fds=(own_end,))
    except BaseException:
        os.close(channel)
        raise
    finally:
        os.close(own_end)  # the worker holds it now: the channel ends when the worker does
    progress.follow(channel)
    return child


def _named(name: str) -> Callable[[LostWorker], bool]:
    """Whether a loss is of the worker launch calls `name`."""
    return lambda lost: lost.node == name


def _node_name(lost: LostWorker) -> str:
    """launch's name of a worker: its node id (local-0, ...), which is also its child's name."""
    return lost.node


def _end_coordinator(coordinator: Child, events: Path, wait_s: float) -> str:
    """Every worker is done: the coordinator exits by itself once its job finished (--max-steps
    is the absolute last step, so resumed jobs end too); if it has not after `wait_s` (the
    workers left early), it is asked to stop."""
    try:
        code = coordinator.proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        coordinator.proc.terminate()
        try:
            code = coordinator.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            return f"coordinator did not stop within {STOP_GRACE_S:g} s of SIGTERM"
        if code == -signal.SIGTERM:
            return ""
    return coordinator_failure(coordinator, events) if code != 0 else ""


def _start_coordinator(job: _Job, progress: _Progress, tmp: Path, deadline: float) -> tuple[Child, str]:
    port_file = tmp / "port"
    events = str(tmp / "events")
    options = ["--max-steps", str(job.worker.steps), "--log-level", "WARNING", "--events-file", events]
    if job.launch.restart_lost:
        options += ["--on-worker-loss", "continue"]  # the others go on while a lost one restarts
    bind, port, host = "127.0.0.1", 0, "127.0.0.1"
    if job.step is not None:  # every task's workers reach it on the first node
        bind, port, host = "0.0.0.0", job.step.ports()[0], job.step.first_host
    argv = coordinator_command(job.world, port_file, *options, port=port, host=bind)
    coordinator = start_child(argv, "coordinator", progress.line)
    return coordinator, f"{host}:{await_coordinator(coordinator, port_file, deadline)}"


def await_coordinator(coordinator: Child, port_file: Path, deadline: float) -> int:
    """The port the started coordinator listens on; stops it and raises if it exits first or does
    not listen by `deadline`."""
    timeout_s = max(0.0, deadline - time.monotonic())
    try:
        return await_port(coordinator, port_file, timeout_s)
    except DeadlineExceededError:
        raise DeadlineExceededError("the coordinator did not start within --run-timeout") from None


def next_exit(exits: queue.Queue[Child], deadline: float, timeout: float) -> Child:
    try:
        if deadline == float("inf"):
            return exits.get()
        return exits.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise DeadlineExceededError(f"the run did not finish within --run-timeout {timeout:g} s") from None
