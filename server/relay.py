"""`PeerRelay`: point-to-point messages between workers, relayed by the coordinator (pure: no I/O).

A worker sends a message for another worker of its job as `PeerMessage` pieces on its own Exchange
stream (docs/PROTOCOL.md "Point-to-point"); the relay passes each piece on, as it comes, to the
receiver's stream, naming the sender, and tells the sender once the receiver's stream has written
each piece (`PeerDelivered`, up to which byte): the sender keeps a window of bytes without that
notice, so what waits at the coordinator for one receiver is bounded by its senders' windows, and a
send is complete once its last piece was written. Each byte crosses the sender's link and the
receiver's link once, and no other worker sees it. Pieces of one sender reach one receiver in the
order sent (one stream in, one stream out), so messages between two workers keep their order. What
the relay refuses, it answers with an error naming the message (its receiver, tag and number) and
why: a receiver out of range, the sender itself, or one that left or was lost. A receiver that
joined but has not opened its stream yet gets the pieces held for it until it does (workers open
their streams after the world completes, and a fast sender may already be sending).

It is also the outbox (server/outbox.py) that learns when a stream opens and when a worker leaves,
and it offers each joiner the members it shares memory with (`host_peers`): workers that said the
same `peer_host_id` move their messages to each other through shared memory
(worker/transports/peer_rings.py) and never through here. That memory is shared out once, as the job
begins, so it is offered only under `--on-worker-loss abort` and never to a worker taking a departed
one's place; the departed worker's peers relay to its place from then on, and when a replacement's
stream opens every other member hears so (`MemberJoinedOut`).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from gradserver.common.errors import Status
from gradserver.common.messages import ChunkIn, ErrorOut, MemberJoinedOut, PeerDeliveredOut, PeerPiece

from .membership import Member
from .outgoing import Outgoing
from .reduction import ReductionTable

_KEY_BYTES = 16


@dataclasses.dataclass(frozen=True)
class AfterWritten:
    """`notice` is to go out once `worker`'s stream wrote everything queued for it before."""

    worker: int
    notice: Outgoing


Relayed = list[Outgoing | AfterWritten]


class PeerRelay:
    """The relay of one job (a fresh job starts a fresh one: `reset`)."""

    def __init__(
        self,
        world_size: int,
        *,
        host_peers: bool,
        streaming: Callable[[int], bool],
        first_step: Callable[[int], int] = lambda w: 0,
    ) -> None:
        """`host_peers`: whether joiners are offered the members they share memory with;
        `streaming(w)`: whether member w's stream is open (its pieces can be queued there);
        `first_step(w)`: the first step member w takes part in."""
        self._world = world_size
        self._share_memory = host_peers
        self._streaming = streaming
        self._first_step = first_step
        self._gone: dict[int, str] = {}  # worker id -> why it left (until one takes its place)
        self._held: dict[int, Relayed] = {}  # receiver -> pieces (and notices) for its stream-to-be
        self._keys: dict[str, bytes] = {}  # peer_host_id -> the key naming that host's mailboxes

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

    def forward(self, sender: int, piece: PeerPiece) -> Relayed:
        """One piece from `sender`: passed on to its receiver, the sender told once the
        receiver's stream wrote it, or refused naming why."""
        receiver = piece.peer
        problem = self._refusal(sender, receiver)
        if problem is not None:
            message = (
                f"worker {sender}: point-to-point message {piece.sequence} (tag {piece.tag}) for worker "
                f"{receiver} refused: {problem}"
            )
            refused = PeerPiece(receiver, piece.tag, piece.sequence, piece.total_bytes, piece.offset)
            malformed = receiver >= self._world or receiver == sender
            code = Status.INVALID_ARGUMENT if malformed else Status.ABORTED
            event = ErrorOut(int(code), message, 0, culprit_worker_id=receiver, peer_message=refused)
            refusal: Relayed = [Outgoing((sender,), event)]
            return refusal
        relayed = PeerPiece(sender, piece.tag, piece.sequence, piece.total_bytes, piece.offset, piece.data)
        upto = piece.offset + len(piece.data)
        notice = Outgoing((sender,), PeerDeliveredOut(receiver, piece.sequence, upto))
        out: Relayed = [Outgoing((receiver,), relayed), AfterWritten(receiver, notice)]
        if self._streaming(receiver):
            return out
        # The receiver's stream is not open yet: its pieces wait, and so do the sender's notices.
        self._held.setdefault(receiver, []).extend(out)
        return []

    def _refusal(self, sender: int, receiver: int) -> str | None:
        if receiver >= self._world:
            return f"the job has workers 0..{self._world - 1}"
        if receiver == sender:
            return "a worker does not send to itself through the coordinator"
        why = self._gone.get(receiver)
        if why is not None:
            return f"worker {receiver} is no longer in the job ({why})"
        return None

    def opened(self, worker_id: int) -> Relayed:
        """Member `worker_id`'s stream opened: what was held for it, in order; when it takes a
        departed worker's place, every other streaming member hears so first."""
        out: Relayed = []
        if self._gone.pop(worker_id, None) is not None:
            others = tuple(w for w in range(self._world) if w != worker_id and self._streaming(w))
            if others:
                out.append(Outgoing(others, MemberJoinedOut(worker_id, self._first_step(worker_id))))
        return out + self._held.pop(worker_id, [])

    # --- the outbox ------------------------------------------------------------------------------

    def route(self, item: Outgoing) -> list[Outgoing]:
        return [item]

    def resolve(self, chunk: ChunkIn, member: Member) -> ChunkIn | None:
        return None

    def sent(self, outgoing: Sequence[Outgoing]) -> None:
        pass

    def streaming(self, worker_id: int) -> None:
        pass

    def worker_gone(self, worker_id: int, reason: str, *, lost: bool, table: ReductionTable) -> None:
        """Pieces for it are refused from now on, naming why (those held for it are dropped: it
        never read them)."""
        self._gone[worker_id] = f"it was lost: {reason}" if lost else f"it left: {reason}"
        self._held.pop(worker_id, None)

    def offer(self) -> dict[str, Any]:
        return {}

    def reset(self) -> None:
        self._gone.clear()
        self._held.clear()
        self._keys.clear()

    def stopping(self, reason: str) -> None:
        pass

    async def close(self) -> None:
        pass
