"""The network-namespace emulator (bench/_netns.py) leaves nothing behind: whichever command of a
build fails, and whatever a test does inside it, no namespace, veth, bridge, iptables rule or
process it made outlives it. What is left is read from `ip netns list`, `ip -o link` and
`iptables -S FORWARD` here, not through the emulator. Needs root and iproute2 (skipped otherwise)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import _netns
from bench._netns import Cluster, ClusterError, Emulation, PeerHost

from .helpers.processes import pid_alive

OK, WHY = _netns.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")


def _left_by(prefix: str) -> list[str]:
    """Namespaces, links and FORWARD rules here whose name starts with `prefix`."""

    def lines(*argv: str) -> list[str]:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()

    names = [line.split()[0] for line in lines("ip", "netns", "list") if line.strip()]
    names += [m.group(1) for line in lines("ip", "-o", "link") if (m := re.match(r"\d+: ([^:@]+)", line))]
    found = [name for name in names if name.startswith(prefix)]
    if shutil.which("iptables") is not None:
        found += [rule for rule in lines("iptables", "-S", "FORWARD") if f" {prefix}" in rule]
    return found


class _Fail(Exception):
    """The fault this test injects into one build command."""


def _prefix() -> str:
    return f"gn{_netns.random_prefix()[2:7]}"


# The build commands that make something named (an address or a qdisc goes with its device).
_CREATING = ("ip link add", "ip netns add", "iptables -I")
_TOPOLOGIES: dict[str, Callable[[str], Emulation]] = {
    "cluster": lambda prefix: Cluster(2, 50, prefix),
    "peer-host": PeerHost,
}


def _build_commands(topology: Callable[[str], Emulation]) -> list[str]:
    """Every command a successful build runs, in order (not the teardown's)."""
    real_run = _netns.run
    seen: list[str] = []
    building = True

    def recording(*argv: str, **options: Any) -> subprocess.CompletedProcess[str]:
        if building:
            seen.append(" ".join(argv))
        return real_run(*argv, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_netns, "run", recording)
        with topology(_prefix()):
            building = False
    return seen


def _build_failing_at(topology: Callable[[str], Emulation], index: int, prefix: str) -> list[str]:
    """Builds with command `index` raising `_Fail`; returns what existed when it was reached."""
    real_run = _netns.run
    existed: list[str] = []
    calls = 0

    def failing(*argv: str, **options: Any) -> subprocess.CompletedProcess[str]:
        nonlocal calls
        calls += 1
        if calls == index + 1:
            existed.extend(_left_by(prefix))
            raise _Fail(f"injected failure of {' '.join(argv)}")
        return real_run(*argv, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_netns, "run", failing)
        with pytest.raises(_Fail, match="injected failure"), topology(prefix):
            pass
    return existed


@pytest.mark.parametrize("name", list(_TOPOLOGIES))
def test_a_build_that_fails_at_any_command_leaves_no_namespace_link_or_rule(name: str) -> None:
    topology = _TOPOLOGIES[name]
    commands = _build_commands(topology)
    assert len(commands) > 5, commands
    for index, command in enumerate(commands):
        prefix = _prefix()
        existed = _build_failing_at(topology, index, prefix)
        assert _left_by(prefix) == [], f"left after {command} failed"
        if any(done.startswith(_CREATING) for done in commands[:index]):
            # Something existed when it failed, so the check above had something to find.
            assert existed, f"nothing of {prefix} found before {command}"


def _sleeper(emulation: Emulation, host: _netns.Host) -> int:
    return emulation.spawn(host, [sys.executable, "-c", "import time; time.sleep(300)"]).pid


def _use_then_fail(prefix: str, started: list[int]) -> None:
    with PeerHost(prefix) as host:
        started.append(_sleeper(host, host.host))
        host.slow("20mbit")
        host.cut()
        assert _left_by(prefix)
        raise RuntimeError("boom")


def test_an_exception_inside_a_peer_host_leaves_nothing_and_ends_its_processes() -> None:
    prefix = _prefix()
    started: list[int] = []
    with pytest.raises(RuntimeError, match="boom"):
        _use_then_fail(prefix, started)
    (pid,) = started
    assert _left_by(prefix) == []
    assert not pid_alive(pid)


@pytest.fixture
def peer_host() -> Iterator[PeerHost]:
    with PeerHost(_prefix()) as host:
        yield host


def _link_state(device: str) -> str:
    return Path(f"/sys/class/net/{device}/operstate").read_text().strip()


def test_a_peer_host_reaches_this_namespace_until_its_link_is_cut(peer_host: PeerHost) -> None:
    with socket.create_server((peer_host.local_ip, 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(20)
        connect = (
            "import socket, sys; "
            f"socket.create_connection(('{peer_host.local_ip}', {port}), timeout=float(sys.argv[1])).close()"
        )
        inside = [*peer_host.host.prefix(), sys.executable, "-c", connect]
        assert subprocess.run([*inside, "20"], capture_output=True, timeout=30, check=False).returncode == 0
        server.accept()[0].close()
        peer_host.cut()
        assert _link_state(peer_host.host.outer_if) == "down"
        cut_off = subprocess.run([*inside, "2"], capture_output=True, text=True, timeout=30, check=False)
        assert cut_off.returncode != 0, "connected over a cut link"
        peer_host.restore()
        assert _link_state(peer_host.host.outer_if) != "down"


def test_a_slowed_peer_host_has_a_tbf_limit_on_both_ends(peer_host: PeerHost) -> None:
    peer_host.slow("20mbit")
    host = peer_host.host
    outer = _netns.run("tc", "qdisc", "show", "dev", host.outer_if).stdout
    inner = _netns.run(*host.prefix(), "tc", "qdisc", "show", "dev", host.inner_if).stdout
    for shown in (outer, inner):
        assert "tbf" in shown and "rate 20Mbit" in shown, shown


def test_two_peer_hosts_that_would_pick_the_same_subnet_get_different_ones() -> None:
    first_prefix = _prefix()
    wanted = zlib.crc32(first_prefix.encode()) % 256
    # The prefix picks where the search for a free subnet starts: find one that starts alike.
    second_prefix = next(
        p for p in iter(_prefix, None) if p != first_prefix and zlib.crc32(p.encode()) % 256 == wanted
    )
    with PeerHost(first_prefix) as first, PeerHost(second_prefix) as second:
        assert first.local_ip.rsplit(".", 1)[0] != second.local_ip.rsplit(".", 1)[0]


def test_a_teardown_goes_on_past_a_failing_step_and_names_it() -> None:
    prefix = _prefix()
    with (
        pytest.raises(ClusterError, match=rf"teardown of {prefix}: ip link frobnicate failed"),
        PeerHost(prefix) as host,
    ):
        host.teardown.remove_with("ip", "link", "frobnicate")
    assert _left_by(prefix) == []
