"""Benchmark: DDP training throughput of the "gradserver" torch.distributed backend vs gloo.

    python -m bench.ddp                          # N = 2 and 4, 40 steps, 2 rounds
    python -m bench.ddp --workers 2 --steps 60 --rounds 3

Runs examples/ddp_cnn.py (a small CNN with BatchNorm on synthetic images) under
`torchrun --standalone`, the same command with only `--backend` changed, for every N in one
invocation: same seed, steps and batch per rank. The backends alternate within each round so
that a change in the machine's load hits both. Each run reports the median samples/s over its
steps after warm-up (the example prints it on rank 0); the table gives the median over rounds
and the ratio gradserver/gloo. gradserver runs with its default embedded coordinator (rank 0's
child process on 127.0.0.1), over gRPC unless the client library picks another transport.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_cnn.py"
_RESULT = re.compile(r"backend (\S+) world (\d+): ([\d.]+) samples/s")
BACKENDS = ("gradserver", "gloo")


def run_once(backend: str, workers: int, steps: int, batch: int, timeout_s: float) -> tuple[float, bool]:
    """Median samples/s of one torchrun of the example, and whether it exited 0. A run that
    printed its result but failed afterwards (seen: gloo aborting in destroy_process_group at
    N=4, "terminate called without an active exception") still counts, and is reported."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(workers), str(EXAMPLE)]
    cmd += [
        "--backend",
        backend,
        "--steps",
        str(steps),
        "--batch-size",
        str(batch),
        "--log-every",
        str(steps),
    ]
    # The example shares the cores out between its ranks itself (torch.set_num_threads).
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    match = _RESULT.search(result.stdout)
    if match is None:
        output = result.stdout[-2000:] + result.stderr[-3000:]
        raise RuntimeError(f"{backend} N={workers} failed ({result.returncode}):\n{output}")
    return float(match.group(3)), result.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--rounds", type=int, default=2, help="runs per backend and N, alternating")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = parser.parse_args()

    load = os.getloadavg()[0]
    print(f"load average before: {load:.2f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for workers in args.workers:
        rates: dict[str, list[float]] = {b: [] for b in BACKENDS}
        for round_ in range(args.rounds):
            order = BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]
            for backend in order:
                rate, clean = run_once(backend, workers, args.steps, args.batch_size, args.timeout)
                rates[backend].append(rate)
                note = "" if clean else " (then exited non-zero after training)"
                print(f"N={workers} round {round_} {backend}: {rate:.1f} samples/s{note}", flush=True)
        ours, gloo = (statistics.median(rates[b]) for b in BACKENDS)
        rows.append((workers, ours, gloo, ours / gloo, rates))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print("| N | gradserver samples/s | gloo samples/s | gradserver/gloo | runs (gradserver; gloo) |")
    print("| --- | --- | --- | --- | --- |")
    for workers, ours, gloo, ratio, rates in rows:
        runs = "; ".join(", ".join(f"{r:.0f}" for r in rates[b]) for b in BACKENDS)
        print(f"| {workers} | {ours:.0f} | {gloo:.0f} | {ratio:.2f} | {runs} |")


if __name__ == "__main__":
    main()
