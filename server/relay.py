"""`PeerRelay`: point-to-point messages between workers, relayed by the coordinator (pure: no I/O).

A worker sends a message for another worker of its job as `PeerMessage` pieces on its own Exchange
stream (docs/PROTOCOL.md "Point-to-point"); the relay passes each piece on, as it comes, to the
receiver's stream, naming the sender, and tells the sender once the receiver's stream has written
each piece (`PeerDelivered`, up to which byte): the sender keeps a window of bytes without that
notice, and a send is complete once its last piece was written. Each byte crosses the sender's link
and the receiver's link once, and no other worker sees it. Pieces of one sender reach one receiver
in the order sent (one stream in, one stream out), so messages between two workers keep their
order. A receiver that joined but has not opened its stream yet gets the pieces held for it until
it does (workers open their streams after the world completes, and a fast sender may already be
sending).

The relay does not take the sender's window on trust. Every piece not yet written to its
receiver's stream (held, or queued there) counts against its sender and its receiver
(`RelayBounds`); while either is over its bound, `holding_back(sender)` says so and the coordinator
stops reading the sender's stream (server/streams.py), which HTTP/2 flow control turns into
back-pressure on the sender: what the relay holds is bounded by these bounds, not by what senders
send. A sender within its window never meets them.

Every piece is checked against the message it belongs to: one message at a time from one worker to
another, numbered upwards; its pieces carry the message's tag and size and come in order, each
starting where the one before ended, none past the end (so a `PeerDelivered` never passes it
either). Tags gradserver reserves for live recovery pass only as recovery uses them: a request to
anyone, a donor's answer only to a worker that asked it. What the relay refuses, it answers with an
error to the sender naming the sender, the message (its receiver, tag and number) and the rule; a
refused message's later pieces are dropped without another answer.

It subscribes to the coordinator's lifecycle (`subscribe`, server/lifecycle.py): it hears when a
stream opens, every batch that goes out (the notices that free its bounds), when a worker leaves
and when a job resets, holds back senders, takes the `PeerPiece`s read from the streams, and offers
each joiner the members it shares memory with (`host_peers`): workers that said the
same `peer_host_id` move their messages to each other through shared memory
(worker/transports/peer_rings.py) and never through here. That memory is shared out once, as the job
begins, so it is offered only under `--on-worker-loss abort` and never to a worker taking a departed
one's place; the departed worker's peers relay to its place from then on, and when a replacement's
stream opens every other member hears so (`MemberJoinedOut`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from gradserver.common.config import MIB
from gradserver.common.errors import Status
from gradserver.common.messages import ErrorOut, MemberJoinedOut, PeerDeliveredOut, PeerPiece

from .lifecycle import Departure, Lifecycle, Shell
from .membership import Member
from .outgoing import Outgoing

_KEY_BYTES = 16

# Tags gradserver reserves for its own messages: the same range as worker/recovery.py's
# RESERVED_TAGS (this side may not import the client), which `WorkerClient.send_to` refuses.
# Live recovery uses the first three: a newcomer's request, and the donor's manifest and data.
RESERVED_TAGS = range(-(2**62), -(2**62) + 16)
_REQUEST_TAG = RESERVED_TAGS[0]
_ANSWER_TAGS = (RESERVED_TAGS[1], RESERVED_TAGS[2])


@dataclasses.dataclass(frozen=True)
class RelayBounds:
    """What the relay lets wait for a receiver's stream, from the client's window.

    A relaying client keeps at most `window_pieces` pieces of the job's chunk size, and at least
    `window_min_bytes`, without `PeerDelivered` (worker/transports/mailbox.py). A sender may
    have that window waiting, each piece counted with `piece_overhead` bytes for what holding it
    costs besides its data (its encoded message, its notice), so a stream of tiny pieces is
    bounded as well. A receiver may have `receiver_windows` senders' windows waiting for it: held
    while its stream is not open, or queued there while it reads slower than they send."""

    window_pieces: int = 16
    window_min_bytes: int = 4 * MIB
    piece_overhead: int = 1024
    receiver_windows: int = 2

    def cost(self, nbytes: int) -> int:
        """What one piece of `nbytes` counts while it waits."""
        return nbytes + self.piece_overhead

    def sender_bytes(self, piece_bytes: int) -> int:
        """A sender's bound: its client's whole window, in pieces of `piece_bytes`."""
        window = max(self.window_pieces * piece_bytes, self.window_min_bytes)
        return window + math.ceil(window / max(1, piece_bytes)) * self.piece_overhead

    def receiver_bytes(self, piece_bytes: int) -> int:
        """A receiver's bound, over all its senders."""
        return self.receiver_windows * self.sender_bytes(piece_bytes)


@dataclasses.dataclass(frozen=True)
class AfterWritten:
    """`notice` is to go out once `worker`'s stream wrote everything queued for it before."""

    worker: int
    notice: Outgoing


Relayed = list[Outgoing | AfterWritten]


@dataclasses.dataclass
class _Message:
    """The message being relayed from one worker to another: the next piece starts at `upto`."""

    sequence: int
    tag: int
    total: int
    upto: int = 0


@dataclasses.dataclass
class _Waiting:
    """A piece relayed but not yet written to its receiver's stream: what it counts, and
    against whom (`sender` None: a worker that is gone, whose bound no longer matters)."""

    notice: Outgoing
    sender: int | None
    receiver: int
    cost: int


class PeerRelay:
    """The relay of one job (a fresh job starts a fresh one: `reset`)."""

    def __init__(
        self,
        world_size: int,
        *,
        host_peers: bool,
        streaming: Callable[[int], bool],
        first_step: Callable[[int], int] = lambda w: 0,
        piece_bytes: Callable[[], int] = lambda: MIB,
        bounds: RelayBounds = RelayBounds(),
    ) -> None:
        """`host_peers`: whether joiners are offered the members they share memory with;
        `streaming(w)`: whether member w's stream is open (its pieces can be queued there);
        `first_step(w)`: the first step member w takes part in; `piece_bytes()`: the largest piece
        (the job's chunk size, or the largest it can be before it is chosen), which sizes
        `bounds`."""
        self._world = world_size
        self._share_memory = host_peers
        self._streaming = streaming
        self._first_step = first_step
        self._piece_bytes = piece_bytes
        self._bounds = bounds
        self._gone: dict[int, str] = {}  # worker id -> why it left (until one takes its place)
        self._held: dict[int, Relayed] = {}  # receiver -> pieces (and notices) for its stream-to-be
        self._keys: dict[str, bytes] = {}  # peer_host_id -> the key naming that host's mailboxes
        # The rules, per (sender, receiver): the message under way, the last one begun, the last
        # one refused (its later pieces are dropped); (requester, donor) of live recovery.
        self._open: dict[tuple[int, int], _Message] = {}
        self._begun: dict[tuple[int, int], int] = {}
        self._refused: dict[tuple[int, int], int] = {}
        self._asked: set[tuple[int, int]] = set()
        # The bounds: each piece not yet written, by its notice's identity (the coordinator hands
        # the very object back through `sent` once the receiver's stream wrote the piece), and
        # what waits from each sender (per receiver) and for each receiver.
        self._waiting: dict[int, _Waiting] = {}
        self._from: dict[int, dict[int, int]] = {}
        self._to: collections.Counter[int] = collections.Counter()

    def offer_to(self, member: Member, members: Sequence[Member]) -> dict[str, Any]:
        """The JoinAccepted fields for `member`: who shares its memory, and their key (none for
        a worker taking a departed one's place: the host's memory was shared out as the job
        began, and its peers relay to it from the departure on)."""
        if not self._share_memory or not member.peer_host_id or member.worker_id in self._gone:
            return {}
        peers = tuple(sorted(m.worker_id for m in members if m.peer_host_id == member.peer_host_id))
        if len(peers) < 2:
            return {}
        key = self._keys.setdefault(member.peer_host_id, secrets.token_bytes(_KEY_BYTES))
        return {"host_peers": peers, "peer_key": key}

    # --- relaying -------------------------------------------------------------------------------

    def forward(self, sender: int, piece: PeerPiece) -> Relayed:
        """One piece from `sender`: passed on to its receiver, the sender told once the
        receiver's stream wrote it; refused naming the rule it breaks; or dropped, as a later
        piece of a message already refused."""
        receiver = piece.peer
        if receiver >= self._world or receiver == sender:
            why = self._misaddressed(sender, receiver)
            return self._refuse(sender, piece, Status.INVALID_ARGUMENT, why, culprit=receiver)
        pair = (sender, receiver)
        if self._refused.get(pair) == piece.sequence:
            return []  # the sender heard why at its first refused piece
        gone = self._gone.get(receiver)
        if gone is not None:
            why = f"worker {receiver} is no longer in the job ({gone})"
            return self._refuse(sender, piece, Status.ABORTED, why, culprit=receiver)
        problem = self._out_of_place(pair, piece)
        if problem is not None:
            return self._refuse(sender, piece, *problem, culprit=sender)
        self._accept(pair, piece)
        return self._pass_on(sender, piece)

    def _misaddressed(self, sender: int, receiver: int) -> str:
        if receiver >= self._world:
            return f"the job has workers 0..{self._world - 1}"
        return "a worker does not send to itself through the coordinator"

    def _out_of_place(self, pair: tuple[int, int], piece: PeerPiece) -> tuple[Status, str] | None:
        """Why `piece` does not belong where it claims to (None: it does)."""
        start, end = piece.offset, piece.offset + len(piece.data)
        span = f"the piece [{start}, {end})"
        current = self._open.get(pair)
        if current is not None and current.sequence == piece.sequence:
            if piece.total_bytes != current.total:
                return Status.INVALID_ARGUMENT, (
                    f"its total_bytes changed from {current.total} to {piece.total_bytes}: every piece "
                    "of a message carries its size"
                )
            if piece.tag != current.tag:
                return Status.INVALID_ARGUMENT, (
                    f"its tag changed from {current.tag} to {piece.tag}: every piece of a message carries "
                    "its tag"
                )
            if start != current.upto:
                if end <= current.upto:
                    what = f"repeats bytes already relayed (up to byte {current.upto})"
                elif start < current.upto:
                    what = f"overlaps bytes already relayed (up to byte {current.upto})"
                else:
                    what = f"skips bytes [{current.upto}, {start}), never sent"
                return Status.INVALID_ARGUMENT, (
                    f"{span} {what}: a message's pieces come in order, each starting where the one "
                    "before ended"
                )
        else:
            last = self._begun.get(pair)
            if last is not None and piece.sequence <= last:
                # (the message under way never gets here: `current` is it)
                told = (
                    "was relayed whole already" if piece.sequence == last else f"comes after message {last}"
                )
                return Status.INVALID_ARGUMENT, (
                    f"it {told}: the messages from one worker to another are numbered upwards"
                )
            if start != 0:
                return Status.INVALID_ARGUMENT, (
                    f"{span} is the first the relay saw of it: a message's first piece starts at byte 0"
                )
        if end > piece.total_bytes:
            return Status.INVALID_ARGUMENT, f"{span} ends past the message's {piece.total_bytes} bytes"
        if current is None or current.sequence != piece.sequence:
            return self._tag_problem(*pair, piece.tag)
        return None

    def _tag_problem(self, sender: int, receiver: int, tag: int) -> tuple[Status, str] | None:
        """Why a message with `tag` may not go from `sender` to `receiver` (None: it may)."""
        if tag not in RESERVED_TAGS or tag == _REQUEST_TAG:
            return None
        if tag in _ANSWER_TAGS:
            if (receiver, sender) in self._asked:
                return None
            return Status.PERMISSION_DENIED, (
                f"tag {tag} carries a donor's state in live recovery, and worker {receiver} did not ask "
                f"worker {sender} for it"
            )
        return Status.INVALID_ARGUMENT, (
            f"tag {tag} is reserved for gradserver's own messages ({RESERVED_TAGS.start}.."
            f"{RESERVED_TAGS.stop - 1}), and gradserver sends none with it"
        )

    def _accept(self, pair: tuple[int, int], piece: PeerPiece) -> None:
        """Notes that `piece` was relayed: where its message's next piece starts."""
        current = self._open.get(pair)
        if current is None or current.sequence != piece.sequence:
            # A new message: one the sender began before and did not finish, it gave up (its
            # send failed on its side); any later piece of that one is refused.
            current = self._open[pair] = _Message(piece.sequence, piece.tag, piece.total_bytes)
            self._begun[pair] = piece.sequence
            if piece.tag == _REQUEST_TAG:
                self._asked.add(pair)
        current.upto = piece.offset + len(piece.data)
        if current.upto >= current.total:
            del self._open[pair]

    def _pass_on(self, sender: int, piece: PeerPiece) -> Relayed:
        receiver = piece.peer
        relayed = PeerPiece(sender, piece.tag, piece.sequence, piece.total_bytes, piece.offset, piece.data)
        upto = piece.offset + len(piece.data)
        notice = Outgoing((sender,), PeerDeliveredOut(receiver, piece.sequence, upto))
        self._wait(_Waiting(notice, sender, receiver, self._bounds.cost(len(piece.data))))
        out: Relayed = [Outgoing((receiver,), relayed), AfterWritten(receiver, notice)]
        if self._streaming(receiver):
            return out
        # The receiver's stream is not open yet: its pieces wait, and so do the sender's notices.
        self._held.setdefault(receiver, []).extend(out)
        return []

    def _refuse(self, sender: int, piece: PeerPiece, code: Status, problem: str, *, culprit: int) -> Relayed:
        """The refusal of `piece`'s message, to its sender; `culprit`: the receiver when the
        message cannot reach it, the sender when its message breaks a rule."""
        receiver = piece.peer
        if 0 <= receiver < self._world:
            pair = (sender, receiver)
            self._refused[pair] = piece.sequence
            current = self._open.get(pair)
            if current is not None and current.sequence == piece.sequence:
                del self._open[pair]
        message = (
            f"worker {sender}: point-to-point message {piece.sequence} (tag {piece.tag}) for worker "
            f"{receiver} refused: {problem}"
        )
        refused = PeerPiece(receiver, piece.tag, piece.sequence, piece.total_bytes, piece.offset)
        event = ErrorOut(int(code), message, 0, culprit_worker_id=culprit, peer_message=refused)
        return [Outgoing((sender,), event)]

    def opened(self, worker_id: int) -> Relayed:
        """Member `worker_id`'s stream opened: what was held for it, in order; when it takes a
        departed worker's place, every other streaming member hears so first."""
        out: Relayed = []
        if self._gone.pop(worker_id, None) is not None:
            others = tuple(w for w in range(self._world) if w != worker_id and self._streaming(w))
            if others:
                out.append(Outgoing(others, MemberJoinedOut(worker_id, self._first_step(worker_id))))
        return out + self._held.pop(worker_id, [])

    # --- the bounds -------------------------------------------------------------------------------

    def holding_back(self, sender: int) -> bool:
        """Whether the coordinator is to read no more of `sender`'s stream for now: what it
        relayed and its receivers' streams did not write yet is over its bound, or it waits for a
        receiver for which more than that receiver's bound waits."""
        mine = self._from.get(sender)
        if not mine:
            return False
        piece_bytes = self._piece_bytes()
        if sum(mine.values()) > self._bounds.sender_bytes(piece_bytes):
            return True
        limit = self._bounds.receiver_bytes(piece_bytes)
        return any(self._to[receiver] > limit for receiver in mine)

    def waiting_bytes(self, worker_id: int) -> tuple[int, int]:
        """(from it, for it): what pieces relayed from and to `worker_id` count while no stream
        has written them yet (their data and overhead)."""
        return sum(self._from.get(worker_id, {}).values()), self._to[worker_id]

    def _wait(self, waiting: _Waiting) -> None:
        self._waiting[id(waiting.notice)] = waiting
        assert waiting.sender is not None
        mine = self._from.setdefault(waiting.sender, {})
        mine[waiting.receiver] = mine.get(waiting.receiver, 0) + waiting.cost
        self._to[waiting.receiver] += waiting.cost

    def _written(self, waiting: _Waiting) -> None:
        self._to[waiting.receiver] -= waiting.cost
        if self._to[waiting.receiver] <= 0:
            del self._to[waiting.receiver]
        if waiting.sender is not None:
            self._unsend(waiting)

    def _unsend(self, waiting: _Waiting) -> None:
        """It no longer counts against its sender."""
        assert waiting.sender is not None
        mine = self._from[waiting.sender]
        mine[waiting.receiver] -= waiting.cost
        if mine[waiting.receiver] <= 0:
            del mine[waiting.receiver]
        if not mine:
            del self._from[waiting.sender]
        waiting.sender = None

    # --- the lifecycle -------------------------------------------------------------------------

    def sent(self, outgoing: Sequence[Outgoing]) -> None:
        """A notice going out: its piece was written, and counts no more."""
        for item in outgoing:
            if isinstance(item.event, PeerDeliveredOut):
                waiting = self._waiting.get(id(item))
                if waiting is not None and waiting.notice is item:
                    del self._waiting[id(item)]
                    self._written(waiting)

    def worker_gone(self, worker_id: int, reason: str, *, lost: bool) -> None:
        """Pieces for it are refused from now on, naming why (those held for it are dropped: it
        never read them, and neither will it read those queued on its stream); a worker that takes
        its place starts afresh, as receiver and as sender."""
        self._gone[worker_id] = f"it was lost: {reason}" if lost else f"it left: {reason}"
        self._held.pop(worker_id, None)
        for key, waiting in list(self._waiting.items()):
            if waiting.receiver == worker_id:
                del self._waiting[key]
                self._written(waiting)
            elif waiting.sender == worker_id:
                self._unsend(waiting)  # still queued for its receiver, whose bound it counts in
        for rules in (self._open, self._begun, self._refused):
            for pair in [p for p in rules if worker_id in p]:
                del rules[pair]
        self._asked = {pair for pair in self._asked if worker_id not in pair}

    def reset(self) -> None:
        self._gone.clear()
        self._held.clear()
        self._keys.clear()
        self._open.clear()
        self._begun.clear()
        self._refused.clear()
        self._asked.clear()
        self._waiting.clear()
        self._from.clear()
        self._to.clear()


def subscribe(lifecycle: Lifecycle, shell: Shell) -> PeerRelay:
    """The coordinator's relay: built from its settings and subscribed to its lifecycle."""
    config = shell.config
    relay = PeerRelay(
        config.world_size,
        host_peers=config.on_worker_loss == "abort",
        streaming=lambda w: w in shell.streaming_workers(),
        first_step=lambda w: shell.table().first_step(w),
        piece_bytes=shell.chunk_bytes,
    )
    send = functools.partial(_send, shell)

    def gone(departure: Departure) -> None:
        relay.worker_gone(departure.worker_id, departure.reason, lost=departure.lost)

    lifecycle.on_joined(relay.offer_to)
    lifecycle.on_stream_opened(lambda w: send(relay.opened(w)))
    lifecycle.on_sent(relay.sent)
    lifecycle.on_departed(gone)
    lifecycle.on_reset(relay.reset)
    lifecycle.on_hold_back(relay.holding_back)
    lifecycle.handle_message(PeerPiece, lambda sender, piece: send(relay.forward(sender.worker_id, piece)))
    return relay


def _send(shell: Shell, items: Relayed) -> None:
    """Sends what the relay answered; a notice to a sender goes once the receiver's stream
    wrote the piece before it."""
    batch: list[Outgoing] = []
    for item in items:
        if isinstance(item, AfterWritten):
            shell.deliver(batch)
            batch = []
            shell.after_written(item.worker, functools.partial(shell.deliver, [item.notice]))
        else:
            batch.append(item)
    shell.deliver(batch)
