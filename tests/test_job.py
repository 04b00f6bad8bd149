"""The job lifecycle against the pure cores, with no sockets: `Job` and `ReductionTable` driven
together by a manual clock, in the order the coordinator drives them (docs/RELIABILITY.md's
fault matrix rows 1, 2, 7, 13, 16 and 17, all workers dead, rejoin within and after the
deadline, --max-steps, a fresh job after everyone left cleanly), then fuzzed for invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import FailedPreconditionError, Status, UnavailableError
from gradserver.common.messages import AveragedChunkOut, ChunkHeader, ChunkIn, DType, ErrorOut, TensorKey
from gradserver.server.job import (
    ArmTimer,
    CancelTimer,
    Job,
    JobEffect,
    JobState,
    Liveness,
    ResetJob,
    StateChanged,
    Stop,
    WriteEvent,
)
from gradserver.server.outgoing import Outgoing
from gradserver.server.reduction import ReductionTable

CHUNK = 4
HEARTBEAT = 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Cores:
    """The two pure cores wired as GradientServer wires them: joins complete the world, a
    departure goes to the job, then the table, then the job again; effects are carried out here
    (a timer is a deadline on the manual clock, a reset a fresh table)."""

    def __init__(
        self, world: int = 2, *, rejoin_timeout: float = 10.0, max_steps: int = 0, policy: str = "abort"
    ) -> None:
        self.world = world
        self.policy = policy
        self.clock = Clock()
        self.job = Job(
            world,
            rejoin_timeout=rejoin_timeout,
            heartbeat_timeout=HEARTBEAT,
            max_steps=max_steps,
            on_worker_loss=policy,
            clock=self.clock,
        )
        self.table = self._new_table()
        self.members: set[int] = set()
        self.effects: list[JobEffect] = []
        self.sent: list[Outgoing] = []
        self.timer_at: float | None = None
        self.stopped = False

    def _new_table(self) -> ReductionTable:
        return ReductionTable(self.world, CHUNK, 30.0, self.clock, on_worker_loss=self.policy)

    # --- events, as the coordinator feeds them ----------------------------------------------

    def join(self, worker: int) -> bool:
        """False when the job refuses joins (it ended or the coordinator stops)."""
        if self.job.join_refusal() is not None:
            return False
        self.members.add(worker)
        self.table.worker_joined(worker)
        if len(self.members) == self.world:
            self.apply(self.job.world_complete())
        return True

    def depart(self, worker: int, reason: str, *, lost: bool) -> None:
        self.members.discard(worker)
        step = min(self.table.pending_steps(), default=None)
        self.apply(self.job.worker_left(worker, reason, lost=lost, step=step))
        self.deliver(self.table.worker_lost(worker, reason))
        last = self.table.last_completed_step
        waiting = sum(1 for w in self.members if last is None or self.table.first_step(w) > last)
        self.apply(self.job.after_departure(lost=lost, members_left=len(self.members), waiting_left=waiting))

    def contribute(self, worker: int, step: int, value: float = 1.0) -> list[Outgoing]:
        key = TensorKey.non_block(step, NonBlockComponent.FINAL_NORM)
        data = np.full(CHUNK, value, np.float32).tobytes()
        chunk = ChunkIn(worker, key, ChunkHeader(DType.FLOAT32, CHUNK, ()), 0, data)
        if self.job.refusal(step) is not None:
            return []
        return self.deliver(self.table.contribute(chunk))

    def finish_step(self, step: int) -> None:
        """Every member contributes to `step` (a step counts as completed once they move on)."""
        for worker in sorted(self.members):
            self.contribute(worker, step)

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        if self.timer_at is not None and self.clock.now >= self.timer_at:
            self.timer_at = None
            self.apply(self.job.time_passed())
        self.deliver(self.table.expire())

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.apply(self.job.stop())

    # --- effects --------------------------------------------------------------------------------

    def deliver(self, outgoing: list[Outgoing]) -> list[Outgoing]:
        self.sent += outgoing
        self.job.steps_completed(self.table.last_completed_step)
        return outgoing

    def apply(self, effects: list[JobEffect]) -> None:
        for effect in effects:
            # A stopping coordinator still records who it lost while it drains (a supervisor
            # names them); nothing else may follow Stop.
            recorded = isinstance(effect, WriteEvent) and effect.name == "worker_lost"
            assert not self.stopped or recorded or isinstance(effect, CancelTimer), f"{effect} after Stop"
            self.effects.append(effect)
            if isinstance(effect, ArmTimer):
                self.timer_at = self.clock.now + effect.delay
            elif isinstance(effect, CancelTimer):
                self.timer_at = None
            elif isinstance(effect, ResetJob):
                self.table = self._new_table()
            elif isinstance(effect, Stop):
                self.stop()

    # --- what came out --------------------------------------------------------------------------

    def states(self) -> list[JobState]:
        return [e.new for e in self.effects if isinstance(e, StateChanged)]

    def events(self, name: str) -> list[dict[str, object]]:
        return [dict(e.fields) for e in self.effects if isinstance(e, WriteEvent) and e.name == name]

    def step_failures(self, step: int) -> list[tuple[tuple[int, ...], ErrorOut]]:
        return [
            (o.to, o.event)
            for o in self.sent
            if isinstance(o.event, ErrorOut) and o.event.step_failed and o.event.step == step
        ]


def running(world: int = 2, **kwargs: object) -> Cores:
    cores = Cores(world, **kwargs)  # type: ignore[arg-type]
    for worker in range(world):
        assert cores.join(worker)
    assert cores.job.state is JobState.RUNNING
    return cores


# --- the world ---------------------------------------------------------------------------------


def test_the_job_runs_once_the_world_is_complete() -> None:
    cores = Cores(3)
    cores.join(0)
    cores.join(1)
    assert cores.job.state is JobState.WAITING and cores.states() == []
    cores.join(2)
    assert cores.states() == [JobState.RUNNING]


# --- row 1: a worker lost mid-step -------------------------------------------------------------


def test_row1_a_lost_worker_aborts_the_step_for_the_others_naming_it() -> None:
    cores = running(3)
    cores.contribute(0, 0)
    cores.contribute(1, 0)
    cores.depart(2, "disconnected (its stream was cancelled)", lost=True)
    [(to, failure)] = cores.step_failures(0)
    assert to == (0, 1) and "worker 2 disconnected" in failure.message
    assert failure.code == Status.ABORTED and failure.culprit_worker_id == 2
    assert cores.job.state is JobState.RESTARTING and cores.timer_at == 10.0
    assert cores.events("worker_lost") == [
        {"worker": 2, "node": "", "reason": "disconnected (its stream was cancelled)", "step": 0}
    ]


def test_row1_a_replacement_in_time_resumes_the_job_and_the_next_step_completes() -> None:
    cores = running(3, rejoin_timeout=10.0)
    cores.contribute(0, 0)
    cores.depart(2, "disconnected", lost=True)
    cores.advance(9.0)
    assert cores.join(2)
    assert cores.job.state is JobState.RUNNING and cores.timer_at is None
    assert CancelTimer() in cores.effects
    got = [o for w in range(3) for o in cores.contribute(w, 1) if isinstance(o.event, AveragedChunkOut)]
    assert [o.to for o in got] == [(0, 1, 2)]
    cores.advance(5.0)
    assert cores.job.state is JobState.RUNNING


def test_with_continue_a_lost_worker_does_not_restart_the_job() -> None:
    cores = running(3, policy="continue")
    cores.depart(2, "disconnected", lost=True)
    assert cores.job.state is JobState.RUNNING and cores.timer_at is None
    got = [o for w in (0, 1) for o in cores.contribute(w, 0) if isinstance(o.event, AveragedChunkOut)]
    assert [o.event.num_contributors for o in got] == [2]


# --- when a job is finished --------------------------------------------------------------------


def _finished_steps(cores: Cores, steps: int) -> None:
    """Steps 0..steps-1 done by every member (the last one counts as completed once they move on
    or leave)."""
    for step in range(steps):
        cores.finish_step(step)


def test_with_continue_the_job_finishes_when_every_rank_that_took_part_left_after_a_loss() -> None:
    """Issue 50: a lost rank's replacement arrives after the others finished. The job does not
    wait for it to rejoin (it has no one to heal from): it finished, and a Join says so."""
    cores = running(3, policy="continue")
    _finished_steps(cores, 3)
    cores.depart(1, "disconnected (its stream was cancelled)", lost=True)
    assert cores.job.state is JobState.RUNNING
    cores.depart(0, "left the job", lost=False)
    assert cores.job.state is JobState.RUNNING
    cores.depart(2, "left the job", lost=False)
    assert cores.states() == [JobState.RUNNING, JobState.FINISHED]
    assert (
        cores.stopped and cores.timer_at is None and not any(isinstance(e, ResetJob) for e in cores.effects)
    )
    [ended] = cores.events("job_ended")
    assert ended["state"] == "finished"
    assert "every worker that took part left with a goodbye after step 2" in str(ended["reason"])
    assert "worker 1 disconnected" in str(ended["reason"])
    refusal = cores.job.join_refusal()
    assert isinstance(refusal, FailedPreconditionError)
    assert refusal.message.startswith("the job finished at step 2: ")


def test_with_continue_a_replacement_still_healing_does_not_keep_a_finished_job_open() -> None:
    cores = running(3, policy="continue")
    _finished_steps(cores, 2)
    cores.depart(1, "disconnected", lost=True)
    assert cores.join(1)  # the replacement: it takes part from the next step, once healed
    assert cores.job.state is JobState.RUNNING
    cores.depart(0, "left the job", lost=False)
    assert cores.job.state is JobState.RUNNING
    cores.depart(2, "left the job", lost=False)
    assert cores.job.state is JobState.FINISHED
    assert "1 worker(s) that joined since found it finished" in cores.job.finish_reason


def test_with_continue_a_healed_replacement_that_took_part_ends_the_job_as_if_nothing_was_lost() -> None:
    """The replacement took part in a step: the loss is healed, and every rank leaving after the
    last step is a clean end (a fresh job may follow), not a finish that turns late ranks away."""
    cores = running(3, policy="continue")
    _finished_steps(cores, 2)
    cores.depart(1, "disconnected", lost=True)
    assert cores.join(1)
    _finished_steps(cores, 5)
    for worker in (0, 1, 2):
        cores.depart(worker, "left the job", lost=False)
    assert cores.job.state is JobState.WAITING and not cores.stopped


def test_with_continue_and_no_loss_an_empty_world_still_makes_way_for_a_fresh_job() -> None:
    cores = running(2, policy="continue")
    _finished_steps(cores, 2)
    cores.depart(0, "left the job", lost=False)
    cores.depart(1, "left the job", lost=False)
    assert cores.job.state is JobState.WAITING and not cores.stopped


def test_with_abort_the_others_leaving_after_a_loss_still_wait_for_a_restarted_world() -> None:
    """Under abort, the survivors leave because the loss failed their step: a restart from a
    checkpoint follows, so the job waits for the world to rejoin, as before."""
    cores = running(3)
    _finished_steps(cores, 2)
    cores.depart(1, "disconnected", lost=True)
    cores.depart(0, "left the job", lost=False)
    cores.depart(2, "left the job", lost=False)
    assert cores.job.state is JobState.RESTARTING and cores.timer_at is not None


def test_a_finished_job_refuses_for_good_and_a_stopping_one_for_now() -> None:
    cores = running(2, max_steps=2)
    _finished_steps(cores, 2)
    cores.depart(0, "left the job", lost=False)
    cores.depart(1, "left the job", lost=False)
    assert cores.job.state is JobState.FINISHED
    assert isinstance(cores.job.join_refusal(), FailedPreconditionError)
    stopping = running(2)
    stopping.stop()
    assert isinstance(stopping.job.join_refusal(), UnavailableError)


# --- row 17: every worker dead ----------------------------------------------------------------


def test_row17_all_workers_lost_fails_the_job_after_the_rejoin_timeout_naming_each() -> None:
    cores = running(2, rejoin_timeout=1.5)
    cores.depart(0, "disconnected (its stream was cancelled)", lost=True)
    cores.depart(1, "lost: no message for 3.1 s (heartbeat timeout 3 s)", lost=True)
    assert cores.job.state is JobState.RESTARTING
    cores.advance(1.4)
    assert cores.job.state is JobState.RESTARTING
    cores.advance(0.2)
    assert cores.states() == [JobState.RUNNING, JobState.RESTARTING, JobState.FAILED]
    failure = cores.job.failure or ""
    assert "--rejoin-timeout 1.5 s" in failure
    assert "worker 0 disconnected" in failure and "worker 1 lost: no message" in failure
    assert cores.events("job_ended") == [{"state": "failed", "reason": failure}]
    assert cores.stopped and cores.job.join_refusal() is not None


def test_row17_a_timer_that_fires_early_waits_for_the_rest_of_the_deadline() -> None:
    cores = running(2, rejoin_timeout=2.0)
    cores.depart(0, "disconnected", lost=True)
    cores.clock.now = 1.0
    assert cores.job.time_passed() == [ArmTimer(1.0)]
    assert cores.job.state is JobState.RESTARTING


def test_everyone_lost_then_a_full_world_in_time_keeps_the_job_with_a_fresh_table() -> None:
    cores = running(2, rejoin_timeout=5.0)
    cores.finish_step(0)
    cores.depart(0, "disconnected", lost=True)
    cores.depart(1, "disconnected", lost=True)
    assert ResetJob() in cores.effects and cores.job.state is JobState.RESTARTING
    cores.join(0)
    cores.join(1)
    cores.advance(10.0)
    assert cores.job.state is JobState.RUNNING
    assert cores.table.last_completed_step is None


# --- a fresh job after a clean end ---------------------------------------------------------------


def test_everyone_left_cleanly_without_max_steps_makes_way_for_a_fresh_job() -> None:
    cores = running(2)
    cores.finish_step(0)
    cores.finish_step(1)
    old_table = cores.table
    cores.depart(0, "left the job", lost=False)
    assert cores.job.state is JobState.RUNNING  # one goodbye is no loss
    cores.depart(1, "left the job", lost=False)
    assert cores.job.state is JobState.WAITING and cores.table is not old_table
    assert cores.events("worker_lost") == [] and not cores.stopped
    assert cores.events("every_worker_left") == [{}]  # once, for the last goodbye
    cores.join(0)
    cores.join(1)
    assert cores.job.state is JobState.RUNNING and cores.job.departures == []


def test_everyone_left_after_a_loss_keeps_waiting_for_the_lost_one_until_the_deadline() -> None:
    cores = running(2, rejoin_timeout=3.0)
    cores.depart(0, "disconnected", lost=True)
    cores.depart(1, "left the job", lost=False)
    assert cores.job.state is JobState.RESTARTING
    # The last member said goodbye: a supervisor waiting for that hears it all the same.
    assert cores.events("every_worker_left") == [{}]
    cores.advance(3.0)
    assert cores.job.state is JobState.FAILED


# --- --max-steps ---------------------------------------------------------------------------------


def test_a_last_member_lost_is_no_goodbye() -> None:
    cores = running(2, rejoin_timeout=3.0)
    cores.depart(1, "left the job", lost=False)
    cores.depart(0, "disconnected", lost=True)
    assert cores.events("every_worker_left") == []
    assert [e["worker"] for e in cores.events("worker_lost")] == [0]


def test_max_steps_refuses_later_steps_and_finishes_when_everyone_left() -> None:
    cores = running(2, max_steps=2)
    assert cores.job.refusal(2) == "step 2 refused: --max-steps 2 ends the job after step 1"
    assert cores.job.refusal(1) is None
    cores.finish_step(0)
    cores.finish_step(1)
    cores.depart(0, "left the job", lost=False)
    cores.depart(1, "left the job", lost=False)
    assert cores.job.state is JobState.FINISHED and cores.stopped
    [ended] = cores.events("job_ended")
    assert ended["reason"] == "step 1 (--max-steps 2) done and every worker left"


def test_max_steps_reached_is_reported_once() -> None:
    job = Job(2, rejoin_timeout=1.0, heartbeat_timeout=1.0, max_steps=3)
    assert not job.steps_completed(1)
    assert job.steps_completed(2)
    assert not job.steps_completed(3)


def test_everyone_left_before_max_steps_waits_for_them_to_come_back() -> None:
    cores = running(2, max_steps=5, rejoin_timeout=4.0)
    cores.finish_step(0)
    cores.depart(0, "left the job", lost=False)
    cores.depart(1, "left the job", lost=False)
    assert cores.job.state is JobState.RESTARTING
    cores.advance(4.0)
    assert cores.job.state is JobState.FAILED


# --- liveness verdicts (rows 2, 7, 16) -----------------------------------------------------------


def _seen(**overrides: object) -> Liveness:
    fields: dict[str, object] = {
        "silent_s": 0.0,
        "stalled_s": 0.0,
        "has_stream": True,
        "paused": False,
        "streaming": True,
        "world_complete": True,
    }
    fields.update(overrides)
    return Liveness(**fields)  # type: ignore[arg-type]


def test_row2_a_silent_worker_is_lost_after_the_heartbeat_timeout() -> None:
    job = Job(2, rejoin_timeout=1.0, heartbeat_timeout=HEARTBEAT)
    assert job.liveness_verdict(_seen(silent_s=2.9)) is None
    assert job.liveness_verdict(_seen(silent_s=3.2)) == "lost: no message for 3.2 s (heartbeat timeout 3 s)"


def test_row7_a_worker_the_coordinator_holds_back_is_not_counted_silent() -> None:
    job = Job(2, rejoin_timeout=1.0, heartbeat_timeout=HEARTBEAT)
    assert job.liveness_verdict(_seen(silent_s=60.0, paused=True)) is None


def test_row16_a_worker_that_stops_reading_is_lost_even_while_held_back() -> None:
    job = Job(2, rejoin_timeout=1.0, heartbeat_timeout=HEARTBEAT)
    why = job.liveness_verdict(_seen(stalled_s=4.0, paused=True))
    assert why == "lost: it read nothing of its results for 4.0 s (heartbeat timeout 3 s)"


def test_a_member_without_a_stream_is_watched_only_once_the_world_is_complete() -> None:
    job = Job(2, rejoin_timeout=1.0, heartbeat_timeout=HEARTBEAT)
    waiting = _seen(silent_s=10.0, has_stream=False, streaming=False, world_complete=False)
    assert job.liveness_verdict(waiting) is None
    complete = _seen(silent_s=10.0, has_stream=False, streaming=False, world_complete=True)
    assert job.liveness_verdict(complete) is not None


# --- row 13: the monitor, and stopping ------------------------------------------------------------


def test_row13_the_job_fails_only_when_the_monitor_keeps_failing() -> None:
    job = Job(2, rejoin_timeout=1.0, heartbeat_timeout=1.0)
    assert job.monitor_failed(4, 5, "RuntimeError('x')") == []
    effects = job.monitor_failed(5, 5, "RuntimeError('x')")
    assert job.state is JobState.FAILED
    assert Stop("job failed: the liveness monitor failed 5 times: RuntimeError('x')") in effects


def test_after_a_stop_only_the_record_of_a_lost_worker_follows() -> None:
    cores = running(2, rejoin_timeout=1.0)
    cores.depart(0, "disconnected", lost=True)
    cores.stop()
    assert cores.timer_at is None
    count = len(cores.effects)
    cores.depart(1, "disconnected while the coordinator is shutting down", lost=True)
    cores.advance(5.0)
    assert not cores.join(0)
    assert cores.job.state is JobState.RESTARTING
    assert cores.effects[count:] == [
        WriteEvent(
            "worker_lost",
            (
                ("worker", 1),
                ("node", ""),
                ("reason", "disconnected while the coordinator is shutting down"),
                ("step", None),
            ),
        )
    ]


# --- fuzzed together -------------------------------------------------------------------------------

EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("lost"), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("left"), st.integers(0, 2), st.just(0)),
        st.tuples(st.just("chunk"), st.integers(0, 2), st.integers(0, 4)),
        st.tuples(st.just("advance"), st.just(0), st.sampled_from([0.5, 2.0, 40.0])),
        st.tuples(st.just("monitor"), st.just(0), st.integers(1, 5)),
        st.tuples(st.just("stop"), st.just(0), st.just(0)),
    ),
    max_size=50,
)


@pytest.mark.parametrize("policy", ["abort", "continue"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS, max_steps=st.sampled_from([0, 2]), start_running=st.booleans())
def test_the_job_and_the_table_keep_their_invariants_under_any_events(
    policy: str, events: list[tuple[str, int, float]], max_steps: int, start_running: bool
) -> None:
    """A finished or failed job never moves again; nothing follows Stop; a job that fails at the
    rejoin deadline names every worker lost since its world was last complete; every step is
    delivered to every live worker or failed for every live worker, never both."""
    cores = Cores(3, rejoin_timeout=5.0, max_steps=max_steps, policy=policy)
    lost_since_complete: set[int] = set()
    failed_steps: set[int] = set()
    for worker in range(cores.world if start_running else 0):
        cores.join(worker)
    for kind, worker, arg in events:
        before = len(cores.sent)
        ended_before = cores.job.ended
        resets = cores.effects.count(ResetJob())
        table = cores.table  # a reset replaces it after its last answer
        if kind == "join" and worker not in cores.members:
            if cores.join(worker) and len(cores.members) == cores.world:
                lost_since_complete.clear()
        elif kind in ("lost", "left") and worker in cores.members:
            cores.depart(worker, f"fuzzed {kind}", lost=kind == "lost")
            if kind == "lost" and not ended_before:  # a failure names those lost before it
                lost_since_complete.add(worker)
        elif kind == "chunk" and worker in cores.members:
            cores.contribute(worker, int(arg), float(worker + 1))
        elif kind == "advance":
            cores.advance(arg)
        elif kind == "monitor":
            cores.apply(cores.job.monitor_failed(int(arg), 5, "fuzzed"))
        elif kind == "stop":
            cores.stop()
        if ended_before:
            assert cores.job.ended and cores.states()[-1] in (JobState.FINISHED, JobState.FAILED)
        live = set(table.live_workers())
        by_step: dict[int, set[int]] = {}
        for item in cores.sent[before:]:
            event = item.event
            if isinstance(event, AveragedChunkOut):
                assert event.key.step not in failed_steps, f"step {event.key.step} averaged after it failed"
                assert set(item.to) == live
            elif isinstance(event, ErrorOut) and event.step_failed:
                by_step.setdefault(event.step, set()).update(item.to)
        for step, told in by_step.items():
            if step not in failed_steps:  # a step's first failure goes to every live worker
                assert told == live, f"step {step} failed for {sorted(told)}, live {sorted(live)}"
            failed_steps.add(step)
        if cores.effects.count(ResetJob()) != resets:
            failed_steps.clear()  # a fresh job numbers its steps from 0 again
    ended = [s for s in cores.states() if s in (JobState.FINISHED, JobState.FAILED)]
    assert len(ended) <= 1
    failure = cores.job.failure or ""
    if "--rejoin-timeout" in failure:
        for worker in lost_since_complete:
            assert f"worker {worker} fuzzed lost" in failure
