"""Benchmark: DDP against DiLoCo outer steps on emulated slow links (issue 51).

    sudo .venv/bin/python -m bench.wan                          # 4 hosts, 100 Mbit/s, 50 ms RTT
    sudo .venv/bin/python -m bench.wan --steps 100 --variants ddp,diloco --plot wan.png --json

The network (bench/_wan_net.py, on bench/_netns.Cluster): --hosts hosts, each a network
namespace on one bridge with its own full-duplex link shaped by tbf to --link-mbit each way, and
one more namespace for the coordinator's site, whose own link is not shaped (--coordinator-mbit
shapes it). This kernel's tc has no netem, so the round trip time comes from a delaying TCP
relay (bench/_wan_relay.py) in the site's namespace: the coordinator listens on an address of
the site's loopback device that no host has a route to, and the ranks reach it through the
relay, which holds every chunk of bytes --rtt-ms / 2 in each direction before passing it on, in
order and without limiting throughput. A rank is thus one shaped link and RTT/2 away from the
coordinator each way. Not emulated: packet loss, jitter, and TCP's slow start and window limits
over a long path (the TCP connections on either side of the relay have a short round trip; see
the relay's docstring).

One rank per host (`python -m bench._wan_rank`, GRADSERVER_COORDINATOR = the relay) trains the
trainer's model (train/model.py's TransformerLM, a small config: --hidden, --layers, ...) on the
shipped corpus (train/corpus.py, bytes as tokens), --steps steps of --batch windows of --seq-len
bytes per rank: the same tokens, in the same order, for every variant:

- ddp: plain DistributedDataParallel over the "gradserver" torch.distributed backend;
- ddp-bf16: the same with GRADSERVER_WIRE_DTYPE=bfloat16 (the backend's 16-bit wire);
- ddp-gloo: DDP over gloo, for comparison: its ranks connect to each other over the same shaped
  links, but not through the relay, so without its delay (this kernel has no netem);
- diloco: gradserver.torch.diloco outer steps every --sync-every (H) inner steps, float32;
- diloco-int8: the same with int8 pseudo-gradients;
- streaming, streaming-int4: 4 fragments, delay 5 and int8 (int4) pseudo-gradients;
- diloco-ft, diloco-ft-kill, streaming-ft, streaming-ft-kill: over `ft.Replica` (each exchange a
  fault-tolerant step; -kill: one rank SIGKILLed mid-run and started again);
- trainer-streaming: the built-in trainer's outer steps (train/outer_steps.py) instead of the
  wrapper: 2 fragments, the exchange sent H/4 inner steps before the end of its trainer step
  (`--outer-delay`), alpha 0.5, int8 with error feedback, then the flush (as the mean weights);
  trainer-streaming-f5: 5 fragments, sent H/10 inner steps before the end (5 at H = 50, as the
  wrapper's streaming); trainer-streaming-outer-flush: 2 fragments, the flush as outer steps.

Inner optimizer AdamW (DDP's optimizer too), the same learning rate and warm-up. Per variant:
tokens/s (every rank's tokens over the slowest rank's training time), wire bytes per token
(both directions of every host's link, from the veth counters, over the training window), the
busiest link direction's mean rate, the share of wall time computing (forward, backward until
the last gradient, inner optimizer; the mean over ranks), the held-out loss at the end, the loss
it had at DDP's wall time (its final loss if it finished sooner) and DDP's loss at its wall
time, and whether every rank ended with the same weights. For outer steps also how the exchanges
held the ranks (DiLoCo's `exchange_times`, the trainer's steps' `in_flight_s` and `comm_s`): the
share of wall time spent sending and waiting for them (the mean over ranks), how many were
waited for, and of those the share of their time after the send that the next inner steps hid
(an exchange not waited for was hidden whole); for the wrapper's rows also the ranks' send
spread, how far apart (on this machine's clock) the first and the last rank sent an exchange,
the mean over the exchanges: a wait as long as that is a late replica's, not the link's.
Evaluations (every --eval-every
steps, on the held-out windows shared out over the ranks) are not counted in any time.
--plot FILE draws loss against wall time (matplotlib, when importable); --json prints one JSON
object instead of the table.

Everything made (namespaces, veths, bridge, iptables rule, coordinator, relay, ranks) is removed
on exit, also on an exception, Ctrl-C or SIGTERM; every wait is bounded (--timeout per variant).
Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import _wan_rank
from ._netns import Interrupted, available, install_signal_handlers
from ._wan_net import Site, WanCluster, tail
from ._wan_report import VARIANTS, Summary, as_json, compare, kill_step, plot, summarize, table
from .cluster import Timeline

_REPO = Path(__file__).resolve().parent.parent
# The settings every rank gets from the driver as they are (bench/_wan_rank.py defines them).
_SHARED = (
    "steps",
    "batch",
    "seq_len",
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "intermediate",
    "lr",
    "inner_lr",
    "outer_lr",
    "outer_momentum",
    "warmup_steps",
    "sync_every",
    "eval_every",
    "eval_seqs",
)


def rank_env(site_address: str, wire_dtype: str = "float32") -> dict[str, str]:
    """A rank's environment: this one without gradserver or rendezvous settings, the relay as the
    coordinator, gRPC (no shared memory across hosts), the torch backend's wire dtype, one OpenMP
    thread."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRADSERVER_") and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    env.update(
        GRADSERVER_COORDINATOR=site_address,
        GRADSERVER_TRANSPORT="grpc",
        GRADSERVER_HOST_GROUPS="off",
        GRADSERVER_WIRE_DTYPE=wire_dtype,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def rank_argv(args: argparse.Namespace, variant: str, rank: int, tmp: Path) -> list[str]:
    argv = [sys.executable, "-m", "bench._wan_rank", "--variant", variant, "--rank", str(rank)]
    argv += [
        "--world",
        str(args.hosts),
        "--store",
        str(tmp / "store"),
        "--out",
        str(tmp / f"rank{rank}.json"),
    ]
    argv += ["--timeout", f"{args.timeout:g}"]
    for name in _SHARED:
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv


def _wait_ranks(procs: list[subprocess.Popen[str]], logs: list[Path], timeout: float, what: str) -> None:
    """Waits for every rank to exit 0 within `timeout` s in all; else raises with the first failure's
    output (a rank that fails makes the others fail in their next collective)."""
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{what}: rank {rank} did not finish within {timeout:g} s:\n{tail(logs[rank])}"
            ) from None
        if proc.returncode != 0:
            raise RuntimeError(f"{what}: rank {rank} failed ({proc.returncode}):\n{tail(logs[rank])}")


def _restart_killed(
    cluster: WanCluster,
    args: argparse.Namespace,
    name: str,
    rank: int,
    first: subprocess.Popen[str],
    log: Path,
    site: Site,
) -> subprocess.Popen[str]:
    """Waits for `rank`'s first process to kill itself, then starts it again on its host without
    --die-at: it takes a live rank's state at its next exchange and trains on from there."""
    try:
        first.wait(args.timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{name}: rank {rank} was not killed within {args.timeout:g} s") from None
    if first.returncode != -signal.SIGKILL:
        raise RuntimeError(
            f"{name}: rank {rank} was to be killed but exited with {first.returncode}:\n{tail(log)}"
        )
    print(f"# {name}: rank {rank} killed; starting it again", file=sys.stderr, flush=True)
    tmp = log.parent
    with log.open("a") as sink:
        return cluster.spawn(
            cluster.hosts[rank],
            rank_argv(args, name, rank, tmp),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=rank_env(site.address, VARIANTS[name].wire_dtype),
            cwd=_REPO,
        )


def run_variant(cluster: WanCluster, args: argparse.Namespace, name: str) -> Summary:
    """One variant on fresh processes: a coordinator and relay, a rank on every host (a kill
    variant kills one rank mid-run and starts it again)."""
    variant = VARIANTS[name]
    victim = 1 % args.hosts  # the rank a kill variant kills
    with tempfile.TemporaryDirectory(prefix="gradserver-wan-") as tmp_name:
        tmp = Path(tmp_name)
        sampler: Timeline | None = None
        try:
            # gloo's ranks connect to each other: no coordinator, and no relay to delay them.
            # ft: the others go on while a lost rank restarts.
            extra = ("--on-worker-loss", "continue") if variant.ft else ()
            site = (
                None
                if variant.backend == "gloo"
                else cluster.start_site(args.hosts, args.rtt_ms / 2e3, tmp, args.chunk_mib, extra)
            )
            sampler = Timeline(cluster)
            procs, logs = [], []
            for rank, host in enumerate(cluster.hosts):
                logs.append(tmp / f"rank{rank}.log")
                with logs[-1].open("w") as sink:
                    argv = rank_argv(args, name, rank, tmp)
                    if variant.kill and rank == victim:
                        argv += ["--die-at", str(kill_step(args.steps, args.sync_every))]
                    env = rank_env("" if site is None else site.address, variant.wire_dtype)
                    if site is None:
                        env["GLOO_SOCKET_IFNAME"] = host.inner_if  # the host's shaped link
                    procs.append(
                        cluster.spawn(host, argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=_REPO)
                    )
            if variant.kill and site is not None:
                procs[victim] = _restart_killed(
                    cluster, args, name, victim, procs[victim], logs[victim], site
                )
            _wait_ranks(procs, logs, args.timeout, name)
        finally:
            if sampler is not None:
                sampler.stop()
            cluster.stop_processes()
        results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(args.hosts)]
    assert sampler is not None
    moved = sampler.between(min(r["window"][0] for r in results), max(r["window"][1] for r in results))
    wire = sum(moved.to_host) + sum(moved.from_host)
    summary = summarize(variant, args.sync_every, results, wire, moved.busiest())
    if not variant.ddp:
        outer = results[0]
        summary.note = f"{outer['outer_steps']} fragment outer steps"
        if outer["sent_bytes"] is not None:  # the wrapper counts its payloads; the trainer does not
            sent, received = outer["sent_bytes"], outer["received_bytes"]
            summary.note += f"; diloco counted {sent} B sent, {received} B received per rank"
        for result in results:
            if result.get("healed_at") is not None:
                summary.note += (
                    f"; rank {result['rank']} started again, joined at the job's step {result['healed_at']}"
                )
        if variant.ft:
            summary.note += f"; {max(int(r['discarded']) for r in results)} exchanges discarded"
    summary.note = "; ".join(x for x in (f"{results[0]['parameters']} parameters", summary.note) if x)
    return summary


def run_all(args: argparse.Namespace) -> tuple[list[Summary], list[str]]:
    """Every variant's summary, and a line for each variant that failed (the others still run)."""
    summaries: list[Summary] = []
    failed: list[str] = []
    with WanCluster(args.hosts, args.link_mbit, args.prefix, args.coordinator_mbit) as cluster:
        for name in args.variants:
            print(f"# {name} ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            try:
                summaries.append(run_variant(cluster, args, name))
            except RuntimeError as exc:
                failed.append(f"{name}: {str(exc).splitlines()[0]}")
                print(f"# {name} failed: {exc}", file=sys.stderr, flush=True)
                continue
            print(f"# {name}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    compare(summaries)
    return summaries, failed


def setup(args: argparse.Namespace) -> dict[str, Any]:
    """What the run was: the network, the model, the tokens, the machine."""
    load = os.getloadavg()
    return {
        "hosts": args.hosts,
        "link_mbit": args.link_mbit,
        "rtt_ms": args.rtt_ms,
        "coordinator_mbit": args.coordinator_mbit or None,
        "tokens_per_variant": args.hosts * args.steps * args.batch * args.seq_len,
        "nproc": os.cpu_count(),
        "loadavg_at_end": [round(x, 2) for x in load],
        **{name: getattr(args, name) for name in _SHARED},
    }


def headline(info: dict[str, Any]) -> str:
    return (
        f"# {info['hosts']} hosts, {info['link_mbit']:g} Mbit/s links, {info['rtt_ms']:g} ms RTT (relay), "
        f"{info['tokens_per_variant']} tokens per variant ({info['steps']} steps x {info['batch']} x "
        f"{info['seq_len']} per rank), model hidden {info['hidden']} x {info['layers']} layers, "
        f"H={info['sync_every']}, nproc={info['nproc']}, load average at end {info['loadavg_at_end']}"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts, one rank each")
    p.add_argument("--link-mbit", type=float, default=100.0, help="rate of every host's link, each way")
    p.add_argument("--rtt-ms", type=float, default=50.0, help="round trip time to the coordinator")
    p.add_argument(
        "--coordinator-mbit", type=float, default=0.0, help="rate of the coordinator's link (0: not shaped)"
    )
    p.add_argument("--chunk-mib", type=float, default=0.0, help="coordinator chunk size (0: it chooses)")
    p.add_argument(
        "--variants",
        type=lambda text: [v.strip() for v in text.split(",") if v.strip()],
        default=list(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)",
    )
    _wan_rank.add_training_arguments(p)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant, start to end")
    p.add_argument("--plot", type=Path, default=None, help="write a loss-vs-wall-time PNG here")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--prefix", default=None, help="name prefix of namespaces and links (default gc<pid>)")
    return p


def check(args: argparse.Namespace) -> str | None:
    """Why these settings cannot run, or None."""
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        return f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}"
    if args.hosts < 1 or args.steps < 1 or args.link_mbit <= 0 or args.rtt_ms < 0:
        return "--hosts, --steps and --link-mbit must be positive, --rtt-ms not negative"
    diloco = [VARIANTS[v] for v in args.variants if not VARIANTS[v].ddp]
    if diloco and args.steps % args.sync_every:
        return f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every} (whole periods)"
    if any(v.delay >= args.sync_every or v.fragments > args.sync_every for v in diloco):
        return (
            f"--sync-every {args.sync_every} must exceed the streaming variant's delay (5) and fragments (4)"
        )
    for v in diloco:
        per = args.sync_every // v.fragments
        # The trainer evaluates between its steps: where one ends on a multiple of --eval-every.
        if v.trainer and (args.sync_every % v.fragments or per < 2):
            return (
                f"{v.name}: --sync-every {args.sync_every} must be a multiple of its {v.fragments} fragments "
                "with at least 2 inner steps each"
            )
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if (why := check(args)) is not None:
        print(f"bench.wan: {why}", file=sys.stderr)
        return 2
    ok, why = available()
    if not ok:
        print(f"bench.wan: cannot build namespaces: {why}", file=sys.stderr)
        return 2
    install_signal_handlers()
    try:
        summaries, failed = run_all(args)
    except Interrupted as exc:
        print(f"bench.wan: {exc}; cleaned up", file=sys.stderr)
        return 128 + exc.signum
    info = setup(args)
    info["failed"] = failed
    if args.json:
        print(as_json(summaries, info))
    else:
        print(headline(info))
        print("\n".join(table(summaries)))
        for s in summaries:
            print(f"# {s.label}: {s.note}")
        for line in failed:
            print(f"# FAILED {line}")
    if args.plot is not None:
        title = (
            f"{info['hosts']} emulated hosts, {info['link_mbit']:g} Mbit/s, {info['rtt_ms']:g} ms RTT, "
            f"{info['tokens_per_variant']} tokens per variant"
        )
        print(f"# {plot(summaries, args.plot, title)}", file=sys.stderr)
    return 0 if not failed and all(s.identical for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
