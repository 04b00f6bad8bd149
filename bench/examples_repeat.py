"""Benchmark of reliability: every framework example, run again and again with gloo and with
gradserver, counting the runs that did not end cleanly.

    .venv/bin/python -m bench.examples_repeat                      # 20 runs of each, both backends
    .venv/bin/python -m bench.examples_repeat --runs 5 --examples fsdp2 accelerate_loop --json

Each run is the command a user types (`torchrun --standalone --nproc-per-node 2 examples/X.py
--backend B ...`, Ray Train's example with `python`), with the arguments the framework tests use.
A run counts as clean when it exits 0 and every rank printed its RESULT line; the table gives, per
example and backend, the runs, the unclean ones (with the exit code and the last line of output
of the first few) and the median wall time. Examples whose framework is not installed are listed
as skipped. Exit code 1 when any run was unclean.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BACKENDS = ("gloo", "gradserver")
_RESULT = re.compile(r"RESULT (\{[^{}]*\})")
_THROUGHPUT = re.compile(r"backend \S+ world \d+: [\d.]+ samples/s")
_SHOWN_FAILURES = 3


@dataclasses.dataclass(frozen=True)
class Example:
    """One example as the framework tests run it: its script, ranks, arguments, and the module
    that must be installed for it."""

    name: str
    ranks: int
    args: tuple[str, ...]
    needs: str | None = None
    launcher: str = "torchrun"
    # False: the example prints no RESULT lines (ddp_cnn prints its throughput instead).
    results: bool = True


ALL = (
    Example("fsdp2", 2, ("--steps", "5")),
    Example("fsdp2_hsdp", 4, ("--steps", "5", "--mesh", "2", "2")),
    Example("pipeline", 2, ("--steps", "5")),
    Example("pipeline_mesh", 4, ("--steps", "5")),
    Example("ddp_cnn", 2, ("--steps", "6", "--log-every", "5"), results=False),
    Example("lightning_ddp", 2, ("--steps", "5"), needs="lightning"),
    Example("hf_trainer", 2, ("--steps", "4"), needs="transformers"),
    Example("accelerate_loop", 2, ("--steps", "5"), needs="accelerate"),
    Example("ray_train", 2, ("--steps", "5"), needs="ray.train", launcher="python"),
)


@dataclasses.dataclass
class Tally:
    example: str
    backend: str
    runs: int = 0
    unclean: int = 0
    seconds: list[float] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "example": self.example,
            "backend": self.backend,
            "runs": self.runs,
            "unclean": self.unclean,
            "median_s": statistics.median(self.seconds) if self.seconds else None,
            "failures": self.failures,
        }


def _script(example: Example) -> Path:
    return EXAMPLES / f"{example.name.removesuffix('_hsdp').removesuffix('_mesh')}.py"


def command(example: Example, backend: str) -> list[str]:
    """What a user runs for `example` with `backend`."""
    script = [str(_script(example)), *example.args, "--backend", backend]
    if example.launcher == "python":
        return [sys.executable, *script]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return [torchrun, "--standalone", "--nproc-per-node", str(example.ranks), *script]


def installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def run_once(example: Example, backend: str, timeout_s: float) -> tuple[bool, float, str]:
    """One run in its own session (killed with its ranks past `timeout_s`): whether it was clean,
    its wall time, and what to show when it was not."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gradserver-example-") as cwd:
        proc = subprocess.Popen(
            command(example, backend),
            cwd=cwd,
            env={**os.environ, "RAY_DEDUP_LOGS": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            return False, time.monotonic() - started, f"timed out after {timeout_s:g} s"
    elapsed = time.monotonic() - started
    ranks = {json.loads(m.group(1))["rank"] for m in _RESULT.finditer(output)}
    if example.results:
        printed = ranks == set(range(example.ranks))
    else:
        printed = _THROUGHPUT.search(output) is not None
    if proc.returncode == 0 and printed:
        return True, elapsed, ""
    lines = [line for line in output.splitlines() if line.strip()]
    why = next((line for line in reversed(lines) if "terminate called" in line), lines[-1] if lines else "")
    return False, elapsed, f"exit {proc.returncode}, RESULT from ranks {sorted(ranks)}: {why[:200]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per example and backend")
    parser.add_argument("--examples", nargs="+", default=[e.name for e in ALL], choices=[e.name for e in ALL])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()

    tallies: list[Tally] = []
    skipped: list[str] = []
    for example in (e for e in ALL if e.name in args.examples):
        if not installed(example.needs):
            skipped.append(f"{example.name} ({example.needs} is not installed)")
            continue
        for backend in args.backends:
            tally = Tally(example.name, backend)
            for run in range(args.runs):
                clean, seconds, why = run_once(example, backend, args.timeout)
                tally.runs += 1
                tally.seconds.append(seconds)
                if not clean:
                    tally.unclean += 1
                    if len(tally.failures) < _SHOWN_FAILURES:
                        tally.failures.append(f"run {run}: {why}")
                if not args.json:
                    print(f"{example.name} {backend} run {run}: {'clean' if clean else why}", flush=True)
            tallies.append(tally)
    if args.json:
        print(json.dumps({"tallies": [t.as_json() for t in tallies], "skipped": skipped}))
    else:
        print("| example | backend | runs | unclean | median s | first failures |")
        print("| --- | --- | --- | --- | --- | --- |")
        for t in tallies:
            median = f"{statistics.median(t.seconds):.1f}" if t.seconds else "-"
            print(
                f"| {t.example} | {t.backend} | {t.runs} | {t.unclean} | {median} | {'; '.join(t.failures)} |"
            )
        for line in skipped:
            print(f"skipped: {line}")
    sys.exit(1 if any(t.unclean for t in tallies) else 0)


if __name__ == "__main__":
    main()
