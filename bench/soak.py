"""Soak: N synthetic workers x S steps through one coordinator; nothing lost, nothing leaked.

    python -m bench.soak                        # 4 workers, 1000 steps of the tiny model's gradients
    python -m bench.soak --workers 2 --steps 200

Reports contributions sent (workers x steps x keys) against contributions the coordinator
counted (its keys_reduced metric x workers), whether every worker saw the same checksum for every
step, and the coordinator's resident memory and open file descriptors early in the run and at
its end (drift must stay under 5%).
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
import urllib.request
from pathlib import Path


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--early", type=int, default=100, help="step at which the early sample is taken")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "gradserver.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        metrics_port = 0
        coord = subprocess.Popen(
            [
                *cli,
                "coordinator",
                "--bind",
                "127.0.0.1:0",
                "--world-size",
                str(args.workers),
                "--port-file",
                str(port_file),
                "--metrics-port",
                "0",
                "--log-level",
                "INFO",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert coord.stderr is not None
            for line in coord.stderr:
                found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line)
                if found:
                    metrics_port = int(found.group(1))
                    break
            threading.Thread(target=lambda: [None for _ in coord.stderr], daemon=True).start()  # type: ignore[union-attr]
            while not port_file.exists():
                time.sleep(0.05)
            address = f"127.0.0.1:{port_file.read_text().strip()}"
            workers = [
                subprocess.Popen(
                    [
                        *cli,
                        "worker",
                        "--job",
                        "synthetic",
                        "--coordinator",
                        address,
                        "--steps",
                        str(args.steps),
                        "--model",
                        args.model,
                        "--no-verify",
                        "--json",
                        "--log-level",
                        "WARNING",
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for _ in range(args.workers)
            ]
            early: tuple[float, int] | None = None
            started = time.monotonic()
            while early is None and all(w.poll() is None for w in workers):
                if _metric(metrics_port, "gradserver_steps_completed_total") >= args.early:
                    early = (_rss_mib(coord.pid), _fds(coord.pid))
                time.sleep(0.2)
            summaries = []
            for w in workers:
                out, _ = w.communicate(timeout=3600)
                if w.returncode != 0:
                    raise RuntimeError(f"worker failed:\n{out[-2000:]}")
                summaries.append(json.loads(out.strip().splitlines()[-1]))
            elapsed = time.monotonic() - started
            end = (_rss_mib(coord.pid), _fds(coord.pid))
            keys_reduced = _metric(metrics_port, "gradserver_keys_reduced_total")
        finally:
            coord.terminate()
            coord.wait(30)
    per_step = summaries[0]["steps"][0]["tensors"]
    sent = args.workers * args.steps * per_step
    counted = int(keys_reduced) * args.workers
    identical = all(len({s["steps"][i]["checksum"] for s in summaries}) == 1 for i in range(args.steps))
    assert early is not None, "the run ended before the early sample"
    drift = (end[0] - early[0]) / early[0]
    print(f"{args.workers} workers x {args.steps} steps of the {args.model} model in {elapsed:.1f} s")
    print(f"contributions sent {sent}, counted {counted}: {'equal' if sent == counted else 'DIFFERENT'}")
    print(f"averages bit-identical across workers at every step: {identical}")
    print(
        f"coordinator RSS {early[0]:.1f} MiB at step {args.early} -> {end[0]:.1f} MiB at the end "
        f"(drift {drift:+.1%}); open fds {early[1]} -> {end[1]}"
    )
    ok = sent == counted and identical and abs(drift) < 0.05 and end[1] <= early[1]
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
