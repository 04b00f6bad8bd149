"""Where a process group's coordinator is: GRADSERVER_COORDINATOR, or one that rank 0 starts.

The embedded coordinator is the `gradserver coordinator` command in a child process of rank 0
(so its event loop never competes with training for rank 0's GIL, and the client library stays
independent of the server package), bound to 127.0.0.1 port 0. Rank 0 publishes its address in
the torch Store that `init_process_group` set up; the other ranks read it from there. The child
watches its parent (`--exit-with-parent`), so a SIGKILLed rank 0 leaves no coordinator behind, and
the port file's directory goes as soon as the port is read; `stop` removes the shared-memory socket
directory of a child that was SIGKILLed.
"""

from __future__ import annotations

import atexit
import tempfile
from pathlib import Path
from typing import Protocol

from gradserver.common.errors import UnavailableError
from gradserver.worker.local_coordinator import coordinator_command, remove_shm_dirs
from gradserver.worker.supervisor import Child, stop, wait_for_port

from ._settings import RankSettings, rank_settings

STORE_KEY = "gradserver/coordinator"


class Store(Protocol):
    """What the backend uses of a torch.distributed Store."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...


class EmbeddedCoordinator:
    """A `gradserver coordinator` child process for one process group, stopped by `stop()` or at
    exit; it stops by itself when this process exits (`--exit-with-parent`)."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float,
        start_timeout_s: float = 60.0,
        settings: RankSettings | None = None,
    ) -> None:
        log_level = (settings or rank_settings()).log_level
        self._dir = tempfile.TemporaryDirectory(prefix="gradserver-pg-")
        port_file = Path(self._dir.name) / "port"
        command = coordinator_command(
            world_size,
            port_file,
            "--join-timeout",
            f"{timeout_s:g}",
            "--step-timeout",
            f"{timeout_s:g}",
            "--log-level",
            log_level,
            # It must not outlive this rank, SIGKILL included.
            "--exit-with-parent",
        )
        # Its output is this rank's own (no sink): its log lines appear where the rank's do.
        self._child = Child(command, "embedded coordinator", None)
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
                "before it listened (its log is above)"
            )
        self.address = f"127.0.0.1:{port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the child (SIGTERM, then SIGKILL after `timeout_s`) and removes what it could not
        (its shared-memory socket directory, when it was SIGKILLed). Safe to call more than once."""
        stop([self._child], timeout_s)
        self._dir.cleanup()
        if not self._cleaned:
            self._cleaned = True
            remove_shm_dirs(self._process.pid)


def coordinator_for(
    store: Store, rank: int, world_size: int, timeout_s: float, settings: RankSettings | None = None
) -> tuple[str, EmbeddedCoordinator | None]:
    """The address to join, and the coordinator this rank started (rank 0 without
    GRADSERVER_COORDINATOR) or None."""
    settings = settings or rank_settings()
    external = settings.coordinator.strip()
    if external:
        return external, None
    if rank == 0:
        embedded = EmbeddedCoordinator(world_size, timeout_s, settings=settings)
        store.set(STORE_KEY, embedded.address)
        return embedded.address, embedded
    # Store.get waits (up to the store's timeout) until rank 0 has published the address.
    return store.get(STORE_KEY).decode(), None
