"""Shared-memory pieces both sides of the same-host fast path use (docs/PROTOCOL.md, "Shared memory").

Memory has no name: arenas are `memfd_create` files, passed as file descriptors over an AF_UNIX
socket, so nothing appears in /dev/shm and the kernel frees an arena when its last holder exits,
SIGKILL included. Every arena is sealed against shrinking and growing before it is passed: a peer
that could shrink it would make the other side's reads fault (SIGBUS). Whoever receives an arena
maps it read-only; the output arena's fd is passed as an O_RDONLY descriptor, which cannot be
mapped writable at all.

The handshake on the coordinator's socket (fixed-size little-endian frames):
  coordinator -> worker: the 16-byte nonce announced in JoinResponse.shm_nonce
  worker -> coordinator: worker_id u32, session_id u64, member_token u64, + the input arena's fd
  coordinator -> worker: status u8 (0 ok), message length u16, UTF-8 message, + when ok the output
                         arena's read-only fd and, when the coordinator offers the collective lane
                         (common/lane.py), a read-write fd of the lane's arena
After it, the worker sends u64 byte offsets of output slots it has finished reading (releases).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import socket
import stat
import struct

NONCE_BYTES = 16
HELLO = struct.Struct("<IQQ")
REPLY = struct.Struct("<BH")
RELEASE = struct.Struct("<Q")
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# The coordinator's socket lives alone in a 0700 directory of this name in the temp dir, followed
# by the coordinator's pid (`socket_dir_prefix`), so that what a dead one left can be told at once.
SOCKET_DIR_PREFIX = "gradserver-shm-"
# Short: a socket's whole path must fit in 107 bytes, and the directory's name carries a pid.
SOCKET_NAME = "sock"


def round_up(value: int, to: int) -> int:
    """`value` rounded up to a multiple of `to` (layouts of the shared arenas)."""
    return -(-value // to) * to


def supported() -> bool:
    """Whether this platform has what the path needs (Linux memfd and fd passing)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(socket, "SO_PEERCRED")


def host_id() -> str:
    """What processes that can share memory through this module have in common: the machine (its
    boot id), the network namespace (abstract Unix sockets are per namespace) and the user (SO_PEERCRED
    checks hand memory only to the same user). Two processes with equal ids reach each other's
    abstract sockets and may pass arenas; "" where this platform cannot."""
    if not supported():
        return ""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            machine = boot.read().strip()
        namespace = os.readlink("/proc/self/ns/net")
    except OSError:
        return ""
    return f"{machine} {namespace} uid={os.getuid()}"


def socket_dir_prefix(pid: int) -> str:
    """The name prefix of the socket directory of the coordinator with process id `pid`."""
    return f"{SOCKET_DIR_PREFIX}{pid}-"


def socket_dir_pid(name: str) -> int | None:
    """The coordinator pid a socket directory's name carries; None for any other name, and for
    the names of older versions (a random suffix, no pid)."""
    if not name.startswith(SOCKET_DIR_PREFIX):
        return None
    pid, dash, _ = name[len(SOCKET_DIR_PREFIX) :].partition("-")
    return int(pid) if dash and pid.isdigit() else None


def remove_dirs_of(pid: int, parent: str) -> list[str]:
    """Removes the socket directories that coordinator `pid` left in `parent` (a SIGKILLed one
    cannot remove its own), once it is gone: only when no process `pid` is alive, and then each
    only as `remove_if_abandoned` would (this uid's, its socket refusing connections: a live
    coordinator of another pid namespace may carry the same number). Returns those removed."""
    if process_alive(pid):
        return []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    prefix = socket_dir_prefix(pid)
    return [
        os.path.join(parent, name)
        for name in names
        if name.startswith(prefix) and remove_if_abandoned(os.path.join(parent, name, SOCKET_NAME))
    ]


def remove_if_abandoned(socket_path: str) -> bool:
    """Removes the socket directory of a coordinator that is gone (a SIGKILLed one cannot remove
    it itself): only a gradserver socket directory of this uid whose socket refuses connections,
    as does any other socket in it (older versions named theirs otherwise). True if it was
    removed. A live coordinator's socket accepts, and its directory is kept."""
    directory = os.path.dirname(socket_path)
    if not os.path.basename(directory).startswith(SOCKET_DIR_PREFIX):
        return False
    try:
        info = os.lstat(directory)
        if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode):
            return False
        with os.scandir(directory) as entries:
            others = [e.path for e in entries if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)]
    except OSError:
        return False
    if any(_may_listen(path) for path in {socket_path, *others}):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return not os.path.exists(directory)


def _may_listen(socket_path: str) -> bool:
    """False only when nobody can listen on `socket_path`: it refuses connections, or is gone."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(socket_path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # cannot tell: kept
    return True


def create_arena(size: int, name: str) -> tuple[int, mmap.mmap]:
    """A sealed anonymous shared-memory file of `size` bytes and a writable mapping of it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def readonly_fd(fd: int) -> int:
    """A new O_RDONLY descriptor of the same file: its holder can map it for reading only."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def map_readonly(fd: int, what: str) -> mmap.mmap:
    """Maps a received arena read-only after checking that its size can no longer change.

    Raises ValueError naming `what` when the file is not a sealed arena."""
    return _map_sealed(fd, what, mmap.PROT_READ)


def map_shared(fd: int, what: str) -> mmap.mmap:
    """Maps a received arena read-write (the collective lane's), after the same checks."""
    return _map_sealed(fd, what, mmap.PROT_READ | mmap.PROT_WRITE)


def _map_sealed(fd: int, what: str, prot: int) -> mmap.mmap:
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError(f"{what} is not a sealable shared-memory file: {exc}") from None
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        raise ValueError(f"{what} is not sealed against resizing (seals {seals:#x})")
    size = os.fstat(fd).st_size
    if size <= 0:
        raise ValueError(f"{what} is empty")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The process id and user id at the other end of a connected AF_UNIX socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def same_network_namespace(pid: int) -> bool:
    """Whether process `pid` shares this process's network namespace. Another one is treated
    as another host (a container, or a test's emulated machine), even when it can reach the
    socket; when it cannot be told, the answer is no."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{os.getpid()}/ns/net")
    except OSError:
        return False


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has). Without /proc it answers
    no; callers confirm by probing before they act on it."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True
    return state not in ("Z", "X")


def recv_exact(sock: socket.socket, size: int, fds: int = 0) -> tuple[bytes, list[int]]:
    """Reads exactly `size` bytes (and up to `fds` descriptors with the first piece); EOF raises
    ConnectionError. The socket's timeout bounds each read."""
    received: list[int] = []
    buf = bytearray()
    try:
        if fds:
            data, received, _flags, _addr = socket.recv_fds(sock, size, fds)
        else:
            data = sock.recv(size)
        while True:
            if not data:
                raise ConnectionError("the peer closed the socket during the handshake")
            buf += data
            if len(buf) >= size:
                break
            data = sock.recv(size - len(buf))
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    return bytes(buf), list(received)


def send_reply(sock: socket.socket, message: str, fds: list[int] | None) -> None:
    """The coordinator's answer to a hello: ok with the output arena's fd (and the lane's), or a
    refusal (no fds)."""
    text = message.encode()[:60000]
    frame = REPLY.pack(0 if fds else 1, len(text)) + text
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


class SlotArena:
    """Fixed-size slots of one arena: which are free. Not thread-safe; callers lock."""

    def __init__(self, size: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.count = size // slot_bytes
        self._free = bytearray(b"\x01") * self.count  # 1: free; searched by bytes.find, in C
        self.free_slots = self.count

    def take(self) -> int | None:
        """The byte offset of a free slot, or None when all are taken."""
        return self.take_run(1)

    def take_run(self, slots: int) -> int | None:
        """The byte offset of `slots` contiguous free slots (first fit), or None."""
        if slots < 1 or slots > self.free_slots:
            return None
        first = self._free.find(b"\x01" * slots)
        if first < 0:
            return None
        self._free[first : first + slots] = bytes(slots)
        self.free_slots -= slots
        return first * self.slot_bytes

    def free(self, offset: int, slots: int = 1) -> None:
        first = offset // self.slot_bytes
        if first < 0 or first + slots > self.count:
            raise IndexError(f"slots {first}..{first + slots - 1} of an arena of {self.count}")
        run = self._free[first : first + slots]
        self.free_slots += len(run) - run.count(1)
        self._free[first : first + slots] = b"\x01" * slots
