"""Where an embedded coordinator listens so that every rank of its process group can reach it.

Loopback when every rank of the group shares this process's loopback interface; else the local
address of the interface that routes to the torch Store's host (MASTER_ADDR under torchrun), the
host every rank already reached to rendezvous. Whether the ranks share the loopback interface is
read from their host identities (machine boot id and network namespace, not the hostname: network
namespaces and containers share one hostname but not one loopback), which each rank publishes in
the group's Store.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any, Protocol

from gradserver.common.errors import UnavailableError
from gradserver.common.security import is_loopback

IDENTITY_KEY = "gradserver/host"
LOOPBACK = "127.0.0.1"
# The Store wrappers torch nests (PrefixStore in PrefixStore in TCPStore): a bound on the walk.
_MAX_STORE_DEPTH = 16


class Store(Protocol):
    """What the backend uses of a torch.distributed Store."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, value: int) -> int: ...


def host_identity() -> str:
    """What two processes share exactly when they share a loopback interface: the machine (its
    boot id; the hostname where there is none) and the network namespace."""
    machine = socket.gethostname()
    with contextlib.suppress(OSError):
        machine = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/net")
    return f"{machine} {namespace}"


def publish_identity(store: Store, rank: int) -> None:
    """Rank `rank`'s host identity, for the rank that starts the group's coordinator."""
    store.set(f"{IDENTITY_KEY}/{rank}", host_identity())


def all_ranks_local(store: Store, size: int) -> bool:
    """Whether ranks 1..size-1 (as they published, waiting for each up to the Store's timeout)
    share this process's loopback interface."""
    mine = host_identity()
    return all(store.get(f"{IDENTITY_KEY}/{rank}").decode() == mine for rank in range(1, size))


def listen_host(store: Store, size: int) -> str:
    """The host an embedded coordinator for this group binds (and publishes): loopback when every
    rank is local, else the local address that reaches the Store's host."""
    if all_ranks_local(store, size):
        return LOOPBACK
    target = store_host(store)
    if target is None:
        raise UnavailableError(
            "gradserver: the ranks of this process group are on several hosts and the torch Store "
            "names no host to reach them through (no TCPStore, no MASTER_ADDR): set "
            "GRADSERVER_COORDINATOR to a coordinator every rank can reach"
        )
    host = interface_towards(target)
    if is_loopback(host):
        raise UnavailableError(
            f"gradserver: the ranks of this process group are on several hosts, but the torch Store's "
            f"host {target} is a loopback address here, which the other hosts cannot reach: point "
            "MASTER_ADDR at an address of this host that they can reach, or set GRADSERVER_COORDINATOR"
        )
    return host


def store_host(store: Any) -> str | None:
    """The host of the TCPStore under `store`'s wrappers, else torch's MASTER_ADDR (what its
    env:// rendezvous reads; not a gradserver setting), else None."""
    seen = store
    for _ in range(_MAX_STORE_DEPTH):
        host = getattr(seen, "host", None)
        if isinstance(host, str) and host:
            return host
        seen = getattr(seen, "underlying_store", None)
        if seen is None:
            break
    return os.environ.get("MASTER_ADDR") or None


def interface_towards(target: str) -> str:
    """This host's address on the interface that routes to `target` (no packet is sent: a UDP
    socket's connect only consults the routing table)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise UnavailableError(
            f"gradserver: no route from this host to the torch Store's host {target}: {exc}"
        ) from None


def address_of(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    return f"{host}:{port}"
