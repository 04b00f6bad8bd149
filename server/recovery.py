"""Live recovery's plan: where a worker that joins a running job gets the job's state (pure).

A worker that takes a departed one's place while the job runs (`--on-worker-loss continue`)
takes part from the next step that has not started (`Participation`). Its own state is stale or
missing, so before it contributes it must hold the state every other replica holds at that
step's boundary (every earlier step applied). Its JoinAccepted names that step and the donors to
ask, in order: live members that took part before it (they reach that boundary; none can pass it
without the joiner's contribution), longest-standing first. The transfer itself is between the
two workers (point-to-point messages, authenticated as every member's stream is; see
gradserver.worker.recovery): the coordinator serves no state.

A worker that rejoins a restarted coordinator without any state (`committed_step` unset) while
the others resume a job (`resume_step`) gets a plan too: the resume step, and the members that
reported one as donors. Only the first kind of plan may be moved later (`StartAt`, within
`START_AT_WINDOW` steps: server/message_rules.py): after a restart every member resumes at the
resume step together, and no step has opened without the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .lifecycle import Lifecycle, Shell
from .membership import Member


def recovery_offer(
    member: Member,
    members: Sequence[Member],
    *,
    first_step: Callable[[int], int],
    resume_step: int | None,
) -> dict[str, Any]:
    """The JoinAccepted fields that tell `member` to recover (empty: it needs no state).
    `first_step(w)`: the first step worker w takes part in."""
    others = [m for m in members if m.worker_id != member.worker_id]
    step = first_step(member.worker_id)
    if step > 0:
        donors = sorted(
            (m for m in others if first_step(m.worker_id) < step),
            key=lambda m: (first_step(m.worker_id), m.worker_id),
        )
        return {"recovery_step": step, "donors": tuple(m.worker_id for m in donors)}
    if resume_step is not None and member.committed_step is None:
        donors = [m for m in others if m.committed_step is not None]
        return {"recovery_step": resume_step, "donors": tuple(m.worker_id for m in donors)}
    return {}


def subscribe(lifecycle: Lifecycle, shell: Shell) -> None:
    """Every joiner is offered its plan (none when it needs no state)."""
    lifecycle.on_joined(
        lambda member, members: recovery_offer(
            member, members, first_step=shell.table().first_step, resume_step=shell.resume_step()
        )
    )
