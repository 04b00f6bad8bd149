"""Benchmark: gradserver against gloo's ring on an emulated cluster of rate-limited hosts.

    sudo .venv/bin/python -m bench.cluster                        # N=4, 200 Mbit/s, 32 MiB
    sudo .venv/bin/python -m bench.cluster --workers 4 --link-mbit 100 --mib 64 --json

Builds hosts as network namespaces on one bridge (bench/_netns.py: a tbf limit of --link-mbit on
both ends of every host's veth, so every host has its own full-duplex link), runs one worker per
host and measures, in the same run on the same links, one step of averaging --mib MiB per worker
(--blocks block keys, sent pipelined like bench/exchange.py):

- gloo: torch.distributed.all_reduce (ring) then a division, float32 (and bfloat16 with
  --gloo-bf16, when this torch's gloo reduces bfloat16);
- gradserver, one coordinator on worker host 0;
- gradserver, K=N partitions on the worker hosts (`--partition-index i --partition-map ...`, workers given
  partition 0's address);
- gradserver, K=N partitions on N extra server hosts;

each gradserver configuration with --wire-dtype float32 and bfloat16. A step starts after a
barrier and lasts until the slowest worker holds every average; the median of --steps steps
after --warmup is reported with its ratio to gloo float32, and the busiest link's utilization:
the most bytes one direction of one host link carried per step over (link capacity x median step
time). Configurations this build cannot run (no --partition-map yet) are listed as skipped.

Everything made (namespaces, veths, bridge, iptables rule, processes) is removed on exit, also on
an exception, Ctrl-C or SIGTERM. Needs root.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._netns import Cluster, Host, Interrupted, LinkBytes, available, install_signal_handlers
from .exchange import step_times

COORDINATOR_PORT = 50051
GLOO_PORT = 29500
_REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Config:
    """One row of the table: which system, where its servers run, what it sends."""

    name: str
    placement: str
    partitions: int | None
    wire_dtype: str


@dataclasses.dataclass
class Row:
    config: Config
    n_workers: int
    step_s_median: float | None = None
    busiest_bytes_per_step: float | None = None
    link_utilization: float | None = None
    ratio_to_gloo: float | None = None
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "config": self.config.name,
            "n_workers": self.n_workers,
            "partitions": self.config.partitions,
            "placement": self.config.placement,
            "wire_dtype": self.config.wire_dtype,
            "step_s_median": self.step_s_median,
            "ratio_to_gloo": self.ratio_to_gloo,
            "link_utilization": self.link_utilization,
            "note": self.note,
        }


# --- worker roles (run inside a host) -----------------------------------------------------------


class _Window:
    """When (wall clock, shared by every namespace) a worker's timed steps began and ended, so the
    link bytes per step count only those steps: not the joins, the link probes or the warm-up."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None

    def step_starts(self, timed: bool) -> None:
        if timed and self.first is None:
            self.first = time.time()

    def step_ended(self) -> None:
        self.last = time.time()

    def span(self) -> list[float | None]:
        return [self.first, self.last]


def _gradients(rank: int, mib: float, blocks: int) -> list[np.ndarray]:
    per_block = int(mib * 2**20 / 4) // blocks
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(per_block, dtype=np.float32) for _ in range(blocks)]


def _gradserver_worker(args: argparse.Namespace) -> dict[str, Any]:
    from gradserver.worker import Timeouts, WorkerClient

    client = WorkerClient.connect(
        args.address,
        node_id=f"cluster-{args.rank}",
        timeout=Timeouts(connect=60.0, join=120.0, receive=args.step_timeout, send=args.step_timeout),
        wire_dtype=args.wire_dtype,
    )
    blocks = _gradients(client.worker_id, args.mib, args.blocks)
    sizes = [(b.size, 0, 0, 0, 0, 0, 0, 0, 0) for b in blocks]
    times, window = [], _Window()
    with client:
        for step in range(args.warmup + args.steps):
            client.barrier(step)
            started = time.perf_counter()
            window.step_starts(step >= args.warmup)
            for b in reversed(range(len(blocks))):
                client.send_block_gradient(step, b, len(blocks), blocks[b], sizes[b])
            for _ in blocks:
                client.receive_averaged_block()
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
                window.step_ended()
    return {"rank": client.worker_id, "times": times, "window": window.span()}


def _gloo_worker(args: argparse.Namespace) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.address}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=args.step_timeout),
    )
    dtype = torch.bfloat16 if args.wire_dtype == "bfloat16" else torch.float32
    tensors = [torch.from_numpy(b).to(dtype) for b in _gradients(args.rank, args.mib, args.blocks)]
    times, window = [], _Window()
    try:
        for step in range(args.warmup + args.steps):
            dist.barrier()
            started = time.perf_counter()
            window.step_starts(step >= args.warmup)
            for t in reversed(tensors):
                dist.all_reduce(t)
                t.div_(args.world)
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
                window.step_ended()
    finally:
        dist.destroy_process_group()
    return {"rank": args.rank, "times": times, "window": window.span()}


# --- the driver ---------------------------------------------------------------------------------


def _me(*extra: str) -> list[str]:
    return [sys.executable, "-m", "bench.cluster", *extra]


def _collect(procs: list[subprocess.Popen[str]], timeout: float, what: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what}: a worker did not finish within {timeout:g} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{what}: a worker failed ({proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _wait_for_file(path: Path, procs: list[subprocess.Popen[str]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for proc in procs:
            if proc.poll() is not None:
                _, err = proc.communicate(timeout=5)
                raise RuntimeError(f"{what} exited with {proc.returncode}:\n{(err or '')[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start within {timeout:g} s")
        # Polling a file the coordinator writes once bound: there is no event to wait on across
        # namespaces, and the poll is bounded by the deadline above.
        time.sleep(0.05)


def partitioning_supported() -> bool:
    """Whether this build's coordinator has part A's --partition-map."""
    result = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "coordinator", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return "--partition-map" in result.stdout


class Bench:
    """Runs every configuration on one cluster and keeps the rows."""

    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.args = args
        self.workers = cluster.hosts[: args.workers]
        self.servers = cluster.hosts[args.workers :]

    def _common(self) -> list[str]:
        a = self.args
        return [
            "--mib",
            str(a.mib),
            "--blocks",
            str(a.blocks),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            "--step-timeout",
            str(a.step_timeout),
        ]

    def measure(self, config: Config) -> Row:
        row = Row(config, len(self.workers))
        sampler = Timeline(self.cluster)
        try:
            results = self._gloo(config.wire_dtype) if config.name == "gloo" else self._gradserver(config)
        finally:
            sampler.stop()
            self.cluster.stop_processes()
        if self.args.timeline:
            sampler.report(f"{config.name} {config.placement} {config.wire_dtype}", self.args.link_mbit)
        first = min(r["window"][0] for r in results)
        last = max(r["window"][1] for r in results)
        moved = sampler.between(first, last)
        row.step_s_median = statistics.median(step_times(results))
        row.busiest_bytes_per_step = moved.busiest() / self.args.steps
        capacity = self.args.link_mbit * 1e6 / 8
        row.link_utilization = row.busiest_bytes_per_step / (capacity * row.step_s_median)
        return row

    def _gloo(self, wire_dtype: str) -> list[dict[str, Any]]:
        master = f"{self.workers[0].ip}:{GLOO_PORT}"
        procs = []
        for rank, host in enumerate(self.workers):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=host.inner_if, OMP_NUM_THREADS="1")
            argv = _me("--role", "gloo-worker", "--address", master, "--rank", str(rank))
            argv += ["--world", str(len(self.workers)), "--wire-dtype", wire_dtype, *self._common()]
            procs.append(self.cluster.spawn(host, argv, env=env, cwd=_REPO))
        return _collect(procs, self.args.timeout, f"gloo {wire_dtype}")

    def _server_hosts(self, config: Config) -> list[Host]:
        if config.placement == "worker host 0":
            return self.workers[:1]
        if config.placement == "worker hosts":
            return self.workers
        return self.servers

    def _gradserver(self, config: Config) -> list[dict[str, Any]]:
        hosts = self._server_hosts(config)
        addresses = [f"{h.ip}:{COORDINATOR_PORT}" for h in hosts]
        with tempfile.TemporaryDirectory(prefix="gradserver-cluster-") as tmp:
            servers = []
            for index, host in enumerate(hosts):
                port_file = Path(tmp) / f"port{index}"
                argv = [sys.executable, "-m", "gradserver.cli", "coordinator", "--bind", addresses[index]]
                argv += ["--world-size", str(len(self.workers)), "--insecure", "--log-level", "WARNING"]
                argv += ["--port-file", str(port_file)]
                chunk = self.args.chunk_mib
                if chunk:  # else each coordinator chooses (0.25 MiB: its workers are on other hosts)
                    argv += ["--chunk-mib", f"{chunk:g}", "--max-message-mib", f"{max(16.0, chunk + 1):g}"]
                if len(hosts) > 1:
                    argv += ["--partition-index", str(index), "--partition-map", ",".join(addresses)]
                servers.append(self.cluster.spawn(host, argv, stdout=subprocess.DEVNULL, cwd=_REPO))
            for index, server in enumerate(servers):
                _wait_for_file(Path(tmp) / f"port{index}", [server], 60.0, f"coordinator partition {index}")
            procs = []
            for rank, host in enumerate(self.workers):
                argv = _me("--role", "gradserver-worker", "--address", addresses[0], "--rank", str(rank))
                argv += ["--wire-dtype", config.wire_dtype, *self._common()]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                procs.append(self.cluster.spawn(host, argv, env=env, cwd=_REPO))
            return _collect(procs, self.args.timeout, f"gradserver {config.placement}")


class Timeline:
    """Samples every link's counters while one configuration runs: the bytes of its timed steps
    (`between`) and, with --timeline, when each direction of each link idled: what the single
    utilization figure sums up."""

    PERIOD_S = 0.02

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._samples: list[tuple[float, LinkBytes]] = [(time.monotonic(), cluster.link_bytes())]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.PERIOD_S):
            self._samples.append((time.monotonic(), self._cluster.link_bytes()))

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5.0)
        self._samples.append((time.monotonic(), self._cluster.link_bytes()))

    def between(self, first: float, last: float) -> LinkBytes:
        """Bytes each link direction carried between two wall-clock times (linear between samples)."""
        offset = time.time() - time.monotonic()
        return self._at(last - offset) - self._at(first - offset)

    def _at(self, when: float) -> LinkBytes:
        samples = self._samples
        if when <= samples[0][0]:
            return samples[0][1]
        for (t0, a), (t1, b) in itertools.pairwise(samples):
            if when <= t1:
                share = (when - t0) / (t1 - t0) if t1 > t0 else 1.0
                return LinkBytes(
                    tuple(round(x + (y - x) * share) for x, y in zip(a.to_host, b.to_host, strict=True)),
                    tuple(round(x + (y - x) * share) for x, y in zip(a.from_host, b.from_host, strict=True)),
                )
        return samples[-1][1]

    def report(self, what: str, link_mbit: float) -> None:
        """One line per link direction: each character one period, by its share of capacity
        (' ' idle, '.' <25%, '-' <50%, '=' <75%, '#' above), over the busy span of the run."""
        capacity = link_mbit * 1e6 / 8
        rates: list[tuple[list[float], list[float]]] = []
        for (t0, a), (t1, b) in itertools.pairwise(self._samples):
            d, full = b - a, capacity * (t1 - t0)
            rates.append(([x / full for x in d.to_host], [x / full for x in d.from_host]))
        busy = [i for i, (to, fr) in enumerate(rates) if max(*to, *fr) > 0.05]
        if not busy:
            return
        span = rates[busy[0] : busy[-1] + 1]
        width = min(len(span), 120)
        marks = " .-=#"
        print(f"# timeline {what}: {len(span) * self.PERIOD_S:.1f} s in {width} columns", file=sys.stderr)
        for h in range(len(span[0][0])):
            for direction, name in ((1, "out"), (0, "in ")):
                values = [r[direction][h] for r in span]
                columns = [
                    statistics.fmean(values[c * len(values) // width : (c + 1) * len(values) // width])
                    for c in range(width)
                ]
                line = "".join(marks[0 if v < 0.02 else min(4, 1 + int(v * 4))] for v in columns)
                print(f"#  host{h} {name} {statistics.fmean(values):4.2f} |{line}|", file=sys.stderr)


def configurations(args: argparse.Namespace) -> list[Config]:
    n = args.workers
    configs = [Config("gloo", "ring", None, "float32")]
    if args.gloo_bf16:
        configs.append(Config("gloo", "ring", None, "bfloat16"))
    layouts = [("gradserver", "worker host 0", 1)]
    if not args.no_partitions:
        layouts += [
            ("gradserver partitioned", "worker hosts", n),
            ("gradserver partitioned", "server hosts", n),
        ]
    for name, placement, partitions in layouts:
        for dtype in args.wire_dtypes.split(","):
            configs.append(Config(name, placement, partitions, dtype.strip()))
    return configs


def run_all(args: argparse.Namespace) -> list[Row]:
    configs = configurations(args)
    partitioned = partitioning_supported()
    extra_hosts = args.workers if any(c.placement == "server hosts" for c in configs) and partitioned else 0
    rows: list[Row] = []
    with Cluster(args.workers + extra_hosts, args.link_mbit, args.prefix) as cluster:
        bench = Bench(cluster, args)
        for config in configs:
            if config.partitions is not None and config.partitions > 1 and not partitioned:
                rows.append(Row(config, args.workers, note="skipped: this build has no --partition-map"))
                continue
            try:
                rows.append(bench.measure(config))
            except RuntimeError as exc:
                rows.append(Row(config, args.workers, note=f"failed: {str(exc).splitlines()[0]}"))
                print(f"# {config}: {exc}", file=sys.stderr, flush=True)
    gloo = next((r.step_s_median for r in rows if r.config.name == "gloo" and r.step_s_median), None)
    for row in rows:
        if gloo and row.step_s_median:
            row.ratio_to_gloo = row.step_s_median / gloo
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"# N={args.workers} workers, {args.link_mbit:g} Mbit/s links, {args.mib:g} MiB per worker in "
        f"{args.blocks} keys, median of {args.steps} steps after {args.warmup} warm-up, "
        f"nproc={os.cpu_count()}"
    )
    print(
        "| config | placement | partitions | wire dtype | step s | x gloo | busiest link MB/step "
        "| link util | note |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mb = None if r.busiest_bytes_per_step is None else r.busiest_bytes_per_step / 1e6
        partitions = "-" if r.config.partitions is None else str(r.config.partitions)
        print(
            f"| {r.config.name} | {r.config.placement} | {partitions} | {r.config.wire_dtype} "
            f"| {_fmt(r.step_s_median, '.3f')} | {_fmt(r.ratio_to_gloo, '.2f')} | {_fmt(mb, '.1f')} "
            f"| {_fmt(r.link_utilization, '.2f')} | {r.note} |"
        )
    if args.json:
        for r in rows:
            print(json.dumps(r.as_json()))


def _hold(args: argparse.Namespace) -> int:
    """Builds the cluster, says so, and waits to be interrupted (for the cleanup test)."""
    with Cluster(args.workers, args.link_mbit, args.prefix) as cluster:
        spawned = cluster.spawn(cluster.hosts[0], [sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"READY {cluster.prefix} {spawned.pid}", flush=True)
        spawned.wait(args.timeout)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", default="driver", choices=["driver", "gradserver-worker", "gloo-worker", "hold"])
    p.add_argument("--workers", type=int, default=4, help="N: worker hosts")
    p.add_argument("--link-mbit", type=float, default=200.0, help="rate of every host's link, each way")
    p.add_argument("--mib", type=float, default=32.0, help="gradient MiB per worker (float32)")
    p.add_argument("--blocks", type=int, default=8, help="keys the gradient set is split into")
    p.add_argument(
        "--chunk-mib", type=float, default=0.0, help="gradserver chunk size (0: the coordinators choose)"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--wire-dtypes", default="float32,bfloat16", help="gradserver wire dtypes to measure")
    p.add_argument("--gloo-bf16", action="store_true", help="also gloo all_reduce of bfloat16 tensors")
    p.add_argument("--no-partitions", action="store_true", help="only gloo and the single coordinator")
    p.add_argument("--no-shards", action="store_true", help="deprecated: --no-partitions")
    p.add_argument("--json", action="store_true", help="one JSON line per row after the table")
    p.add_argument("--timeline", action="store_true", help="print when each link direction was busy (stderr)")
    p.add_argument("--prefix", default=None, help="name prefix of namespaces and links (default gc<pid>)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration")
    p.add_argument("--step-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    p.add_argument("--address", default="", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--wire-dtype", default="float32", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.no_shards:
        print(
            "bench.cluster: --no-shards is deprecated and goes in the next release: use --no-partitions",
            file=sys.stderr,
        )
        args.no_partitions = True
    if args.role == "gradserver-worker":
        print(json.dumps(_gradserver_worker(args)), flush=True)
        return 0
    if args.role == "gloo-worker":
        print(json.dumps(_gloo_worker(args)), flush=True)
        return 0
    ok, why = available()
    if not ok:
        print(f"bench.cluster: cannot build namespaces: {why}", file=sys.stderr)
        return 2
    install_signal_handlers()
    try:
        if args.role == "hold":
            return _hold(args)
        print_table(run_all(args), args)
    except Interrupted as exc:
        print(f"bench.cluster: {exc}; cleaned up", file=sys.stderr)
        return 128 + exc.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
