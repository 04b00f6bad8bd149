"""The shared memory of one host group (docs/PROTOCOL.md "Host groups"): where the members of a
group post their chunks for the member that sums them, and where that member publishes the
average it got back for the others to read.

Forming: the group's first member creates the arena (a sealed memfd, as every arena of this
package: nothing has a name in /dev/shm, and the kernel frees it with its last holder) and hands
it out on an abstract Unix socket named after the group's key, which only the group's members
learned from the coordinator: a member connects, the socket's peer must be its own user
(SO_PEERCRED), it says the key and its worker id, and it receives the arena's descriptor. Once
every member has attached, the first member marks the arena OPEN; if one has not within the
connect timeout, FAILED, and every member then sends its own contributions, so the group decides
as one.

Layout (little-endian; 32-bit words read and written with single aligned loads and stores, each
written by one side at a time, published by a sequence word written last, as in the collective
lane: enough on x86-64, where stores are seen in program order):
  header (4096 bytes): magic, version, members, slot bytes, input and output slots per member,
      state (FORMING, OPEN, FAILED)
  a control block per member: `attached`, `closed` (written by it), `bell` (written by anyone
      who has something for it: a futex word it sleeps on)
  input slot descriptors, per member: seq (the member's post number, written last; 0: never
      used), consumed (written by the member that summed it: its seq), the key's identity, the
      element offset, the payload's bytes, dtype and header checksum
  output slot descriptors, per member: seq, the key's identity, offset, bytes, dtype,
      contributors, and one `taken` word per member (its seq once that member read it)
  the slots themselves, each `slot_bytes` (a chunk's payload)
A member posts into its own free input slots (free: never used, or consumed), sums the chunks it
owns from everyone's input slots, and publishes into its own free output slots (free: every
other member took it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import struct
from collections.abc import Iterator

import numpy as np

from gradserver.common.futex import Bells
from gradserver.common.messages import DType, KeyKind, TensorKey
from gradserver.common.shm import round_up

from . import arena_sharing as sharing
from .arena_sharing import ArenaState, FormingError

log = logging.getLogger("gradserver.worker")

MAGIC = 0x47534847  # "GHSG"
VERSION = 1
_HEADER = 4096
_CONTROL = 256
_IN_DESC = 64
_PAGE = mmap.PAGESIZE
# Header words.
_W_MAGIC, _W_VERSION, _W_MEMBERS, _W_SLOT, _W_IN, _W_OUT, _W_STATE = range(7)
# Control block words (relative): attached and closed in one cache line, the bell in the next.
_C_ATTACHED, _C_CLOSED, _C_BELL = 0, 1, 16
# Descriptor words (relative); u64 fields at 8-byte aligned word pairs.
_D_SEQ, _D_CONSUMED, _D_STEP, _D_KIND, _D_INDEX = 0, 1, 2, 4, 5
_D_OFFSET, _D_NBYTES, _D_DTYPE, _D_CHECK = 6, 8, 9, 10
_D_CONTRIBUTORS = 11  # output descriptors: how many workers the average stands for
_D_TAKEN = 16  # output descriptors: one word per member from here
_KIND_CODES = {KeyKind.BLOCK: 1, KeyKind.NON_BLOCK: 2, KeyKind.WHOLE_MODEL: 3, KeyKind.COLLECTIVE: 4}
# Input and output slots per member: about this many bytes of each, 4 to 64 slots.
_SLOTS_BYTES = 16 * 2**20
_SOCKET_PREFIX = b"\0gradserver-host-"


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Where everything lies in a host group's arena of `members` with slots of `slot_bytes`."""

    members: int
    slot_bytes: int
    in_slots: int
    out_slots: int

    @classmethod
    def for_chunks(cls, members: int, chunk_bytes: int) -> ArenaLayout:
        slot = round_up(max(chunk_bytes, 4), _PAGE)
        slots = max(4, min(64, _SLOTS_BYTES // slot))
        return cls(members, slot, slots, slots)

    @property
    def out_desc_bytes(self) -> int:
        return round_up(4 * (_D_TAKEN + self.members), 64)

    def control(self, member: int) -> int:
        return _HEADER + member * _CONTROL

    def in_desc(self, member: int, slot: int) -> int:
        return _HEADER + self.members * _CONTROL + (member * self.in_slots + slot) * _IN_DESC

    def out_desc(self, member: int, slot: int) -> int:
        start = self.in_desc(self.members, 0)
        return start + (member * self.out_slots + slot) * self.out_desc_bytes

    @property
    def data_start(self) -> int:
        return round_up(self.out_desc(self.members, 0), _PAGE)

    def in_data(self, member: int, slot: int) -> int:
        return self.data_start + (member * self.in_slots + slot) * self.slot_bytes

    def out_data(self, member: int, slot: int) -> int:
        slots_before = self.members * self.in_slots + member * self.out_slots + slot
        return self.data_start + slots_before * self.slot_bytes

    @property
    def size(self) -> int:
        return self.data_start + self.members * (self.in_slots + self.out_slots) * self.slot_bytes


_KINDS = {code: kind for kind, code in _KIND_CODES.items()}


def identity(key: TensorKey) -> tuple[int, int, int]:
    """What tells one key from another in a descriptor: its step, kind and index."""
    return key.step, _KIND_CODES[key.kind], key.index


def key_of(ident: tuple[int, int, int]) -> TensorKey:
    """The key a descriptor names (its identity only: what decides where its chunks go)."""
    step, kind, index = ident
    return TensorKey(step, _KINDS[kind], index)


@dataclasses.dataclass(frozen=True)
class Post:
    """One member's chunk in its input slot."""

    member: int
    slot: int
    seq: int
    nbytes: int
    dtype: DType
    check: int


@dataclasses.dataclass(frozen=True)
class Published:
    """An average in a member's output slot."""

    member: int
    slot: int
    seq: int
    ident: tuple[int, int, int]
    offset: int
    nbytes: int
    dtype: DType
    contributors: int


class HostArena:
    """One member's mapping of its group's arena."""

    def __init__(self, mapping: mmap.mmap, layout: ArenaLayout, position: int) -> None:
        self.mapping = mapping
        self.layout = layout
        self.position = position
        self.bytes = np.frombuffer(mapping, dtype=np.uint8)
        self.words = np.frombuffer(mapping, dtype=np.uint32, count=layout.data_start // 4)
        self._wide = np.frombuffer(mapping, dtype=np.uint64, count=layout.data_start // 8)
        self._in_seq = 0
        self._out_seq = 0
        self._bells = Bells(self.words, self._bell_index, position)

    # --- words ---------------------------------------------------------------------------------

    def _w(self, offset: int) -> int:
        return offset // 4

    @property
    def state(self) -> ArenaState:
        return ArenaState(int(self.words[_W_STATE]))

    def set_state(self, state: ArenaState) -> None:
        self.words[_W_STATE] = int(state)
        self.ring_all()

    def attached(self, member: int) -> bool:
        return bool(self.words[self._w(self.layout.control(member)) + _C_ATTACHED])

    def closed(self, member: int) -> bool:
        return bool(self.words[self._w(self.layout.control(member)) + _C_CLOSED])

    def _bell_index(self, member: int) -> int:
        return self._w(self.layout.control(member)) + _C_BELL

    def bell(self) -> int:
        """This member's bell: read it before looking for what it waits for, then `sleep`."""
        return self._bells.value()

    def ring(self, member: int) -> None:
        """Tells `member` that something it may wait for changed (common.futex.Bells)."""
        self._bells.ring(member)

    def ring_all(self) -> None:
        for member in range(self.layout.members):
            self.ring(member)

    def sleep(self, seen: int, timeout_s: float) -> None:
        """Sleeps while this member's bell still reads `seen`, at most `timeout_s`."""
        self._bells.sleep(seen, timeout_s)

    def mark_closed(self) -> None:
        self.words[self._w(self.layout.control(self.position)) + _C_CLOSED] = 1
        self.ring_all()

    # --- posting -------------------------------------------------------------------------------

    def _in_free(self, member: int, slot: int) -> bool:
        d = self._w(self.layout.in_desc(member, slot))
        seq = int(self.words[d + _D_SEQ])
        return seq == 0 or int(self.words[d + _D_CONSUMED]) == seq

    def free_input(self) -> int | None:
        """One of this member's input slots that is free, or None."""
        for slot in range(self.layout.in_slots):
            if self._in_free(self.position, slot):
                return slot
        return None

    def post(
        self,
        slot: int,
        ident: tuple[int, int, int],
        offset: int,
        payload: np.ndarray,
        dtype: DType,
        check: int,
    ) -> None:
        """Copies `payload` (bytes) into this member's free input `slot` and publishes it."""
        layout = self.layout
        start = layout.in_data(self.position, slot)
        self.bytes[start : start + payload.nbytes] = payload.view(np.uint8).reshape(-1)
        self._describe(layout.in_desc(self.position, slot), ident, offset, payload.nbytes, dtype)
        self.words[self._w(layout.in_desc(self.position, slot)) + _D_CHECK] = check
        self._in_seq = _next(self._in_seq)
        self.words[self._w(layout.in_desc(self.position, slot)) + _D_SEQ] = self._in_seq

    def _describe(
        self, desc: int, ident: tuple[int, int, int], offset: int, nbytes: int, dtype: DType
    ) -> None:
        d = self._w(desc)
        step, kind, index = ident
        self._wide[d // 2 + _D_STEP // 2] = step
        self.words[d + _D_KIND] = kind
        self.words[d + _D_INDEX] = index
        self._wide[d // 2 + _D_OFFSET // 2] = offset
        self.words[d + _D_NBYTES] = nbytes
        self.words[d + _D_DTYPE] = int(dtype)

    def _ident_at(self, d: int) -> tuple[tuple[int, int, int], int]:
        step = int(self._wide[d // 2 + _D_STEP // 2])
        ident = (step, int(self.words[d + _D_KIND]), int(self.words[d + _D_INDEX]))
        return ident, int(self._wide[d // 2 + _D_OFFSET // 2])

    def find_post(self, member: int, ident: tuple[int, int, int], offset: int) -> Post | None:
        """`member`'s unconsumed post of that chunk, if it is there yet."""
        for post, post_ident, post_offset in self.posts(member):
            if post_ident == ident and post_offset == offset:
                return post
        return None

    def posts(self, member: int) -> Iterator[tuple[Post, tuple[int, int, int], int]]:
        """Every unconsumed post of `member`: the post, its key's identity and offset."""
        for slot in range(self.layout.in_slots):
            d = self._w(self.layout.in_desc(member, slot))
            seq = int(self.words[d + _D_SEQ])
            if seq == 0 or int(self.words[d + _D_CONSUMED]) == seq:
                continue
            ident, offset = self._ident_at(d)
            post = Post(
                member,
                slot,
                seq,
                int(self.words[d + _D_NBYTES]),
                DType(int(self.words[d + _D_DTYPE])),
                int(self.words[d + _D_CHECK]),
            )
            # The seq read again: a slot reused meanwhile described another chunk.
            if int(self.words[d + _D_SEQ]) == seq:
                yield post, ident, offset

    def payload(self, post: Post) -> memoryview:
        start = self.layout.in_data(post.member, post.slot)
        return memoryview(self.mapping)[start : start + post.nbytes]

    def consume(self, post: Post) -> None:
        """`post` was summed (or dropped): its slot is its member's again."""
        self.words[self._w(self.layout.in_desc(post.member, post.slot)) + _D_CONSUMED] = post.seq
        if post.member != self.position:
            self.ring(post.member)

    # --- publishing ----------------------------------------------------------------------------

    def _out_free(self, slot: int) -> bool:
        d = self._w(self.layout.out_desc(self.position, slot))
        seq = int(self.words[d + _D_SEQ])
        if seq == 0:
            return True
        return all(
            int(self.words[d + _D_TAKEN + m]) == seq or self.closed(m)
            for m in range(self.layout.members)
            if m != self.position
        )

    def free_output(self) -> int | None:
        for slot in range(self.layout.out_slots):
            if self._out_free(slot):
                return slot
        return None

    def publish(
        self,
        slot: int,
        ident: tuple[int, int, int],
        offset: int,
        data: bytes | memoryview,
        dtype: DType,
        contributors: int,
    ) -> None:
        """Writes an average into this member's free output `slot` and tells the others."""
        layout = self.layout
        view = np.frombuffer(data, dtype=np.uint8)
        start = layout.out_data(self.position, slot)
        self.bytes[start : start + view.size] = view
        desc = layout.out_desc(self.position, slot)
        self._describe(desc, ident, offset, view.size, dtype)
        d = self._w(desc)
        self.words[d + _D_CONTRIBUTORS] = contributors
        self._out_seq = _next(self._out_seq)
        self.words[d + _D_SEQ] = self._out_seq
        for member in range(layout.members):
            if member != self.position:
                self.ring(member)

    def published(self) -> Iterator[Published]:
        """Every average the other members published that this member has not taken."""
        for member in range(self.layout.members):
            if member == self.position:
                continue
            for slot in range(self.layout.out_slots):
                d = self._w(self.layout.out_desc(member, slot))
                seq = int(self.words[d + _D_SEQ])
                if seq == 0 or int(self.words[d + _D_TAKEN + self.position]) == seq:
                    continue
                ident, offset = self._ident_at(d)
                item = Published(
                    member,
                    slot,
                    seq,
                    ident,
                    offset,
                    int(self.words[d + _D_NBYTES]),
                    DType(int(self.words[d + _D_DTYPE])),
                    int(self.words[d + _D_CONTRIBUTORS]),
                )
                if int(self.words[d + _D_SEQ]) == seq:
                    yield item

    def average(self, item: Published) -> memoryview:
        start = self.layout.out_data(item.member, item.slot)
        return memoryview(self.mapping)[start : start + item.nbytes]

    def take(self, item: Published) -> None:
        """This member read `item` (or has no use for it): the publisher may reuse its slot."""
        d = self._w(self.layout.out_desc(item.member, item.slot))
        self.words[d + _D_TAKEN + self.position] = item.seq
        self.ring(item.member)

    def close(self) -> None:
        self._bells.release()
        self.words = np.zeros(0, np.uint32)
        self._wide = np.zeros(0, np.uint64)
        self.bytes = np.zeros(0, np.uint8)
        # A view of it still held (a payload being read) keeps it mapped until that view goes.
        with contextlib.suppress(BufferError):
            self.mapping.close()


def _next(seq: int) -> int:
    """The post number after `seq` (0 means never used, so it is skipped when the count wraps)."""
    return (seq + 1) & 0xFFFFFFFF or 1


# --- forming ------------------------------------------------------------------------------------


def form(
    group: tuple[int, ...], worker_id: int, key: bytes, chunk_bytes: int, timeout_s: float
) -> HostArena | None:
    """This member's mapping of its group's OPEN arena, or None when the group could not form it
    (logged; every member then sends its own). Raises `FormingError` only when this member cannot
    know what the group decided (it attached, and the first member said nothing in time)."""
    position = group.index(worker_id)
    layout = ArenaLayout.for_chunks(len(group), chunk_bytes)
    name = _SOCKET_PREFIX + key.hex().encode()
    try:
        if position == 0:
            return _create(group, key, layout, name, timeout_s)
        return _attach(group, position, key, layout, name, timeout_s)
    except FormingError as exc:
        log.info("worker %d sends its own contributions: its host group did not form: %s", worker_id, exc)
        return None


def _create(
    group: tuple[int, ...], key: bytes, layout: ArenaLayout, name: bytes, timeout_s: float
) -> HostArena:
    fd, mapping = sharing.create(layout.size, "gradserver-host-group")
    arena = HostArena(mapping, layout, 0)
    header = (MAGIC, VERSION, layout.members, layout.slot_bytes, layout.in_slots, layout.out_slots)
    arena.words[: len(header)] = header
    arena.words[arena._w(layout.control(0)) + _C_ATTACHED] = 1
    sharing.serve_then_open(arena, group, key, fd, name, timeout_s)
    return arena


def _attach(
    group: tuple[int, ...], position: int, key: bytes, layout: ArenaLayout, name: bytes, timeout_s: float
) -> HostArena:
    mapping = sharing.receive(group[position], key, name, timeout_s)
    try:
        arena = _checked(mapping, layout, position)
    except FormingError:
        mapping.close()
        raise
    arena.words[arena._w(layout.control(position)) + _C_ATTACHED] = 1
    arena.ring(0)
    what = "its host group's shared memory"
    sharing.await_verdict(arena, group[position], group[0], what, timeout_s)
    return arena


def _checked(mapping: mmap.mmap, layout: ArenaLayout, position: int) -> HostArena:
    if len(mapping) != layout.size:
        raise FormingError(f"its shared memory holds {len(mapping)} bytes, not the {layout.size} expected")
    magic, version, members, slot, ins, outs = struct.unpack_from("<6I", mapping, 0)
    if (magic, version, members, slot, ins, outs) != (
        MAGIC,
        VERSION,
        layout.members,
        layout.slot_bytes,
        layout.in_slots,
        layout.out_slots,
    ):
        raise FormingError(
            f"its shared memory's header (magic {magic:#x}, version {version}, {members} members, "
            f"{ins}+{outs} slots of {slot} bytes) is not this worker's layout"
        )
    return HostArena(mapping, layout, position)
