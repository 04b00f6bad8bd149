"""Host groups: the members that share a host other than the coordinator's, and sum their
contributions there so that each chunk crosses that host's link once each way.

Every worker says at Join what it shares a host with (`JoinRequest.host_id`: the machine's boot
id, its network namespace and its user, `gradserver.common.shm.host_id`; empty when it cannot sum
with others). When a
job's world is complete, the members that are not on the coordinator's own host (those reach it
through shared memory and the collective lane instead) and share a host_id form a group of two
or more, with a random key naming the group's shared memory; each member learns its group and key
in its JoinAccepted. A group is a job's for as long as all its members stay: the first of them
that leaves or is lost dissolves it (its other members are told, `MemberLeftOut`, and send their
own contributions from then on), and a worker that takes a lost member's place joins no group.
Groups are formed only while a lost worker ends the steps in flight (`--on-worker-loss abort`): a
job that continues without a lost worker would have to change a group in the middle of a step.

Partitioned coordinators: partition 0 forms the groups; partitions 1..K-1 adopt the group each
worker brings in its Join (`JoinRequest.job_host_group`), as they adopt the chunk size.

Pure: no I/O; `JobHostGroups` keeps one per job, subscribed to the coordinator's lifecycle
(`subscribe`), and the reduction table asks it what a partial sum may cover (docs/PROTOCOL.md
"Host groups").
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from gradserver.common import shm

from .lifecycle import ChunkInputs, Lifecycle, Shell, TableParts
from .membership import Member

log = logging.getLogger("gradserver.server.host_groups")

_KEY_BYTES = 16


@dataclasses.dataclass(frozen=True)
class HostGroup:
    """The workers of one host group, in id order, and the key naming its shared memory."""

    workers: tuple[int, ...]
    key: bytes = dataclasses.field(repr=False)


class HostGroups:
    """A job's host groups: formed once its world is complete, dissolved member by member."""

    def __init__(self, own_host_id: str, *, enabled: bool = True) -> None:
        """`own_host_id`: the coordinator's own host (its members there use shared memory with
        it, not a group); `enabled`: False forms none (a job that continues without a lost worker)."""
        self._own = own_host_id
        self._enabled = enabled
        self._groups: dict[int, HostGroup] = {}  # worker id -> its active group

    def form(self, members: Sequence[tuple[int, str]]) -> list[HostGroup]:
        """Groups the members (worker id, host_id) that share a host other than this one."""
        if not self._enabled:
            return []
        by_host: dict[str, list[int]] = {}
        for worker, host in members:
            if host and host != self._own:
                by_host.setdefault(host, []).append(worker)
        groups = [
            HostGroup(tuple(sorted(workers)), secrets.token_bytes(_KEY_BYTES))
            for workers in by_host.values()
            if len(workers) > 1
        ]
        self._install(groups)
        return groups

    def adopt(self, brought: Mapping[int, tuple[int, ...]]) -> list[HostGroup]:
        """Partitions 1..K-1: the groups partition 0 formed, as the workers brought them. A group
        that its members do not all bring alike (or that names a worker who did not bring it) is
        not adopted: its partial sums are then refused here, which fails their steps by name."""
        if not self._enabled:
            return []
        groups: list[HostGroup] = []
        for workers in sorted({g for g in brought.values() if len(g) > 1}):
            if all(brought.get(w) == workers for w in workers):
                groups.append(HostGroup(workers, b""))
            else:
                log.warning("host group %s is not brought alike by its members; not adopted", list(workers))
        self._install(groups)
        return groups

    def _install(self, groups: list[HostGroup]) -> None:
        self._groups = {w: group for group in groups for w in group.workers}
        for group in groups:
            log.info("host group of workers %s sums on its host", ", ".join(map(str, group.workers)))

    def group_of(self, worker: int) -> HostGroup | None:
        """`worker`'s active group, or None."""
        return self._groups.get(worker)

    def offer(self, worker: int) -> dict[str, Any]:
        """The JoinAccepted fields for `worker`: its group and the group's key (none: empty)."""
        group = self._groups.get(worker)
        if group is None:
            return {}
        return {"host_group": group.workers, "host_key": group.key}

    def covers_problem(self, sender: int, covers: tuple[int, ...]) -> str | None:
        """What is wrong with a partial sum from `sender` covering `covers`; None when it covers
        exactly the sender's active group."""
        group = self._groups.get(sender)
        if group is None:
            return (
                f"worker {sender} sent a partial sum of workers {list(covers)}, but it is in no host "
                "group (any more): each worker sends its own contribution"
            )
        if covers != group.workers:
            return (
                f"worker {sender} sent a partial sum of workers {list(covers)}, but its host group is "
                f"workers {list(group.workers)}"
            )
        return None

    def dissolve(self, worker: int) -> tuple[int, ...]:
        """`worker` left its group (if any): the group ends; returns its other members."""
        group = self._groups.get(worker)
        if group is None:
            return ()
        for member in group.workers:
            self._groups.pop(member, None)
        log.info(
            "host group of workers %s dissolved: worker %d left",
            ", ".join(map(str, group.workers)),
            worker,
        )
        return tuple(w for w in group.workers if w != worker)

    def one_per_group(self, to: tuple[int, ...], turn: int) -> tuple[int, ...]:
        """`to` with each active group that it holds whole replaced by one of its members (its
        member number `turn`, modulo its size, so that successive pieces spread over the group's
        links): that member hands the piece on to the rest of its group on their host."""
        keep = set(to)
        for worker in to:
            group = self._groups.get(worker)
            if group is not None and worker == group.workers[0] and keep.issuperset(group.workers):
                keep.difference_update(group.workers)
                keep.add(group.workers[turn % len(group.workers)])
        return tuple(sorted(keep))

    def link_rates(self, rates: Mapping[int, int]) -> dict[int, int]:
        """Each member's link rate as its chunk size should see it: a group's members measured
        their host's link at the same time, each a share of it, and together they send what one
        of them would, so every member of a group counts the group's sum."""
        out = dict(rates)
        for worker, group in self._groups.items():
            measured = [rates.get(w, 0) for w in group.workers]
            out[worker] = sum(measured) if all(measured) else 0
        return out


class JobHostGroups:
    """The current job's `HostGroups` (a fresh one per job), as the coordinator's lifecycle
    drives them: formed as the world completes, offered to each joiner, counted in the chunk
    size's link rates and handed to each job's table."""

    def __init__(self, own_host_id: str, *, enabled: bool, adopt: bool) -> None:
        """`adopt`: partitions 1..K-1 adopt partition 0's groups instead of forming their own."""
        self._own = own_host_id
        self._enabled = enabled
        self._adopt = adopt
        self.groups = self._fresh()

    def _fresh(self) -> HostGroups:
        return HostGroups(self._own, enabled=self._enabled)

    def reset(self) -> None:
        self.groups = self._fresh()

    def world_complete(self, members: Sequence[Member]) -> None:
        if self._adopt:
            self.groups.adopt({m.worker_id: m.job_host_group for m in members})
        else:
            self.groups.form([(m.worker_id, m.host_id) for m in members])

    def offer(self, member: Member, members: Sequence[Member]) -> dict[str, Any]:
        return self.groups.offer(member.worker_id)

    def chunk_inputs(self, inputs: ChunkInputs, members: Sequence[Member]) -> ChunkInputs:
        return dataclasses.replace(inputs, link_rates=self.groups.link_rates(inputs.link_rates))

    def table_parts(self) -> TableParts:
        return {"host_groups": self.groups}


def subscribe(lifecycle: Lifecycle, shell: Shell) -> JobHostGroups:
    """Host groups for every job of the coordinator. Formed only under `--on-worker-loss abort`:
    a job that goes on without a lost worker would have to change a group mid-step."""
    config = shell.config
    job = JobHostGroups(
        shm.host_id(),
        enabled=config.on_worker_loss == "abort",
        adopt=bool(config.partitions) and config.partition_index > 0,
    )
    lifecycle.on_table(job.table_parts)
    lifecycle.on_world_complete(job.world_complete)
    lifecycle.on_chunk_inputs(job.chunk_inputs)
    lifecycle.on_joined(job.offer)
    lifecycle.on_reset(job.reset)
    return job
