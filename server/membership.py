"""Who is in the job: join, worker ids, member tokens, the job's fingerprint and liveness.

Worker ids are handed out lowest-free-first. Every joiner waits until the world is complete (or
the join timeout passes, which frees its place again): a Join never returns while a place is
empty. A place whose worker was lost can be taken by a new joiner, which gets the same worker id
and a new member token, so a resumed zombie holding the old token is refused instead of mixing
old data into a new step. The first member's fingerprint (settings every worker must share)
defines the job until the last member is gone; a joiner whose fingerprint differs is refused
before it takes a place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Mapping

from gradserver.common.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    GradServerError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from gradserver.common.messages import ITEM_SIZE, JoinRequestIn

log = logging.getLogger("gradserver.server.membership")


@dataclasses.dataclass
class Member:
    worker_id: int
    node_id: str
    device_type: str
    gpu_count: int
    token: int
    last_seen: float
    streaming: bool = False
    identity: str | None = None
    committed_step: int | None = None
    host: str = ""
    # Said at Join that it will send through shared memory when offered.
    shared_memory: bool = False
    # What it measured of its link at Join (bytes/s, 0: unknown), its wire dtype's element size and,
    # joining partitions 1..K-1, the chunk size partition 0 gave it (0: none).
    link_bytes_per_s: int = 0
    wire_item_size: int = 4
    job_chunk_bytes: int = 0
    # What it shares a host with ("": it cannot sum with others there) and, joining partitions
    # 1..K-1, the host group partition 0 gave it.
    host_id: str = ""
    job_host_group: tuple[int, ...] = ()
    # What it shares memory with for point-to-point messages ("": nothing).
    peer_host_id: str = ""


class Membership:
    def __init__(self, world_size: int, join_timeout: float, session_id: int) -> None:
        self.world_size = world_size
        self.join_timeout = join_timeout
        self.session_id = session_id
        self._members: list[Member | None] = [None] * world_size
        self._complete = asyncio.Event()
        self._fingerprint: dict[str, str] | None = None
        self._refusal: GradServerError | None = None  # set once no Join may wait any longer
        self._refused = asyncio.Event()

    @property
    def joined(self) -> int:
        return sum(m is not None for m in self._members)

    def members(self) -> list[Member]:
        return [m for m in self._members if m is not None]

    def get(self, worker_id: int) -> Member | None:
        if 0 <= worker_id < self.world_size:
            return self._members[worker_id]
        return None

    @property
    def complete(self) -> bool:
        return self._complete.is_set()

    def local_workers(self, member: Member) -> int:
        """How many members connect from the same host as `member` (itself included)."""
        return sum(1 for m in self.members() if m.host == member.host)

    async def join(self, request: JoinRequestIn, identity: str | None = None, host: str = "") -> Member:
        """Takes the lowest free place and waits for the world to be complete. `identity` (the
        client certificate's name under mutual TLS) is bound to the place; `host` is the peer's
        address without its port."""
        self._check_fingerprint(request)
        free = [i for i, m in enumerate(self._members) if m is None]
        if not free and request.rank is None:
            raise ResourceExhaustedError(
                f"node {request.node_id!r} cannot join: the world is full "
                f"({self.world_size} of {self.world_size} workers joined)"
            )
        worker_id = self._place_for(request, free)
        member = Member(
            worker_id=worker_id,
            node_id=request.node_id,
            device_type=request.device_type,
            gpu_count=request.gpu_count,
            token=secrets.randbits(64),
            last_seen=time.monotonic(),
            identity=identity,
            committed_step=request.committed_step,
            host=host,
            shared_memory=request.shared_memory,
            link_bytes_per_s=request.link_bytes_per_s,
            wire_item_size=ITEM_SIZE[request.wire_dtype],
            job_chunk_bytes=request.job_chunk_bytes,
            host_id=request.host_id,
            job_host_group=request.job_host_group,
            peer_host_id=request.peer_host_id,
        )
        if self._fingerprint is None:
            self._fingerprint = dict(request.fingerprint)
        self._members[worker_id] = member
        log.info(
            "worker %d joined: node %r, %d GPU(s), device type %r (%d of %d)",
            worker_id,
            request.node_id,
            request.gpu_count,
            request.device_type,
            self.joined,
            self.world_size,
            extra={"worker_id": worker_id},
        )
        if self.joined == self.world_size:
            self._complete.set()
        try:
            await self._until_complete()
        except GradServerError:
            self._vacate(member)
            raise
        except TimeoutError:
            joined = self.joined
            self._vacate(member)
            raise DeadlineExceededError(
                f"join timed out after {self.join_timeout:g} s: {joined} of {self.world_size} workers joined",
                worker_id=worker_id,
            ) from None
        except asyncio.CancelledError:
            self._vacate(member)
            log.info("worker %d gave up joining before the world was complete", worker_id)
            raise
        member.last_seen = time.monotonic()
        return member

    async def _until_complete(self) -> None:
        """Waits for the world to be complete, at most the join timeout; raises the refusal
        when the job ends first (`refuse_waiting`)."""
        complete = asyncio.ensure_future(self._complete.wait())
        refused = asyncio.ensure_future(self._refused.wait())
        try:
            await asyncio.wait(
                (complete, refused), timeout=self.join_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            complete.cancel()
            refused.cancel()
        if self._complete.is_set():
            return
        if self._refusal is not None:
            raise self._refusal
        raise TimeoutError

    def refuse_waiting(self, refusal: GradServerError) -> None:
        """The job ended: every Join still waiting for the world (and every later one that gets
        this far) is refused with `refusal` instead."""
        self._refusal = refusal
        self._refused.set()

    def _place_for(self, request: JoinRequestIn, free: list[int]) -> int:
        """The rank the joiner asked for, when it is in range and free; else the lowest free."""
        rank = request.rank
        if rank is None:
            return free[0]
        if rank >= self.world_size:
            raise InvalidArgumentError(
                f"node {request.node_id!r} asks for rank {rank}, out of range for a world of "
                f"{self.world_size} (ranks 0..{self.world_size - 1})",
                worker_id=rank,
            )
        if rank not in free:
            taken = self._members[rank]
            by = f" by node {taken.node_id!r}" if taken is not None else ""
            raise FailedPreconditionError(
                f"node {request.node_id!r} asks for rank {rank}, which is already taken{by}",
                worker_id=rank,
            )
        return rank

    def _check_fingerprint(self, request: JoinRequestIn) -> None:
        """Refuses a joiner whose settings differ from the job's, naming every field and both
        values."""
        job = self._fingerprint
        if job is None:
            return
        differences = fingerprint_differences(request.fingerprint, job)
        if differences:
            raise FailedPreconditionError(
                f"node {request.node_id!r} does not match the job: {', '.join(differences)}"
            )

    def resume_step(self) -> int | None:
        """Where a rejoining world resumes: the fewest steps any member reported applied."""
        reported = [m.committed_step for m in self.members() if m.committed_step is not None]
        return min(reported) if reported else None

    def authenticate(self, worker_id: int, session_id: int, token: int) -> Member:
        """The member an Exchange stream speaks for; refuses strangers, old sessions, zombies."""
        if session_id != self.session_id:
            raise FailedPreconditionError(
                f"worker {worker_id} presents session {session_id:#x}, but this coordinator runs "
                f"session {self.session_id:#x}; join again",
                worker_id=worker_id,
            )
        member = self.get(worker_id)
        if member is None or member.token != token:
            state = "unknown" if not 0 <= worker_id < self.world_size else "not a member any more"
            raise FailedPreconditionError(
                f"worker {worker_id} is {state} (evicted or replaced); join again",
                worker_id=worker_id,
            )
        if not self._complete.is_set():
            raise FailedPreconditionError(
                f"worker {worker_id} opened a stream before the world was complete",
                worker_id=worker_id,
            )
        return member

    def remove(self, member: Member, reason: str, *, expected: bool = False) -> bool:
        """Frees the member's place; False when it was already freed or taken by another."""
        if self._members[member.worker_id] is not member:
            return False
        self._vacate(member)
        level = logging.INFO if expected else logging.WARNING
        log.log(
            level,
            "worker %d (node %r) %s",
            member.worker_id,
            member.node_id,
            reason,
            extra={"worker_id": member.worker_id},
        )
        return True

    def _vacate(self, member: Member) -> None:
        if self._members[member.worker_id] is member:
            self._members[member.worker_id] = None
            # A later joiner waits for the world to be complete again.
            self._complete.clear()
            if self.joined == 0:
                self._fingerprint = None


def fingerprint_differences(joiner: Mapping[str, str], job: Mapping[str, str]) -> list[str]:
    """'field joiner != job (job)' for every field that differs, is missing or is extra."""
    out = []
    for name in sorted(set(joiner) | set(job)):
        mine, theirs = joiner.get(name), job.get(name)
        if mine != theirs:
            out.append(f"{name} {_shown(mine)} != {_shown(theirs)} (job)")
    return out


def _shown(value: str | None) -> str:
    return "(missing)" if value is None else value
