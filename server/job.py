"""The coordinator's job as a pure state machine: its lifecycle, departures, rejoin deadline,
final step and liveness verdicts.

No I/O, no asyncio, no grpc: every call takes an event (the world completed, a worker left or
was lost, time passed on the injected clock, the monitor failed) and returns the effects the
coordinator carries out (`StateChanged`, `WriteEvent`, `ArmTimer`, `CancelTimer`, `ResetJob`,
`Stop`). Beside it, `ReductionTable` is the other pure core: it answers contributions with
`Outgoing` messages. docs/RELIABILITY.md draws the transitions:

    waiting -> running -> finished | failed, and running <-> restarting

A lost worker (or, with `--on-worker-loss continue`, an empty world) moves a running job to
restarting, where its place may be retaken until `--rejoin-timeout` passes; finished and failed
are final and ask the coordinator to stop. When a job is finished is decided here alone
(`after_departure`): `--max-steps` reached and every worker left, or, under `continue`, every
member that took part left with a goodbye after a loss or while a replacement still waits to
take part (nobody is left to heal it). A job whose workers all left cleanly without `--max-steps`
and without a loss makes way for a fresh job (waiting again, nothing of it kept). After `Stop` (or
once the coordinator is stopping for another reason) the job answers nothing more.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable

from gradserver.common.errors import FailedPreconditionError, GradServerError, UnavailableError


class JobState(enum.Enum):
    """Where the coordinator's job is (docs/RELIABILITY.md draws the transitions)."""

    WAITING = "waiting"  # for the world to join
    RUNNING = "running"
    RESTARTING = "restarting"  # a lost worker's place may be retaken until --rejoin-timeout
    FINISHED = "finished"
    FAILED = "failed"


ENDED = (JobState.FINISHED, JobState.FAILED)


@dataclasses.dataclass(frozen=True)
class StateChanged:
    """The job moved from `old` to `new` (for the log and the job-state metric)."""

    old: JobState
    new: JobState
    why: str


@dataclasses.dataclass(frozen=True)
class WriteEvent:
    """One line for the --events-file (a supervisor reads it to name what was lost)."""

    name: str
    fields: tuple[tuple[str, object], ...]


@dataclasses.dataclass(frozen=True)
class ArmTimer:
    """Call `Job.time_passed` in `delay` seconds (the rejoin deadline)."""

    delay: float


@dataclasses.dataclass(frozen=True)
class CancelTimer:
    """The rejoin deadline no longer applies."""


@dataclasses.dataclass(frozen=True)
class ResetJob:
    """No member is left: nothing of this job may leak into the next joiners' (ids, steps,
    reductions, barriers, partitions)."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """The job ended: stop the coordinator with this reason."""

    reason: str


JobEffect = StateChanged | WriteEvent | ArmTimer | CancelTimer | ResetJob | Stop


@dataclasses.dataclass(frozen=True)
class Liveness:
    """What the coordinator observed of one member at one moment, for `Job.liveness_verdict`."""

    silent_s: float  # since its last message
    stalled_s: float  # writes to it made no progress this long while bytes waited (0: none)
    has_stream: bool  # its current Exchange stream is open
    paused: bool  # the coordinator holds its stream back (in-flight budget full)
    streaming: bool  # it opened its stream (the membership's view)
    world_complete: bool


class Job:
    """One coordinator's job. Not thread-safe: the coordinator calls it from its event loop."""

    def __init__(
        self,
        world_size: int,
        *,
        rejoin_timeout: float,
        heartbeat_timeout: float,
        max_steps: int = 0,
        on_worker_loss: str = "abort",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.world_size = world_size
        self.rejoin_timeout = rejoin_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.max_steps = max_steps
        self.on_worker_loss = on_worker_loss
        self._clock = clock
        self.state = JobState.WAITING
        self.failure: str | None = None
        self.finish_reason = ""
        self.final_step: int | None = max_steps - 1 if max_steps else None
        self.departures: list[str] = []  # why each worker of this job left, for the failure line
        self.last_completed_step: int | None = None
        self.rejoin_deadline: float | None = None
        self.stopping = False
        self._had_loss = False
        self._limit_reached = False

    # --- queries ------------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def done(self) -> bool:
        """The final step (--max-steps) completed."""
        last = self.last_completed_step
        return self.final_step is not None and last is not None and last >= self.final_step

    def refusal(self, step: int) -> str | None:
        """Why a message of `step` is refused (past the final step); None when it may go on."""
        if self.final_step is None or step <= self.final_step:
            return None
        return f"step {step} refused: --max-steps {self.max_steps} ends the job after step {self.final_step}"

    def join_refusal(self) -> GradServerError | None:
        """Why a Join is refused now; None when it may join. A job that finished says so and at
        which step, for good (FAILED_PRECONDITION: a joiner does not try again); otherwise the
        coordinator is stopping (UNAVAILABLE)."""
        if self.state is JobState.FINISHED:
            return FailedPreconditionError(self.finished_line())
        if self.stopping or self.ended:
            return UnavailableError(f"the coordinator is shutting down (job {self.state.value})")
        return None

    def finished_line(self) -> str:
        """'the job finished at step N' (or before any step completed)."""
        last = self.last_completed_step
        at = f"at step {last}" if last is not None else "before any step completed"
        return f"the job finished {at}: {self.finish_reason}"

    # --- events -------------------------------------------------------------------------------

    def world_complete(self) -> list[JobEffect]:
        """Every place of the world is taken."""
        if not self.stopping and self.state is JobState.RUNNING:
            # A replacement took a lost worker's place while the others went on (`continue`):
            # the loss is healed, and the job ends as one without it would.
            self.departures.clear()
            self._had_loss = False
        if self.stopping or self.state not in (JobState.WAITING, JobState.RESTARTING):
            return []
        self.departures.clear()
        self._had_loss = False
        return self._set_state(JobState.RUNNING, f"the world of {self.world_size} is complete")

    def worker_left(
        self, worker_id: int, reason: str, *, lost: bool, node: str = "", step: int | None = None
    ) -> list[JobEffect]:
        """A member left (`lost`: without a goodbye); `step` is the lowest one in flight. The
        job moves on in `after_departure`, once the reduction table heard of it too."""
        self.departures.append(f"worker {worker_id} {reason}")
        if not lost:
            return []
        fields = (("worker", worker_id), ("node", node), ("reason", reason), ("step", step))
        return [WriteEvent("worker_lost", fields)]

    def after_departure(self, *, lost: bool, members_left: int, waiting_left: int = 0) -> list[JobEffect]:
        """Moves the job on after a member left and the table settled its steps. `waiting_left`:
        how many of the members left have not taken part in a completed step yet (replacements
        that joined the running job and still heal, or whose Join still waits)."""
        if self.stopping or self.state not in (JobState.RUNNING, JobState.RESTARTING):
            return []
        self._had_loss = self._had_loss or lost
        empty = members_left == 0
        effects: list[JobEffect] = []
        if empty and not lost:
            # The last member said goodbye: a supervisor whose own workers are done learns here
            # that the others left too (`gradserver run` as task 0 of a SLURM step).
            effects.append(WriteEvent("every_worker_left", ()))
        if empty and self.done():
            why = f"step {self.final_step} (--max-steps {self.max_steps}) done and every worker left"
            return effects + self._finish(why)
        if not lost and self._took_part_and_left(members_left, waiting_left):
            why = f"every worker that took part left with a goodbye after step {self.last_completed_step}"
            if self._had_loss:
                why += f" ({'; '.join(self.departures)})"
            if waiting_left:
                why += f"; {waiting_left} worker(s) that joined since found it finished"
            return effects + self._finish(why)
        if empty:
            effects.append(ResetJob())
            self.last_completed_step = None
            if not self._had_loss and self.final_step is None:
                self.departures.clear()
                return effects + self._set_state(
                    JobState.WAITING, "every worker left; the next Join starts a new job"
                )
        if empty or (lost and self.on_worker_loss == "abort"):
            effects += self._restarting()
        return effects

    def steps_completed(self, last_completed_step: int | None) -> bool:
        """The reduction table's newest completed step; True the first time the final step
        (--max-steps) is reached."""
        self.last_completed_step = last_completed_step
        if self._limit_reached or not self.done():
            return False
        self._limit_reached = True
        return True

    def time_passed(self) -> list[JobEffect]:
        """The rejoin timer fired (or any moment): fails a job still restarting past its deadline."""
        if self.rejoin_deadline is None or self.stopping:
            return []
        left = self.rejoin_deadline - self._clock()
        if left > 0:
            return [ArmTimer(left)]  # a timer may fire a little early; wait for the rest
        self.rejoin_deadline = None
        if self.state is not JobState.RESTARTING:
            return []
        return self._set_state(
            JobState.FAILED,
            f"the world of {self.world_size} did not complete again within --rejoin-timeout "
            f"{self.rejoin_timeout:g} s: {'; '.join(self.departures)}",
        )

    def monitor_failed(self, failures: int, limit: int, error: str) -> list[JobEffect]:
        """The liveness monitor failed `failures` times in a row; at `limit` the job fails."""
        if self.stopping or failures < limit:
            return []
        return self._set_state(JobState.FAILED, f"the liveness monitor failed {failures} times: {error}")

    def stop(self) -> list[JobEffect]:
        """The coordinator stops (a signal, a caller, or the job's own `Stop`): nothing follows."""
        self.stopping = True
        return self._cancel_timer()

    def liveness_verdict(self, seen: Liveness) -> str | None:
        """Why a member counts as lost now (the eviction reason); None while it is alive."""
        limit = self.heartbeat_timeout
        if seen.has_stream:
            if seen.stalled_s > limit:
                return (
                    f"lost: it read nothing of its results for {seen.stalled_s:.1f} s (heartbeat "
                    f"timeout {limit:g} s)"
                )
            if seen.paused:
                return None  # the coordinator holds it back: its silence is not its fault
        # A member that never opened its stream is silent too, once the world is complete
        # (before that, Join itself is still waiting for others).
        watched = seen.streaming or seen.world_complete
        if watched and seen.silent_s > limit:
            return f"lost: no message for {seen.silent_s:.1f} s (heartbeat timeout {limit:g} s)"
        return None

    # --- internals ----------------------------------------------------------------------------

    def _took_part_and_left(self, members_left: int, waiting_left: int) -> bool:
        """Whether the job finished by goodbyes (`--on-worker-loss continue`): every member that
        took part in its steps left saying goodbye, at least one step completed, and a worker was
        lost on the way or a replacement is still waiting to take part. Nobody is left to take a
        step further, so a replacement has nothing to heal from or to join: the job is over, not
        waiting for a rejoin. (Without a loss, an empty world makes way for a fresh job, below.)"""
        return (
            self.on_worker_loss == "continue"
            and self.last_completed_step is not None
            and members_left == waiting_left
            and (self._had_loss or waiting_left > 0)
        )

    def _finish(self, why: str) -> list[JobEffect]:
        self.finish_reason = why
        return self._set_state(JobState.FINISHED, why)

    def _restarting(self) -> list[JobEffect]:
        effects = self._set_state(JobState.RESTARTING, "; ".join(self.departures))
        if self.rejoin_deadline is None:
            self.rejoin_deadline = self._clock() + self.rejoin_timeout
            effects.append(ArmTimer(self.rejoin_timeout))
        return effects

    def _cancel_timer(self) -> list[JobEffect]:
        if self.rejoin_deadline is None:
            return []
        self.rejoin_deadline = None
        return [CancelTimer()]

    def _set_state(self, new: JobState, why: str) -> list[JobEffect]:
        if new is self.state:
            return []
        old, self.state = self.state, new
        effects: list[JobEffect] = [StateChanged(old, new, why)]
        if new is JobState.FAILED:
            self.failure = why
        if new is not JobState.RESTARTING:
            effects += self._cancel_timer()
        if new in ENDED:
            effects.append(WriteEvent("job_ended", (("state", new.value), ("reason", why))))
            effects.append(Stop(f"job {new.value}: {why}"))
        return effects
