"""A test host in a network namespace, joined to this one by a veth pair.

`TestHost.create()` makes namespace gs-<id> with veth gsw<id> (inside, 10.213.<n>.2/30) and
gsh<id> (here, 10.213.<n>.1/30); `cut()` and `restore()` take the link down and up, `slow()` puts
a tbf rate limit on both ends, and `destroy()` removes it all. These addresses exist only
between this namespace and the one the test made. Needs root and iproute2; `available()` says
whether this machine allows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def available() -> tuple[bool, str]:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    probe = f"gs-probe-{uuid.uuid4().hex[:6]}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return False, f"ip netns add failed: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


class TestHost:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = f"gs-{tag}"
        self.host_if = f"gsh{tag}"
        self.peer_if = f"gsw{tag}"
        n = int(tag[:2], 16)
        self.host_ip = f"10.213.{n}.1"
        self.peer_ip = f"10.213.{n}.2"

    @classmethod
    def create(cls) -> TestHost:
        host = cls()
        _ip("netns", "add", host.ns)
        try:
            _ip("link", "add", host.host_if, "type", "veth", "peer", "name", host.peer_if, "netns", host.ns)
            _ip("addr", "add", f"{host.host_ip}/30", "dev", host.host_if)
            _ip("link", "set", host.host_if, "up")
            host.exec_ip("addr", "add", f"{host.peer_ip}/30", "dev", host.peer_if)
            host.exec_ip("link", "set", host.peer_if, "up")
            host.exec_ip("link", "set", "lo", "up")
        except BaseException:
            host.destroy()
            raise
        return host

    def exec_ip(self, *args: str) -> None:
        _ip("netns", "exec", self.ns, "ip", *args)

    def prefix(self) -> list[str]:
        """argv prefix that runs a command inside the namespace."""
        return ["ip", "netns", "exec", self.ns]

    def cut(self) -> None:
        _ip("link", "set", self.host_if, "down")

    def restore(self) -> None:
        _ip("link", "set", self.host_if, "up")

    def slow(self, rate: str = "20mbit") -> None:
        tbf = [
            "qdisc",
            "add",
            "dev",
            "{}",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "32kbit",
            "latency",
            "100ms",
        ]
        subprocess.run(["tc", *[a.format(self.host_if) for a in tbf]], check=True, timeout=30)
        subprocess.run([*self.prefix(), "tc", *[a.format(self.peer_if) for a in tbf]], check=True, timeout=30)

    def destroy(self) -> None:
        _ip("link", "del", self.host_if, check=False)
        _ip("netns", "del", self.ns, check=False)
