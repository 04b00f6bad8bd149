"""Where a process group's coordinator is: GRADSERVER_COORDINATOR, or one that its rank 0 starts.

GRADSERVER_COORDINATOR serves the default process group only. Every other group (`dist.new_group`,
a DeviceMesh dimension), and the default group when no coordinator is named, gets an embedded
coordinator: the `gradserver coordinator` command in a child process of the group's rank 0 (its
lowest global rank; so its event loop never competes with training for that rank's GIL, and the
client library stays independent of the server package), port 0, bound where every rank of the
group can reach it (`_reach`: loopback when all are local, else the interface towards the torch
Store's host). It requires a token that rank 0 draws for it alone and publishes, with its address,
in the group's torch Store (each group's Store has its own key prefix); the token is never on a
command line nor in a log. The child watches its parent (`--exit-with-parent`), so a SIGKILLed
rank 0 leaves no coordinator behind, and the port file's directory goes as soon as the port is
read; `stop` removes the shared-memory socket directory of a child that was SIGKILLed.

A process may create a group of the same name again (`destroy_process_group`, then
`init_process_group`: torch numbers groups from 0 again, and torchrun's Store outlives both), so
each incarnation of a group keeps its keys apart (`_Incarnation`): a rank reading the previous
incarnation's address would join a coordinator that is gone.
"""

from __future__ import annotations

import atexit
import dataclasses
import secrets
import tempfile
from pathlib import Path

from gradserver.common.config import env_name
from gradserver.common.errors import UnavailableError
from gradserver.worker.local_coordinator import coordinator_command, remove_shm_dirs
from gradserver.worker.supervisor import Child, stop, wait_for_port

from ._reach import LOOPBACK, Store, address_of, listen_host, publish_identity
from ._settings import RankSettings, rank_settings

__all__ = ["STORE_KEY", "TOKEN_KEY", "EmbeddedCoordinator", "Membership", "Store", "coordinator_for"]

STORE_KEY = "gradserver/coordinator"
TOKEN_KEY = "gradserver/coordinator-token"
INCARNATIONS_KEY = "gradserver/incarnations"
_TOKEN_BYTES = 32


class EmbeddedCoordinator:
    """A `gradserver coordinator` child process for one process group on `host` (any free port),
    requiring `auth_token` when one is given; stopped by `stop()` or at exit, and by itself when
    this process exits (`--exit-with-parent`)."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float,
        start_timeout_s: float = 60.0,
        settings: RankSettings | None = None,
        *,
        host: str = LOOPBACK,
        auth_token: str = "",
    ) -> None:
        log_level = (settings or rank_settings()).log_level
        self._dir = tempfile.TemporaryDirectory(prefix="gradserver-pg-")
        port_file = Path(self._dir.name) / "port"
        command = coordinator_command(
            world_size,
            port_file,
            # The last --bind wins: the helper's own is loopback.
            "--bind",
            address_of(host, 0),
            "--join-timeout",
            f"{timeout_s:g}",
            "--step-timeout",
            f"{timeout_s:g}",
            "--log-level",
            log_level,
            # It must not outlive this rank, SIGKILL included.
            "--exit-with-parent",
        )
        # The token goes in the child's environment: a command line is visible to every user.
        env = {env_name("auth_token"): auth_token} if auth_token else None
        # Its output is this rank's own (no sink): its log lines appear where the rank's do.
        self._child = Child(command, "embedded coordinator", None, env=env)
        self._process = self._child.proc
        self._cleaned = False
        atexit.register(self.stop)
        try:
            port = wait_for_port(self._process, port_file, start_timeout_s)
        except BaseException:
            self.stop()
            raise
        finally:
            # The port file is only the readiness handshake: gone now, nothing is left behind
            # even if this rank is SIGKILLed later.
            self._dir.cleanup()
        if port is None:
            self.stop()
            raise UnavailableError(
                f"the embedded gradserver coordinator exited with status {self._process.returncode} "
                f"before it listened on {host} (its log is above)"
            )
        self.address = address_of(host, port)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the child (SIGTERM, then SIGKILL after `timeout_s`) and removes what it could not
        (its shared-memory socket directory, when it was SIGKILLed). Safe to call more than once."""
        stop([self._child], timeout_s)
        self._dir.cleanup()
        if not self._cleaned:
            self._cleaned = True
            remove_shm_dirs(self._process.pid)


@dataclasses.dataclass(frozen=True)
class Membership:
    """The coordinator a rank joins: its address, the token it requires, whether it is the
    external one (GRADSERVER_COORDINATOR, which may serve TLS; an embedded one never does), and
    the embedded coordinator this rank started (its group's rank 0 only)."""

    address: str
    auth_token: str = dataclasses.field(repr=False)
    external: bool = False
    embedded: EmbeddedCoordinator | None = None


def coordinator_for(
    store: Store,
    rank: int,
    world_size: int,
    timeout_s: float,
    settings: RankSettings | None = None,
    *,
    default_group: bool = True,
) -> Membership:
    """The coordinator of a group of `world_size` that this process joins as `rank`: the one
    GRADSERVER_COORDINATOR names for the default group, else an embedded one (started here when
    `rank` is 0, else read from `store`, waiting up to the Store's timeout)."""
    settings = settings or rank_settings()
    external = settings.coordinator.strip()
    if external and default_group:
        return Membership(external, settings.auth_token, external=True)
    store = _Incarnation.of(store, world_size)
    if rank != 0:
        publish_identity(store, rank)
        # Store.get waits until rank 0 has published the address.
        address = store.get(STORE_KEY).decode()
        return Membership(address, store.get(TOKEN_KEY).decode())
    host = listen_host(store, world_size)
    token = secrets.token_hex(_TOKEN_BYTES)
    embedded = EmbeddedCoordinator(world_size, timeout_s, settings=settings, host=host, auth_token=token)
    store.set(TOKEN_KEY, token)
    store.set(STORE_KEY, embedded.address)
    return Membership(embedded.address, token, embedded=embedded)


class _Incarnation:
    """The keys of one incarnation of a group in its Store: each under a suffix of its own."""

    def __init__(self, store: Store, number: int) -> None:
        self._store = store
        self._suffix = f"@{number}"

    @classmethod
    def of(cls, store: Store, world_size: int) -> _Incarnation:
        """This rank's incarnation of the group: every rank counts itself in, and the count's
        `world_size`-th part is the incarnation's number. A rank reaches the next incarnation
        only after this one's Join returned, which it does once every rank joined, so every
        rank counted itself in this one first."""
        return cls(store, (store.add(INCARNATIONS_KEY, 1) - 1) // world_size)

    def set(self, key: str, value: str) -> None:
        self._store.set(key + self._suffix, value)

    def get(self, key: str) -> bytes:
        return self._store.get(key + self._suffix)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key + self._suffix, value)
