"""Handing one sealed memfd arena to the members of a group on one host (a host group's arena,
a host's point-to-point mailboxes).

The group's first member creates the arena and serves it on an abstract Unix socket named after
the group's key, which only the group's members learned from the coordinator: a member connects,
the socket's peer must be its own user (SO_PEERCRED), it says the key and its worker id, and it
receives the arena's descriptor. Nothing has a name in /dev/shm, and the kernel frees the arena
with its last holder. Every such arena has a state word (`ArenaState`): the first member says
OPEN once every member attached, FAILED when one did not in time (`serve_then_open`), and each
other member waits for that verdict (`await_verdict`), so the group decides as one.
"""

from __future__ import annotations

import enum
import mmap
import os
import socket
import struct
import time
from typing import Protocol

from gradserver.common import shm
from gradserver.common.errors import UnavailableError

_HELLO = struct.Struct("<16sI")
_CONNECT_RETRY_S = 0.05


class FormingError(Exception):
    """The group's arena could not be shared; the message says why."""


class ArenaState(enum.IntEnum):
    FORMING = 0
    OPEN = 1
    FAILED = 2


class SharedArena(Protocol):
    """What deciding as one needs of a member's mapping of its group's arena."""

    @property
    def state(self) -> ArenaState: ...

    def set_state(self, state: ArenaState) -> None:
        """Writes the state word and wakes every member."""
        ...

    def bell(self) -> int: ...

    def sleep(self, seen: int, timeout_s: float) -> None: ...

    def close(self) -> None: ...


def serve_then_open(
    arena: SharedArena, group: tuple[int, ...], key: bytes, fd: int, name: bytes, timeout_s: float
) -> None:
    """The first member's side: serves `fd` (closed here) until every member received it, then
    says OPEN; on any failure says FAILED (the others stop waiting), closes `arena` and raises."""
    try:
        serve(group, key, fd, name, timeout_s)
        arena.set_state(ArenaState.OPEN)
    except BaseException:
        arena.set_state(ArenaState.FAILED)
        arena.close()
        raise
    finally:
        os.close(fd)


def await_verdict(arena: SharedArena, worker: int, first: int, what: str, timeout_s: float) -> None:
    """A member that attached (`worker`): returns once `first` said OPEN; closes `arena` and
    raises `FormingError` when it said FAILED, `UnavailableError` when it said nothing within
    twice `timeout_s` (this member cannot know what the group decided)."""
    verdict_by = time.monotonic() + 2 * timeout_s
    while (state := arena.state) is ArenaState.FORMING:
        remaining = verdict_by - time.monotonic()
        if remaining <= 0:
            arena.close()
            raise UnavailableError(
                f"worker {worker} attached to {what}, but worker {first} said neither open nor failed "
                f"within {2 * timeout_s:g} s"
            )
        seen = arena.bell()
        if arena.state is ArenaState.FORMING:
            arena.sleep(seen, min(remaining, 0.5))
    if state is not ArenaState.OPEN:
        arena.close()
        raise FormingError(f"worker {first} gave up forming {what} (a member did not attach in time)")


def create(size: int, label: str) -> tuple[int, mmap.mmap]:
    """A new sealed arena of `size` bytes (its descriptor and this process's mapping)."""
    try:
        return shm.create_arena(size, label)
    except OSError as exc:
        raise FormingError(f"cannot create its shared memory: {exc}") from None


def serve(group: tuple[int, ...], key: bytes, fd: int, name: bytes, timeout_s: float) -> None:
    """Serves arena `fd` on socket `name` until every member of `group` after the first one
    received it; raises `FormingError` when the socket is taken or a member did not come in time."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            listener.bind(name)
        except OSError as exc:
            raise FormingError(f"its socket is taken ({exc})") from None
        listener.listen(len(group))
        deadline = time.monotonic() + timeout_s
        waiting = set(group[1:])
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FormingError(f"worker(s) {sorted(waiting)} did not attach within {timeout_s:g} s")
            listener.settimeout(remaining)
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                member = _admit(conn, group, key, fd, remaining)
            if member is not None:
                waiting.discard(member)
    finally:
        listener.close()


def _admit(conn: socket.socket, group: tuple[int, ...], key: bytes, fd: int, timeout_s: float) -> int | None:
    """One member's hello: the same user, the group's key and a member's id get the arena."""
    conn.settimeout(min(timeout_s, 5.0))
    try:
        _pid, uid = shm.peer_credentials(conn)
        hello, _ = shm.recv_exact(conn, _HELLO.size)
        told, worker = _HELLO.unpack(hello)
        if uid != os.getuid() or told != key or worker not in group[1:]:
            shm.send_reply(conn, "not a member of this group", None)
            return None
        shm.send_reply(conn, "ok", [fd])
        return int(worker)
    except (OSError, ConnectionError, struct.error):
        return None


def receive(worker: int, key: bytes, name: bytes, timeout_s: float) -> mmap.mmap:
    """Connects to the first member's socket `name` (retrying until it listens, for up to
    `timeout_s`) as `worker` and maps the arena it hands out."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise FormingError(f"its first member's socket did not answer within {timeout_s:g} s")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(min(remaining, 5.0))
        try:
            sock.connect(name)
            _pid, uid = shm.peer_credentials(sock)
            if uid != os.getuid():
                raise FormingError(f"its socket belongs to user {uid}, not to this one")
            sock.sendall(_HELLO.pack(key, worker))
            reply, fds = shm.recv_exact(sock, shm.REPLY.size, fds=1)
            status, length = shm.REPLY.unpack(reply)
            text, _ = shm.recv_exact(sock, length) if length else (b"", [])
            if status != 0 or not fds:
                for received in fds:
                    os.close(received)
                raise FormingError(f"its first member refused this one: {text.decode(errors='replace')}")
            try:
                return shm.map_shared(fds[0], "the group's shared memory")
            except ValueError as exc:
                raise FormingError(str(exc)) from None
            finally:
                for received in fds:
                    os.close(received)
        except (ConnectionRefusedError, FileNotFoundError):
            time.sleep(_CONNECT_RETRY_S)
        except (OSError, ConnectionError) as exc:
            raise FormingError(f"its first member's socket failed: {exc}") from None
        finally:
            sock.close()
