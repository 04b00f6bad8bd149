"""Several ranks on each of several hosts, as `torchrun --nnodes 2 --nproc-per-node 2` starts them
with no gradserver setting: the ranks of the host without the coordinator sum their all_reduce on
their host (a host group), so the host's link carries each tensor once each way, every rank gets
the same bytes, and a rank or a whole host lost ends every survivor's collective with an error
naming it.

Two hosts are network namespaces on a bridge (bench/_netns.py's Cluster; root and iproute2,
skipped otherwise); every rank is a real process under a real torchrun per host.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench import _netns
from bench._netns import Cluster, Host

from .helpers.processes import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.timeout(300)]

PER_HOST = 2
WORLD = 2 * PER_HOST
ELEMENTS = 8 * 2**20  # 32 MiB per operation: the Join's link probes (3 MiB a rank) stay small beside it
OPERATIONS = 3
_TIMEOUT_S = 200.0
_GRACE_S = 30.0  # for the other torchrun to end by itself after one failed

# One rank: OPERATIONS all_reduces of its own seeded input (then, with DIE_AT, a rank that kills
# itself inside the all_reduce of that index), a line per result, and an ERROR line for what failed.
RANK_SCRIPT = """
import hashlib, json, os, signal, sys, threading, time
import numpy as np
import torch
import torch.distributed as dist
import gradserver.torch  # noqa: F401
def say(line):
    # One write per line: print() writes the text and its newline apart, and the library's log
    # lines (same pipe, another thread) could land between them.
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()
def reported(rank):
    # torchrun stops a host's other ranks as soon as one exits with an error: a rank that failed
    # waits (at most 30 s) until the other survivors of its host reported too, so the test reads
    # what each one saw rather than which one its torchrun stopped first.
    open(os.path.join(os.environ["OUT"], f"reported-{rank}"), "w").close()
    first, here = rank - int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    others = [r for r in range(first, first + here) if r != rank and str(r) not in dying]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
        os.path.exists(os.path.join(os.environ["OUT"], f"reported-{r}")) for r in others
    ):
        time.sleep(0.05)
dist.init_process_group("gradserver")
rank = dist.get_rank()
die_at, dying = int(os.environ.get("DIE_AT", "-1")), os.environ.get("DYING_RANKS", "").split(",")
size = int(os.environ["ELEMENTS"])
for op in range(int(os.environ["OPERATIONS"])):
    x = torch.from_numpy(np.random.default_rng(1000 * op + rank).standard_normal(size, dtype=np.float32))
    try:
        if op == die_at and str(rank) in dying:
            work = dist.all_reduce(x, async_op=True)
            threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            work.wait()
        else:
            if op == die_at:
                say(f"RANK {rank} WAITING")
            dist.all_reduce(x)
    except Exception as exc:
        say(f"RANK {rank} ERROR " + json.dumps(str(exc)))
        reported(rank)
        os._exit(3)
    say(f"RANK {rank} OP {op} " + hashlib.sha256(x.numpy().tobytes()).hexdigest())
    if op == 0 and rank == 0:
        np.save(os.path.join(os.environ["OUT"], "op0.npy"), x.numpy())
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    ok, why = _netns.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with Cluster(2, 1000, f"gh{_netns.random_prefix()[2:7]}") as built:
        yield built


def _launch(cluster: Cluster, tmp: Path, **env: str) -> list[tuple[subprocess.Popen[str], Path]]:
    """A torchrun on each host (static rendezvous on host 0), ranks running RANK_SCRIPT; each
    host's output goes to a file."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    port = random.randrange(20000, 30000)  # a fresh namespace: nothing else listens there
    procs = []
    for host in cluster.hosts:
        argv = [torchrun, "--nnodes", "2", "--nproc-per-node", str(PER_HOST), "--node-rank", str(host.index)]
        argv += ["--master-addr", cluster.hosts[0].ip, "--master-port", str(port)]
        argv += ["--no-python", sys.executable, "-c", RANK_SCRIPT]
        log = tmp / f"host{host.index}.log"
        with log.open("w") as out:
            proc = cluster.spawn(
                host, argv, env=_env(host, tmp, env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
        procs.append((proc, log))
    return procs


def _env(host: Host, tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    """No gradserver setting and no rendezvous variable (torchrun sets them), as a user has."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRADSERVER_") and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    env |= {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": host.inner_if}
    env |= {"OUT": str(tmp), "OPERATIONS": str(OPERATIONS), "ELEMENTS": str(ELEMENTS), **extra}
    return env


def _outputs(procs: list[tuple[subprocess.Popen[str], Path]]) -> list[str]:
    """Every host's output once every torchrun ended; a torchrun still running `_GRACE_S` after
    another failed, or any past `_TIMEOUT_S`, is killed (the output says what happened)."""
    deadline = time.monotonic() + _TIMEOUT_S
    failed_at: float | None = None
    while any(proc.poll() is None for proc, _ in procs):
        now = time.monotonic()
        if failed_at is None and any(proc.poll() not in (None, 0) for proc, _ in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + _GRACE_S):
            for proc, _ in procs:
                proc.kill()
                proc.wait(30)
            break
        running = next(proc for proc, _ in procs if proc.poll() is None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            running.wait(0.2)
    return [log.read_text() for _, log in procs]


def _host_reference(op: int) -> np.ndarray:
    """What the job computes: each host's float64 sum rounded once to float32 (host 0's ranks
    reach the coordinator one by one, so theirs is not rounded), summed in float64, rounded once."""
    data = [
        np.random.default_rng(1000 * op + rank).standard_normal(ELEMENTS, dtype=np.float32)
        for rank in range(WORLD)
    ]
    wide = [d.astype(np.float64) for d in data]
    host_1 = (wide[2] + wide[3]).astype(np.float32).astype(np.float64)
    return (wide[0] + wide[1] + host_1).astype(np.float32)


def test_two_hosts_of_two_ranks_send_each_tensor_across_a_link_once_and_agree(
    cluster: Cluster, tmp_path: Path
) -> None:
    before = cluster.link_bytes()
    procs = _launch(cluster, tmp_path)
    outs = _outputs(procs)
    moved = cluster.link_bytes() - before
    shown = "\n".join(f"--- host {h}:\n{out[-20000:]}" for h, out in enumerate(outs))
    assert [proc.returncode for proc, _ in procs] == [0, 0], shown
    text = "\n".join(outs)
    for op in range(OPERATIONS):
        digests = set(re.findall(rf"RANK \d OP {op} (\w+)", text))
        assert len(re.findall(rf"RANK \d OP {op} ", text)) == WORLD and len(digests) == 1, text[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "op0.npy"), _host_reference(0))
    # Host 1 (no coordinator) sent and received each tensor once (not once per rank), plus the
    # joins, link probes and control messages.
    size = OPERATIONS * ELEMENTS * 4
    for direction in (moved.from_host[1], moved.to_host[1]):
        assert 0.95 * size < direction < 1.1 * size, (moved, size)


@pytest.mark.parametrize(
    ("dying", "named"),
    [("3", ["3"]), ("2,3", ["2", "3"])],
    ids=["a rank of the host group", "the whole host"],
)
def test_a_rank_or_host_lost_inside_an_all_reduce_fails_every_survivor_naming_it(
    cluster: Cluster, tmp_path: Path, dying: str, named: list[str]
) -> None:
    started = time.monotonic()
    procs = _launch(cluster, tmp_path, DIE_AT="1", DYING_RANKS=dying, GRADSERVER_HEARTBEAT_TIMEOUT="3")
    outs = _outputs(procs)
    text = "\n".join(outs)
    # Host 0's ranks (the coordinator's) must report; a survivor on the dying host may be stopped
    # by its torchrun first, but what it reports names the lost rank too.
    for rank in range(WORLD):
        if str(rank) in dying.split(","):
            continue
        errors = re.findall(rf"RANK {rank} ERROR (.*)", text)
        assert errors or rank >= PER_HOST, f"rank {rank} reported no error:\n{text[-4000:]}"
        # The ranks of a host share its log file: another process's output may follow a
        # message on its line (CI saw a survivor's log line there), so only the JSON is read.
        for message in (json.JSONDecoder().raw_decode(error)[0] for error in errors):
            assert any(f"worker {w}" in message for w in named), message
    assert all(proc.returncode != 0 for proc, _ in procs)
    assert time.monotonic() - started < _TIMEOUT_S
