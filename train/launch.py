"""`gradserver launch`: the main job on this machine: train (or run the synthetic exchange) with
N workers, and leave metrics, checkpoints and a loss plot in --out.

Backends: `remote` starts a coordinator process and N worker processes (node ids local-0..N-1);
`gloo` starts N worker processes joined by torch.distributed; `local` runs N workers as threads
of this process. A progress bar shows step, loss, tokens/s and all-reduce time (from rank 0);
other output of the processes is relayed with a prefix. At the end: DIR/metrics.jsonl (per step,
per worker), DIR/checkpoint-local-{i}.pt (checkpoint-rank{r}.pt with --backend local) and
DIR/loss.png.

The workers' arguments are checked before anything starts (exit 2, one line). Launch ends when
the job ends: the first worker (or the coordinator) that exits non-zero or is killed stops every
other process (SIGTERM, then SIGKILL after a grace period) and launch exits 1 with one line that
names it and its error. When the coordinator had lost another worker first (one stopped, hung or
cut off, whose step then failed for the others), the line names that one, from the coordinator's
--events-file: `launch: local-1 was lost at step 12 (lost: no message for 10.2 s ...); local-0
exited with code 1: ...`. `--timeout` is only a last resort for a job that stops making progress.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gradserver.common.config import config_from_sources
from gradserver.common.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError
from gradserver.worker.local_coordinator import (
    LostWorker,
    coordinator_command,
    job_failure,
    lost_workers,
    remove_leftovers,
    wait_for_port,
)

from .cli import available_cores
from .extra import require_training_extra
from .plots import plot_metrics

_TAIL_LINES = 200
_RELAY_GRACE_S = 5.0
STOP_GRACE_S = 5.0
_COORDINATOR_EXIT_S = 10.0
# The line `gradserver` prints for an error of the hierarchy (cli/main.py).
_ONE_LINE_ERROR = re.compile(r"^gradserver \w+: ")
# torch.distributed (torchrun's error handler) prefixes every line a rank prints on a failure.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
# How long a failed child's verdict waits for the coordinator's (a survivor can exit a moment
# before the coordinator's line is read).
_VERDICT_WAIT_S = 1.0
_STDOUT_LOCK = threading.Lock()


def print_line(text: str) -> None:
    """Writes one whole line to stdout. Several relay threads print at once, and `print` writes
    the text and its newline separately, so two ranks' lines could otherwise run together."""
    with _STDOUT_LOCK:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "launch", help="run the main job with N workers on this machine", description=__doc__
    )
    parser.add_argument("--workers", type=int, default=2, help="number of workers")
    parser.add_argument("--steps", type=int, default=3, help="steps every worker runs")
    parser.add_argument("--model", default="small", help="model (train) or shape preset (synthetic)")
    parser.add_argument("--job", default="train", choices=["train", "synthetic"])
    parser.add_argument("--backend", default="remote", choices=["remote", "gloo", "local"])
    parser.add_argument("--out", default="", help="directory for metrics.jsonl, checkpoints, loss.png")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per worker per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    parser.add_argument(
        "worker_args", nargs=argparse.REMAINDER, help="after --, extra flags for every worker"
    )
    parser.set_defaults(run=run)


def gradserver_command(*args: str) -> list[str]:
    """The argv that runs `gradserver ARGS` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "gradserver.cli", *args]


_STEP_LINE = re.compile(r"worker \d+ step \d+: loss")


class _Progress:
    """A tqdm bar fed by rank 0's PROGRESS lines; everything else is printed above it."""

    def __init__(self, steps: int, enabled: bool) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, unit="step", dynamic_ncols=True, file=sys.stderr)

    def line(self, prefix: str, line: str) -> None:
        if line.startswith("PROGRESS "):
            self._progress(json.loads(line[len("PROGRESS ") :]))
            return
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


class Child:
    """A started process: its output relayed with a prefix, its last lines kept for the error."""

    def __init__(self, name: str, proc: subprocess.Popen[str], sink: Callable[[str, str], None]) -> None:
        self.name = name
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._relay = threading.Thread(target=self._read, args=(sink,), daemon=True)
        self._relay.start()

    def _read(self, sink: Callable[[str, str], None]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            sink(f"[{self.name}]", line)

    def watch(self, exits: queue.Queue[Child]) -> None:
        """Reports this child on `exits` once it has exited and its output is read."""

        def wait() -> None:
            self.proc.wait()
            self._relay.join(_RELAY_GRACE_S)
            exits.put(self)

        threading.Thread(target=wait, daemon=True).start()

    def finish_output(self) -> None:
        self._relay.join(_RELAY_GRACE_S)

    def failure(self) -> str:
        """One line: which process, how it ended, and its error."""
        code = self.proc.returncode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        error = error_line(list(self.tail))
        return f"{self.name} {how}" + (f": {error}" if error else "")


def error_line(lines: list[str]) -> str:
    """A process's error from the end of its output: the exception line of its last traceback,
    else the one line `gradserver` prints for a GradServerError, else ''. torch's `[rankN]: `
    prefix is read through."""
    lines = [_RANK_PREFIX.sub("", line) for line in lines]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            for line in lines[i + 1 :]:
                if line and not line[0].isspace():
                    return line.strip()
            return ""
    for line in reversed(lines):
        if _ONE_LINE_ERROR.match(line):
            return line.strip()
    return ""


def start_child(
    argv: list[str],
    name: str,
    sink: Callable[[str, str], None],
    threads: int | None = None,
    env_extra: Mapping[str, str] | None = None,
) -> Child:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    if threads is not None:
        # N processes each using every core for torch's intra-op threads oversubscribe the
        # machine and stall at random; like torchrun, share the cores out unless told otherwise.
        # The worker applies the same rule itself when started by hand (train/cli.py).
        env.setdefault("OMP_NUM_THREADS", str(threads))
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env
    )
    child = Child(name, proc, sink)
    sink("[launch]", f"started {name} (pid {proc.pid})")
    return child


def _worker_flags(args: argparse.Namespace, extra: list[str]) -> list[str]:
    flags = ["--job", args.job, "--steps", str(args.steps), "--model", args.model]
    if args.job == "train":
        flags += ["--batch-size", str(args.batch_size), "--lr", str(args.lr)]
    if args.out:
        flags += ["--out", args.out]
    return flags + extra


def _worker_argvs(args: argparse.Namespace, extra: list[str], target: str) -> list[list[str]]:
    """Each worker's `gradserver worker` arguments; `target` is the coordinator's address (remote)
    or the torch.distributed init method (gloo)."""
    argvs = []
    for i in range(args.workers):
        # A node id per worker: checkpoints are found by it on --resume, not by join order.
        own = ["--node-id", f"local-{i}"]
        if args.backend == "remote":
            own += ["--coordinator", target]
        else:
            own += ["--backend", "gloo", "--dist-rank", str(i)]
            own += ["--dist-world-size", str(args.workers), "--dist-init", target]
        argvs.append([*own, *_worker_flags(args, extra)])
    return argvs


def _check_arguments(args: argparse.Namespace, extra: list[str]) -> None:
    """Every argument the workers will get, checked here before anything starts (a checkpoint
    to resume is each worker's own, checked by it before it connects)."""
    if args.workers < 1 or args.steps < 1:
        raise InvalidArgumentError("--workers and --steps must be at least 1")
    if args.backend != "remote" and args.job != "train":
        raise InvalidArgumentError("--job synthetic needs --backend remote (it exercises the coordinator)")
    from .cli import WorkerConfig, check_synthetic, check_training, worker_parser

    placeholder = "127.0.0.1:0" if args.backend == "remote" else "file:///dev/null"
    argv = _worker_argvs(args, extra, placeholder)[0]  # the others differ only in their ids
    config: WorkerConfig = config_from_sources(WorkerConfig, worker_parser().parse_args(argv))
    if args.job == "synthetic":
        check_synthetic(config)
    else:
        check_training(config, checkpoint=False)


def run(args: argparse.Namespace) -> int:
    extra = [a for a in args.worker_args if a != "--"]
    _check_arguments(args, extra)
    if args.job == "train":
        require_training_extra()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "metrics.jsonl").unlink(missing_ok=True)
    progress = _Progress(args.steps, enabled=args.job == "train" and not args.no_progress)
    started = time.monotonic()
    try:
        code = _run_local(args) if args.backend == "local" else _run_processes(args, extra, progress)
    finally:
        progress.close()
    elapsed = time.monotonic() - started
    if code != 0:
        return code
    if args.out and args.job == "train":
        plot = plot_metrics(Path(args.out) / "metrics.jsonl", Path(args.out) / "loss.png")
        print(f"launch: {args.steps} steps in {elapsed:.1f} s; {plot}")
    print("launch: all processes finished")
    return 0


def _run_local(args: argparse.Namespace) -> int:
    from .backends import LocalBackend, LocalHub
    from .training import TrainConfig, train

    hub = LocalHub(args.workers)
    config = TrainConfig(
        model=args.model, steps=args.steps, batch_size=args.batch_size, lr=args.lr, out=args.out
    )
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            train(
                LocalBackend(hub, rank),
                config,
                lambda r: print_line(
                    f"worker {rank} step {r.step}: loss {r.loss:.4f}, global loss {r.global_loss:.4f}"
                ),
            )
        except BaseException as exc:  # noqa: BLE001 - reported below, in this thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.timeout)
    for error in errors:
        print(f"launch: worker failed: {error!r}", file=sys.stderr)
    return 1 if errors or any(t.is_alive() for t in threads) else 0


def _run_processes(args: argparse.Namespace, extra: list[str], progress: _Progress) -> int:
    deadline = time.monotonic() + args.timeout
    children: list[Child] = []
    failure = ""
    with tempfile.TemporaryDirectory(prefix="gradserver-launch-") as tmp:
        try:
            failure = _supervise(args, extra, progress, Path(tmp), deadline, children)
        finally:
            stop_children(children)
            remove_leftovers(Path(tmp) / "events", coordinator_pid(children))
    for child in children:
        child.finish_output()
    if failure:
        # Last, after the other processes' final lines: the one line that says what went wrong.
        print(f"launch: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _supervise(
    args: argparse.Namespace,
    extra: list[str],
    progress: _Progress,
    tmp: Path,
    deadline: float,
    children: list[Child],
) -> str:
    """Starts the processes and watches them until the job ends; returns '' on success, else the
    first failure (the caller stops whatever still runs)."""
    exits: queue.Queue[Child] = queue.Queue()
    coordinator = None
    if args.backend == "remote":
        coordinator, address = _start_coordinator(args, progress, tmp, deadline)
        children.append(coordinator)
        coordinator.watch(exits)
        target = address
    else:
        target = f"file://{tmp}/dist-store"
    threads = max(1, available_cores() // args.workers)
    workers = [
        start_child(gradserver_command("worker", *argv), f"local-{i}", progress.line, threads)
        for i, argv in enumerate(_worker_argvs(args, extra, target))
    ]
    children.extend(workers)
    for child in workers:
        child.watch(exits)
    running = set(workers)
    while running:
        child = next_exit(exits, deadline, args.timeout)
        if child is coordinator:
            if child.proc.returncode != 0:
                return coordinator_failure(child, tmp / "events")
            continue  # done with its steps; the workers finish (or fail) on their own
        running.discard(child)
        if child.proc.returncode != 0:
            if coordinator is None:
                return child.failure()
            return verdict(child, tmp / "events", _node_name, workers)[1]
    if coordinator is not None:
        return _end_coordinator(coordinator, tmp / "events")
    return ""


def _node_name(lost: LostWorker) -> str:
    """launch's name of a worker: its node id (local-0, ...), which is also its child's name."""
    return lost.node


def _end_coordinator(coordinator: Child, events: Path) -> str:
    """Every worker is done: the coordinator exits by itself once its job finished (--max-steps
    is the absolute last step, so resumed jobs end too); if it has not after a short wait (the
    workers left early), it is asked to stop."""
    try:
        code = coordinator.proc.wait(_COORDINATOR_EXIT_S)
    except subprocess.TimeoutExpired:
        coordinator.proc.terminate()
        try:
            code = coordinator.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            return f"coordinator did not stop within {STOP_GRACE_S:g} s of SIGTERM"
        if code == -signal.SIGTERM:
            return ""
    return coordinator_failure(coordinator, events) if code != 0 else ""


def _start_coordinator(
    args: argparse.Namespace, progress: _Progress, tmp: Path, deadline: float
) -> tuple[Child, str]:
    port_file = tmp / "port"
    options = ["--max-steps", str(args.steps), "--log-level", "WARNING", "--events-file", str(tmp / "events")]
    coordinator = start_child(
        coordinator_command(args.workers, port_file, *options), "coordinator", progress.line
    )
    return coordinator, f"127.0.0.1:{await_coordinator(coordinator, port_file, deadline)}"


def await_coordinator(coordinator: Child, port_file: Path, deadline: float) -> int:
    """The port the started coordinator listens on; stops it and raises if it exits first or does
    not listen by `deadline`."""
    try:
        port = wait_for_port(coordinator.proc, port_file, max(0.0, deadline - time.monotonic()))
        if port is None:
            coordinator.finish_output()
            raise FailedPreconditionError(f"the {coordinator.failure()} before it was ready")
    except DeadlineExceededError:
        stop_children([coordinator])
        raise DeadlineExceededError("the coordinator did not start within --timeout") from None
    except BaseException:
        stop_children([coordinator])
        raise
    return port


def next_exit(exits: queue.Queue[Child], deadline: float, timeout: float) -> Child:
    try:
        return exits.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise DeadlineExceededError(f"the run did not finish within --timeout {timeout:g} s") from None


def verdict(
    child: Child,
    events: Path,
    name: Callable[[LostWorker], str],
    others: Iterable[Child] = (),
    unit: str = "step",
) -> tuple[Child, str]:
    """The process that ended the job and the last line, for a job that `child` ended by failing.
    When the coordinator had lost another worker first (`events`, its --events-file), that
    worker, named by `name` and found among `others`: if it has exited by itself (crashed, was
    killed), its own ending; else (stopped, hung, cut off) `NAME was lost at <unit> N (why);
    <child's failure>`. Without such a verdict, the child's failure alone."""
    lost = lost_workers(events, wait_s=_VERDICT_WAIT_S)
    if not lost or name(lost[0]) == child.name:
        return child, child.failure()
    first = lost[0]
    culprit = next((c for c in others if c.name == name(first)), None)
    if culprit is not None and culprit.proc.poll() not in (None, 0):
        culprit.finish_output()
        return culprit, culprit.failure()
    at = f" at {unit} {first.step}" if first.step is not None else ""
    return child, f"{name(first)} was lost{at} ({first.reason}); {child.failure()}"


def coordinator_failure(coordinator: Child, events: Path) -> str:
    """How the coordinator ended, with its job's failure from `events` when its output has no
    error line of its own."""
    failure = coordinator.failure()
    why = job_failure(events)
    return f"{failure}: job failed: {why}" if why and not error_line(list(coordinator.tail)) else failure


def coordinator_pid(children: list[Child]) -> int | None:
    """The pid of the coordinator among `children`; None when none was started."""
    return next((c.proc.pid for c in children if c.name == "coordinator"), None)


def stop_children(children: list[Child]) -> None:
    """SIGTERM to every process still running, SIGKILL to those alive after a grace period."""
    alive = [c for c in children if c.proc.poll() is None]
    for child in alive:
        with contextlib.suppress(ProcessLookupError):
            child.proc.terminate()
            child.proc.send_signal(signal.SIGCONT)  # a stopped process takes the SIGTERM now
    grace_end = time.monotonic() + STOP_GRACE_S
    for child in alive:
        try:
            child.proc.wait(max(0.0, grace_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(STOP_GRACE_S)  # SIGKILL cannot be refused; this only reaps
