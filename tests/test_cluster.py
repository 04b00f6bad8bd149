"""The emulated cluster of bench.cluster: rate-limited links that carry traffic, and a teardown
that leaves no namespace, veth, bridge, iptables rule or process behind, also after an exception,
a failure half-way through building, or SIGTERM. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import select
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bench import _netns
from bench._netns import Cluster, Host, leftovers

OK, WHY = _netns.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")
REPO = Path(__file__).resolve().parent.parent


def _prefix() -> str:
    return f"gt{uuid.uuid4().hex[:5]}"


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The next stdout line of `proc`, waiting at most `timeout` s for it."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output within {timeout:g} s")
    return proc.stdout.readline().strip()


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def _forward_rules() -> str:
    # Without iptables the cluster adds no rule (bench/_netns.py), so there is none to leave.
    if shutil.which("iptables") is None:
        return ""
    return _netns.run("iptables", "-S", "FORWARD", check=False).stdout


_RECEIVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(1)
print("LISTENING", flush=True)
conn, _ = s.accept(); total = 0
while chunk := conn.recv(1 << 16): total += len(chunk)
print(total, flush=True)
"""
_SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], 5001), timeout=20); s.sendall(b"x" * int(sys.argv[2])); s.close()
"""


def test_two_hosts_get_a_tbf_limited_link_each_and_traffic_flows_between_them() -> None:
    size = 1_000_000
    with Cluster(2, 20, _prefix()) as cluster:
        a, b = cluster.hosts
        for outer, inner in (cluster.qdisc(a), cluster.qdisc(b)):
            assert "tbf" in outer and "rate 20Mbit" in outer
            assert "tbf" in inner and "rate 20Mbit" in inner
        before = cluster.link_bytes()
        receiver = cluster.spawn(b, [sys.executable, "-c", _RECEIVER, b.ip])
        assert _read_line(receiver, 20) == "LISTENING"
        sender = cluster.spawn(a, [sys.executable, "-c", _SENDER, b.ip, str(size)])
        assert sender.wait(30) == 0
        assert int(_read_line(receiver, 30)) == size
        moved = cluster.link_bytes() - before
        assert moved.from_host[0] >= size and moved.to_host[1] >= size
        assert moved.busiest() >= size


def _use_then_fail(prefix: str, started: list[int]) -> None:
    with Cluster(2, 50, prefix) as cluster:
        started.append(
            cluster.spawn(cluster.hosts[0], [sys.executable, "-c", "import time; time.sleep(300)"]).pid
        )
        assert leftovers(prefix)
        assert shutil.which("iptables") is None or f"{prefix}br" in _forward_rules()
        raise RuntimeError("boom")


def test_an_exception_inside_the_cluster_leaves_nothing_behind() -> None:
    prefix = _prefix()
    started: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        _use_then_fail(prefix, started)
    (pid,) = started
    assert leftovers(prefix) == []
    assert f"{prefix}br" not in _forward_rules()
    assert not _alive(pid)


class _FailsAtSecondHost(Cluster):
    def _add_host(self, host: Host) -> None:
        if host.index == 1:
            raise _netns.ClusterError("cannot add host 1")
        super()._add_host(host)


def test_a_build_that_fails_half_way_is_torn_down() -> None:
    prefix = _prefix()
    with pytest.raises(_netns.ClusterError, match="cannot add host 1"), _FailsAtSecondHost(2, 50, prefix):
        pass
    assert leftovers(prefix) == []
    assert f"{prefix}br" not in _forward_rules()


def test_sigterm_to_the_benchmark_removes_its_cluster_and_processes() -> None:
    prefix = _prefix()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.cluster", "--role", "hold", "--workers", "2", "--prefix", prefix],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = _read_line(proc, 60).split()
        assert ready[:2] == ["READY", prefix]
        child = int(ready[2])
        assert _alive(child) and leftovers(prefix)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert "interrupted by SIGTERM; cleaned up" in err
        assert leftovers(prefix) == []
        assert not _alive(child)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
