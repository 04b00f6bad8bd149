"""What fault tolerance costs a torch job, and what a lost coordinator costs it.

    python -m bench.ft [--ranks 3] [--steps 300] [--width 512] [--repeats 3] [--kill-at 150]

`steady`: the same small DDP training (bench/_ft_steps.py: a 3-layer MLP of `--width`, AdamW,
32 samples per rank and step) under `gradserver run --workers R`, the three variants alternated
`--repeats` times: `ft` (gradserver.torch.ft: DDP hook as one REDUCE per step, a commit barrier
per step), `ft-grpc` (the same over gRPC instead of shared memory: GRADSERVER_TRANSPORT=grpc, as
ft was before it took the default transport), `ddp` (plain DDP on the "gradserver" backend) and
`gloo` (plain DDP on gloo). Reports
each variant's median step time (after 20 warm-up steps; the median over the repeats) and the
ratios.

`coordinator`: `ft` under `run --restart-lost 1`; the coordinator is SIGKILLed once rank 0 passed
`--kill-at`. Reports the seconds from the kill to run's restart of it and to the last rank's
"rejoined" line, rank 0's longest step, and whether every rank ended with one state digest.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 20
_LINE_TIMEOUT_S = 300.0


@contextmanager
def _run(
    ranks: int, mode: str, steps: int, width: int, *flags: str
) -> Iterator[queue.Queue[tuple[float, str]]]:
    """`gradserver run` of bench/_ft_steps.py; yields its output lines (arrival time, line)."""
    argv = [sys.executable, "-m", "gradserver.cli", "run", "--workers", str(ranks), *flags, "--"]
    argv += [sys.executable, "-m", "bench._ft_steps", "--mode", mode.removesuffix("-grpc")]
    argv += ["--steps", str(steps)]
    argv += ["--width", str(width), "--progress-every", "10"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if mode.endswith("-grpc"):
        env["GRADSERVER_TRANSPORT"] = "grpc"
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env
    )
    lines: queue.Queue[tuple[float, str]] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((time.monotonic(), line.rstrip("\n")))
        lines.put((time.monotonic(), f"EXIT {proc.wait()}"))

    threading.Thread(target=read, daemon=True).start()
    try:
        yield lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def _until(
    lines: queue.Queue[tuple[float, str]], pattern: str, seen: list[str]
) -> tuple[float, re.Match[str]]:
    regex = re.compile(pattern)
    deadline = time.monotonic() + _LINE_TIMEOUT_S
    while time.monotonic() < deadline:
        at, line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        seen.append(line)
        if (found := regex.search(line)) is not None:
            return at, found
        if line.startswith("EXIT "):
            break
    raise RuntimeError(f"no line matching {pattern!r}; output:\n" + "\n".join(seen[-40:]))


def steady(args: argparse.Namespace) -> dict[str, object]:
    medians: dict[str, list[float]] = {"gloo": [], "ddp": [], "ft": [], "ft-grpc": []}
    for _ in range(args.repeats):
        for mode, values in medians.items():
            seen: list[str] = []
            with _run(args.ranks, mode, args.steps, args.width) as lines:
                _, found = _until(lines, r"STEP_TIMES (\[.*\])", seen)
                _until(lines, r"^EXIT 0$", seen)
            values.append(statistics.median(json.loads(found[1])[WARMUP:]))
    ms = {mode: 1000 * statistics.median(values) for mode, values in medians.items()}
    return {
        "part": "steady",
        "ranks": args.ranks,
        "width": args.width,
        "step_ms": {mode: round(value, 2) for mode, value in ms.items()},
        "each_ms": {mode: [round(1000 * v, 2) for v in values] for mode, values in medians.items()},
        "ft_over_ddp": round(ms["ft"] / ms["ddp"], 3),
        "ft_over_gloo": round(ms["ft"] / ms["gloo"], 3),
        "ft_grpc_over_ft": round(ms["ft-grpc"] / ms["ft"], 3),
        "ddp_over_gloo": round(ms["ddp"] / ms["gloo"], 3),
    }


def coordinator(args: argparse.Namespace) -> dict[str, object]:
    seen: list[str] = []
    with _run(args.ranks, "ft", args.steps, args.width, "--restart-lost", "1") as lines:
        _, started = _until(lines, r"started coordinator \(pid (\d+)\)", seen)
        _until(lines, rf"rank 0 at step {args.kill_at}\b", seen)
        os.kill(int(started[1]), signal.SIGKILL)
        killed = time.monotonic()
        restarted, _ = _until(lines, r"starting it again on its port", seen)
        rejoined = [_until(lines, r"rejoined the restarted coordinator", seen)[0] for _ in range(args.ranks)]
        _, times = _until(lines, r"STEP_TIMES (\[.*\])", seen)
        _until(lines, r"^EXIT 0$", seen)
    digests = {m[1] for m in map(re.compile(r"rank \d+: digest (0x[0-9a-f]+)").search, seen) if m}
    return {
        "part": "coordinator",
        "ranks": args.ranks,
        "restarted_after_s": round(restarted - killed, 3),
        "all_rejoined_after_s": round(max(rejoined) - killed, 3),
        "longest_step_s": round(max(json.loads(times[1])), 3),
        "one_state": len(digests) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("steady", "coordinator", "all"), default="all")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=150)
    args = parser.parse_args()
    if args.part in ("steady", "all"):
        print(json.dumps(steady(args)), flush=True)
    if args.part in ("coordinator", "all"):
        print(json.dumps(coordinator(args)), flush=True)


if __name__ == "__main__":
    main()
