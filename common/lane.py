"""The collective lane: what both sides share of the same-host path for one-shot collectives
(docs/PROTOCOL.md, "The collective lane").

Over gRPC, even with payloads in shared memory, every collective costs a few control messages
through two Python gRPC stacks: about 1 ms for a 4-byte allreduce, where gloo takes 0.2 ms. The
lane moves the control of a collective into shared memory too. The coordinator creates one
arena per job (`LaneLayout`): a header, one control block per worker, two input slots per worker
and two output slots. A worker copies its part of a round into its input slot, writes a
`Descriptor` of it and bumps its `posted` word; the coordinator's lane thread, woken on that
word, checks that every worker's descriptor describes the same round of the same operation,
reduces the input slots into an output slot (REDUCE, REDUCE_SCATTER: the same `Averager` and
bytes as the gRPC path) and bumps `done`; each worker then reads its result (from the output
slot, or for the kinds that move bytes straight from the others' input slots) and bumps its
`taken` word. Waiting is a futex on these words: a wake-up costs microseconds, not a message.

Rounds: an operation larger than a slot runs as several rounds, numbered across the whole lane
(1, 2, ...), two in flight per worker (slot `round % 2`), so copying in, reducing and copying
out overlap. A worker posts round g only when every worker has taken round g - 2, which also
frees the output slot the coordinator writes at round g.

The words are aligned 32-bit integers, each written by one side only (a worker's `posted` and
`taken` by that worker, the header by the coordinator), read and written with single aligned
loads and stores. The payload and descriptor are written before the word that publishes them:
on x86-64, whose stores are seen in program order, that is enough; other processors would need
barriers that Python cannot issue, so the lane is offered only on x86-64 Linux (`supported`).
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
import os
import platform
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from .futex import NO_SPIN, Spin, crowded, futex_wait, futex_wake, libc_syscall
from .messages import BYTE_KINDS as _BYTE_KINDS
from .messages import CollectiveKind, ReduceOp
from .shm import round_up

MAGIC = 0x4E4C5347  # "GSLN"
VERSION = 1
HEADER_BYTES = 4096
_MESSAGE_OFFSET = 64
MESSAGE_BYTES = HEADER_BYTES - _MESSAGE_OFFSET
_ALIGN = 64
_PAGE = mmap.PAGESIZE

# Header words (32-bit indices into the control region).
_W_MAGIC, _W_VERSION, _W_WORLD, _W_SLOT = 0, 1, 2, 3
_W_STATE, _W_DONE, _W_STATUS, _W_CULPRIT = 4, 5, 6, 7
_W_CULPRIT_STATUS, _W_FAILED_ROUND, _W_MESSAGE_LEN, _W_GENERATION = 8, 9, 10, 11
_W_FAILED_KNOWN = 12  # 1 when the failure names the newest lane operation (a u64 at byte 56)
_FAILED_OPERATION_OFFSET = 56
# A worker's control block: `posted` in one cache line, `taken` and `abandoned` in the next
# (written by the same worker, read by everyone), then its two descriptors.
# A worker's words: posted, taken, abandoned; its bell (the last coordinator round it rang for,
# the coordinator's futex word) and the coordinator rounds it rang for by parity (two may await
# the coordinator at once: a worker posts round g + 2 only after round g is done).
_POSTED, _TAKEN, _ABANDONED, _BELL, _RUNG = 0, 16, 17, 18, 19
# The word of the lane (its index + 1; 0: none) this worker is about to sleep on, or sleeps on:
# a worker that sets a `posted` or `taken` word wakes it only when someone announced a sleep on
# it (see `LaneMemory._wake_sleepers`). Written by that worker only.
_SLEEPING = 21
# Cumulative u64 counters a worker keeps of its peer rounds (the coordinator does not see them):
# rounds, bytes posted, bytes read.
_PEER_COUNTERS = 96  # bytes; after the words above (the last, _SLEEPING, ends at byte 88)
_DESCRIPTORS = 128

# See Descriptor: lane operation, its number (the key's step), total, offset, length, part, group,
# root, kind, op, flags, split count; the splits (u64 each) follow at +64.
_DESCRIPTOR = struct.Struct("<QQQQQIIIBBBxI")
# Acquired and released between a worker's store of its `posted` or `taken` word and its reads
# of the others' `_SLEEPING` words: see `LaneMemory._wake_sleepers`.
_FENCE = threading.Lock()
_IDENTITY_BYTES = 16  # the lane operation and the key's step: what differs between operations
_SPLITS_OFFSET = 64
FLAG_PROPAGATE_NON_FINITE = 1


class LaneState(enum.IntEnum):
    """The header's state word. FORMING until the coordinator knows whether every worker of the
    job uses the lane; CLOSED when one does not (collectives go over gRPC, for the whole job);
    FAILED after an operation failed (the header says why; later operations go over gRPC)."""

    FORMING = 0
    OPEN = 1
    CLOSED = 2
    FAILED = 3


_OPEN = int(LaneState.OPEN)


def supported() -> bool:
    """Whether this machine can run the lane: Linux futexes, and x86-64's ordered stores."""
    return (
        platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
        and libc_syscall() is not None
        and hasattr(os, "memfd_create")
    )


# A reduction is a peer operation while every worker reducing all of it (its input times the
# workers, in bytes) stays within this: a trip through the coordinator's thread costs more than
# reducing that much N times over (at 2 workers: up to 256 KiB each; at 8: 64 KiB).
PEER_REDUCE_MAX_BYTES = 512 * 1024


def peer_operation(kind: CollectiveKind, total: int, world: int) -> bool:
    """Whether every worker reads (and, for REDUCE and REDUCE_SCATTER, reduces) an operation's
    rounds itself from the others' input slots, so the coordinator only checks and counts them:
    the kinds that move bytes, and small reductions (`total` bytes per worker)."""
    return kind in _BYTE_KINDS or total * world <= PEER_REDUCE_MAX_BYTES


def reached(value: int, target: int) -> bool:
    """Whether round counter `value` is at `target` or past it (32-bit, wrapping)."""
    return (value - target) & 0xFFFFFFFF < 0x80000000


def next_round(value: int) -> int:
    """The round after `value` (0 means none, so it is skipped when the counter wraps)."""
    return (value + 1) & 0xFFFFFFFF or 1


# --- layout -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LaneLayout:
    """Where everything lies in a lane arena for `world` workers with `slot_bytes` slots."""

    world: int
    slot_bytes: int

    @property
    def descriptor_bytes(self) -> int:
        return round_up(_SPLITS_OFFSET + 8 * self.world, _ALIGN)

    @property
    def control_bytes(self) -> int:
        return _DESCRIPTORS + 2 * self.descriptor_bytes

    def control(self, worker: int) -> int:
        return HEADER_BYTES + worker * self.control_bytes

    def descriptor(self, worker: int, round_: int) -> int:
        return self.control(worker) + _DESCRIPTORS + (round_ % 2) * self.descriptor_bytes

    @property
    def data_start(self) -> int:
        return round_up(self.control(self.world), _PAGE)

    def input_slot(self, worker: int, round_: int) -> int:
        return self.data_start + (2 * worker + round_ % 2) * self.slot_bytes

    def output_slot(self, round_: int) -> int:
        return self.data_start + (2 * self.world + round_ % 2) * self.slot_bytes

    @property
    def size(self) -> int:
        return self.data_start + (2 * self.world + 2) * self.slot_bytes


_SLOTS_MAX_BYTES = 512 * 1024 * 1024  # every slot of a lane together (pages are used as touched)


def slot_bytes_for(chunk_bytes: int, world: int) -> int:
    """The lane's slot size: the coordinator's (largest) chunk size, but no more than keeps all
    2N + 2 slots within 512 MiB (a large job's arena stays bounded; larger operations just take
    more rounds); a multiple of the page, and of 4 bytes per worker (a REDUCE_SCATTER round
    carries one piece per worker)."""
    bounded = min(chunk_bytes, _SLOTS_MAX_BYTES // (2 * world + 2))
    return max(bounded // _PAGE * _PAGE, round_up(4 * world, _PAGE))


# --- descriptors --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """What one worker posted for one round: round `part` of operation `sequence` of `group`
    (its `index`-th operation through the lane),
    `length` bytes in its input slot, covering its input from byte `offset` (of `total`; a
    REDUCE_SCATTER's pieces: from `offset` of each part). `splits` are an ALL_TO_ALL's bytes for
    each worker."""

    sequence: int
    total: int
    offset: int
    length: int
    part: int
    group: int
    root: int
    kind: CollectiveKind
    op: ReduceOp
    flags: int = 0
    splits: tuple[int, ...] = ()
    index: int = 0  # the worker's count of lane operations, this one included

    @property
    def propagate_non_finite(self) -> bool:
        return bool(self.flags & FLAG_PROPAGATE_NON_FINITE)


# --- round geometry: the same on both sides -----------------------------------------------------


def round_step(kind: CollectiveKind, world: int, slot_bytes: int) -> int:
    """Bytes of a worker's input (of each part, for REDUCE_SCATTER) that one round covers."""
    if kind is CollectiveKind.REDUCE_SCATTER:
        return max(slot_bytes // world // 4 * 4, 4)
    if kind is CollectiveKind.REDUCE:
        return slot_bytes // 4 * 4
    return slot_bytes


def own_rounds(kind: CollectiveKind, total: int, world: int, slot_bytes: int) -> int:
    """How many rounds a worker whose input is `total` bytes needs (at least one, so an empty
    operation still synchronises). An ALL_TO_ALL runs the most any worker needs."""
    span = total // world if kind is CollectiveKind.REDUCE_SCATTER else total
    return max(1, -(-span // round_step(kind, world, slot_bytes)))


def round_span(kind: CollectiveKind, total: int, world: int, slot_bytes: int, part: int) -> tuple[int, int]:
    """(offset, length) of a worker's input that round `part` covers (of each part, for a
    REDUCE_SCATTER); (span, 0) past its end."""
    span = total // world if kind is CollectiveKind.REDUCE_SCATTER else total
    step = round_step(kind, world, slot_bytes)
    offset = min(part * step, span)
    return offset, min(step, span - offset)


def posted_length(kind: CollectiveKind, length: int, world: int, *, root: bool) -> int:
    """Bytes a worker puts in its input slot for a round covering `length` bytes."""
    if kind is CollectiveKind.REDUCE_SCATTER:
        return length * world
    if kind is CollectiveKind.BROADCAST and not root:
        return 0
    return length


# --- the shared memory --------------------------------------------------------------------------


class LaneMemory:
    """A mapped lane arena: its 32-bit words (with their addresses, for futexes), descriptors
    and slots. Both sides use it; `create` is the coordinator's, `attach` the worker's."""

    def __init__(self, mapping: mmap.mmap, layout: LaneLayout) -> None:
        self.mapping = mapping
        self.layout = layout
        self.buffer = memoryview(mapping)
        self.bytes = np.frombuffer(mapping, dtype=np.uint8)
        words = layout.data_start // 4
        self.words = np.frombuffer(mapping, dtype=np.uint32, count=words)
        self._base = int(self.bytes.__array_interface__["data"][0])
        # Every offset a round needs, computed once (a round is tens of microseconds).
        controls = [layout.control(w) // 4 for w in range(layout.world)]
        self._posted = [c + _POSTED for c in controls]
        self._taken = [c + _TAKEN for c in controls]
        self._abandoned = [c + _ABANDONED for c in controls]
        self._bell = [c + _BELL for c in controls]
        self._rung = [c + _RUNG for c in controls]
        self._sleeping = [c + _SLEEPING for c in controls]
        # The other workers' `_SLEEPING` words, for each worker (read with plain loads: a
        # memoryview's item is a Python int without numpy's per-item cost).
        self._others_sleeping = [
            [self._sleeping[r] for r in range(layout.world) if r != w] for w in range(layout.world)
        ]
        self._ints = self.buffer[: layout.data_start].cast("I")
        self._posted_at = [self._address(i) for i in self._posted]
        self._taken_at = [self._address(i) for i in self._taken]
        self._bell_at = [self._address(i) for i in self._bell]
        self._counters = [layout.control(w) + _PEER_COUNTERS for w in range(layout.world)]
        self._done_at = self._address(_W_DONE)
        self._descriptors = [(layout.descriptor(w, 0), layout.descriptor(w, 1)) for w in range(layout.world)]
        self._inputs = [(layout.input_slot(w, 0), layout.input_slot(w, 1)) for w in range(layout.world)]
        self._outputs = (layout.output_slot(0), layout.output_slot(1))

    @classmethod
    def create(cls, mapping: mmap.mmap, layout: LaneLayout) -> LaneMemory:
        memory = cls(mapping, layout)
        memory.words[_W_MAGIC] = MAGIC
        memory.words[_W_VERSION] = VERSION
        memory.words[_W_WORLD] = layout.world
        memory.words[_W_SLOT] = layout.slot_bytes
        return memory

    @classmethod
    def attach(cls, mapping: mmap.mmap) -> LaneMemory:
        """A worker's view of the arena it was given; ValueError when it is not a lane arena of
        this version or its size does not match what its header says."""
        if len(mapping) < HEADER_BYTES:
            raise ValueError(f"the collective lane arena holds {len(mapping)} bytes, less than its header")
        magic, version, world, slot = struct.unpack_from("<4I", mapping, 0)
        if magic != MAGIC or version != VERSION:
            raise ValueError(
                f"not a version-{VERSION} collective lane arena (magic {magic:#x}, version {version})"
            )
        layout = LaneLayout(world, slot)
        if world < 1 or slot < 4 or slot % 4 or layout.size != len(mapping):
            raise ValueError(
                f"the collective lane arena's header (world {world}, slots of {slot} bytes) does not "
                f"match its size of {len(mapping)} bytes"
            )
        return cls(mapping, layout)

    def close(self) -> None:
        """Drops this object's views; the mapping itself is its owner's to close."""
        self.words = np.zeros(0, np.uint32)
        self.bytes = np.zeros(0, np.uint8)
        self._ints.release()
        self.buffer.release()

    # --- words ---

    def _word(self, index: int) -> int:
        return int(self.words[index])

    def _address(self, index: int) -> int:
        return self._base + 4 * index

    @property
    def state(self) -> LaneState:
        return LaneState(int(self.words[_W_STATE]))

    def open_as(self, generation: int) -> bool:
        """Whether the lane is OPEN for the job of `generation` (the common case, read cheaply)."""
        ints = self._ints
        return ints[_W_STATE] == _OPEN and ints[_W_GENERATION] == generation

    @property
    def done(self) -> int:
        return int(self.words[_W_DONE])

    @property
    def generation(self) -> int:
        return int(self.words[_W_GENERATION])

    def posted(self, worker: int) -> int:
        return int(self.words[self._posted[worker]])

    def taken(self, worker: int) -> int:
        return int(self.words[self._taken[worker]])

    def abandoned(self, worker: int) -> int:
        """The lane operation `worker` gave up on (its low 32 bits; 0: none)."""
        return int(self.words[self._abandoned[worker]])

    def bell(self, worker: int) -> int:
        """The last coordinator round `worker` rang for (the word the coordinator sleeps on)."""
        return int(self.words[self._bell[worker]])

    def rung(self, worker: int, parity: int) -> int:
        """The coordinator round of that parity `worker` last rang for (0: none)."""
        return int(self.words[self._rung[worker] + parity])

    def bell_address(self, worker: int) -> int:
        return self._bell_at[worker]

    def ring(self, worker: int, round_: int) -> None:
        """Tells the coordinator that `worker` posted coordinator round `round_` (its lane thread
        sleeps on the bells; peer rounds never wake it)."""
        self.words[self._rung[worker] + (round_ & 1)] = round_
        self.words[self._bell[worker]] = round_
        futex_wake(self._bell_at[worker])

    def peer_counters(self, worker: int) -> tuple[int, int, int]:
        """(rounds, bytes posted, bytes read) of `worker`'s peer rounds so far."""
        rounds, posted, read = struct.unpack_from("<3Q", self.buffer, self._counters[worker])
        return int(rounds), int(posted), int(read)

    def count_peer_round(self, worker: int, posted: int, read: int) -> None:
        """Adds one peer round of `worker` to its counters (written by that worker only)."""
        rounds, total_posted, total_read = self.peer_counters(worker)
        struct.pack_into(
            "<3Q", self.buffer, self._counters[worker], rounds + 1, total_posted + posted, total_read + read
        )

    def state_address(self) -> int:
        return self._address(_W_STATE)

    def done_address(self) -> int:
        return self._done_at

    def posted_address(self, worker: int) -> int:
        return self._posted_at[worker]

    def taken_address(self, worker: int) -> int:
        return self._taken_at[worker]

    def set_posted(self, worker: int, round_: int) -> None:
        index = self._posted[worker]
        self.words[index] = round_
        self._wake_sleepers(worker, index)

    def set_taken(self, worker: int, round_: int) -> None:
        index = self._taken[worker]
        self.words[index] = round_
        self._wake_sleepers(worker, index)

    def set_sleeping(self, worker: int, address: int) -> None:
        """`worker` is about to sleep on the word at `address` (a `posted` or `taken` word;
        0: it sleeps on none any more). Announce it before the futex wait, withdraw it after."""
        self.words[self._sleeping[worker]] = (address - self._base) // 4 + 1 if address else 0

    def _wake_sleepers(self, worker: int, index: int) -> None:
        """Wakes the word `worker` just stored at `index` when another worker announced a sleep
        on it. A futex wake costs a system call (2-6 µs on a small VM) whether or not anyone
        sleeps, and most rounds find the other workers spinning or not yet waiting.

        Why no wake-up is lost: it is Dekker's pattern. The waiter stores its `_SLEEPING` word,
        then the kernel's futex wait issues a full barrier (smp_mb) before it compares the word
        with the value the waiter last saw, and sleeps only if it is unchanged. This side stores
        the word, then a full barrier, then reads the `_SLEEPING` words. With a barrier between
        each side's store and its later load, at least one side sees the other's store: either
        this side sees the announcement and wakes (the futex's own bucket lock orders the wake
        after the waiter's enqueueing), or the kernel sees the new value and the waiter does not
        sleep. The barrier here is the acquire and release of a lock: on x86-64 (the only
        processor the lane runs on, `supported`) every lock is taken with a locked
        read-modify-write instruction, which no load may pass (Intel SDM vol. 3, 9.2.2); Python
        offers no fence of its own. A stale announcement (a waiter that has woken) costs only a
        wake. Anything else that wakes a worker (a failure, `set_abandoned`, `wake_everyone`)
        still wakes every word unconditionally."""
        with _FENCE:
            pass
        token = index + 1
        ints = self._ints
        for sleeping in self._others_sleeping[worker]:
            if ints[sleeping] == token:
                futex_wake(self._base + 4 * index)
                return

    def set_abandoned(self, worker: int, operation: int) -> None:
        """This worker gave up on its lane operation `operation` (its own deadline or error): the
        coordinator fails it for everyone, naming this worker. (It may be asleep on any worker's
        `posted` word or bell: all are woken.)"""
        self.words[self._abandoned[worker]] = operation & 0xFFFFFFFF or 1
        for address in (*self._posted_at, *self._bell_at):
            futex_wake(address)

    # --- the coordinator's words ---

    def set_state(self, state: LaneState) -> None:
        self.words[_W_STATE] = int(state)
        self.wake_everyone()

    def set_done(self, round_: int) -> None:
        self.words[_W_DONE] = round_
        futex_wake(self._done_at)

    def reset(self, generation: int) -> None:
        """A fresh job: every counter back to zero, state FORMING, a new generation."""
        self.words[_W_DONE] = 0
        self.words[_W_STATUS] = 0
        self.words[_W_CULPRIT] = 0xFFFFFFFF
        self.words[_W_FAILED_ROUND] = 0
        self.words[_W_MESSAGE_LEN] = 0
        self.words[_W_FAILED_KNOWN] = 0
        for worker in range(self.layout.world):
            for index in (
                self._posted[worker],
                self._taken[worker],
                self._abandoned[worker],
                self._bell[worker],
                self._rung[worker],
                self._rung[worker] + 1,
                self._sleeping[worker],
            ):
                self.words[index] = 0
            struct.pack_into("<3Q", self.buffer, self._counters[worker], 0, 0, 0)
        self.words[_W_GENERATION] = generation
        self.set_state(LaneState.FORMING)

    def record_failure(
        self,
        status: int,
        culprit: int | None,
        culprit_status: int,
        message: str,
        operation: int | None = None,
    ) -> None:
        """Writes why the lane failed and the newest lane operation any worker had begun (every
        worker that tries one up to it hears this failure), then the FAILED state (which is what
        waiters look at)."""
        if operation is not None:
            struct.pack_into("<Q", self.buffer, _FAILED_OPERATION_OFFSET, operation)
        self.words[_W_FAILED_KNOWN] = int(operation is not None)
        text = message.encode()[:MESSAGE_BYTES]
        self.bytes[_MESSAGE_OFFSET : _MESSAGE_OFFSET + len(text)] = np.frombuffer(text, np.uint8)
        self.words[_W_MESSAGE_LEN] = len(text)
        self.words[_W_STATUS] = status
        self.words[_W_CULPRIT] = 0xFFFFFFFF if culprit is None else culprit
        self.words[_W_CULPRIT_STATUS] = culprit_status
        self.words[_W_FAILED_ROUND] = self.done
        self.set_state(LaneState.FAILED)

    def failed_operation(self) -> int | None:
        """The newest lane operation a FAILED lane's failure covers (None: none had begun)."""
        if not self.words[_W_FAILED_KNOWN]:
            return None
        return int.from_bytes(self.buffer[_FAILED_OPERATION_OFFSET : _FAILED_OPERATION_OFFSET + 8], "little")

    def newest_operation(self) -> int | None:
        """The newest lane operation any worker has posted a round of (its latest descriptor
        stays in place until its round after next), or None."""
        newest = None
        for worker in range(self.layout.world):
            round_ = self.posted(worker)
            if round_:
                at = self._descriptors[worker][round_ & 1]
                index = int.from_bytes(self.buffer[at : at + 8], "little")
                newest = index if newest is None else max(newest, index)
        return newest

    def failure(self) -> tuple[int, int | None, int, str]:
        """(status, culprit, the culprit's own status, message) of a FAILED lane."""
        length = min(self._word(_W_MESSAGE_LEN), MESSAGE_BYTES)
        message = bytes(self.bytes[_MESSAGE_OFFSET : _MESSAGE_OFFSET + length]).decode(errors="replace")
        culprit = self._word(_W_CULPRIT)
        return (
            self._word(_W_STATUS),
            None if culprit == 0xFFFFFFFF else culprit,
            self._word(_W_CULPRIT_STATUS),
            message,
        )

    def wake_everyone(self) -> None:
        """Wakes whoever sleeps on any word (a failure, a state change, a reset, a stop)."""
        futex_wake(self.state_address())
        futex_wake(self.done_address())
        for worker in range(self.layout.world):
            futex_wake(self.posted_address(worker))
            futex_wake(self.taken_address(worker))
            futex_wake(self.bell_address(worker))

    # --- descriptors and slots ---

    def write_descriptor(self, worker: int, round_: int, d: Descriptor) -> None:
        self.describe(
            worker,
            round_,
            d.index,
            d.sequence,
            d.total,
            d.offset,
            d.length,
            d.part,
            d.group,
            d.root,
            d.kind,
            d.op,
            d.flags,
            d.splits,
        )

    def describe(
        self,
        worker: int,
        round_: int,
        index: int,
        sequence: int,
        total: int,
        offset: int,
        length: int,
        part: int,
        group: int,
        root: int,
        kind: CollectiveKind,
        op: ReduceOp,
        flags: int,
        splits: tuple[int, ...],
    ) -> None:
        """`write_descriptor` from its fields: what a worker posts each round, without building
        a `Descriptor` (a frozen dataclass of 12 fields costs more than a 4-byte round's copy)."""
        at = self._descriptors[worker][round_ & 1]
        _DESCRIPTOR.pack_into(
            self.buffer,
            at,
            index,
            sequence,
            total,
            offset,
            length,
            part,
            group,
            root,
            int(kind),
            int(op),
            flags,
            len(splits),
        )
        if splits:
            struct.pack_into(f"<{len(splits)}Q", self.buffer, at + _SPLITS_OFFSET, *splits)

    def read_descriptor(self, worker: int, round_: int) -> Descriptor:
        """A worker's descriptor of `round_`; ValueError when its fields are out of range."""
        at = self._descriptors[worker][round_ & 1]
        index, sequence, total, offset, length, part, group, root, kind, op, flags, nsplits = (
            _DESCRIPTOR.unpack_from(self.buffer, at)
        )
        if nsplits > self.layout.world:
            raise ValueError(
                f"worker {worker} described {nsplits} split sizes for {self.layout.world} workers"
            )
        splits = struct.unpack_from(f"<{nsplits}Q", self.buffer, at + _SPLITS_OFFSET) if nsplits else ()
        try:
            kind_, op_ = CollectiveKind(kind), ReduceOp(op)
        except ValueError:
            raise ValueError(f"worker {worker} described collective kind {kind} / reduce op {op}") from None
        return Descriptor(
            sequence, total, offset, length, part, group, root, kind_, op_, flags, tuple(splits), index
        )

    def raw_descriptor(self, worker: int, round_: int) -> bytes:
        """The shape part of a worker's descriptor of `round_` as bytes (all but the operation's
        identity): equal for every worker of a REDUCE, REDUCE_SCATTER or ALL_GATHER round, and
        from one operation to the next of the same shape."""
        at = self._descriptors[worker][round_ & 1]
        return bytes(self.buffer[at + _IDENTITY_BYTES : at + _DESCRIPTOR.size])

    def identity(self, worker: int, round_: int) -> bytes:
        """The lane operation and key step of a worker's descriptor of `round_`, as bytes."""
        at = self._descriptors[worker][round_ & 1]
        return bytes(self.buffer[at : at + _IDENTITY_BYTES])

    def input_slot(self, worker: int, round_: int, length: int) -> np.ndarray:
        start = self._inputs[worker][round_ & 1]
        return self.bytes[start : start + length]

    def output_slot(self, round_: int, length: int) -> np.ndarray:
        start = self._outputs[round_ & 1]
        return self.bytes[start : start + length]


def wait_word(
    read: Callable[[], int],
    address: int,
    target: int,
    deadline: float,
    check: Callable[[], None],
    *,
    spin: Spin = NO_SPIN,
    slice_s: float = 0.05,
    announce: Callable[[int], None] | None = None,
) -> bool:
    """Waits until `read()` reaches round `target` (True) or `deadline` passes (False). `check()`
    runs at every wake-up and raises to stop waiting (a failure seen elsewhere). A futex wait on
    `address` in `slice_s` slices, after looking for the length of `spin` (which learns from how
    long the wait took; no spin while the machine is `crowded`). `announce(address)` runs before
    each futex wait and `announce(0)` after it, when given: the word's writer wakes it only for
    an announced sleep (`LaneMemory._wake_sleepers`)."""
    started = time.perf_counter()
    if spin.budget_s > 0 and not crowded() and spin.until(lambda: reached(read(), target)):
        spin.observe(time.perf_counter() - started)
        return True
    while True:
        value = read()
        if reached(value, target):
            spin.observe(time.perf_counter() - started)
            return True
        check()
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if announce is None:
            futex_wait(address, value, min(left, slice_s))
            continue
        announce(address)
        try:
            futex_wait(address, value, min(left, slice_s))
        finally:
            announce(0)


def splits_offsets(splits: Sequence[int]) -> list[int]:
    """Where each worker's piece starts in an ALL_TO_ALL input of these split sizes."""
    offsets, at = [], 0
    for size in splits:
        offsets.append(at)
        at += size
    return offsets
