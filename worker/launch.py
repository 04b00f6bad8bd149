"""`gradserver launch`: the main job on this machine: train (or run the synthetic exchange) with
N workers, and leave metrics, checkpoints and a loss plot in --out.

Backends: `remote` starts a coordinator process and N worker processes; `gloo` starts N worker
processes joined by torch.distributed; `local` runs N workers as threads of this process. A
progress bar shows step, loss, tokens/s and all-reduce time (from rank 0); other output of the
processes is relayed with a prefix. At the end: DIR/metrics.jsonl (per step, per worker),
DIR/checkpoint-rank{r}.pt and DIR/loss.png. Exit 1 if any process fails or the run exceeds
--timeout; every process is stopped on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gradserver.common.errors import DeadlineExceededError, InvalidArgumentError

from .plots import plot_metrics


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
    return [sys.executable, "-m", "gradserver.common.cli", *args]


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
                print(text, flush=True)

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


def _relay(prefix: str, stream: IO[str], sink: Callable[[str, str], None]) -> None:
    for line in stream:
        sink(prefix, line)


def _start(
    argv: list[str], prefix: str, sink: Callable[[str, str], None], threads: int | None = None
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is not None:
        # N processes each using every core for torch's intra-op threads oversubscribe the
        # machine and stall at random; like torchrun, share the cores out unless told otherwise.
        env.setdefault("OMP_NUM_THREADS", str(threads))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    threading.Thread(target=_relay, args=(prefix, proc.stdout, sink), daemon=True).start()
    return proc


def _worker_flags(args: argparse.Namespace, extra: list[str]) -> list[str]:
    flags = ["--job", args.job, "--steps", str(args.steps), "--model", args.model]
    if args.job == "train":
        flags += ["--batch-size", str(args.batch_size), "--lr", str(args.lr)]
    if args.out:
        flags += ["--out", args.out]
    return flags + extra


def run(args: argparse.Namespace) -> int:
    if args.workers < 1 or args.steps < 1:
        raise InvalidArgumentError("--workers and --steps must be at least 1")
    if args.backend != "remote" and args.job != "train":
        raise InvalidArgumentError("--job synthetic needs --backend remote (it exercises the coordinator)")
    extra = [a for a in args.worker_args if a != "--"]
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
    if code == 0 and args.out and args.job == "train":
        plot = plot_metrics(Path(args.out) / "metrics.jsonl", Path(args.out) / "loss.png")
        print(f"launch: {args.steps} steps in {elapsed:.1f} s; {plot}")
    print("launch: all processes finished" if code == 0 else "launch: a process failed")
    return code


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
                lambda r: print(
                    f"worker {rank} step {r.step}: loss {r.loss:.4f}, global loss {r.global_loss:.4f}",
                    flush=True,
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
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="gradserver-launch-") as tmp:
        try:
            if args.backend == "remote":
                port_file = Path(tmp) / "port"
                coordinator = _start(
                    gradserver_command(
                        "coordinator",
                        "--bind",
                        "127.0.0.1:0",
                        "--world-size",
                        str(args.workers),
                        "--max-steps",
                        str(args.steps),
                        "--port-file",
                        str(port_file),
                        "--log-level",
                        "WARNING",
                    ),
                    "[coordinator]",
                    progress.line,
                )
                procs.append(coordinator)
                while not port_file.exists():
                    if coordinator.poll() is not None:
                        print("launch: the coordinator exited before it was ready", file=sys.stderr)
                        return 1
                    if time.monotonic() > deadline:
                        raise DeadlineExceededError("the coordinator did not start in time")
                    time.sleep(0.05)
                address = f"127.0.0.1:{port_file.read_text().strip()}"
                worker_argvs = [
                    ["--coordinator", address, "--node-id", f"local-{i}"] for i in range(args.workers)
                ]
            else:
                init = f"file://{tmp}/dist-store"
                worker_argvs = [
                    [
                        "--backend",
                        "gloo",
                        "--rank",
                        str(i),
                        "--world-size",
                        str(args.workers),
                        "--dist-init",
                        init,
                    ]
                    for i in range(args.workers)
                ]
            threads = max(1, (os.cpu_count() or 1) // args.workers)
            workers = [
                _start(
                    gradserver_command("worker", *argv, *_worker_flags(args, extra)),
                    f"[local-{i}]",
                    progress.line,
                    threads,
                )
                for i, argv in enumerate(worker_argvs)
            ]
            coordinators = list(procs)  # waited for last: it exits once the workers are done
            procs.extend(workers)
            failed = 0
            for proc in [*workers, *coordinators]:
                try:
                    code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise DeadlineExceededError(
                        f"the run did not finish within --timeout {args.timeout:g} s"
                    ) from None
                failed += code != 0
            return 1 if failed else 0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
