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
SIGINT and SIGTERM are forwarded to every process; launch then stops what is left and exits 128 +
the signal.

With `--restart-lost K` a worker that fails or is killed is started again with its command and
takes a live worker's state; a worker the coordinator declared lost while it still runs (stopped,
hung, cut off) is stopped so that it restarts; and with the workers' `--reconnect-timeout` a lost
coordinator is started again on its port, which they rejoin. Each restart is one of the K. A
replacement that found the job finished is no failure: the last line names it.

The supervision (the watch loop, the restarts, the SLURM placement) is gradserver.train.supervision,
shared with `gradserver run`; this module says what launch starts.

Settings (`LaunchConfig`, and the worker's own fields for what launch shares with the worker:
--job, --model, --steps, --engine, --batch-size, --lr, --out, --timeout, --outer-steps, with the worker's
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
import functools
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gradserver.common.config import add_config_arguments, config_from_sources, deprecated_names_of, flag_name
from gradserver.common.cores import available_cores
from gradserver.common.errors import InvalidArgumentError
from gradserver.worker.local_coordinator import LostWorker
from gradserver.worker.supervisor import Child, start_child

from .cli import WorkerConfig, worker_parser
from .extra import require_training_extra
from .plots import plot_metrics
from .slurm import NO_SLURM_HELP, OTHER_TASKS_S, SlurmStep
from .supervision import (
    RESTART_LOST_HELP,
    RUN_TIMEOUT_HELP,
    WORKERS_HELP,
    Ending,
    FrontEnd,
    Supervision,
    print_line,
    supervised,
)
from .supervision_placement import coordinator_place, job_step, why_slurm_stopped

log = logging.getLogger("gradserver.launch")

_COORDINATOR_EXIT_S = 10.0

# The worker's settings launch takes as its own flags: the worker's fields themselves, so they
# have the worker's defaults, choices and meanings.
SHARED_WITH_WORKER = ("job", "model", "steps", "engine", "batch_size", "lr", "out", "timeout", "outer_steps")


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
    def engine_steps(self) -> int:
        """The steps the coordinator runs (its --max-steps): with outer steps one per exchange,
        not one per inner step, the final flush's included."""
        if self.worker.job != "train":
            return self.worker.steps
        return self.worker.train_config().total_steps

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
    step = job_step(
        config.no_slurm, "--in-process runs every worker in one process" if config.in_process else ""
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
            # With outer steps a step is several inner steps, which --steps (the bar's total) counts.
            inner = entry.get("inner_steps")
            self._bar.update(inner - self._bar.n if isinstance(inner, int) else 1)

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
        code, note = _run_processes(job, progress) if job.processes else (_run_in_process(job), "")
    finally:
        progress.close()
    elapsed = time.monotonic() - started
    if code != 0:
        return code
    if worker.out and worker.job == "train" and job.task_zero:
        plot = plot_metrics(Path(worker.out) / "metrics.jsonl", Path(worker.out) / "loss.png")
        print(f"launch: {worker.steps} steps in {elapsed:.1f} s; {plot}")
    print(f"launch: all processes finished{note}")
    return 0


def _deadline(job: _Job) -> float:
    return time.monotonic() + (job.launch.run_timeout or float("inf"))


def _run_in_process(job: _Job) -> int:
    from .engines import LocalEngine, LocalHub
    from .training import TrainConfig, train

    workers, worker = job.launch.workers, job.worker
    hub = LocalHub(workers)
    config = TrainConfig(
        model=worker.model,
        steps=worker.steps,
        batch_size=worker.batch_size,
        lr=worker.lr,
        out=worker.out,
        outer_steps=worker.outer_steps,
        fragments=worker.fragments,
        outer_lr=worker.outer_lr,
        outer_momentum=worker.outer_momentum,
        outer_delay=worker.outer_delay,
        outer_keep_local=worker.outer_keep_local,
        outer_flush=worker.outer_flush,
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


def _front(job: _Job, progress: _Progress) -> FrontEnd:
    return FrontEnd(
        prefix="launch:",
        sink=progress.line,
        unit="step",
        restarting="restarting it",
        timeout_error=f"the run did not finish within --run-timeout {job.launch.run_timeout:g} s",
        coordinator_article="",
        survivor_grace_s=0.0,  # a failed step fails the others' at once: no wait for their errors
        coordinator_ends_itself=True,  # --max-steps
        coordinator_start_s=float("inf"),  # --run-timeout alone bounds it
    )


def _run_processes(job: _Job, progress: _Progress) -> tuple[int, str]:
    """The exit code, and on success what the last line adds (a replacement that found the job
    finished)."""
    with supervised(
        _front(job, progress), job.launch.run_timeout, job.launch.restart_lost, "gradserver-launch-"
    ) as supervision:
        ending = _supervise(job, progress, supervision)
    if ending.code == 0:
        return 0, ending.line
    # Last, after the other processes' final lines: the one line that says what went wrong.
    print(f"launch: {ending.line}", file=sys.stderr, flush=True)
    return (ending.code if supervision.received else 1), ""


def _supervise(job: _Job, progress: _Progress, supervision: Supervision) -> Ending:
    """Starts the processes and watches them until the job ends (the caller stops whatever still
    runs); on success the Ending's line is what the last line adds."""
    step = job.step
    place = coordinator_place(step)
    if job.worker.engine == "remote" and place.here:
        options = ["--max-steps", str(job.engine_steps)]
        target = place.address(
            supervision.start_coordinator("coordinator", job.world, place.bind, place.port, options)
        )
    elif step is None:
        target = f"file://{supervision.tmp}/dist-store"
    elif job.worker.engine == "remote":  # every task knows the ports from the job id
        target = place.address()
    else:  # rank 0's torch Store, on the first node
        target = f"tcp://{place.host}:{place.store_port}"
    threads = max(1, available_cores() // job.launch.workers)
    argvs = job.argvs(target)

    def start(i: int) -> Child:
        # The same command again for a restart: it joins the running job in its old place.
        return supervision.adopt(_start_worker(argvs[i], job.node_id(i), progress, threads))

    supervision.ranks.extend(start(i) for i in range(job.launch.workers))
    # A lost coordinator is started again only for workers that rejoin one (without
    # --reconnect-timeout each fails at once, and a new coordinator would only hide why).
    rejoin = job.worker.reconnect_timeout > 0
    restarts = supervision.restarts(start, _node_name, restart_coordinators=rejoin)
    why = functools.partial(why_slurm_stopped, step, job.launch.workers) if step is not None else str
    ending = supervision.watch(restarts, why)
    if ending is not None:
        return ending
    if supervision.coordinators:
        # In a SLURM step it also waits for the other tasks' workers to leave.
        ending = supervision.await_coordinators_end(OTHER_TASKS_S if step else _COORDINATOR_EXIT_S)
        if ending.code:
            return ending
    return Ending(0, restarts.finished_note())


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


def _node_name(lost: LostWorker) -> str:
    """launch's name of a worker: its node id (local-0, ...), which is also its child's name."""
    return lost.node
