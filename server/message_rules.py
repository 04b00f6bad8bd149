"""Whether the reduction table believes a host group's report, a later first step or a partial
sum's cover (docs/PROTOCOL.md, "Errors").

Three messages ask the table to act on more than the sender's own contribution: a host group
member's `step_failure` fails a step for every worker, a `StartAt` changes which steps wait for
its sender, and a partial sum's `covers` counts other workers' contributions. This module owns the
rules that decide whether such a message is believed. Each check is pure: it is handed what the
table knows and returns a `Refusal` (a status and a message naming the worker, the step and the
rule) or None; the table answers a refusal to the sender alone and changes nothing.

A step is *open* to a report when the report could still be the first word of its failure:
- the key the report names is being reduced at that step here (in flight), or that key has not
  reached the step here yet (none of its steps at or after it was averaged or failed) and the step
  is at most the next one no key or barrier has opened here: a member's report can precede every
  chunk of its step (a key of one chunk, summed and found wrong on the host, never reaches the
  coordinator), but a host cannot sum a step its members have not begun, and they begin a key's
  step only once its previous step's averages came back;
- a report that names no key: a key or barrier of the step waits here.
A step that failed already is not open either; the table answers a report of it with that
failure, as it answers every late message of a failed step.
"""

from __future__ import annotations

import dataclasses

from gradserver.common.errors import Status
from gradserver.common.messages import START_AT_WINDOW, StartAtIn, StepFailureIn

from .host_groups import HostGroup, HostGroups


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a message is not believed: its status and a message naming the worker, step and rule."""

    code: Status
    message: str


@dataclasses.dataclass(frozen=True)
class StepView:
    """What the table knows that decides whether a report's step is open."""

    # The highest step a key or barrier opened here (-1: none yet).
    newest: int
    # A key or barrier of the report's step waits here.
    pending: bool
    # The named key's slot: the step it is being reduced at (None: none), and the last step it
    # was averaged or failed at here (None: never).
    key_pending_at: int | None = None
    key_last: int | None = None


def reporter_refusal(report: StepFailureIn, group: HostGroup | None) -> Refusal | None:
    """Whether `report`'s sender may report at all, and what it reports: a member of an active
    host group, blaming a member of that group, with the failure's own (non-OK) status."""
    w, step = report.worker_id, report.step
    if group is None:
        return Refusal(
            Status.INVALID_ARGUMENT,
            f"worker {w} reported a failure of step {step}, but only a host group's members report "
            "what they find summing their host's contributions",
        )
    if report.culprit is not None and report.culprit not in group.workers:
        return Refusal(
            Status.INVALID_ARGUMENT,
            f"worker {w} blamed worker {report.culprit} for step {step}, which is not in its host group "
            f"{list(group.workers)}",
        )
    if report.code == Status.OK:
        return Refusal(
            Status.INVALID_ARGUMENT,
            f"worker {w} reported a failure of step {step} with status OK: a report carries the "
            "status the step fails with",
        )
    return None


def closed_step_refusal(report: StepFailureIn, view: StepView) -> Refusal | None:
    """Whether `report`'s step is closed to it (see the module's docstring for what is open)."""
    w, step, key = report.worker_id, report.step, report.key
    what = f"worker {w} reported a failure of step {step}"
    if key is None:
        if view.pending:
            return None
        return Refusal(
            Status.FAILED_PRECONDITION,
            f"{what}, but no key or barrier of step {step} waits here: a report that names no key "
            "fails only a step in flight",
        )
    what += f" in {key.describe()}"
    if view.key_pending_at is not None:
        if view.key_pending_at == step:
            return None
        return Refusal(
            Status.FAILED_PRECONDITION,
            f"{what}, but {key.describe()} is in flight at step {view.key_pending_at}: a report fails "
            "the step its key is in flight at",
        )
    if view.key_last is not None and step <= view.key_last:
        return Refusal(
            Status.FAILED_PRECONDITION,
            f"{what}, but {key.describe()} is done here up to step {view.key_last} (its averages went "
            "out, or its step failed): a report fails only a step still in flight",
        )
    following = view.newest + 1
    if step > following:
        return Refusal(
            Status.FAILED_PRECONDITION,
            f"{what}, beyond step {following}, the next step no key or barrier has opened here: a "
            "report fails only a step in flight or the next one",
        )
    return None


def start_at_refusal(
    request: StartAtIn, *, plan: int | None, first: int, sent: int | None, partitioned: bool
) -> Refusal | None:
    """Whether `request` is the answer to its sender's recovery plan that the protocol allows:
    `plan`, the first step the worker was given when it joined a running job (None: no plan);
    `first`, its first step now; `sent`, the newest step it sent anything of (None: nothing)."""
    w, step = request.worker_id, request.step
    asked = f"worker {w} asked to take part from step {step}"
    if partitioned:
        problem = (
            f"{asked}, but a later first step needs one coordinator: partitions would disagree on "
            "which steps wait for it"
        )
    elif plan is None:
        problem = (
            f"{asked}, but it has no recovery plan to move: it joined as the job began or rejoined a "
            "restarted coordinator (every member resumes together), or a lost worker stops the job's "
            "steps (--on-worker-loss abort), so every step waits for it"
        )
    elif sent is not None:
        problem = f"{asked} after it sent step {sent}: a worker moves its first step before it contributes"
    elif step < first:
        problem = f"{asked}, before its first step {first}"
    elif step > plan + START_AT_WINDOW:
        problem = (
            f"{asked}, out of the range its recovery plan allows: steps {first} to {plan + START_AT_WINDOW} "
            f"(at most {START_AT_WINDOW} past the plan's step {plan})"
        )
    else:
        return None
    return Refusal(Status.FAILED_PRECONDITION, problem)


def covers_refusal(
    sender: int, covers: tuple[int, ...], world_size: int, groups: HostGroups
) -> Refusal | None:
    """Whether a partial sum from `sender` may cover `covers`: worker ids of this world, exactly
    the sender's active host group."""
    outside = [v for v in covers if v >= world_size]
    if outside:
        return Refusal(
            Status.INVALID_ARGUMENT,
            f"worker {sender} sent a partial sum covering worker {outside[0]}, out of range for a world "
            f"of {world_size} workers",
        )
    problem = groups.covers_problem(sender, covers)
    return None if problem is None else Refusal(Status.INVALID_ARGUMENT, problem)
