"""The point-to-point mailboxes of the workers of one host (docs/PROTOCOL.md "Point-to-point"):
one shared arena holding a byte ring for every ordered pair of them, and a bell per worker.

Forming: as a host group's arena (worker/transports/arena_sharing.py): the first of the host's
peers (`JoinAccepted.host_peers`) creates it and hands it to the others, who learned its key from
the coordinator; once all attached it says OPEN, else FAILED, and then every one of them sends to
the others through the coordinator instead, so they decide as one.

Layout (little-endian; words written by one side each, published by a counter written last: on
x86-64 stores are seen in program order, as the collective lane relies on too):
  header (4096 bytes): magic, version, members, ring capacity, state (FORMING, OPEN, FAILED)
  a control block per member (128 bytes): `attached`; in its second cache line its `bell` (a
      futex word it sleeps on, written by whoever has news for it)
  a ring per ordered pair (sender s, receiver r) at index s * members + r, each a page of words
      (`head`: bytes ever written, by s; `waiting`: s sleeps for room; in another cache line
      `tail`: bytes ever read, by r) and then `capacity` bytes of data
A message is a frame in its ring's byte stream: tag (i64), length (u64), the bytes, padding to 8.
A sender writes what fits and rings the receiver; a receiver reads what is there (a message larger
than the ring streams through it while both run) and rings the sender if it waits for room.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import struct

import numpy as np

from gradserver.common.futex import Bells
from gradserver.common.shm import round_up

from . import arena_sharing as sharing
from .arena_sharing import ArenaState, FormingError

log = logging.getLogger("gradserver.worker")

MAGIC = 0x47535032  # "GSP2"
VERSION = 1
_HEADER = 4096
_CONTROL = 128
_PAGE = mmap.PAGESIZE
_RING_WORDS = 4096  # a ring's header: head at byte 0, waiting at 64, tail at 128
_W_MAGIC, _W_VERSION, _W_MEMBERS, _W_CAPACITY, _W_STATE = range(5)
_C_ATTACHED, _C_BELL = 0, 16  # words within a control block
_R_HEAD, _R_WAITING, _R_TAIL = 0, 16, 32  # 32-bit word indexes within a ring's header
FRAME = struct.Struct("<qQ")
_SOCKET_PREFIX = b"\0gradserver-p2p-"
# Ring capacity: large enough that a 1 MiB message is written in one go, small enough that the
# arena of many workers stays modest (pages are only allocated when a pair talks).
_MAX_CAPACITY = 4 * 2**20
_MIN_CAPACITY = 256 * 2**10
_ARENA_BUDGET = 256 * 2**20


def capacity_for(members: int) -> int:
    """Each ring's data bytes for a host of `members` peers."""
    share = _ARENA_BUDGET // max(1, members * (members - 1))
    return max(_MIN_CAPACITY, min(_MAX_CAPACITY, share // _PAGE * _PAGE))


def padded(nbytes: int) -> int:
    """A message's bytes in its frame, padding included."""
    return round_up(nbytes, 8)


def _rings_start(members: int) -> int:
    """Where the first ring lies: the page after the header and the control blocks."""
    return round_up(_HEADER + members * _CONTROL, _PAGE)


class PeerRings:
    """One member's mapping of its host's mailboxes."""

    def __init__(self, mapping: mmap.mmap, peers: tuple[int, ...], position: int, capacity: int) -> None:
        self.mapping = mapping
        self.peers = peers
        self.position = position
        self.capacity = capacity
        n = len(peers)
        self._stride = _RING_WORDS + capacity
        self.bytes = np.frombuffer(mapping, dtype=np.uint8)
        self.words = np.frombuffer(mapping, dtype=np.uint32)
        self._wide = np.frombuffer(mapping, dtype=np.uint64)
        self._rings_start = _rings_start(n)
        self._bells = Bells(self.words, self._bell_index, position)

    @staticmethod
    def size(members: int, capacity: int) -> int:
        return _rings_start(members) + members * members * (_RING_WORDS + capacity)

    # --- where things lie ----------------------------------------------------------------------

    def _ring_offset(self, sender: int, receiver: int) -> int:
        return self._rings_start + (sender * len(self.peers) + receiver) * self._stride

    def _word(self, sender: int, receiver: int, word: int) -> int:
        return self._ring_offset(sender, receiver) // 4 + word

    # --- state and bells -----------------------------------------------------------------------

    @property
    def state(self) -> ArenaState:
        return ArenaState(int(self.words[_W_STATE]))

    def set_state(self, state: ArenaState) -> None:
        self.words[_W_STATE] = int(state)
        for member in range(len(self.peers)):
            self.ring(member)

    def _bell_index(self, member: int) -> int:
        return (_HEADER + member * _CONTROL) // 4 + _C_BELL

    def bell(self) -> int:
        """This member's bell: read it before looking for what it waits for, then `sleep`."""
        return self._bells.value()

    def ring(self, member: int) -> None:
        """Tells `member` that something it may wait for changed (common.futex.Bells)."""
        self._bells.ring(member)

    def sleep(self, seen: int, timeout_s: float) -> None:
        """Sleeps while this member's bell still reads `seen`, at most `timeout_s`."""
        self._bells.sleep(seen, timeout_s)

    def mark_attached(self) -> None:
        self.words[(_HEADER + self.position * _CONTROL) // 4 + _C_ATTACHED] = 1
        self.ring(0)

    # --- a sender's side -----------------------------------------------------------------------

    def write(self, receiver: int, frame: bytes, data: np.ndarray, written: int) -> int:
        """Writes what fits of message `frame` + `data` (+ padding) to `receiver` (a position),
        from byte `written` of it; returns the bytes written by now. Rings the receiver when it
        wrote anything."""
        me, cap = self.position, self.capacity
        head_i = self._word(me, receiver, _R_HEAD) // 2
        head = int(self._wide[head_i])
        tail = int(self._wide[self._word(me, receiver, _R_TAIL) // 2])
        room = cap - (head - tail)
        total = FRAME.size + padded(data.size)
        start = written
        data_at = self._ring_offset(me, receiver) + _RING_WORDS
        while room > 0 and written < total:
            if written < FRAME.size:
                piece = np.frombuffer(frame, np.uint8)[written : written + room]
            elif written < FRAME.size + data.size:
                piece = data[written - FRAME.size : written - FRAME.size + room]
            else:
                piece = np.zeros(min(room, total - written), np.uint8)
            self._copy_in(data_at, head, piece)
            head += piece.size
            written += piece.size
            room -= piece.size
        if written != start:
            self._wide[head_i] = head
            self.ring(receiver)
        return written

    def _copy_in(self, data_at: int, head: int, piece: np.ndarray) -> None:
        at = head % self.capacity
        first = min(piece.size, self.capacity - at)
        self.bytes[data_at + at : data_at + at + first] = piece[:first]
        if first < piece.size:
            self.bytes[data_at : data_at + piece.size - first] = piece[first:]

    def want_room(self, receiver: int, waiting: bool) -> None:
        """Says (or unsays) that this member sleeps until `receiver` makes room in its ring."""
        self.words[self._word(self.position, receiver, _R_WAITING)] = int(waiting)

    # --- a receiver's side ---------------------------------------------------------------------

    def available(self, sender: int) -> int:
        """Bytes of `sender`'s (a position) ring written and not read yet."""
        me = self.position
        head = int(self._wide[self._word(sender, me, _R_HEAD) // 2])
        return head - int(self._wide[self._word(sender, me, _R_TAIL) // 2])

    def peek_frame(self, sender: int) -> tuple[int, int] | None:
        """The (tag, length) of the next message from `sender`, if its frame header is there."""
        if self.available(sender) < FRAME.size:
            return None
        out = np.empty(FRAME.size, np.uint8)
        self._copy_out(sender, 0, out)
        tag, nbytes = FRAME.unpack(out.tobytes())
        return tag, nbytes

    def read(self, sender: int, into: np.ndarray | None, skip: int = 0) -> int:
        """Moves up to `into.size` bytes (None: `skip` bytes, thrown away) from `sender`'s ring,
        as far as they are there; returns how many, and rings the sender if it waits for room."""
        want = into.size if into is not None else skip
        n = min(want, self.available(sender))
        if n <= 0:
            return 0
        if into is not None:
            self._copy_out(sender, 0, into[:n])
        me = self.position
        tail_i = self._word(sender, me, _R_TAIL) // 2
        self._wide[tail_i] = int(self._wide[tail_i]) + n
        if self.words[self._word(sender, me, _R_WAITING)]:
            self.ring(sender)
        return n

    def _copy_out(self, sender: int, skip: int, out: np.ndarray) -> None:
        me, cap = self.position, self.capacity
        tail = int(self._wide[self._word(sender, me, _R_TAIL) // 2]) + skip
        data_at = self._ring_offset(sender, me) + _RING_WORDS
        at = tail % cap
        first = min(out.size, cap - at)
        out[:first] = self.bytes[data_at + at : data_at + at + first]
        if first < out.size:
            out[first:] = self.bytes[data_at : data_at + out.size - first]

    def close(self) -> None:
        self._bells.release()
        self.words = np.zeros(0, np.uint32)
        self._wide = np.zeros(0, np.uint64)
        self.bytes = np.zeros(0, np.uint8)
        with contextlib.suppress(BufferError):
            self.mapping.close()


def form(peers: tuple[int, ...], worker_id: int, key: bytes, timeout_s: float) -> PeerRings | None:
    """This member's mapping of its host's OPEN mailboxes, or None when they could not be formed
    (logged; every peer then sends through the coordinator)."""
    position = peers.index(worker_id)
    capacity = capacity_for(len(peers))
    name = _SOCKET_PREFIX + key.hex().encode()
    try:
        if position == 0:
            return _create(peers, key, capacity, name, timeout_s)
        return _attach(peers, position, key, capacity, name, timeout_s)
    except FormingError as exc:
        log.info(
            "worker %d sends point-to-point messages through the coordinator: its host's mailboxes "
            "did not form: %s",
            worker_id,
            exc,
        )
        return None


def _create(peers: tuple[int, ...], key: bytes, capacity: int, name: bytes, timeout_s: float) -> PeerRings:
    fd, mapping = sharing.create(PeerRings.size(len(peers), capacity), "gradserver-p2p")
    rings = PeerRings(mapping, peers, 0, capacity)
    rings.words[:4] = (MAGIC, VERSION, len(peers), capacity)
    sharing.serve_then_open(rings, peers, key, fd, name, timeout_s)
    return rings


def _attach(
    peers: tuple[int, ...], position: int, key: bytes, capacity: int, name: bytes, timeout_s: float
) -> PeerRings:
    mapping = sharing.receive(peers[position], key, name, timeout_s)
    header = struct.unpack_from("<4I", mapping, 0) if len(mapping) >= 16 else ()
    expected = (MAGIC, VERSION, len(peers), capacity)
    if len(mapping) != PeerRings.size(len(peers), capacity) or header != expected:
        size = len(mapping)
        mapping.close()
        raise FormingError(f"its shared memory ({size} bytes, header {header}) is not this worker's layout")
    rings = PeerRings(mapping, peers, position, capacity)
    rings.mark_attached()
    sharing.await_verdict(rings, peers[position], peers[0], "its host's mailboxes", timeout_s)
    return rings
