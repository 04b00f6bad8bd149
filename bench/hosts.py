"""Benchmark: several torch ranks per host, gradserver against gloo, on emulated rate-limited hosts.

    sudo .venv/bin/python -m bench.hosts --hosts 2 --ranks-per-host 2 4
    sudo .venv/bin/python -m bench.hosts --hosts 3 --ranks-per-host 4 --link-mbit 100 --mib 32 --json
    sudo .venv/bin/python -m bench.hosts --hosts 3 --ranks-per-host 1 --op send_recv --mib 4

Real clusters run several ranks per host. This builds H hosts as network namespaces on one bridge
(bench/_netns.py: every host has its own full-duplex link of --link-mbit each way) and, for each P
in --ranks-per-host and each backend ("gloo" and "gradserver", alternating which goes first), starts
on every host h exactly what a user starts on a multi-node cluster:

    torchrun --nnodes H --nproc-per-node P --node-rank h --master-addr <host 0> --master-port <port>
             -m bench.hosts --role rank --backend <backend> ...

with no gradserver settings (every GRADSERVER_* variable is removed): the "gradserver" backend's
rank 0 starts its own embedded coordinator on host 0 and the other ranks find it through the torch
Store. Each rank fills a float32 tensor of --mib MiB from its rank (torch.Generator seeded with the
rank), then runs --warmup and --steps timed iterations of barrier, all_reduce (SUM) of a fresh copy
of its input. It checks the last result against the exact float64 sum of every rank's input (each
rank regenerates all of them) and reports the error relative to max |expected| and a sha256 of its
result's bytes, in one `HOSTS_RESULT {json}` line on stdout. With `--op send_recv` a step is
instead a point-to-point round trip: the first rank of the second host sends its tensor to the
first rank of the last host, which sends it back (every other rank only takes part in the
barriers; with gradserver the bytes go through the coordinator on host 0, the first host's
rank 0, so with 3 hosts they cross host 0's link both ways, which a direct connection would
not); every rank reports the bytes the sender's tensor must come back as.

The table has, for every (P, backend): the median step time (a step's time is its slowest rank's
all_reduce time), its ratio gradserver/gloo, whether every rank's result bytes were identical, the
largest relative error and, for every host, the bytes its link carried per all_reduce each way (in
MB and as a multiple of S, the tensor's bytes), counted from the bridge-side veth counters over the
timed steps only (from the first rank's first timed step to the last rank's last one, barriers
between them included). --json prints one JSON object instead of the table.

Everything made (namespaces, veths, bridge, iptables rule, processes) is removed on exit, also on
an exception, Ctrl-C or SIGTERM; every run is bounded by --timeout. Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._netns import Cluster, Interrupted, available, install_signal_handlers
from ._netns import run as run_command
from .cluster import Timeline

BACKENDS = ("gloo", "gradserver")
RESULT_PREFIX = "HOSTS_RESULT "
BASE_PORT = 29600
_REPO = Path(__file__).resolve().parent.parent


# --- the rank role (run by torchrun inside a host) ----------------------------------------------


def _input(rank: int, elements: int) -> Any:
    """Rank `rank`'s input tensor: the same on every process that asks."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    return torch.randn(elements, generator=generator, dtype=torch.float32)


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    # Registers "gradserver" (through importlib: mypy cannot see the editable install's finder).
    importlib.import_module("gradserver.torch")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    elements = int(args.mib * 2**20) // 4
    tensor = _input(rank, elements)
    times: list[float] = []
    first: float | None = None
    last: float | None = None
    result = tensor
    try:
        for step in range(args.warmup + args.steps):
            work = tensor.clone()
            dist.barrier()
            timed = step >= args.warmup
            if timed and first is None:
                first = time.time()
            started = time.perf_counter()
            if args.op == "send_recv":
                work = _round_trip(work, rank, world, world // args.hosts)
            else:
                dist.all_reduce(work, op=dist.ReduceOp.SUM)
            elapsed = time.perf_counter() - started
            if timed:
                last = time.time()
                times.append(elapsed)
            result = work
        expected = torch.zeros(elements, dtype=torch.float64)
        if args.op == "send_recv":
            sender = _pair(world, world // args.hosts)[0]
            expected += _input(sender, elements).to(torch.float64)
            result = _input(sender, elements) if rank not in _pair(world, world // args.hosts) else result
        else:
            for other in range(world):
                expected += _input(other, elements).to(torch.float64)
        scale = float(expected.abs().max())
        error = float((result.to(torch.float64) - expected).abs().max()) / (scale or 1.0)
        digest = hashlib.sha256(result.numpy().tobytes()).hexdigest()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {
        "rank": rank,
        "world": world,
        "backend": args.backend,
        "times": times,
        "window": [first, last],
        "rel_error": error,
        "sha256": digest,
    }


def _pair(world: int, per_host: int) -> tuple[int, int]:
    """The ranks of a `send_recv` round trip: the first of the second host, the first of the
    last (with 2 hosts, host 0's rank 0 and host 1's first rank)."""
    hosts = world // per_host
    first = per_host if hosts > 2 else 0
    return first, (hosts - 1) * per_host


def _round_trip(tensor: Any, rank: int, world: int, per_host: int) -> Any:
    """`tensor` from the pair's first rank to its second and back; what came back (the
    first), what came (the second), `tensor` itself elsewhere."""
    import torch.distributed as dist

    first, second = _pair(world, per_host)
    if rank == first:
        dist.send(tensor, second)
        dist.recv(tensor, second)
    elif rank == second:
        dist.recv(tensor, first)
        dist.send(tensor, first)
    return tensor


# --- the driver ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One (ranks per host, backend) run."""

    backend: str
    ranks_per_host: int
    world: int
    step_s_median: float | None = None
    step_s: list[float] = dataclasses.field(default_factory=list)
    ratio_to_gloo: float | None = None
    # Per host, bytes per all_reduce: to the host (in) and from it (out).
    in_bytes: list[float] = dataclasses.field(default_factory=list)
    out_bytes: list[float] = dataclasses.field(default_factory=list)
    digests_identical: bool | None = None
    max_rel_error: float | None = None
    note: str = ""

    def as_json(self, tensor_bytes: int) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "ranks_per_host": self.ranks_per_host,
            "world": self.world,
            "step_s_median": self.step_s_median,
            "step_s": self.step_s,
            "ratio_to_gloo": self.ratio_to_gloo,
            "hosts": [
                {
                    "host": h,
                    "in_bytes_per_allreduce": i,
                    "out_bytes_per_allreduce": o,
                    "in_x_s": i / tensor_bytes,
                    "out_x_s": o / tensor_bytes,
                }
                for h, (i, o) in enumerate(zip(self.in_bytes, self.out_bytes, strict=True))
            ],
            "digests_identical": self.digests_identical,
            "max_rel_error": self.max_rel_error,
            "note": self.note,
        }


def _rank_env(host_if: str) -> dict[str, str]:
    """The environment of a host's torchrun: this one without any gradserver or rendezvous
    setting, one OpenMP thread per rank (two cores for every host), gloo on the host's link."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRADSERVER_")
        and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=host_if, PYTHONUNBUFFERED="1")
    return env


def _kill_leftovers(cluster: Cluster) -> None:
    """Ends what still runs in the cluster's hosts (ranks run in sessions of their own that
    torchrun starts); every process in these namespaces is this benchmark's."""
    cluster.stop_processes()
    for host in cluster.hosts:
        pids = run_command("ip", "netns", "pids", host.namespace, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _results(text: str) -> list[dict[str, Any]]:
    decoder = json.JSONDecoder()
    found = []
    at = text.find(RESULT_PREFIX)
    while at >= 0:
        start = at + len(RESULT_PREFIX)
        with contextlib.suppress(json.JSONDecodeError):
            found.append(decoder.raw_decode(text, start)[0])
        at = text.find(RESULT_PREFIX, start)
    return found


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


def _launch(cluster: Cluster, args: argparse.Namespace, backend: str, per_host: int, port: int) -> list[Any]:
    """One run: a torchrun on every host; returns every rank's result (raises RuntimeError)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    master = cluster.hosts[0].ip
    with tempfile.TemporaryDirectory(prefix="gradserver-hosts-") as tmp:
        procs: list[tuple[subprocess.Popen[str], Path, Path]] = []
        for host in cluster.hosts:
            argv = [
                torchrun,
                "--nnodes",
                str(len(cluster.hosts)),
                "--nproc-per-node",
                str(per_host),
                "--node-rank",
                str(host.index),
                "--master-addr",
                master,
                "--master-port",
                str(port),
                "-m",
                "bench.hosts",
                "--role",
                "rank",
                "--backend",
                backend,
                "--mib",
                str(args.mib),
                "--op",
                args.op,
                "--hosts",
                str(len(cluster.hosts)),
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
                "--timeout",
                str(args.timeout),
            ]
            out, err = Path(tmp) / f"h{host.index}.out", Path(tmp) / f"h{host.index}.err"
            with out.open("w") as out_file, err.open("w") as err_file:
                proc = cluster.spawn(
                    host, argv, stdout=out_file, stderr=err_file, env=_rank_env(host.inner_if), cwd=_REPO
                )
            procs.append((proc, out, err))
        deadline = time.monotonic() + args.timeout
        for index, (proc, _, err) in enumerate(procs):
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"host {index}'s torchrun did not finish within {args.timeout:g} s"
                ) from None
            if proc.returncode != 0:
                raise RuntimeError(f"host {index}'s torchrun failed ({proc.returncode}):\n{_tail(err)}")
        results = [r for _, out, _ in procs for r in _results(out.read_text(errors="replace"))]
        world = len(cluster.hosts) * per_host
        if sorted(r["rank"] for r in results) != list(range(world)):
            stderr = "\n".join(_tail(err, 1500) for _, _, err in procs)
            raise RuntimeError(f"expected results from ranks 0..{world - 1}, got {len(results)}:\n{stderr}")
        return results


def measure(cluster: Cluster, args: argparse.Namespace, backend: str, per_host: int, port: int) -> Row:
    row = Row(backend, per_host, len(cluster.hosts) * per_host)
    sampler = Timeline(cluster)
    try:
        results = _launch(cluster, args, backend, per_host, port)
    finally:
        sampler.stop()
        _kill_leftovers(cluster)
    row.step_s = [max(step) for step in zip(*(r["times"] for r in results), strict=True)]
    row.step_s_median = statistics.median(row.step_s)
    first = min(r["window"][0] for r in results)
    last = max(r["window"][1] for r in results)
    moved = sampler.between(first, last)
    row.in_bytes = [b / args.steps for b in moved.to_host]
    row.out_bytes = [b / args.steps for b in moved.from_host]
    row.digests_identical = len({r["sha256"] for r in results}) == 1
    row.max_rel_error = max(r["rel_error"] for r in results)
    return row


def run_all(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    port = BASE_PORT
    with Cluster(args.hosts, args.link_mbit, args.prefix) as cluster:
        for index, per_host in enumerate(args.ranks_per_host):
            order = BACKENDS if index % 2 == 0 else BACKENDS[::-1]
            done: dict[str, Row] = {}
            for backend in order:
                port += 1  # each run its own rendezvous port: no TIME_WAIT clash with the last one
                print(f"# P={per_host} {backend} ...", file=sys.stderr, flush=True)
                try:
                    done[backend] = measure(cluster, args, backend, per_host, port)
                except RuntimeError as exc:
                    done[backend] = Row(backend, per_host, args.hosts * per_host)
                    done[backend].note = f"failed: {str(exc).splitlines()[0]}"
                    print(f"# P={per_host} {backend}: {exc}", file=sys.stderr, flush=True)
            gloo, ours = done["gloo"].step_s_median, done["gradserver"].step_s_median
            if gloo and ours:
                done["gradserver"].ratio_to_gloo = ours / gloo
                done["gloo"].ratio_to_gloo = 1.0
            rows += [done[b] for b in BACKENDS]
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def tensor_bytes(args: argparse.Namespace) -> int:
    return (int(args.mib * 2**20) // 4) * 4


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    size = tensor_bytes(args)
    what = "all_reduce SUM" if args.op == "all_reduce" else "send/recv round trip"
    print(
        f"# H={args.hosts} hosts, {args.link_mbit:g} Mbit/s links, S={args.mib:g} MiB float32 per rank, "
        f"{what}, median of {args.steps} steps after {args.warmup} warm-up, nproc={os.cpu_count()}"
    )
    print(
        "| P | ranks | backend | step s | x gloo | host | in MB/allreduce | in xS | out MB/allreduce "
        "| out xS | identical | max rel err | note |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        identical = "-" if r.digests_identical is None else ("yes" if r.digests_identical else "NO")
        head = (
            f"| {r.ranks_per_host} | {r.world} | {r.backend} | {_fmt(r.step_s_median, '.3f')} "
            f"| {_fmt(r.ratio_to_gloo, '.2f')}"
        )
        tail = f"| {identical} | {_fmt(r.max_rel_error, '.1e')} | {r.note} |"
        if not r.in_bytes:
            print(f"{head} | - | - | - | - | - {tail}")
            continue
        for h, (i, o) in enumerate(zip(r.in_bytes, r.out_bytes, strict=True)):
            print(f"{head} | {h} | {i / 1e6:.1f} | {i / size:.2f} | {o / 1e6:.1f} | {o / size:.2f} {tail}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", default="driver", choices=["driver", "rank"])
    p.add_argument("--hosts", type=int, default=2, help="H: emulated hosts")
    p.add_argument("--ranks-per-host", type=int, nargs="+", default=[2, 4], help="P values to run")
    p.add_argument("--link-mbit", type=float, default=200.0, help="rate of every host's link, each way")
    p.add_argument("--mib", type=float, default=16.0, help="S: tensor MiB per rank (float32)")
    p.add_argument("--op", default="all_reduce", choices=["all_reduce", "send_recv"], help="what a step is")
    p.add_argument("--steps", type=int, default=5, help="timed all_reduces")
    p.add_argument("--warmup", type=int, default=2, help="untimed all_reduces first")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run (backend, P)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--prefix", default=None, help="name prefix of namespaces and links (default gc<pid>)")
    p.add_argument("--backend", default="gloo", choices=BACKENDS, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.role == "rank":
        # One write of the whole line: ranks share torchrun's output, and print() writes the
        # text and the newline apart, so two ranks' lines could interleave.
        sys.stdout.write(RESULT_PREFIX + json.dumps(_rank(args)) + "\n")
        sys.stdout.flush()
        return 0
    if args.steps < 1 or args.hosts < 1 or min(args.ranks_per_host) < 1:
        print("bench.hosts: --steps, --hosts and --ranks-per-host must be positive", file=sys.stderr)
        return 2
    ok, why = available()
    if not ok:
        print(f"bench.hosts: cannot build namespaces: {why}", file=sys.stderr)
        return 2
    install_signal_handlers()
    try:
        rows = run_all(args)
    except Interrupted as exc:
        print(f"bench.hosts: {exc}; cleaned up", file=sys.stderr)
        return 128 + exc.signum
    if args.json:
        size = tensor_bytes(args)
        summary = {
            "hosts": args.hosts,
            "link_mbit": args.link_mbit,
            "mib": args.mib,
            "tensor_bytes": size,
            "steps": args.steps,
            "warmup": args.warmup,
            "nproc": os.cpu_count(),
            "rows": [r.as_json(size) for r in rows],
        }
        print(json.dumps(summary))
    else:
        print_table(rows, args)
    return 0 if all(not r.note for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
