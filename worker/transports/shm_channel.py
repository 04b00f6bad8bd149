"""The worker's side of the same-host fast path (docs/PROTOCOL.md, "Shared memory").

`ShmChannel.open` connects to the Unix socket the coordinator announced at Join, checks the nonce
the coordinator sends first (only the coordinator that answered this worker's Join knows it),
presents the worker id and member token, and passes this worker's sealed input arena; it gets a
read-only descriptor of the coordinator's output arena back and maps it read-only.

Input arena: pages of at most 1 MiB, taken in runs: a staging slot is a chunk's worth, a
`gradient_buffer` or a result array as many as it needs (so a small buffer does not take a whole
chunk's room when chunks are large). A chunk is copied into a free slot (or, when it already
lies in a gradient buffer, referenced where it is) and only then named to the coordinator, so a
worker killed while writing never references partial data. A slot is reused once the chunk's
average (or an error that voids it) arrived: by then the coordinator has dropped its view of it.
When no slot frees up within a short wait, the chunk goes inline over gRPC instead, so
mismatched key orders across workers cannot deadlock on a full arena.

Output arena: averages are read where the coordinator wrote them; the worker copies them out and
releases the slot over the Unix socket (never through the gRPC stream, whose back-pressure must
not hold releases back).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
import time
import weakref

import numpy as np

from gradserver.common import lane, shm
from gradserver.common.errors import InternalError, PermissionDeniedError, UnavailableError
from gradserver.common.messages import JoinAccepted, ShmRef, TensorKey

from .lane import LaneClient

log = logging.getLogger("gradserver.worker.shm")

_F32 = np.dtype("<f4")
# How long a chunk waits for a free input slot before it goes inline instead: long enough to ride
# out the normal turnover of a busy arena, short enough that a stalled arena costs little.
_SLOT_WAIT_S = 2.0
# Slots a result buffer never takes (half the arena, when smaller): what chunks sent from other
# memory are staged in, so results held by the caller cannot push them inline.
_STAGING_RESERVE = 8
# The input arena's allocation unit when chunks are larger.
_PAGE_BYTES = 1 << 20
# A SIGKILLed coordinator closes its sockets a moment before /proc shows it gone (it still runs its
# exit then); on a loaded machine that moment lasts long enough for a single look to call it alive
# and keep its directory for good. A closed socket is worth waiting this long for the process.
_EXIT_WAIT_S = 3.0
_EXIT_POLL_S = 0.02
_CLOSE_JOIN_S = 1.0


class ShmChannel:
    """A registered input arena, the mapped output arena and the socket to the coordinator."""

    def __init__(
        self,
        sock: socket.socket,
        arena_fd: int,
        arena: mmap.mmap,
        out: mmap.mmap,
        slot_bytes: int,
        socket_path: str = "",
        coordinator_pid: int = 0,
        lane: LaneClient | None = None,
    ) -> None:
        self._sock = sock
        # The collective lane, when the coordinator offers it (its mapping is closed with this).
        self.lane = lane
        self._arena_fd = arena_fd
        self._arena = arena
        self._arena_view = np.frombuffer(arena, dtype=np.uint8)
        self._base = int(self._arena_view.__array_interface__["data"][0])
        self._out = out
        self._out_view = np.frombuffer(out, dtype=np.uint8)
        page = min(slot_bytes, _PAGE_BYTES)
        self._pages = shm.SlotArena(len(arena), page)  # a staging slot is `_slot_pages` of them
        self._slot_bytes = slot_bytes
        self._slot_pages = -(-slot_bytes // page)
        self._cond = threading.Condition()
        self._held: dict[tuple[TensorKey, int], int] = {}  # (key, offset) -> slot byte offset
        self._send_lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # wakes a watcher that waits for the coordinator's exit
        # The coordinator writes nothing after the handshake: the socket ends only when it closes
        # the connection or dies. A SIGKILLed coordinator cannot remove its socket directory, so
        # whoever of its workers notices first does.
        self._socket_path = socket_path
        self._coordinator_pid = coordinator_pid
        self._watch = threading.Thread(
            target=self._watch_coordinator, name="gradserver-shm-watch", daemon=True
        )
        self._watch.start()
        self.staged_bytes = 0  # copied into the arena
        self.zero_copy_bytes = 0  # sent from a gradient buffer where it lies

    @classmethod
    def open(cls, accepted: JoinAccepted, arena_bytes: int, timeout: float) -> ShmChannel:
        """Registers with the coordinator; raises UnavailableError (or PermissionDeniedError when
        the coordinator refuses) saying why. Every socket operation is bounded by `timeout`."""
        if not accepted.shm_socket:
            raise UnavailableError("the coordinator offers no shared memory")
        if not shm.supported():
            raise UnavailableError("this platform lacks memfd_create or descriptor passing")
        slot_bytes = accepted.chunk_bytes
        size = max(arena_bytes // slot_bytes, 1) * slot_bytes
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        fd = -1
        try:
            try:
                sock.connect(accepted.shm_socket)
                nonce, _ = shm.recv_exact(sock, shm.NONCE_BYTES)
            except OSError as exc:
                raise UnavailableError(
                    f"cannot reach the coordinator's shared-memory socket {accepted.shm_socket}: {exc!r} "
                    "(another host or container?)"
                ) from None
            if nonce != accepted.shm_nonce:
                raise UnavailableError(
                    f"{accepted.shm_socket} belongs to another coordinator than the one this worker joined"
                )
            fd, arena = shm.create_arena(size, f"gradserver-in-{accepted.worker_id}")
            hello = shm.HELLO.pack(accepted.worker_id, accepted.session_id, accepted.member_token)
            socket.send_fds(sock, [hello], [fd])
            reply, fds = shm.recv_exact(sock, shm.REPLY.size, fds=2)
            try:
                status, length = shm.REPLY.unpack(reply)
                text = shm.recv_exact(sock, length)[0].decode(errors="replace") if length else ""
                if status != 0 or not fds:
                    raise PermissionDeniedError(
                        f"the coordinator refused the shared-memory registration: {text}"
                    )
                out, lane = _map_given(fds, accepted.worker_id)
            finally:
                for given in fds:
                    os.close(given)
            coordinator_pid, _ = shm.peer_credentials(sock)
            return cls(sock, fd, arena, out, slot_bytes, accepted.shm_socket, coordinator_pid, lane)
        except OSError as exc:
            sock.close()
            if fd >= 0:
                os.close(fd)
            raise UnavailableError(f"shared-memory registration failed: {exc!r}") from None
        except BaseException:
            sock.close()
            if fd >= 0:
                os.close(fd)
            raise

    # --- sending ------------------------------------------------------------------------------

    def gradient_buffer(self, num_elements: int) -> np.ndarray | None:
        """A float32 array of `num_elements` in the registered arena (chunks sent from it need no
        copy), or None when no contiguous room is left. Its slots return when it is collected."""
        return self._run(num_elements, keep_free=0)

    def result_buffer(self, num_elements: int) -> np.ndarray | None:
        """A float32 array of `num_elements` in the registered arena for a result (its contents
        unspecified), or None when taking it would leave fewer than `_STAGING_RESERVE` slots
        (or half the arena) for staging. Its slots return when it is collected."""
        reserve = min(_STAGING_RESERVE * self._slot_pages, self._pages.count // 2)
        return self._run(num_elements, keep_free=reserve)

    def _run(self, num_elements: int, *, keep_free: int) -> np.ndarray | None:
        pages = -(-max(num_elements, 1) * 4 // self._pages.slot_bytes)
        with self._cond:
            if self._pages.free_slots - pages < keep_free:
                return None
            offset = self._pages.take_run(pages)
        if offset is None:
            return None
        array = np.frombuffer(memoryview(self._arena)[offset : offset + num_elements * 4], dtype=_F32)
        weakref.finalize(array, self._free_run, offset, pages)
        return array

    def _free_run(self, offset: int, pages: int) -> None:
        with self._cond:
            self._pages.free(offset, pages)
            self._cond.notify_all()

    def stage(
        self, key: TensorKey, offset: int, piece: np.ndarray, *, wait_s: float = _SLOT_WAIT_S
    ) -> ShmRef | None:
        """Where the chunk `piece` (elements from `offset` of `key`) lies in the input arena once
        written there; None when it must go inline (no slot freed up within `wait_s`)."""
        nbytes = piece.nbytes
        where = self.placed(piece)
        if where is not None:
            self.zero_copy_bytes += nbytes
            return ShmRef("in", where, nbytes)
        if nbytes > self._slot_bytes:
            return None
        deadline = time.monotonic() + wait_s
        with self._cond:
            while (slot := self._pages.take_run(self._slot_pages)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._cond.wait(remaining)
            self._held[(key, offset)] = slot
        self._arena_view[slot : slot + nbytes] = piece.view(np.uint8)
        self.staged_bytes += nbytes
        return ShmRef("in", slot, nbytes)

    def placed(self, piece: np.ndarray) -> int | None:
        """The byte offset of `piece` in the input arena when it lies there contiguously (a
        `gradient_buffer` or a slice of one: sent from where it lies), else None."""
        address = int(piece.__array_interface__["data"][0])
        if (
            self._base <= address
            and address + piece.nbytes <= self._base + len(self._arena)
            and piece.flags.c_contiguous
        ):
            return address - self._base
        return None

    def chunk_done(self, key: TensorKey, offset: int) -> None:
        """The coordinator is done with this chunk (averaged, or refused): its slot is free."""
        with self._cond:
            slot = self._held.pop((key, offset), None)
            if slot is not None:
                self._pages.free(slot, self._slot_pages)
                self._cond.notify_all()

    def key_done(self, key: TensorKey) -> None:
        self._free_where(lambda k: k == key)

    def step_done(self, step: int) -> None:
        self._free_where(lambda k: k.step == step)

    def _free_where(self, match: object) -> None:
        with self._cond:
            for held in [h for h in self._held if match(h[0])]:  # type: ignore[operator]
                self._pages.free(self._held.pop(held), self._slot_pages)
            self._cond.notify_all()

    # --- receiving ----------------------------------------------------------------------------

    def average(self, ref: ShmRef) -> np.ndarray:
        """The float32 average the coordinator wrote at `ref` (a read-only view; copy it, then
        `release`). A reference outside the arena is an InternalError."""
        if ref.offset % 4 or ref.length % 4 or ref.offset + ref.length > len(self._out):
            raise InternalError(
                f"coordinator named output bytes [{ref.offset}, {ref.offset + ref.length}) outside "
                f"its {len(self._out)}-byte arena"
            )
        return self._out_view[ref.offset : ref.offset + ref.length].view(_F32)

    def own_average(self, ref: ShmRef) -> np.ndarray:
        """The float32 average the coordinator wrote over this worker's own "inout" chunk at
        `ref` (a view of the input arena; nothing to release). Outside it: InternalError."""
        if ref.offset % 4 or ref.length % 4 or ref.offset + ref.length > len(self._arena):
            raise InternalError(
                f"coordinator named input bytes [{ref.offset}, {ref.offset + ref.length}) outside "
                f"this worker's {len(self._arena)}-byte arena"
            )
        return self._arena_view[ref.offset : ref.offset + ref.length].view(_F32)

    def result_bytes(self, ref: ShmRef) -> np.ndarray:
        """The raw bytes of a byte-moving collective's result the coordinator wrote at `ref` (a
        read-only uint8 view; copy it, then `release`). Outside the arena: InternalError."""
        if ref.offset + ref.length > len(self._out):
            raise InternalError(
                f"coordinator named output bytes [{ref.offset}, {ref.offset + ref.length}) outside "
                f"its {len(self._out)}-byte arena"
            )
        return self._out_view[ref.offset : ref.offset + ref.length]

    def release(self, ref: ShmRef) -> None:
        """Tells the coordinator this worker is done with an output slot. A failure means the
        coordinator is gone, which the gRPC stream reports; nothing to do here."""
        with self._send_lock, contextlib.suppress(OSError):
            if not self._closed:
                self._sock.sendall(shm.RELEASE.pack(ref.offset))

    def _watch_coordinator(self) -> None:
        while True:
            try:
                if not self._sock.recv(4096):
                    break  # the coordinator closed it, or died
            except TimeoutError:
                continue  # the socket's own timeout: nothing to read, keep watching
            except ConnectionError:
                break  # reset: the coordinator died with releases it had not read
            except OSError:
                return  # closed by this side
        if not self._closed:
            self._remove_if_abandoned(_EXIT_WAIT_S)

    def coordinator_lost(self) -> None:
        """The gRPC stream says the coordinator is gone: remove its socket directory if so, before
        the caller hears of it (a process that exits on that error may never run the watcher)."""
        self._remove_if_abandoned(_EXIT_WAIT_S if self._coordinator_closed() else 0.0)

    def _remove_if_abandoned(self, wait_s: float = 0.0) -> None:
        # A live coordinator (the common case: it only dropped this worker, or the network did)
        # keeps its directory, and is not even probed.
        if not self._socket_path or (self._coordinator_pid and not self._coordinator_gone(wait_s)):
            return
        if shm.remove_if_abandoned(self._socket_path):
            log.info("removed %s, left by a coordinator that is gone", os.path.dirname(self._socket_path))

    def _coordinator_gone(self, wait_s: float) -> bool:
        """Whether the coordinator's process is gone, or goes within `wait_s` (looked at every few
        ms; given up early once this side closes, so no thread outlives the client for long)."""
        if self._coordinator_pid == os.getpid():
            return False  # a coordinator in this very process (tests, embedding) lives on
        deadline = time.monotonic() + wait_s
        directory = os.path.dirname(self._socket_path)
        while shm.process_alive(self._coordinator_pid):
            left = deadline - time.monotonic()
            # A coordinator that stops gracefully removes its directory itself: nothing to wait for.
            if left <= 0 or not os.path.isdir(directory) or self._closing.wait(min(left, _EXIT_POLL_S)):
                return False
        return True

    def _coordinator_closed(self) -> bool:
        """Whether the coordinator closed its end (an EOF is waiting), without blocking."""
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True  # reset, or already closed: a probe decides

    def close(self) -> None:
        # Checked before this side closes: the watcher may not have run since the coordinator died.
        gone = self._coordinator_closed()
        self._closing.set()
        with self._send_lock:
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher
            self._sock.close()
        with self._cond:
            self._held.clear()
            self._cond.notify_all()
        if gone:
            self._remove_if_abandoned()
        if self._watch is not threading.current_thread():
            self._watch.join(_CLOSE_JOIN_S)  # it holds this channel, and so its mappings
        os.close(self._arena_fd)
        # Mappings still viewed by arrays (gradient buffers, results) are unmapped when those go.
        mappings = [self._arena, self._out]
        if self.lane is not None:
            self.lane.memory.close()
            mappings.append(self.lane.memory.mapping)
        for mapping in mappings:
            with contextlib.suppress(BufferError):
                mapping.close()


def _map_given(fds: list[int], worker_id: int) -> tuple[mmap.mmap, LaneClient | None]:
    """Maps what the coordinator's reply passed: its output arena (read-only) and, when it offers
    the collective lane, the lane's arena (read-write). A descriptor that is not what it should
    be is an InternalError (the registration fails, and the worker falls back to gRPC)."""
    mapped: list[mmap.mmap] = []
    try:
        mapped.append(shm.map_readonly(fds[0], "the coordinator's output arena"))
        if len(fds) < 2:
            return mapped[0], None
        mapped.append(shm.map_shared(fds[1], "the coordinator's collective lane"))
        return mapped[0], LaneClient(lane.LaneMemory.attach(mapped[1]), worker_id)
    except ValueError as exc:
        for mapping in mapped:
            mapping.close()
        raise InternalError(str(exc)) from None
