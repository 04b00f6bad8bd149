"""Benchmark: training throughput of `gradserver launch`, remote (coordinator) vs gloo backend.

    python -m bench.training                     # small model, N = 1, 2, 4, 30 steps each
    python -m bench.training --workers 2 --steps 50
    python -m bench.training --workers 2 --transport grpc,shm   # remote over gRPC and over shared memory

Same model, batch per worker and steps for every run, all in this one invocation. Reports the
median over steps (after warm-up) of global tokens/s (all workers' tokens / the slowest worker's
step time), scaling efficiency (tokens/s at N / (N x tokens/s at N=1), same backend), and the
fraction of step time spent in communication (averaging plus waiting), from DIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path


def run(
    backend: str,
    workers: int,
    model: str,
    steps: int,
    batch: int,
    warmup: int,
    transport: str = "auto",
    extra: Sequence[str] = (),
) -> tuple[float, float]:
    """Median global tokens/s and communication fraction; `extra` are more training flags."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "gradserver.cli",
            "launch",
            "--workers",
            str(workers),
            "--model",
            model,
            "--steps",
            str(steps),
            "--batch-size",
            str(batch),
            "--engine",
            backend,
            "--out",
            out,
            "--no-progress",
            *extra,
        ]
        # The launched workers read their transport from the environment (remote backend only).
        env = dict(os.environ, GRADSERVER_TRANSPORT=transport)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{backend} N={workers} failed:\n{result.stdout[-3000:]}")
        by_step: dict[int, list[dict[str, float]]] = defaultdict(list)
        for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
            entry = json.loads(line)
            by_step[entry["step"]].append(entry)
    rates, comm = [], []
    for step, entries in sorted(by_step.items()):
        if step < warmup:
            continue
        slowest = max(e["seconds"] for e in entries)
        rates.append(sum(e["tokens"] for e in entries) / slowest)
        comm.append(statistics.mean(e["comm_s"] / e["seconds"] for e in entries))
    return statistics.median(rates), statistics.mean(comm)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--transport", default="auto", help="remote backend: comma-separated auto, grpc, shm")
    args = parser.parse_args()
    sizes = [int(w) for w in args.workers.split(",")]
    print(
        f"model {args.model}, batch {args.batch_size} per worker, {args.steps} steps "
        f"(median after {args.warmup}), nproc={os.cpu_count()}"
    )
    print(
        "| N | remote transport | remote tokens/s | gloo tokens/s | remote/gloo | remote scaling "
        "| gloo scaling | remote comm share | gloo comm share |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base: dict[str, float] = {}
    for n in sizes:
        g, gc = run("gloo", n, args.model, args.steps, args.batch_size, args.warmup)
        base.setdefault("gloo", g / n)
        for transport in args.transport.split(","):
            r, rc = run("remote", n, args.model, args.steps, args.batch_size, args.warmup, transport)
            base.setdefault(transport, r / n)
            print(
                f"| {n} | {transport} | {r:.0f} | {g:.0f} | {r / g:.2f} | {r / (n * base[transport]):.2f} "
                f"| {g / (n * base['gloo']):.2f} | {rc:.0%} | {gc:.0%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
