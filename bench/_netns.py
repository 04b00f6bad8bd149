"""An emulated cluster on one Linux machine: H hosts as network namespaces on one bridge.

Host i is namespace `<prefix>-h<i>` with interface `<prefix>p<i>` (address 10.77.0.<i+1>/24),
joined by a veth pair to `<prefix>v<i>` on bridge `<prefix>br` in this namespace. Every veth end
has a tbf rate limit (`link_mbit`), so each host has its own full-duplex link of that rate, as
machines on one switch. The bridge has no address: nothing in this namespace can reach the
hosts, and the same subnet in two runs cannot collide. Names carry a prefix with the pid, so
parallel runs do not collide either.

`Cluster` is a context manager: leaving it (normally, on an exception, or on SIGTERM/SIGINT once
`install_signal_handlers` turned them into exceptions) kills every process started in a host,
deletes the namespaces (which deletes their veth ends and so the pairs), the bridge and the
iptables rule. Teardown goes on past errors and reports the first. Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

SUBNET = "10.77.0"
_CMD_TIMEOUT = 30.0


class ClusterError(RuntimeError):
    """A command that builds or tears down the cluster failed; names the command."""


def run(*argv: str, check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Runs one setup command, bounded; raises ClusterError naming it and its stderr."""
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(argv)}: no answer within {timeout:g} s") from None
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def available() -> tuple[bool, str]:
    """Whether this machine can build a cluster, and if not why."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool} (iproute2) is not installed"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    probe = f"gcprobe{os.getpid()}"
    result = run("ip", "netns", "add", probe, check=False)
    if result.returncode != 0:
        return False, f"ip netns add failed: {result.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return True, ""


def default_prefix() -> str:
    """`gc<pid>`: interface names stay within Linux's 15 characters for up to 99 hosts."""
    return f"gc{os.getpid()}"


@dataclasses.dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    ip: str
    inner_if: str
    outer_if: str

    def prefix(self) -> list[str]:
        """argv prefix that runs a command inside this host."""
        return ["ip", "netns", "exec", self.namespace]


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes through each host's link: `to_host[i]`, `from_host[i]` (veth counters)."""

    to_host: tuple[int, ...]
    from_host: tuple[int, ...]

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(
            tuple(a - b for a, b in zip(self.to_host, other.to_host, strict=True)),
            tuple(a - b for a, b in zip(self.from_host, other.from_host, strict=True)),
        )

    def busiest(self) -> int:
        """The most bytes one direction of one link carried (each direction is its own capacity)."""
        return max((*self.to_host, *self.from_host), default=0)


class Cluster:
    """H hosts on one bridge; see the module docstring."""

    def __init__(self, hosts: int, link_mbit: float, prefix: str | None = None) -> None:
        if not 1 <= hosts <= 99:
            raise ValueError(f"hosts must be 1..99, got {hosts}")
        if link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive, got {link_mbit}")
        self.prefix = prefix or default_prefix()
        self.link_mbit = link_mbit
        self.bridge = f"{self.prefix}br"
        self.hosts = [
            Host(i, f"{self.prefix}-h{i}", f"{SUBNET}.{i + 1}", f"{self.prefix}p{i}", f"{self.prefix}v{i}")
            for i in range(hosts)
        ]
        self._processes: list[subprocess.Popen[Any]] = []
        self._iptables = False
        self._built = False

    # --- building -----------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self.build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.destroy()

    def build(self) -> None:
        self._built = True
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "link", "set", self.bridge, "up")
        # dockerd sets FORWARD to DROP, and with br_netfilter bridged frames pass through it.
        if shutil.which("iptables") is not None:
            run("iptables", "-I", "FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT")
            self._iptables = True
        for host in self.hosts:
            self._add_host(host)

    def _add_host(self, host: Host) -> None:
        run("ip", "netns", "add", host.namespace)
        run("ip", "link", "add", host.outer_if, "type", "veth", "peer", "name", host.inner_if)
        run("ip", "link", "set", host.inner_if, "netns", host.namespace)
        run("ip", "link", "set", host.outer_if, "master", self.bridge)
        run("ip", "link", "set", host.outer_if, "up")
        inside = host.prefix()
        run(*inside, "ip", "addr", "add", f"{host.ip}/24", "dev", host.inner_if)
        run(*inside, "ip", "link", "set", host.inner_if, "up")
        run(*inside, "ip", "link", "set", "lo", "up")
        self._limit(host.outer_if, [])
        self._limit(host.inner_if, inside)

    def _limit(self, device: str, inside: list[str]) -> None:
        rate_bytes = self.link_mbit * 1e6 / 8
        # A burst of ~10 ms of traffic (at least a few full-size frames) keeps TCP smooth without
        # letting a link run above its rate for long.
        burst = max(32 * 1024, int(rate_bytes / 100))
        run(
            *inside,
            "tc",
            "qdisc",
            "add",
            "dev",
            device,
            "root",
            "tbf",
            "rate",
            f"{self.link_mbit:g}mbit",
            "burst",
            str(burst),
            "latency",
            "100ms",
        )

    # --- using --------------------------------------------------------------------------------

    def spawn(
        self,
        host: Host,
        argv: Sequence[str],
        *,
        stdout: int | IO[Any] | None = subprocess.PIPE,
        stderr: int | IO[Any] | None = subprocess.PIPE,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[str]:
        """Starts `argv` inside `host`, in its own process group; the cluster ends it on exit."""
        proc = subprocess.Popen(
            [*host.prefix(), *argv],
            stdout=stdout,
            stderr=stderr,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self._processes.append(proc)
        return proc

    def link_bytes(self) -> LinkBytes:
        """Bytes so far through every host's link, from the bridge-side veth counters."""

        def counter(host: Host, name: str) -> int:
            return int(Path(f"/sys/class/net/{host.outer_if}/statistics/{name}").read_text())

        # The bridge side transmits what goes to the host and receives what comes from it.
        return LinkBytes(
            tuple(counter(h, "tx_bytes") for h in self.hosts),
            tuple(counter(h, "rx_bytes") for h in self.hosts),
        )

    def qdisc(self, host: Host) -> tuple[str, str]:
        """`tc qdisc show` of both ends of `host`'s link (outside, inside)."""
        outer = run("tc", "qdisc", "show", "dev", host.outer_if).stdout
        inner = run(*host.prefix(), "tc", "qdisc", "show", "dev", host.inner_if).stdout
        return outer, inner

    # --- teardown -----------------------------------------------------------------------------

    def stop_processes(self, grace: float = 5.0) -> None:
        """SIGTERM to every process group started here, then SIGKILL after `grace` s."""
        for proc in self._processes:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self._processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(grace)
        self._processes.clear()

    def destroy(self) -> None:
        """Removes everything this cluster made; safe to call twice and on a half-built one."""
        if not self._built:
            return
        errors: list[str] = []
        try:
            self.stop_processes()
        except Exception as exc:  # keep tearing down: a leaked namespace is worse
            errors.append(f"stopping processes: {exc}")
        for host in self.hosts:
            _kill_namespace_pids(host.namespace)
            # Deleting the namespace deletes the inner veth end and with it the outer one.
            result = run("ip", "netns", "del", host.namespace, check=False)
            if result.returncode != 0 and "No such file" not in result.stderr:
                errors.append(result.stderr.strip())
            run("ip", "link", "del", host.outer_if, check=False)
        result = run("ip", "link", "del", self.bridge, check=False)
        if result.returncode != 0 and "Cannot find device" not in result.stderr:
            errors.append(result.stderr.strip())
        if self._iptables:
            run(
                "iptables", "-D", "FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT", check=False
            )
            self._iptables = False
        self._built = False
        if errors:
            raise ClusterError("cluster teardown: " + "; ".join(errors))


def _signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _kill_namespace_pids(namespace: str) -> None:
    """Kills what still runs in `namespace` (children that left their process group)."""
    result = run("ip", "netns", "pids", namespace, check=False)
    for word in result.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError):
            os.kill(int(word), signal.SIGKILL)


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links whose name starts with `prefix` (for checks after teardown)."""
    names = [line.split()[0] for line in run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in run("ip", "-o", "link").stdout.splitlines()]
    return [n for n in names + links if n.startswith(prefix)]


class Interrupted(BaseException):
    """SIGTERM (or SIGINT) arrived: unwinds like KeyboardInterrupt so every `finally` runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def install_signal_handlers() -> None:
    """Turns SIGTERM and SIGINT into `Interrupted`, so teardown runs on both."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        # A second signal must not interrupt the teardown the first one starts.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
