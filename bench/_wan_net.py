"""bench.wan's network: bench/_netns.Cluster's H shaped hosts plus a coordinator host behind a delay.

The hosts are `Cluster`'s (namespaces on one bridge, a tbf limit of `link_mbit` on both ends of
each host's veth, so each host has its own full-duplex link of that rate). One more namespace,
`<prefix>-c` (10.77.0.200), joins the bridge as the coordinator's site: its link is not shaped
unless `coordinator_mbit` is given (a server in a data centre whose own link is not what limits;
the hosts' links are, and `Cluster.link_bytes` counts only those). In it run the delaying relay
(bench/_wan_relay.py) on the bridge address and the coordinator on 10.78.0.1, an address of the
site's own loopback device that no host has a route to: a rank reaches the coordinator only over
its host's shaped link and through the relay's delay. (Not on 127.0.0.1: a coordinator whose
members all come from loopback takes them for local processes and sizes its chunks for that, 8
MiB; from 10.78.0.1 they are remote, as over a real network, and it sizes chunks from the link
rate each measured before joining.) Everything is recorded in the cluster's teardown, so leaving
the context removes it too.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

from ._netns import SUBNET, Cluster, Host, run, shape

COORDINATOR_IP = f"{SUBNET}.200"
PRIVATE_IP = "10.78.0.1"  # the coordinator's, on the site's loopback device: no host routes to it
_REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Site:
    """Where the ranks reach the coordinator (the relay's address) and the processes serving it."""

    address: str
    coordinator: subprocess.Popen[str]
    relay: subprocess.Popen[str]


class WanCluster(Cluster):
    """`Cluster` plus the coordinator's namespace; see the module docstring."""

    def __init__(
        self, hosts: int, link_mbit: float, prefix: str | None = None, coordinator_mbit: float = 0.0
    ) -> None:
        super().__init__(hosts, link_mbit, prefix)
        self.coordinator_mbit = coordinator_mbit
        # Named as host 99 would be; Cluster allows at most 99 hosts (0..98), so it cannot clash.
        self.site = Host(99, f"{self.prefix}-c", COORDINATOR_IP, f"{self.prefix}ci", f"{self.prefix}co")

    def build(self) -> None:
        super().build()
        site = self.site
        self.attach(site)
        inside = site.prefix()
        run(*inside, "ip", "addr", "add", f"{PRIVATE_IP}/32", "dev", "lo")
        if self.coordinator_mbit > 0:
            burst = str(max(32 * 1024, int(self.coordinator_mbit * 1e6 / 8 / 100)))
            shape(site.outer_if, f"{self.coordinator_mbit:g}mbit", burst)
            shape(site.inner_if, f"{self.coordinator_mbit:g}mbit", burst, inside)

    def start_site(
        self, world: int, delay_s: float, workdir: Path, chunk_mib: float = 0.0, extra: tuple[str, ...] = ()
    ) -> Site:
        """A fresh coordinator for `world` ranks on the site's private address (`extra`: more of its
        flags) and the relay in front of it on the bridge, delaying each way by `delay_s`; both end
        with `stop_processes`."""
        port_file = workdir / "coordinator.port"
        argv = [sys.executable, "-m", "gradserver.cli", "coordinator", "--bind", f"{PRIVATE_IP}:0"]
        # --insecure: a bind beyond 127.0.0.1 needs it, and only the relay can reach this one.
        argv += ["--world-size", str(world), "--port-file", str(port_file), "--insecure"]
        argv += ["--log-level", "WARNING"]
        # The ranks are on other hosts: nothing to offer them through shared memory.
        argv += ["--no-shm", "--no-lane", "--join-timeout", "180", "--heartbeat-timeout", "60"]
        argv += list(extra)
        if chunk_mib:
            argv += ["--chunk-mib", f"{chunk_mib:g}", "--max-message-mib", f"{max(33.0, chunk_mib + 1):g}"]
        coordinator = self._spawn_logged(argv, workdir / "coordinator.log")
        port = wait_for_port(port_file, coordinator, workdir / "coordinator.log", 60.0, "the coordinator")
        relay_file = workdir / "relay.port"
        argv = [sys.executable, "-m", "bench._wan_relay", "--listen", f"{self.site.ip}:0"]
        argv += ["--upstream", f"{PRIVATE_IP}:{port}", "--delay-ms", f"{delay_s * 1e3:g}"]
        argv += ["--port-file", str(relay_file)]
        relay = self._spawn_logged(argv, workdir / "relay.log")
        relay_port = wait_for_port(relay_file, relay, workdir / "relay.log", 30.0, "the relay")
        return Site(f"{self.site.ip}:{relay_port}", coordinator, relay)

    def _spawn_logged(self, argv: list[str], log: Path) -> subprocess.Popen[str]:
        # Its output goes to a file: a pipe nobody reads would block it once full.
        with log.open("w") as sink:
            return self.spawn(self.site, argv, stdout=sink, stderr=subprocess.STDOUT, cwd=_REPO)


def wait_for_port(path: Path, proc: subprocess.Popen[str], log: Path, timeout: float, what: str) -> int:
    """The port `proc` writes to `path` once it listens; raises if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text().strip() if path.exists() else ""
        if text.isdigit():
            return int(text)
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not listen within {timeout:g} s")
        # A file written by a process in another namespace: no event to wait on; bounded above.
        time.sleep(0.05)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
