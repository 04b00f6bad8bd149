"""A process group whose ranks are on several hosts needs no GRADSERVER_COORDINATOR: rank 0's
embedded coordinator listens where the torch Store's host is reached (loopback when every rank
is local) and requires the token rank 0 shares through the Store.

Where it listens is decided from the ranks' published host identities and the Store (unit tests
with a dict Store); the real thing runs rank 0 and rank 1 in two network namespaces of
bench/_netns.py's Cluster (root and iproute2; skipped otherwise) and, on one host, in two spawned
processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench import _netns
from bench._netns import Cluster
from gradserver.common.errors import UnavailableError
from gradserver.torch import _reach

from .helpers.processes import ROOT

_JOINED = re.compile(r"rank (\d) of 2 joined the gradserver coordinator at (\S+)")
_RANK_TIMEOUT_S = 150.0
# What RANK_SCRIPT's all_reduce gives: a float32 sum of two is the exactly rounded one.
_SUM = (torch.tensor([0.1, 1.0]) + torch.tensor([0.2, 2.0])).tolist()


class _DictStore:
    """A torch Store's set/get over a dict (get of a missing key fails: nothing waits here)."""

    def __init__(self, **values: str) -> None:
        self.values = dict(values)

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def _identities(*others: str) -> dict[str, str]:
    return {f"{_reach.IDENTITY_KEY}/{rank}": identity for rank, identity in enumerate(others, start=1)}


def test_a_group_whose_ranks_are_all_local_listens_on_loopback_only() -> None:
    store = _DictStore(**_identities(_reach.host_identity(), _reach.host_identity()))
    assert _reach.listen_host(store, 3) == "127.0.0.1"


def test_a_rank_on_another_host_moves_the_coordinator_to_the_interface_towards_the_store() -> None:
    store = _DictStore(**_identities(_reach.host_identity(), "another-machine net:[1]"))
    store.host = "127.0.0.2"  # type: ignore[attr-defined]  # as a TCPStore has
    # A loopback store host cannot serve several hosts: refused, naming what to set.
    with pytest.raises(UnavailableError, match="MASTER_ADDR at an address of this host"):
        _reach.listen_host(store, 3)


def test_the_store_host_is_found_through_prefix_stores_and_else_from_master_addr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=True)
    nested = dist.PrefixStore("0/cpu/", dist.PrefixStore("group/", tcp))
    assert _reach.store_host(nested) == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert _reach.store_host(_DictStore()) == "10.1.2.3"
    monkeypatch.delenv("MASTER_ADDR")
    assert _reach.store_host(_DictStore()) is None
    store = _DictStore(**_identities("another-machine net:[1]"))
    with pytest.raises(UnavailableError, match="GRADSERVER_COORDINATOR"):
        _reach.listen_host(store, 2)


def test_ipv6_addresses_are_bracketed() -> None:
    assert _reach.address_of("fd00::1", 5) == "[fd00::1]:5"
    assert _reach.address_of("10.0.0.1", 5) == "10.0.0.1:5"


# --- real ranks --------------------------------------------------------------------------------

# One rank, torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: rank 0 creates the
# TCPStore on port 0 and prints the port for rank 1). After the all_reduce, rank 0 waits until
# the test says the coordinator has been probed.
RANK_SCRIPT = """
import json, logging, os, sys, datetime
import torch
import torch.distributed as dist
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
rank = int(os.environ["RANK"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "0")), 2,
                      is_master=rank == 0, timeout=datetime.timedelta(seconds=120),
                      wait_for_workers=False)
if rank == 0:
    print("STORE_PORT", store.port, flush=True)
dist.init_process_group("gradserver", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
x = torch.tensor([0.1 * (rank + 1), 2.0 ** rank])
dist.all_reduce(x)
print("RESULT " + json.dumps(x.tolist()), flush=True)
if rank == 0:
    store.wait(["probed"], datetime.timedelta(seconds=120))
dist.barrier()
dist.destroy_process_group()
print("DONE", flush=True)
"""

# A client without the token, from rank 1's host: it must be refused. Then it lets rank 0 finish.
PROBE_SCRIPT = """
import datetime, json, sys
import torch.distributed as dist
from gradserver.torch._collective import CollectiveClient
address, store_host, store_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    CollectiveClient.connect_as_rank(address, 1, timeout=30.0).close()
    print("PROBE joined", flush=True)
except Exception as exc:
    print("PROBE " + json.dumps([type(exc).__name__, str(exc)]), flush=True)
store = dist.TCPStore(store_host, store_port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
store.set("probed", "1")
"""


def _rank_env(rank: int, master_addr: str, master_port: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSERVER_")}
    env |= {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": master_addr, "PYTHONPATH": str(ROOT)}
    # As two torchrun nodes would say: locality is read from the ranks' host identities.
    env |= {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    return env


def _line(proc: subprocess.Popen[str], prefix: str, seen: list[str]) -> str:
    """The first line of `proc`'s output starting with `prefix` (read on; every line is kept in
    `seen`); fails with the output when it ends first."""
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    proc.wait(30)
    raise AssertionError(f"no {prefix!r} line; exit {proc.returncode}:\n" + "\n".join(seen))


def _finish(proc: subprocess.Popen[str], seen: list[str]) -> list[str]:
    """The rest of `proc`'s output, once it exited 0."""
    assert proc.stdout is not None
    # Read through the file object: it may hold lines already read ahead of `_line`'s loop, which
    # communicate() (reading the descriptor) would lose. Bounded by the ranks' own Store timeouts.
    seen += proc.stdout.read().splitlines()
    proc.wait(_RANK_TIMEOUT_S)
    assert proc.returncode == 0, "\n".join(seen)
    return seen


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    ok, why = _netns.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with Cluster(2, 1000, f"gm{_netns.random_prefix()[2:7]}") as built:
        yield built


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_two_hosts_train_without_a_coordinator_setting_and_a_client_without_the_token_is_refused(
    cluster: Cluster,
) -> None:
    host_a, host_b = cluster.hosts
    argv = [sys.executable, "-c", RANK_SCRIPT]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    rank0 = cluster.spawn(host_a, argv, env=_rank_env(0, host_a.ip, None), cwd=ROOT, **pipes)
    out0: list[str] = []
    port = int(_line(rank0, "STORE_PORT", out0))
    rank1 = cluster.spawn(host_b, argv, env=_rank_env(1, host_a.ip, port), cwd=ROOT, **pipes)
    out1: list[str] = []
    assert json.loads(_line(rank1, "RESULT", out1)) == _SUM
    joined = {int(m[1]): m[2] for m in map(_JOINED.search, out1) if m}
    address = joined[1]
    # Rank 0's coordinator is on host A's interface (not loopback), reached from host B.
    assert address.startswith(f"{host_a.ip}:"), out1
    probe = cluster.spawn(
        host_b,
        [sys.executable, "-c", PROBE_SCRIPT, address, host_a.ip, str(port)],
        env=_rank_env(1, host_a.ip, port),
        cwd=ROOT,
        **pipes,
    )
    probed: list[str] = []
    name, message = json.loads(_line(probe, "PROBE", probed))
    assert name == "UnauthenticatedError" and "missing or wrong auth token" in message, probed
    _finish(probe, probed)
    assert json.loads(_line(rank0, "RESULT", out0)) == _SUM
    for proc, seen in ((rank0, out0), (rank1, out1)):
        assert _finish(proc, seen)[-1] == "DONE", seen
    # The token reached rank 1 through the Store, never through a log.
    assert not [line for line in out0 + out1 if re.search(r"\b[0-9a-f]{64}\b", line)]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_ranks_on_one_host_join_a_coordinator_on_loopback_with_a_token(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", RANK_SCRIPT]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "cwd": ROOT}
    rank0 = subprocess.Popen(argv, env=_rank_env(0, "127.0.0.1", None), **pipes)  # type: ignore[call-overload]
    rank1: subprocess.Popen[str] | None = None
    probe: subprocess.Popen[str] | None = None
    try:
        out0: list[str] = []
        port = int(_line(rank0, "STORE_PORT", out0))
        rank1 = subprocess.Popen(argv, env=_rank_env(1, "127.0.0.1", port), **pipes)  # type: ignore[call-overload]
        out1: list[str] = []
        assert json.loads(_line(rank1, "RESULT", out1)) == _SUM
        address = {int(m[1]): m[2] for m in map(_JOINED.search, out1) if m}[1]
        assert address.startswith("127.0.0.1:"), out1
        probe_argv = [sys.executable, "-c", PROBE_SCRIPT, address, "127.0.0.1", str(port)]
        probe = subprocess.Popen(probe_argv, env=_rank_env(1, "127.0.0.1", port), **pipes)  # type: ignore[call-overload]
        probed: list[str] = []
        name, _ = json.loads(_line(probe, "PROBE", probed))
        assert name == "UnauthenticatedError", probed
        _finish(probe, probed)
        for proc, seen in ((rank0, out0), (rank1, out1)):
            assert _finish(proc, seen)[-1] == "DONE", seen
    finally:
        for proc in (rank0, rank1, probe):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
