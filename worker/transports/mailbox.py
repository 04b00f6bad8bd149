"""`Mailbox`: one worker's point-to-point messages (docs/PROTOCOL.md "Point-to-point").

A message goes to another worker of the job with a tag; the receiver takes it with a receive
naming the sender (or any sender) and the tag. Messages from one sender with one tag are received
in the order sent. Between workers of one host that share their mailboxes (`peer_rings`), a
message is written into the pair's ring and read out of it straight into the receiver's buffer;
to any other worker it goes through the coordinator (`PeerPiece` messages on the link, in pieces of
the job's chunk size) and is assembled on this side.

Receives are matched in the order they were posted, with the messages in the order they came, so
two receives of one sender and tag get its messages in order whichever is waited for first.
Nothing runs in the background for a receive: whoever waits moves the bytes (from the rings, or
those the link's receiver thread assembled) and completes every receive they are for. A send
writes what it can at once; what does not fit yet (a message larger than the ring's free room, or
of many pieces) is finished by the mailbox's sender thread, so a send never waits for its
receiver to post a receive (every rank may send before it receives, as in a ring).

A send is complete once its last byte is in the receiver's ring, or the coordinator wrote its last
piece to the receiver's stream (`PeerDeliveredOut`, one per piece: a relaying sender keeps at most a
window of bytes without it, so a slow receiver holds its senders back instead of filling the
coordinator); refused (its receiver left), it fails naming the receiver. When the link breaks (the
job failed: a worker was lost, the coordinator stopped), every send and receive not complete fails
with the link's error, which names the lost worker.

What the relay passes on is checked here too, as the coordinator checks it (server/relay.py): a
sender's messages come one at a time, numbered upwards, each in pieces in order with one tag and
size, none past its end. A piece that does not fit its message fails that message alone (its
receive, or the one that would have taken it, raises naming the sender), so no receive completes
with bytes that were not sent and the link's receiver thread goes on; a message its sender left
unfinished fails once that sender's next message begins. A `PeerDeliveredOut` for bytes this worker
has not sent fails that send.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time

import numpy as np

from gradserver.common.codec import PEER_BYTES_PER_ELEMENT
from gradserver.common.errors import (
    AbortedError,
    DeadlineExceededError,
    GradServerError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from gradserver.common.futex import NO_SPIN, spin_for
from gradserver.common.messages import JoinAccepted, PeerDeliveredOut, PeerPiece

from .base import ControlPlane
from .peer_rings import FRAME, PeerRings, padded

log = logging.getLogger("gradserver.worker")

_SLEEP_S = 0.05  # the longest a waiter sleeps before it looks at the link's state again
_RELAY_WINDOW_PIECES = 16
_RELAY_WINDOW_MIN = 4 * 2**20
_JOINS_KEPT = 64


class PeerSend:
    """One message on its way: `wait` until it is delivered (or raises why it was not)."""

    def __init__(self, mailbox: Mailbox, peer: int, tag: int, data: np.ndarray, sequence: int) -> None:
        self._mailbox = mailbox
        self.peer = peer
        self.tag = tag
        self.data = data
        self.sequence = sequence
        self.written = 0  # bytes of its frame in the ring, or of its pieces sent
        self.acked = 0  # relayed: bytes its receiver's stream took (PeerDelivered)
        self.busy = False  # the sending thread is writing it (no other thread may)
        self.error: GradServerError | None = None
        self.done = False

    def describe(self) -> str:
        return (
            f"worker {self._mailbox.worker_id}: send of {self.data.size} bytes to worker {self.peer} "
            f"(tag {self.tag})"
        )

    def _finish(self, error: GradServerError | None = None) -> None:
        if not self.done:
            self.error = error
            self.done = True

    def wait(self, timeout: float | None = None) -> None:
        """Returns once delivered; raises the reason it was not, or DeadlineExceededError after
        `timeout` seconds (None: the client's receive timeout) while it is still on its way.
        While it waits, this worker reads what its peers send it (so two workers that each wait
        for their own send to the other never wait for good)."""
        self._mailbox.wait_for(self, self._mailbox.timeout if timeout is None else timeout)
        if self.error is not None:
            raise _named(self.error, self.describe())


class PeerReceive:
    """One posted receive: `wait` for its message (`data`, from `sender`)."""

    def __init__(self, mailbox: Mailbox, source: int | None, tag: int, into: np.ndarray | None) -> None:
        self._mailbox = mailbox
        self.source = source
        self.tag = tag
        self.into = into
        self.sender = -1
        self.data = np.zeros(0, np.uint8)
        self.error: GradServerError | None = None
        self.done = False

    def describe(self) -> str:
        who = "any worker" if self.source is None else f"worker {self.source}"
        return f"worker {self._mailbox.worker_id}: receive from {who} (tag {self.tag})"

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """The message's bytes (in `into` when one was given); raises why there is none, or
        DeadlineExceededError after `timeout` seconds (None: the client's receive timeout): the
        receive stays posted and may be waited for again."""
        self._mailbox.wait_for(self, self._mailbox.timeout if timeout is None else timeout)
        if self.error is not None:
            raise _named(self.error, self.describe())
        return self.data


@dataclasses.dataclass(eq=False)
class _Incoming:
    """A message being moved into its target: a posted receive's buffer, or one of its own."""

    sender: int
    tag: int
    nbytes: int
    target: np.ndarray | None  # None: thrown away (it did not fit the receive it matched)
    receive: PeerReceive | None
    got: int = 0  # bytes moved (ring: of the frame after its header, padding included)
    sequence: int = -1  # relayed: the sender's number of the message


class _Bell:
    """What waiters sleep on: the worker's bell in its host's rings, else a condition."""

    def __init__(self, rings: PeerRings | None) -> None:
        self._rings = rings
        self._cond = threading.Condition()
        self._count = 0

    def detach(self) -> None:
        """The rings are about to be unmapped: from now on a condition serves (under its lock, so
        no ring of them is under way)."""
        with self._cond:
            self._rings = None
            self._count += 1
            self._cond.notify_all()

    def value(self) -> int:
        with self._cond:
            return self._rings.bell() if self._rings is not None else self._count

    def ring(self) -> None:
        with self._cond:
            if self._rings is not None:
                self._rings.ring(self._rings.position)
                return
            self._count += 1
            self._cond.notify_all()

    def sleep(self, seen: int, timeout_s: float) -> None:
        rings = self._rings
        if rings is not None:
            rings.sleep(seen, timeout_s)  # unmapped meanwhile, the futex call returns at once
            return
        with self._cond:
            if self._count == seen:
                self._cond.wait(timeout_s)


class Mailbox:
    """The point-to-point messages of one worker, over its link and its host's rings."""

    def __init__(
        self, link: ControlPlane, accepted: JoinAccepted, timeout: float, rings: PeerRings | None
    ) -> None:
        self.worker_id = accepted.worker_id
        self.timeout = timeout
        self._world = accepted.total_workers
        self._link = link
        self._piece_bytes = max(8, accepted.chunk_bytes)
        self._largest = accepted.max_tensor_elements * PEER_BYTES_PER_ELEMENT  # a message, bytes
        self._rings = rings
        peers = () if rings is None else rings.peers
        self._local = {w: peers.index(w) for w in peers if w != self.worker_id}
        self._bell = _Bell(rings)
        # Spin before sleeping only while every peer of this host can have a core of its own.
        self._spin = spin_for(max(2, len(peers))) if rings is not None else NO_SPIN
        self._lock = threading.Lock()
        self._sequence = itertools.count()
        self._posted: list[PeerReceive] = []
        # (sender, tag, its bytes or why it failed), as they came
        self._unexpected: list[tuple[int, int, np.ndarray | GradServerError]] = []
        # Relayed: the message each sender is sending this worker (one at a time, in order), and
        # the number of the last one it began (a later piece of an earlier one is dropped).
        self._assembling: dict[int, _Incoming] = {}
        self._begun: dict[int, int] = {}
        self._reading: dict[int, _Incoming] = {}  # from the rings: sender -> its message being read
        self._progress = threading.Lock()  # one thread reads the rings at a time
        self._queued: dict[int, collections.deque[PeerSend]] = {}  # peer -> sends not fully written
        self._relayed: dict[int, PeerSend] = {}  # sequence -> relayed sends not delivered whole
        # Relayed bytes the coordinator has not yet written to their receivers' streams (of the
        # sends in `_relayed`): at most a window of them, so what waits there stays bounded.
        self._window = max(_RELAY_WINDOW_PIECES * self._piece_bytes, _RELAY_WINDOW_MIN)
        self._broken: GradServerError | None = None
        self._gone: dict[int, GradServerError] = {}  # workers that left the job, and how
        self._joins: list[tuple[int, int]] = []  # replacements: (worker id, first step)
        self._closed = False
        self._work = threading.Condition(self._lock)
        self._sender: threading.Thread | None = None
        link.on_peer_messages(self)

    @property
    def transport(self) -> str:
        return "shared memory" if self._rings is not None else "coordinator"

    def same_host(self, peer: int) -> bool:
        """Whether messages to and from `peer` go through this host's shared memory."""
        return peer in self._local

    # --- sending ---------------------------------------------------------------------------------

    def send(self, peer: int, tag: int, data: np.ndarray) -> PeerSend:
        """Starts sending `data` (raw bytes, read until the send is complete) to worker `peer`."""
        if not 0 <= peer < self._world:
            raise InvalidArgumentError(
                f"worker {self.worker_id}: send to worker {peer}: the job has workers 0..{self._world - 1}"
            )
        payload = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        send = PeerSend(self, peer, tag, payload, next(self._sequence))
        with self._lock:
            self._raise_if_unusable(send.describe())
            if peer == self.worker_id:
                self._arrived_whole(peer, tag, payload.copy())
                send._finish()
                return send
            queue = self._queued.setdefault(peer, collections.deque())
            queue.append(send)
            send.busy = len(queue) == 1
        if send.busy and self._advance(send, inline=True):
            return send
        with self._lock:
            send.busy = False
            self._start_sender()
            self._work.notify_all()
        return send

    def _advance(self, send: PeerSend, *, inline: bool) -> bool:
        """Moves `send` on as far as it goes without waiting (inline: only if it is one piece for
        the coordinator); True once it is fully written (it left the queue then)."""
        try:
            if send.peer in self._local:
                assert self._rings is not None
                frame = FRAME.pack(send.tag, send.data.size)
                send.written = self._rings.write(self._local[send.peer], frame, send.data, send.written)
                whole = send.written >= FRAME.size + padded(send.data.size)
            else:
                if inline and send.data.size > self._piece_bytes:
                    return False
                whole = self._send_pieces(send, window=not inline)
        except GradServerError as exc:
            self._fail_send(send, exc)
            whole = True
        if whole:
            with self._lock:
                send.busy = False
                queue = self._queued.get(send.peer)
                if queue and queue[0] is send:
                    queue.popleft()
                if send.peer in self._local:
                    send._finish()
                if queue:
                    self._start_sender()
                    self._work.notify_all()
            if not inline:
                self._bell.ring()  # its waiter sleeps on the bell
        return whole

    def _send_pieces(self, send: PeerSend, *, window: bool) -> bool:
        """Sends `send`'s pieces to the coordinator while the window has room (`window`; a piece
        always goes when nothing is outstanding); True once every piece went."""
        total = send.data.size
        with self._lock:
            if send.written == 0:
                self._relayed[send.sequence] = send
        while True:
            offset = send.written
            piece = send.data[offset : offset + self._piece_bytes]
            with self._lock:
                if send.done:
                    return True  # failed meanwhile: its other pieces are not sent
                outstanding = sum(s.written - s.acked for s in self._relayed.values())
                if window and outstanding and outstanding + piece.size > self._window:
                    return False
            # Counted before it goes, so a notice for it never finds it unsent (a notice past
            # `written` is one this worker cannot trust).
            send.written = offset + piece.size
            self._link.send(PeerPiece(send.peer, send.tag, send.sequence, total, offset, piece.data))
            if send.written >= total:
                return True

    def _fail_send(self, send: PeerSend, error: GradServerError) -> None:
        with self._lock:
            self._relayed.pop(send.sequence, None)
        send._finish(error)

    def _start_sender(self) -> None:
        """Starts the sender thread if it is not running (lock held)."""
        if self._sender is None and not self._closed:
            self._sender = threading.Thread(
                target=self._send_loop, name=f"gradserver-p2p-send-{self.worker_id}", daemon=True
            )
            self._sender.start()

    def _send_loop(self) -> None:
        """Finishes the sends that did not fit at once, the oldest to each peer first."""
        while True:
            with self._lock:
                while not self._closed and not self._idle_heads():
                    self._work.wait(1.0)
                if self._closed:
                    return
                heads = self._idle_heads()
                for send in heads:
                    send.busy = True
            try:
                self._send_some(heads)
            finally:
                with self._lock:
                    for send in heads:
                        send.busy = False

    def _send_some(self, heads: list[PeerSend]) -> None:
        """One pass over the oldest sends to each peer; sleeps when none could move (every one
        waits for room in a ring), reading meanwhile what this worker's peers send it (they may be
        waiting for room themselves)."""
        seen = self._bell.value()
        if [send for send in heads if self._advance(send, inline=False)]:
            return
        waiting = [self._local[s.peer] for s in heads if s.peer in self._local]
        if self._rings is None or not waiting:
            with self._lock:  # relayed sends wait for the window: a notice frees it
                if not self._closed and self._broken is None:
                    self._work.wait(_SLEEP_S)
            return
        for position in waiting:
            self._rings.want_room(position, True)
        moved = [send for send in heads if self._advance(send, inline=False)]
        if not moved and not self._progress_rings():
            self._bell.sleep(seen, _SLEEP_S)
        for position in waiting:
            self._rings.want_room(position, False)

    def _idle_heads(self) -> list[PeerSend]:
        """The oldest unwritten send to each peer that no thread is writing (lock held)."""
        return [queue[0] for queue in self._queued.values() if queue and not queue[0].busy]

    # --- what the link hears ---------------------------------------------------------------------

    def peer_message(self, event: PeerPiece | PeerDeliveredOut) -> None:
        """From the link's receiver thread: a piece of a relayed message, or a send delivered."""
        if isinstance(event, PeerDeliveredOut):
            self._delivered(event)
        elif self._piece(event):
            self._bell.ring()

    def _delivered(self, event: PeerDeliveredOut) -> None:
        with self._lock:
            send = self._relayed.get(event.sequence)
            if send is None:
                return
            if event.peer != send.peer or event.upto > send.written:
                del self._relayed[event.sequence]
                send._finish(
                    InternalError(
                        f"the coordinator said worker {event.peer} took this send up to byte {event.upto}, "
                        f"but {send.written} of its bytes went to worker {send.peer} so far",
                        worker_id=event.peer,
                    )
                )
            else:
                send.acked = max(send.acked, event.upto)
                if event.upto >= send.data.size:
                    del self._relayed[event.sequence]
                    send._finish()
            self._work.notify_all()  # the window has room
        self._bell.ring()

    def _piece(self, piece: PeerPiece) -> bool:
        """Moves one relayed piece into its message; True when a receive may have ended (its
        waiter is to be rung)."""
        sender, data = piece.peer, np.frombuffer(piece.data, np.uint8)
        end = piece.offset + data.size
        voided = False
        with self._lock:
            incoming = self._assembling.get(sender)
            if incoming is None or incoming.sequence != piece.sequence:
                last = self._begun.get(sender)
                if last is not None and piece.sequence <= last:
                    # The rest of a message this worker dropped (it failed, or its link did).
                    log.debug(
                        "worker %d: dropped a piece of message %d from worker %d, which it dropped",
                        self.worker_id,
                        piece.sequence,
                        sender,
                    )
                    return False
                self._begun[sender] = piece.sequence
                if incoming is not None:
                    # Its sender moved on to the next message: the rest of this one never comes.
                    del self._assembling[sender]
                    self._void(incoming, _unfinished(incoming))
                    voided = True
                problem = self._first_piece_problem(piece, end)
                if problem is not None:
                    self._void(_Incoming(sender, piece.tag, piece.total_bytes, None, None), problem)
                    return True
                try:
                    incoming = self._incoming(sender, piece.tag, piece.total_bytes)
                except MemoryError:
                    what = f"worker {sender}'s message {piece.sequence} (tag {piece.tag})"
                    unheld = ResourceExhaustedError(
                        f"{what} of {piece.total_bytes} bytes does not fit in this worker's memory",
                        worker_id=sender,
                    )
                    self._void(_Incoming(sender, piece.tag, piece.total_bytes, None, None), unheld)
                    return True
                incoming.sequence = piece.sequence
                self._assembling[sender] = incoming
            else:
                problem = _misfit(incoming, piece, end)
                if problem is not None:
                    del self._assembling[sender]
                    self._void(incoming, problem)
                    return True
        if incoming.target is not None and data.size:
            incoming.target[piece.offset : end] = data
        with self._lock:
            if self._assembling.get(sender) is not incoming:
                return voided  # failed meanwhile (a departure, the link)
            incoming.got = end
            if end < incoming.nbytes:
                return voided
            del self._assembling[sender]
            self._complete(incoming)
        return True

    def _first_piece_problem(self, piece: PeerPiece, end: int) -> InternalError | None:
        """Why the first piece this worker gets of a message cannot begin it (lock held)."""
        if piece.total_bytes > self._largest:
            why = f"it declares {piece.total_bytes} bytes, more than the largest message of {self._largest}"
        elif piece.offset != 0:
            why = f"its first piece here is [{piece.offset}, {end}): its bytes from 0 never came"
        elif end > piece.total_bytes:
            why = f"the piece [{piece.offset}, {end}) ends past its {piece.total_bytes} bytes"
        else:
            return None
        return _malformed(piece.peer, piece.sequence, piece.tag, why)

    def _void(self, incoming: _Incoming, error: GradServerError) -> None:
        """The message `incoming` fails with `error` (lock held): its receive raises it, or, when
        none took it yet, the receive that would have (a message that never came whole is not
        lost silently)."""
        log.warning("worker %d: %s", self.worker_id, error.message)
        receive = incoming.receive
        if receive is None:
            self._arrived_whole(incoming.sender, incoming.tag, error)
        elif not receive.done:
            if receive.error is None:  # else it already says why it cannot take the message
                receive.error = error
            receive.sender = incoming.sender
            receive.done = True

    def peer_refused(self, piece: PeerPiece, error: GradServerError) -> None:
        """The coordinator refused message `piece.sequence` (its receiver is gone, ...)."""
        with self._lock:
            send = self._relayed.pop(piece.sequence, None)
            if send is not None:
                self._work.notify_all()
        if send is not None:
            send._finish(error)
            self._bell.ring()

    def link_broken(self, error: GradServerError) -> None:
        """The link broke: nothing can be sent or received any more."""
        with self._lock:
            if self._broken is not None or self._closed:
                return
            self._broken = error
            self._fail_everything(error)
            self._work.notify_all()
        self._bell.ring()

    def peer_left(self, worker_id: int, reason: str, *, aborts: bool) -> None:
        """Worker `worker_id` left the job: what waits for it fails naming it, and so does what
        is sent to it or received from it from now on (what it sent before is still received).
        `aborts` (--on-worker-loss abort): every send and receive in flight fails too, as every
        collective in flight does."""
        error = AbortedError(f"worker {worker_id} left the job: {reason}", worker_id=worker_id)
        position = self._local.get(worker_id)
        with self._progress:
            # What it wrote into its ring before it left is received (whole messages): read it
            # now, as its ring is never read again. It is a relayed peer from now on (a worker
            # that takes its place joins no host's memory), which the coordinator refuses or
            # passes to its replacement.
            if position is not None and not self._closed:
                self._read_rings()
            with self._lock:
                if self._closed or self._broken is not None:
                    return
                self._gone[worker_id] = error
                self._local.pop(worker_id, None)
                partial = self._reading.pop(position, None) if position is not None else None
                if partial is not None and partial.receive is not None and not partial.receive.done:
                    partial.receive.error, partial.receive.done = error, True
                self._fail_involving(worker_id, error)
                if aborts:
                    self._fail_everything(error)
                self._work.notify_all()
        self._bell.ring()

    def peer_joined(self, worker_id: int, first_step: int) -> None:
        """A worker took the place of one that left, from step `first_step` (announced again when
        it moves its first step later): messages to and from it go through the coordinator (a
        replacement joins no host's memory)."""
        with self._lock:
            left = self._gone.pop(worker_id, None) is not None
            if left:
                self._begun.pop(worker_id, None)  # it numbers its messages afresh
            mine = [i for i, (w, _) in enumerate(self._joins) if w == worker_id]
            if mine and not left:  # a later first step of the same replacement (StartAt)
                self._joins[mine[-1]] = (worker_id, first_step)
                return
            self._joins.append((worker_id, first_step))
            del self._joins[:-_JOINS_KEPT]

    def joins(self) -> list[tuple[int, int]]:
        """(worker id, first step) of the latest workers that took a departed one's place."""
        with self._lock:
            return list(self._joins)

    def _fail_involving(self, worker_id: int, error: GradServerError) -> None:
        """Fails the sends to `worker_id` and the receives waiting for it (lock held); a receive
        from any worker stays, and a message it began is dropped."""
        for receive in [r for r in self._posted if r.source == worker_id]:
            receive.error, receive.done = error, True
            self._posted.remove(receive)
        for incoming in [*self._assembling.values(), *self._reading.values()]:
            if incoming.sender == worker_id and incoming.receive is not None and not incoming.receive.done:
                incoming.receive.error, incoming.receive.done = error, True
        self._assembling.pop(worker_id, None)  # its last pieces will never come
        self._begun.pop(worker_id, None)  # one that takes its place numbers its messages afresh
        for send in self._queued.pop(worker_id, ()):
            send._finish(error)
        for sequence, send in list(self._relayed.items()):
            if send.peer == worker_id:
                send._finish(error)
                del self._relayed[sequence]

    def _fail_everything(self, error: GradServerError) -> None:
        """Fails every send and receive not complete (lock held). A send partly written into a
        ring is still written to its end (failed all the same), so the ring's next message
        starts where the receiver looks for it; a message partly received is read to its end and
        dropped."""
        for receive in self._posted:
            receive.error, receive.done = error, True
        self._posted.clear()
        for incoming in [*self._assembling.values(), *self._reading.values()]:
            if incoming.receive is not None and not incoming.receive.done:
                incoming.receive.error, incoming.receive.done = error, True
        for peer, queue in self._queued.items():
            for send in queue:
                send._finish(error)
            under_way = [s for s in queue if peer in self._local and s.written > 0]
            queue.clear()
            queue.extend(under_way)
        for send in self._relayed.values():
            send._finish(error)
        self._relayed.clear()
        # Messages being relayed to this worker: their senders stop sending them (their pieces
        # still under way are dropped as pieces of a message not begun here).
        for sender, incoming in list(self._assembling.items()):
            if incoming.receive is None or incoming.receive.done:
                del self._assembling[sender]

    # --- receiving -------------------------------------------------------------------------------

    def receive(self, source: int | None, tag: int, into: np.ndarray | None = None) -> PeerReceive:
        """Posts a receive of a message from `source` (None: any worker) with `tag`, into `into`
        (raw bytes: the message must fill it exactly) or a new array."""
        if source is not None and not 0 <= source < self._world:
            raise InvalidArgumentError(
                f"worker {self.worker_id}: receive from worker {source}: the job has workers "
                f"0..{self._world - 1}"
            )
        target = None if into is None else into.reshape(-1).view(np.uint8)
        receive = PeerReceive(self, source, tag, target)
        with self._lock:
            self._raise_if_unusable(receive.describe())
            for i, (sender, got_tag, data) in enumerate(self._unexpected):
                if got_tag == tag and (source is None or source == sender):
                    del self._unexpected[i]
                    self._deliver_to(receive, sender, data)
                    return receive
            if source is not None:
                self._raise_if_gone(source, receive.describe())
            self._posted.append(receive)
        return receive

    def _matching(self, sender: int, tag: int) -> PeerReceive | None:
        """The oldest posted receive a message from `sender` with `tag` is for (lock held)."""
        for i, receive in enumerate(self._posted):
            if receive.tag == tag and (receive.source is None or receive.source == sender):
                del self._posted[i]
                return receive
        return None

    def _incoming(self, sender: int, tag: int, nbytes: int) -> _Incoming:
        """Where a message starting to arrive goes (lock held): a matching receive's buffer
        when it has one of that size, else an array of its own."""
        receive = next((r for r in self._posted if r.tag == tag and r.source in (None, sender)), None)
        if receive is not None and receive.into is not None:
            self._posted.remove(receive)
            if receive.into.size == nbytes:
                return _Incoming(sender, tag, nbytes, receive.into, receive)
            receive.error = _size_mismatch(receive, sender, nbytes)
            return _Incoming(sender, tag, nbytes, None, receive)
        target = np.empty(nbytes, np.uint8)  # raises MemoryError before the receive is taken
        if receive is not None:
            self._posted.remove(receive)
        return _Incoming(sender, tag, nbytes, target, receive)

    def _complete(self, incoming: _Incoming) -> None:
        """A message arrived whole (lock held): its receive is done, or a receive posted since it
        began takes it, or it waits for one."""
        receive = incoming.receive
        if receive is not None and receive.error is not None and receive.done:
            return  # failed meanwhile (a departure, the link): the message is dropped
        if receive is None:
            receive = self._matching(incoming.sender, incoming.tag)
            if receive is None:
                assert incoming.target is not None
                self._unexpected.append((incoming.sender, incoming.tag, incoming.target))
                return
            assert incoming.target is not None
            self._deliver_to(receive, incoming.sender, incoming.target)
            return
        receive.sender = incoming.sender
        if incoming.target is not None:
            receive.data = incoming.target
        receive.done = True

    def _deliver_to(self, receive: PeerReceive, sender: int, data: np.ndarray | GradServerError) -> None:
        """Completes `receive` with a message already in hand, or the reason it failed (lock
        held)."""
        receive.sender = sender
        if isinstance(data, GradServerError):
            receive.error = data
        elif receive.into is None:
            receive.data = data
        elif receive.into.size == data.size:
            receive.into[:] = data
            receive.data = receive.into
        else:
            receive.error = _size_mismatch(receive, sender, data.size)
        receive.done = True

    def _arrived_whole(self, sender: int, tag: int, data: np.ndarray | GradServerError) -> None:
        """A message in hand (lock held), e.g. one this worker sent itself; or why one failed."""
        receive = self._matching(sender, tag)
        if receive is None:
            self._unexpected.append((sender, tag, data))
        else:
            self._deliver_to(receive, sender, data)

    def wait_for(self, operation: PeerSend | PeerReceive, timeout: float) -> None:
        """Moves messages until `operation` is done (or the link broke, or `timeout` passed)."""
        deadline = time.monotonic() + timeout
        started = time.perf_counter()
        spin_end = started + self._spin.budget_s
        while not operation.done:
            seen = self._bell.value()
            if self._progress_rings() or _done(operation):
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(f"{operation.describe()}: not done within {timeout:g} s")
            if time.perf_counter() < spin_end:
                continue
            self._bell.sleep(seen, min(remaining, _SLEEP_S))
        self._spin.observe(time.perf_counter() - started)

    def _progress_rings(self) -> bool:
        """Reads the rings unless another thread is at it; True when a message was completed
        (every waiter is rung then: its operation may be the one)."""
        if self._rings is None or not self._progress.acquire(blocking=False):
            return False
        try:
            moved = self._read_rings()
        finally:
            self._progress.release()
        if moved:
            self._bell.ring()
        return moved

    def _read_rings(self) -> bool:
        """Moves what the rings hold into the receives it is for (progress lock held); True when
        a message was completed."""
        rings = self._rings
        if rings is None or self._closed:
            return False
        completed = False
        for sender, position in self._local.items():
            while True:
                incoming = self._reading.get(position)
                if incoming is None:
                    frame = rings.peek_frame(position)
                    if frame is None:
                        break
                    tag, nbytes = frame
                    rings.read(position, None, skip=FRAME.size)
                    with self._lock:
                        incoming = self._incoming(sender, tag, nbytes)
                    self._reading[position] = incoming
                framed = padded(incoming.nbytes)
                if incoming.got < incoming.nbytes and incoming.target is not None:
                    incoming.got += rings.read(position, incoming.target[incoming.got :])
                if incoming.got < framed and (incoming.got >= incoming.nbytes or incoming.target is None):
                    incoming.got += rings.read(position, None, skip=framed - incoming.got)
                if incoming.got < framed:
                    break  # the rest is not written yet
                del self._reading[position]
                with self._lock:
                    self._complete(incoming)
                completed = True
        return completed

    def _raise_if_gone(self, worker: int, what: str) -> None:
        """`what` names this worker and the operation."""
        gone = self._gone.get(worker)
        if gone is not None:
            raise type(gone)(f"{what}: {gone.message}", worker_id=worker)

    def _raise_if_unusable(self, what: str) -> None:
        """`what` names this worker and the operation."""
        if self._broken is not None:
            raise type(self._broken)(f"{what}: {self._broken.message}", worker_id=self._broken.worker_id)
        if self._closed:
            raise UnavailableError(f"{what}: the client was closed")

    # --- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Fails what is not complete and lets the rings go (no thread reads them afterwards)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fail_everything(UnavailableError(f"worker {self.worker_id}: the client was closed"))
            self._work.notify_all()
            sender = self._sender
        self._bell.ring()
        if sender is not None:
            sender.join(5.0)
        if self._rings is not None:
            with self._progress:
                self._bell.detach()
                self._rings.close()


def _done(operation: PeerSend | PeerReceive) -> bool:
    """Whether `operation` is done now (another thread may have completed it meanwhile)."""
    return operation.done


def _malformed(sender: int, sequence: int, tag: int, why: str) -> InternalError:
    """Why a relayed message from `sender` is dropped: a piece that cannot be part of it."""
    return InternalError(
        f"worker {sender}'s message {sequence} (tag {tag}) came with a piece that does not fit it: {why}; "
        "the message is dropped",
        worker_id=sender,
    )


def _misfit(incoming: _Incoming, piece: PeerPiece, end: int) -> InternalError | None:
    """Why `piece` cannot be the next piece of `incoming` (None: it is)."""
    if piece.total_bytes != incoming.nbytes:
        why = f"its size changed from {incoming.nbytes} to {piece.total_bytes} bytes"
    elif piece.tag != incoming.tag:
        why = f"its tag changed from {incoming.tag} to {piece.tag}"
    elif piece.offset != incoming.got:
        why = f"the piece [{piece.offset}, {end}) came where byte {incoming.got} was next"
    elif end > incoming.nbytes:
        why = f"the piece [{piece.offset}, {end}) ends past its {incoming.nbytes} bytes"
    else:
        return None
    return _malformed(incoming.sender, incoming.sequence, incoming.tag, why)


def _unfinished(incoming: _Incoming) -> AbortedError:
    """Why a relayed message its sender left unfinished (it began its next one) is dropped."""
    return AbortedError(
        f"worker {incoming.sender}'s message {incoming.sequence} (tag {incoming.tag}) ended after "
        f"{incoming.got} of its {incoming.nbytes} bytes (its sender gave it up, or the coordinator "
        "refused the rest); the message is dropped",
        worker_id=incoming.sender,
    )


def _size_mismatch(receive: PeerReceive, sender: int, nbytes: int) -> InvalidArgumentError:
    """Why a message of `nbytes` from `sender` cannot fill `receive`'s buffer."""
    size = 0 if receive.into is None else receive.into.size
    return InvalidArgumentError(
        f"{receive.describe()}: the message from worker {sender} holds {nbytes} bytes, the "
        f"receive's buffer {size}",
        worker_id=sender,
    )


def _named(error: GradServerError, what: str) -> GradServerError:
    """`error` (a fresh one, without the thread's traceback) saying which operation it ended."""
    named = error.message.startswith(what.split(":", maxsplit=1)[0] + ":")  # it names this worker
    message = error.message if named else f"{what}: {error.message}"
    return type(error)(message, worker_id=error.worker_id)
