"""The coordinator's side of the same-host fast path: its Unix socket, the workers' input arenas
and the output arena (docs/PROTOCOL.md and docs/ARCHITECTURE.md, "Shared memory").

`ShmHub.start` makes a 0700 directory (gradserver-shm-PID-*, so what a SIGKILLed coordinator left
is known as such) with a listening AF_UNIX socket and a random nonce; both go to every joiner in
JoinResponse. A worker that reaches the socket proves it is on this host and can open this
directory; the nonce (sent first) proves to the worker that it reached the coordinator that
answered its Join; SO_PEERCRED's uid and the member token from Join prove who
the worker is. The worker passes its sealed input arena, and gets a read-only descriptor of the
output arena.

Chunks then name byte ranges of the sender's input arena (`resolve` turns them into read-only
views for the reduction table) and averages are written once into a slot of the output arena and
named to every shared-memory recipient (`publish`). When every contributor named its chunk
"inout" (it wants the average over it: `into=` the buffer it sent), the average is written over
the contributors' own chunks instead (`in_place`), the only write into an input arena, and
nothing is copied out. A slot is reused only when every recipient released it (over the Unix
socket) or left; when no slot is free, the average goes inline, so a slow reader never blocks
anyone. A departed worker's arena is never read again: its peer entry goes, and the table holds
copies of whatever of its data it still needs (`copy_held_data`).
`ShmOutbox` and the transport's subscriptions to the coordinator's lifecycle are in
server/shm_transport.py.

Everything here runs on the coordinator's event loop except the blocking handshake reads, which
run in a thread bounded by the handshake timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from gradserver.common import shm
from gradserver.common.averaging import InPlace
from gradserver.common.errors import GradServerError, InvalidArgumentError
from gradserver.common.messages import AveragedChunkOut, ChunkIn, ShmRef

from .lane import Lane
from .membership import Member
from .metrics import CoordinatorMetrics

log = logging.getLogger("gradserver.server.shm")

_DIR_PREFIX = shm.SOCKET_DIR_PREFIX
_STALE_AFTER_S = 60.0  # a directory this old whose socket nobody listens on is a dead one's
# How long a worker that closed its socket has to be heard leaving on its gRPC stream before the
# lane counts it as having stopped using shared memory.
_LANE_DEPARTURE_GRACE_S = 2.0


def remove_stale_dirs(parent: str | None, now: float | None = None) -> list[str]:
    """Removes the socket directories of coordinators that were killed (SIGKILL leaves them, and
    no worker of theirs was there to remove it): ours (same uid), whose socket refuses
    connections, and either named by a pid that is gone or (an older version's name, or a pid
    now alive, perhaps reused) older than a minute (a younger one may not listen yet). Returns
    them."""
    parent = parent or tempfile.gettempdir()
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    return [
        entry.path
        for entry in entries
        if entry.name.startswith(_DIR_PREFIX)
        and _dead_or_old(entry, now)
        and shm.remove_if_abandoned(os.path.join(entry.path, shm.SOCKET_NAME))
    ]


def _dead_or_old(entry: os.DirEntry[str], now: float) -> bool:
    pid = shm.socket_dir_pid(entry.name)
    if pid is not None and not shm.process_alive(pid):
        return True
    try:
        return now - entry.stat(follow_symlinks=False).st_mtime >= _STALE_AFTER_S
    except OSError:
        return False


Authenticate = Callable[[int, int, int], Member]


@dataclasses.dataclass
class _Peer:
    worker_id: int
    token: int
    conn: socket.socket
    arena: mmap.mmap
    view: memoryview  # read-only: what chunks are resolved to
    writable: memoryview  # for averages over "inout" chunks only
    base: int  # the arena's address here
    reader: asyncio.Task[Any] | None = None

    def locate(self, data: bytes | memoryview) -> int | None:
        """The byte offset of `data` in this peer's arena, when it lies there."""
        address = _address(data)
        if self.base <= address and address + len(data) <= self.base + len(self.view):
            return address - self.base
        return None


def _address(data: bytes | memoryview) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).__array_interface__["data"][0])


class ShmHub:
    """The Unix socket, the registered input arenas and the output arena of one coordinator."""

    def __init__(
        self,
        directory: str,
        arena_bytes: int,
        slot_bytes: int,
        handshake_timeout: float,
        authenticate: Authenticate,
        metrics: CoordinatorMetrics,
    ) -> None:
        self._parent = directory or None
        self._metrics = metrics
        # Sized for the largest chunk this coordinator's jobs can have, before any worker joins;
        # `reslot` cuts them to the job's own chunk size once its world is complete.
        self._slots = shm.SlotArena(arena_bytes, slot_bytes)
        self._arena_bytes = self._slots.count * slot_bytes
        self._wanted_slot_bytes = slot_bytes
        self._timeout = handshake_timeout
        self._authenticate = authenticate
        self.nonce = secrets.token_bytes(shm.NONCE_BYTES)
        self.path = ""
        self._dir = ""
        self._listener: socket.socket | None = None
        self._out_fd = -1
        self._out: mmap.mmap | None = None
        self._peers: dict[int, _Peer] = {}
        self._holders: dict[int, set[int]] = {}  # output slot offset -> workers yet to release it
        # Slots handed to the averager to write into (`take`), keyed by the view's id.
        self._reserved: dict[int, tuple[memoryview, int]] = {}
        # "inout" chunks resolved and not yet averaged: (worker, arena offset) -> byte length.
        self._inout: dict[tuple[int, int], int] = {}
        # Averages handed out to be written over their contributors' chunks (`in_place`), keyed
        # by the id of the first target: the target and each contributor's (offset, length).
        self._over_inputs: dict[int, tuple[memoryview, dict[int, tuple[int, int]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # The collective lane, when offered: its arena goes to every worker that registers.
        self.lane: Lane | None = None

    async def start(self) -> None:
        for path in remove_stale_dirs(self._parent):
            log.info("removed %s, left by a coordinator that was killed", path)
        self._dir = tempfile.mkdtemp(prefix=shm.socket_dir_prefix(os.getpid()), dir=self._parent)
        os.chmod(self._dir, 0o700)
        self.path = os.path.join(self._dir, shm.SOCKET_NAME)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._out_fd, self._out = shm.create_arena(self._arena_bytes, "gradserver-out")
        self._spawn(self._accept_loop())
        log.info("shared memory: socket %s, output arena %d MiB", self.path, self._arena_bytes >> 20)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for worker_id in list(self._peers):
            self.worker_gone(worker_id)
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._out_fd >= 0:
            os.close(self._out_fd)
            self._out_fd = -1
        self._reserved.clear()
        self._over_inputs.clear()
        self._inout.clear()
        if self._out is not None:
            # A view still alive (an average being encoded) keeps the mapping until it goes.
            with contextlib.suppress(BufferError):
                self._out.close()
            self._out = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def registered(self, worker_id: int) -> bool:
        return worker_id in self._peers

    @property
    def slot_bytes(self) -> int:
        return self._slots.slot_bytes

    def reslot(self, slot_bytes: int) -> None:
        """Cuts the output arena into slots of `slot_bytes` (the job's chunk size: smaller chunks
        get more slots of the same arena). Done at once when no slot is in use, which is the case
        when a job's world completes (no worker of it has registered yet); else as soon as every
        slot is free again. Until then the slots keep their size: an average larger than a slot
        goes inline, a smaller one fits."""
        self._wanted_slot_bytes = min(slot_bytes, self._arena_bytes)
        self._reslot_when_idle()

    def _reslot_when_idle(self) -> None:
        wanted = self._wanted_slot_bytes
        slots = self._slots
        if wanted == slots.slot_bytes or slots.free_slots != slots.count or self._holders or self._reserved:
            return
        self._slots = shm.SlotArena(self._arena_bytes, wanted)
        log.debug("output arena: %d slots of %d bytes", self._slots.count, wanted)

    # --- data path ------------------------------------------------------------------------------

    def resolve(self, chunk: ChunkIn, member: Member) -> ChunkIn:
        """The chunk with `data` as a read-only view of the sender's arena; raises naming the
        worker, step and key when it has no arena or the range lies outside it."""
        ref = chunk.shm
        assert ref is not None
        w, key = chunk.worker_id, chunk.key
        peer = self._peers.get(w)
        if peer is None or peer.token != member.token:
            raise InvalidArgumentError(
                f"worker {w}, {key}: chunk names shared memory, but worker {w} registered no arena",
                step=key.step,
                key=str(key),
                worker_id=w,
            )
        size = len(peer.view)
        if ref.offset % 4 or ref.offset + ref.length > size:
            raise InvalidArgumentError(
                f"worker {w}, {key}: shared-memory range [{ref.offset}, {ref.offset + ref.length}) "
                f"lies outside its {size}-byte arena or is not 4-byte aligned",
                step=key.step,
                key=str(key),
                worker_id=w,
            )
        if ref.name == "inout":
            self._inout[(w, ref.offset)] = ref.length
        else:
            self._inout.pop((w, ref.offset), None)
        return dataclasses.replace(chunk, data=peer.view[ref.offset : ref.offset + ref.length], shm=None)

    def take(self, nbytes: int) -> memoryview | None:
        """A writable view of a free output slot for the averager to write an average into, so
        that `publish` names it without copying; None when no worker uses shared memory, the
        average is larger than a slot or no slot is free (the averager allocates then)."""
        if not self._peers or self._out is None:
            return None
        self._reslot_when_idle()
        if nbytes > self._slots.slot_bytes:
            return None
        offset = self._slots.take()
        if offset is None:
            return None
        view = memoryview(self._out)[offset : offset + nbytes]
        self._reserved[id(view)] = (view, offset)
        return view

    def in_place(self, contributions: Sequence[bytes | memoryview]) -> InPlace | None:
        """Writable views of the contributions themselves, when every one is a registered
        worker's "inout" chunk (it asked for its average there: `into=` the buffer it sent); the
        average then needs no output slot and its recipients nothing copied out. None otherwise
        (a gRPC worker's chunk, one that asked nothing, one the table copied)."""
        if len(contributions) > len(self._peers):
            return None
        found: list[tuple[int, int, int]] = []
        for data in contributions:
            place = next(((w, o) for w, p in self._peers.items() if (o := p.locate(data)) is not None), None)
            if place is None or self._inout.get(place) != len(data):
                return None
            found.append((*place, len(data)))
        if len({w for w, _, _ in found}) != len(found):
            return None
        targets = tuple(self._peers[w].writable[o : o + n] for w, o, n in found)
        for w, o, _ in found:
            del self._inout[(w, o)]
        self._over_inputs[id(targets[0])] = (targets[0], {w: (o, n) for w, o, n in found})
        return InPlace(targets)

    def give_back(self, view: memoryview) -> None:
        """Frees a slot from `take` that holds no average after all (the step failed), or forgets
        an average `in_place` handed out."""
        over = self._over_inputs.pop(id(view), None)
        if over is not None and over[0] is not view:
            self._over_inputs[id(view)] = over  # another object under a reused id
        entry = self._reserved.pop(id(view), None)
        if entry is not None and entry[0] is view:
            self._slots.free(entry[1])

    def publish(
        self, event: AveragedChunkOut, to: tuple[int, ...]
    ) -> list[tuple[AveragedChunkOut, tuple[int, ...]]]:
        """Splits one average's recipients: shared-memory ones get a reference into an output
        slot holding the bytes (the one the averager wrote into, or a fresh one it is copied
        to), the others (or everyone, when no slot is free) inline."""
        over = self._over_inputs.pop(id(event.data), None)
        if over is not None and over[0] is not event.data:
            self._over_inputs[id(event.data)] = over  # another object under a reused id
            over = None
        if over is not None:
            return self._publish_over_inputs(event, to, over[1])
        readers = tuple(w for w in to if w in self._peers)
        reserved = self._reserved.pop(id(event.data), None)
        if reserved is not None and reserved[0] is not event.data:
            self._reserved[id(event.data)] = reserved  # another object under a reused id
            reserved = None
        if not readers or self._out is None:
            if reserved is not None:
                # Encoded inline before anything else can write the slot (the caller encodes
                # at once, on this thread), so it is free again already.
                self._slots.free(reserved[1])
            return [(event, to)]
        data = memoryview(event.data).cast("B")
        if reserved is not None:
            offset = reserved[1]
            self._metrics.shm_averaged_in_place_bytes.inc(len(data))
        else:
            self._reslot_when_idle()
            free = self._slots.take() if len(data) <= self._slots.slot_bytes else None
            if free is None:
                self._metrics.shm_inline_fallbacks.inc()
                return [(event, to)]
            offset = free
            self._out[offset : offset + len(data)] = data
        self._holders[offset] = set(readers)
        ref = ShmRef("out", offset, len(data))
        out = [(dataclasses.replace(event, data=b"", shm=ref), readers)]
        rest = tuple(w for w in to if w not in self._peers)
        if rest:
            out.append((event, rest))
        return out

    def _publish_over_inputs(
        self, event: AveragedChunkOut, to: tuple[int, ...], places: dict[int, tuple[int, int]]
    ) -> list[tuple[AveragedChunkOut, tuple[int, ...]]]:
        """An average written over its contributors' chunks: each of them is told where it lies
        in its own arena; anyone else (none, unless the recipients changed) gets it as usual,
        copied from the first contributor's arena before anything returns."""
        out: list[tuple[AveragedChunkOut, tuple[int, ...]]] = []
        for w in to:
            if w in places and w in self._peers:
                offset, length = places[w]
                self._metrics.shm_averaged_over_inputs_bytes.inc(length)
                out.append((dataclasses.replace(event, data=b"", shm=ShmRef("in", offset, length)), (w,)))
        rest = tuple(w for w in to if not any(w in t for _, t in out))
        if rest:
            out.extend(self.publish(dataclasses.replace(event, data=bytes(event.data)), rest))
        return out

    def release(self, worker_id: int, offset: int) -> None:
        holders = self._holders.get(offset)
        if holders is None or worker_id not in holders:
            log.warning("worker %d released output offset %d it does not hold; ignored", worker_id, offset)
            return
        holders.discard(worker_id)
        if not holders:
            del self._holders[offset]
            self._slots.free(offset)

    def worker_gone(self, worker_id: int) -> None:
        """Forgets a departed worker: its arena is never read again, its output slots are freed."""
        peer = self._peers.pop(worker_id, None)
        if peer is None:
            return
        for offset in [o for o, h in self._holders.items() if worker_id in h]:
            self.release(worker_id, offset)
        if peer.reader is not None and peer.reader is not asyncio.current_task():
            peer.reader.cancel()
        peer.conn.close()
        for place in [p for p in self._inout if p[0] == worker_id]:
            del self._inout[place]
        peer.view.release()
        peer.writable.release()
        # Views the table still holds keep the mapping alive until they go (never re-read: the
        # table copies a lost worker's data first); the kernel unmaps it then.
        with contextlib.suppress(BufferError):
            peer.arena.close()

    # --- the socket -----------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            self._spawn(self._handshake(conn))

    async def _handshake(self, conn: socket.socket) -> None:
        fds: list[int] = []
        try:
            conn.setblocking(True)
            conn.settimeout(self._timeout)
            hello, fds = await asyncio.to_thread(self._read_hello, conn)
            worker_id, session_id, token = shm.HELLO.unpack(hello)
            if len(fds) != 1:
                raise InvalidArgumentError(f"worker {worker_id} sent {len(fds)} descriptors, expected 1")
            pid, uid = shm.peer_credentials(conn)
            if uid != os.getuid():
                raise InvalidArgumentError(
                    f"the process claiming worker {worker_id} runs as uid {uid}, this coordinator as "
                    f"{os.getuid()}"
                )
            if not shm.same_network_namespace(pid):
                raise InvalidArgumentError(
                    f"worker {worker_id} (pid {pid}) runs in another network namespace, which counts "
                    "as another host: it uses gRPC"
                )
            member = self._authenticate(worker_id, session_id, token)
            try:
                # Writable only for the averages its "inout" chunks ask for.
                arena = shm.map_shared(fds[0], f"worker {worker_id}'s input arena")
            except (ValueError, OSError) as exc:
                raise InvalidArgumentError(str(exc)) from None
            view = memoryview(arena).toreadonly()
            self._register(
                _Peer(worker_id, member.token, conn, arena, view, memoryview(arena), _address(view))
            )
            given = [shm.readonly_fd(self._out_fd)]
            if self.lane is not None:
                given.append(self.lane.shared_fd())
                # Before the reply: the worker opens its Exchange stream as soon as it has it, and
                # the lane closes for a worker streaming unregistered.
                self.lane.registered(worker_id)
            try:
                await asyncio.to_thread(shm.send_reply, conn, "ok", given)
            finally:
                for fd in given:
                    os.close(fd)
            log.info("worker %d uses shared memory (%d MiB input arena)", worker_id, len(arena) >> 20)
            conn.setblocking(False)
            peer = self._peers.get(worker_id)
            if peer is not None and peer.conn is conn:
                peer.reader = asyncio.current_task()
                await self._read_releases(peer)
        except (GradServerError, OSError, ConnectionError) as exc:
            text = exc.message if isinstance(exc, GradServerError) else repr(exc)
            log.warning("refused a shared-memory registration: %s", text)
            stale = [w for w, p in self._peers.items() if p.conn is conn]
            for worker_id in stale:
                self.worker_gone(worker_id)
                if self.lane is not None:
                    self.lane.stopped_using(worker_id, None)
            with contextlib.suppress(OSError):
                conn.settimeout(self._timeout)
                await asyncio.to_thread(shm.send_reply, conn, text, None)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _read_hello(self, conn: socket.socket) -> tuple[bytes, list[int]]:
        conn.sendall(self.nonce)
        return shm.recv_exact(conn, shm.HELLO.size, fds=1)

    def _register(self, peer: _Peer) -> None:
        if peer.worker_id in self._peers:
            self.worker_gone(peer.worker_id)  # a rejoined member replaces its predecessor
        self._peers[peer.worker_id] = peer

    def _lane_socket_closed(self, worker_id: int) -> None:
        """A worker closed its socket: it is leaving (or died), and its departure, heard on its
        gRPC stream a moment later, fails the lane with the reason that departure gives. A
        worker that stays a member without its socket has given up on shared memory, so no
        longer uses the lane: that is checked after a grace period."""
        lane = self.lane
        assert lane is not None
        registration = lane.socket_closed(worker_id)
        if registration is not None:
            asyncio.get_running_loop().call_later(
                _LANE_DEPARTURE_GRACE_S, lane.stopped_using, worker_id, registration
            )

    async def _read_releases(self, peer: _Peer) -> None:
        loop = asyncio.get_running_loop()
        pending = b""
        while True:
            data = await loop.sock_recv(peer.conn, 64 * 1024)
            if not data:
                # The worker closed it (it exits, or gave up on shared memory after all): nothing
                # more is named in its arena, and averages go to it inline from now on.
                if self._peers.get(peer.worker_id) is peer:
                    log.info("worker %d closed its shared-memory socket", peer.worker_id)
                    self.worker_gone(peer.worker_id)
                    if self.lane is not None:
                        self._lane_socket_closed(peer.worker_id)
                return
            pending += data
            whole = len(pending) - len(pending) % shm.RELEASE.size
            for (offset,) in shm.RELEASE.iter_unpack(pending[:whole]):
                if self._peers.get(peer.worker_id) is not peer:
                    return
                self.release(peer.worker_id, offset)
            pending = pending[whole:]
