"""What live recovery costs the job: the survivors' step time while a replacement joins.

    python -m bench.recovery [--model tiny] [--steps 400] [--kill-at 60]

Three `gradserver worker` processes train through a coordinator (`--on-worker-loss continue`);
once worker n2 logged step --kill-at it is SIGKILLed and started again with the same command and
an empty --out. Reported from the survivors' metrics.jsonl and the replacement's log: the
median step time before the loss, with two workers, the step the replacement joined at (it waits
from the replacement's Join to its first contribution), the transfer (bytes, seconds) and
whether the three final checkpoints are bit-identical (weights and optimizer state).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gradserver.train.checkpoint import load_checkpoint


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def _wait_for(log: Path, pattern: str, timeout: float) -> re.Match[str]:
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = regex.search(log.read_text(errors="replace")) if log.exists() else None
        if match:
            return match
        time.sleep(0.05)
    raise TimeoutError(f"{log}: no {pattern!r} within {timeout} s")


def _identical(paths: list[Path]) -> bool:
    states = [load_checkpoint(p) for p in paths]
    first = states[0]
    for other in states[1:]:
        for name, tensor in first.model_state.items():
            if not torch.equal(tensor, other.model_state[name]):
                return False
        for index, state in first.optimizer_state["state"].items():
            for name, value in state.items():
                if not torch.equal(value, other.optimizer_state["state"][index][name]):
                    return False
    return True


def run(model: str, steps: int, kill_at: int, tmp: Path) -> dict[str, object]:
    gradserver = [sys.executable, "-m", "gradserver.cli"]
    port_file = tmp / "port"
    coordinator = _start(
        [
            *gradserver,
            "coordinator",
            "--bind",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--world-size",
            "3",
            "--on-worker-loss",
            "continue",
            "--max-steps",
            str(steps),
        ],
        tmp / "coordinator.log",
    )
    procs = [coordinator]
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline:
                raise TimeoutError("the coordinator did not start")
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"

        def worker(node: str, out: str, log: str) -> subprocess.Popen[bytes]:
            argv = [*gradserver, "worker", "--coordinator", address, "--model", model, "--batch-size", "2"]
            argv += ["--steps", str(steps), "--node-id", node, "--out", str(tmp / out)]
            proc = _start(argv, tmp / log)
            procs.append(proc)
            return proc

        workers = [worker(f"n{i}", f"out{i}", f"n{i}.log") for i in range(3)]
        _wait_for(tmp / "n2.log", rf"worker \d step {kill_at}:", 600)
        workers[2].send_signal(signal.SIGKILL)
        workers[2].wait(30)
        again = worker("n2", "out2-again", "n2-again.log")
        for proc in [workers[0], workers[1], again]:
            if proc.wait(1800) != 0:
                raise RuntimeError(f"a worker failed: see {tmp}")
        took = _wait_for(
            tmp / "n2-again.log",
            r"took the state of step (\d+) from worker \d \((\d+) tensors, (\d+) bytes, ([\d.]+) s\)",
            5,
        )
        joined_at = int(took[1])
        survivors = [
            json.loads(line)
            for line in (tmp / "out0" / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
        by_step = {e["step"]: e for e in survivors}
        warm = min(5, kill_at // 2)  # the first steps pay one-time costs
        before = [e["seconds"] for e in survivors if warm <= e["step"] < kill_at]
        alone = [e["seconds"] for e in survivors if e["contributors"] == 2 and e["step"] < joined_at]
        after = [e["seconds"] for e in survivors if joined_at < e["step"] <= joined_at + 30]
        paths = [tmp / "out0" / "checkpoint-n0.pt", tmp / "out1" / "checkpoint-n1.pt"]
        paths.append(tmp / "out2-again" / "checkpoint-n2.pt")
        return {
            "model": model,
            "state_bytes": int(took[3]),
            "tensors": int(took[2]),
            "transfer_s": float(took[4]),
            "joined_at_step": joined_at,
            "step_s_before_median": statistics.median(before),
            "step_s_two_workers_median": statistics.median(alone) if alone else None,
            "step_s_at_join": by_step[joined_at]["seconds"],
            "step_s_after_median": statistics.median(after),
            "identical": _identical(paths),
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kill-at", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gradserver-bench-recovery-") as tmp:
        print(json.dumps(run(args.model, args.steps, args.kill_at, Path(tmp)), indent=2))


if __name__ == "__main__":
    main()
