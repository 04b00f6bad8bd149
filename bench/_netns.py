"""Emulated machines on one Linux host: network namespaces joined by veth pairs, links shaped by tc.

The one emulator of the benchmarks and the tests; two topologies share its building blocks and its
teardown:

- `Cluster` (bench.cluster, tests/test_cluster.py): H hosts on one bridge. Host i is namespace
  `<prefix>-h<i>` with interface `<prefix>p<i>` (address 10.77.0.<i+1>/24), joined by a veth
  pair to `<prefix>v<i>` on bridge `<prefix>br` in this namespace. Every veth end has a tbf rate
  limit (`link_mbit`), so each host has its own full-duplex link of that rate, as machines on one
  switch. The bridge has no address: nothing in this namespace can reach the hosts, and the same
  subnet in two runs cannot collide. Where iptables is installed, a FORWARD rule accepts the
  bridge's frames (a running dockerd sets FORWARD to DROP).
- `PeerHost` (tests/test_faults.py, rows 6 and 7): one host, named as a cluster's host 0, whose
  veth pair ends in this namespace with an address (10.213.<n>.1/30 here, .2/30 inside), so a
  coordinator here can bind to `local_ip` and a worker inside reaches it over that link alone.
  `cut()`/`restore()` take the link down and up; `slow(rate)` puts a tbf limit on both ends.

Names carry a prefix (the pid, or a random tag), so parallel runs do not collide. Each topology
records everything it makes, as it makes it, with the command that removes it; leaving it as a
context manager (normally, on an exception, on a build that fails half-way, or on SIGTERM/SIGINT
once `install_signal_handlers` turned them into exceptions) ends every process started in its
hosts and removes what it made, newest first: the namespaces (with their veth ends and so the
pairs), the bridge and the iptables rule. Teardown goes on past errors and reports them all.
Needs root and iproute2; `available()` says whether this machine allows it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, Self

SUBNET = "10.77.0"
PEER_SUBNET = "10.213"
_CMD_TIMEOUT = 30.0
# Linux interface names hold 15 characters; the longest made is `<prefix>p<99>`.
_MAX_PREFIX = 12
# What a removal command says when what it removes is already gone (not an error).
_ALREADY_GONE = ("Cannot find device", "No such file or directory", "does a matching rule exist")


class ClusterError(RuntimeError):
    """A command that builds or tears down an emulation failed; names the command."""


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
    """Whether this machine can build an emulation, and if not why."""
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


def random_prefix() -> str:
    """`gs<6 hex>`: for emulations several of which one process makes."""
    return f"gs{uuid.uuid4().hex[:6]}"


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


def host_named(prefix: str, index: int, ip: str) -> Host:
    """Host `index` of the emulation named `prefix` (the one naming scheme of both topologies)."""
    return Host(index, f"{prefix}-h{index}", ip, f"{prefix}p{index}", f"{prefix}v{index}")


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


class Teardown:
    """What an emulation made, oldest first, each with the step that removes it."""

    def __init__(self) -> None:
        self._steps: list[Callable[[], str | None]] = []

    def remove_with(self, *argv: str) -> None:
        """Records that `argv` removes something just made; its absence later is no error."""

        def step() -> str | None:
            result = run(*argv, check=False)
            if result.returncode == 0 or any(gone in result.stderr for gone in _ALREADY_GONE):
                return None
            return f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}"

        self._steps.append(step)

    def namespace(self, namespace: str) -> None:
        """Records a namespace just made: on removal, what still runs in it is killed first."""

        def step() -> str | None:
            _kill_namespace_pids(namespace)
            result = run("ip", "netns", "del", namespace, check=False)
            if result.returncode == 0 or "No such file" in result.stderr:
                return None
            return f"ip netns del {namespace} failed ({result.returncode}): {result.stderr.strip()}"

        self._steps.append(step)

    def unwind(self) -> list[str]:
        """Removes everything recorded, newest first, past errors; returns the errors."""
        errors: list[str] = []
        while self._steps:
            step = self._steps.pop()
            try:
                error = step()
            except Exception as exc:  # keep tearing down: a leaked namespace is worse
                error = str(exc)
            if error:
                errors.append(error)
        return errors


def add_namespace(teardown: Teardown, namespace: str) -> None:
    run("ip", "netns", "add", namespace)
    teardown.namespace(namespace)


def add_veth(teardown: Teardown, outer: str, inner: str, namespace: str | None = None) -> None:
    """A veth pair `outer` (here) - `inner` (in `namespace` when given); deleting one end deletes both."""
    into = ["netns", namespace] if namespace else []
    run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, *into)
    teardown.remove_with("ip", "link", "del", outer)


def shape(device: str, rate: str, burst: str, inside: Sequence[str] = ()) -> None:
    """A tbf rate limit on `device` (removed with the device)."""
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
        rate,
        "burst",
        burst,
        "latency",
        "100ms",
    )


class Emulation(ABC):
    """Namespaces, links and processes of one topology, and their teardown; see the module docstring."""

    def __init__(self, prefix: str) -> None:
        if not prefix or len(prefix) > _MAX_PREFIX:
            raise ValueError(f"prefix must be 1..{_MAX_PREFIX} characters (interface names), got {prefix!r}")
        self.prefix = prefix
        self.teardown = Teardown()
        self._processes: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> Self:
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

    @abstractmethod
    def build(self) -> None:
        """Makes the topology, recording each thing made in `self.teardown` as it is made."""

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
        """Starts `argv` inside `host`, in its own process group; the emulation ends it on exit."""
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
        """Removes everything this emulation made; safe to call twice and on a half-built one."""
        errors: list[str] = []
        try:
            self.stop_processes()
        except Exception as exc:  # keep tearing down: a leaked namespace is worse
            errors.append(f"stopping processes: {exc}")
        errors += self.teardown.unwind()
        if errors:
            raise ClusterError(f"teardown of {self.prefix}: " + "; ".join(errors))


class Cluster(Emulation):
    """H hosts on one bridge; see the module docstring."""

    def __init__(self, hosts: int, link_mbit: float, prefix: str | None = None) -> None:
        if not 1 <= hosts <= 99:
            raise ValueError(f"hosts must be 1..99, got {hosts}")
        if link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive, got {link_mbit}")
        super().__init__(prefix or default_prefix())
        self.link_mbit = link_mbit
        self.bridge = f"{self.prefix}br"
        self.hosts = [host_named(self.prefix, i, f"{SUBNET}.{i + 1}") for i in range(hosts)]

    def build(self) -> None:
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.teardown.remove_with("ip", "link", "del", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        # dockerd sets FORWARD to DROP, and with br_netfilter bridged frames pass through it.
        if shutil.which("iptables") is not None:
            rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            run("iptables", "-I", *rule)
            self.teardown.remove_with("iptables", "-D", *rule)
        for host in self.hosts:
            self._add_host(host)

    def _add_host(self, host: Host) -> None:
        self.attach(host)
        self._limit(host.outer_if, [])
        self._limit(host.inner_if, host.prefix())

    def attach(self, host: Host) -> None:
        """Makes `host`'s namespace and joins it to the bridge by a veth pair (no shaping)."""
        add_namespace(self.teardown, host.namespace)
        add_veth(self.teardown, host.outer_if, host.inner_if)
        run("ip", "link", "set", host.inner_if, "netns", host.namespace)
        run("ip", "link", "set", host.outer_if, "master", self.bridge)
        run("ip", "link", "set", host.outer_if, "up")
        inside = host.prefix()
        run(*inside, "ip", "addr", "add", f"{host.ip}/24", "dev", host.inner_if)
        run(*inside, "ip", "link", "set", host.inner_if, "up")
        run(*inside, "ip", "link", "set", "lo", "up")

    def _limit(self, device: str, inside: list[str]) -> None:
        rate_bytes = self.link_mbit * 1e6 / 8
        # A burst of ~10 ms of traffic (at least a few full-size frames) keeps TCP smooth without
        # letting a link run above its rate for long.
        burst = max(32 * 1024, int(rate_bytes / 100))
        shape(device, f"{self.link_mbit:g}mbit", str(burst), inside)

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


class PeerHost(Emulation):
    """One host joined straight to this namespace by an addressed veth pair; see the module docstring."""

    def __init__(self, prefix: str | None = None) -> None:
        super().__init__(prefix or random_prefix())
        subnet = _free_peer_subnet(self.prefix)
        self.local_ip = f"{subnet}.1"
        self.host = host_named(self.prefix, 0, f"{subnet}.2")

    def build(self) -> None:
        host = self.host
        add_namespace(self.teardown, host.namespace)
        add_veth(self.teardown, host.outer_if, host.inner_if, host.namespace)
        run("ip", "addr", "add", f"{self.local_ip}/30", "dev", host.outer_if)
        run("ip", "link", "set", host.outer_if, "up")
        inside = host.prefix()
        run(*inside, "ip", "addr", "add", f"{host.ip}/30", "dev", host.inner_if)
        run(*inside, "ip", "link", "set", host.inner_if, "up")
        run(*inside, "ip", "link", "set", "lo", "up")

    def cut(self) -> None:
        """Takes the link down (this namespace's end): nothing passes either way until `restore`."""
        run("ip", "link", "set", self.host.outer_if, "down")

    def restore(self) -> None:
        run("ip", "link", "set", self.host.outer_if, "up")

    def slow(self, rate: str = "20mbit") -> None:
        """A tbf limit of `rate` on both ends of the link."""
        shape(self.host.outer_if, rate, "32kbit")
        shape(self.host.inner_if, rate, "32kbit", self.host.prefix())


def _free_peer_subnet(prefix: str) -> str:
    """`10.213.<n>` for a /30 no interface here uses yet, starting from one the prefix picks."""
    used = set(re.findall(rf"inet {re.escape(PEER_SUBNET)}\.(\d+)\.", run("ip", "-o", "-4", "addr").stdout))
    start = zlib.crc32(prefix.encode()) % 256
    for offset in range(256):
        n = (start + offset) % 256
        if str(n) not in used:
            return f"{PEER_SUBNET}.{n}"
    raise ClusterError(f"{prefix}: every {PEER_SUBNET}.<n>.0/30 is in use by an interface here")


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
    """Namespaces, links and iptables rules whose name starts with `prefix` (checks after teardown)."""
    names = [line.split()[0] for line in run("ip", "netns", "list").stdout.splitlines() if line.strip()]
    links = [line.split(":")[1].strip().split("@")[0] for line in run("ip", "-o", "link").stdout.splitlines()]
    found = [n for n in names + links if n.startswith(prefix)]
    if shutil.which("iptables") is not None:
        rules = run("iptables", "-S", "FORWARD", check=False).stdout.splitlines()
        found += [rule for rule in rules if f" {prefix}" in rule]
    return found


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
