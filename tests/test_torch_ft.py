"""Fault-tolerant DDP (`gradserver.torch.ft`) over real processes, as a user runs it:
`gradserver run --workers 3 --restart-lost K -- python examples/ft_ddp.py`. A rank killed or
stopped mid-job is started again alone, heals from a live rank, and every rank ends with the same
state digest; steps a rank missed are averaged over the ranks that took part. In one process:
the bound on live replicas."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from gradserver.common.errors import (
    AbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    UnavailableError,
)
from gradserver.torch import ft
from gradserver.worker import Timeouts, WorkerClient

from .helpers.processes import ROOT, ManagedProcess, ProcessGroup, pid_alive
from .helpers.proxy import FaultProxy
from .helpers.ranks import rank_errors, spawn_and_join
from .helpers.server import TEST_TIMEOUTS, connect_all

STEPS = 2500
STARTED = re.compile(r"started (rank \d+) \(pid (\d+)\)")
FINAL = re.compile(r"rank (\d): (\d+) steps \((\d+) applied here\), digest (0x[0-9a-f]+)")


def _pids(run: ManagedProcess) -> dict[str, int]:
    """The latest pid of each rank, from run's own 'started rank N (pid P)' lines."""
    return {m[1]: int(m[2]) for m in map(STARTED.search, run.lines) if m}


@contextlib.contextmanager
def _ft_run(
    processes: ProcessGroup,
    *run_flags: str,
    steps: int = STEPS,
    script: tuple[str, ...] = (),
    workers: int = 3,
    example: str = "ft_ddp.py",
):
    command = script or (sys.executable, str(ROOT / "examples" / example))
    run = processes.gradserver(
        "run",
        "--workers",
        str(workers),
        *run_flags,
        "--",
        *command,
        "--steps",
        str(steps),
        name="run",
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        yield run
    finally:
        run.ensure_ended()
        for pid in _pids(run).values():
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _assert_one_state(run: ManagedProcess, steps: int = STEPS) -> dict[int, tuple[int, str]]:
    finals = {int(m[1]): (int(m[3]), m[4]) for m in map(FINAL.search, run.lines) if m and int(m[2]) == steps}
    assert sorted(finals) == [0, 1, 2], run.output
    assert len({digest for _, digest in finals.values()}) == 1, finals
    return finals


@pytest.mark.timeout(240)
def test_a_killed_rank_is_restarted_alone_and_heals_to_the_same_state(processes: ProcessGroup) -> None:
    with _ft_run(processes, "--restart-lost", "1") as run:
        run.wait_for(r"\[rank 1\] rank 1 step 300:", timeout=120)
        os.kill(_pids(run)["rank 1"], signal.SIGKILL)
        run.wait_for(r"^run: rank 1 was killed by SIGKILL; starting it again \(0 restart\(s\) left\)", 30)
        joined = run.wait_for(r"rank 1: joined the running job at step (\d+), state from rank (\d)", 120)
        assert int(joined[1]) > 300 and joined[2] in ("0", "2")
        assert run.wait(180) == 0, run.output
        assert run.lines[-1] == "run: all 3 ranks finished", run.output
        finals = _assert_one_state(run)
        assert finals[1][0] == STEPS - int(joined[1])  # the healed rank applied only its own steps
        # While it was gone, the others' steps were averaged over the two of them.
        assert re.search(r"\[rank [02]\] rank [02] step \d+: loss \S+, averaged over 2", run.output), (
            run.output
        )


@pytest.mark.timeout(240)
def test_a_stopped_rank_is_evicted_then_restarted_and_heals(processes: ProcessGroup) -> None:
    """SIGSTOP beyond the heartbeat: the coordinator declares it lost, run stops it for good and
    starts it again (it is never continued)."""
    with _ft_run(processes, "--restart-lost", "1", "--heartbeat-timeout", "2") as run:
        run.wait_for(r"\[rank 2\] rank 2 step 300:", timeout=120)
        stopped = _pids(run)["rank 2"]
        os.kill(stopped, signal.SIGSTOP)
        run.wait_for(r"^run: rank 2 was lost \(lost: no message for [\d.]+ s.*\); stopping it", 60)
        run.wait_for(r"^run: rank 2 was killed by SIGKILL; starting it again", 60)
        run.wait_for(r"rank 2: joined the running job at step \d+, state from rank \d", 120)
        assert run.wait(180) == 0, run.output
        _assert_one_state(run)
        assert not pid_alive(stopped)


@pytest.mark.timeout(240)
def test_without_restarts_left_a_second_loss_ends_the_run_naming_it(processes: ProcessGroup) -> None:
    with _ft_run(processes, "--restart-lost", "1", steps=100_000) as run:
        run.wait_for(r"\[rank 1\] rank 1 step 200:", timeout=120)
        os.kill(_pids(run)["rank 1"], signal.SIGKILL)
        run.wait_for(r"rank 1: joined the running job", 120)
        os.kill(_pids(run)["rank 0"], signal.SIGKILL)
        assert run.wait(60) != 0, run.output
        assert run.lines[-1] == "run: rank 0 was killed by SIGKILL", run.output


def test_a_step_over_fewer_than_min_replicas_stops_the_job(coordinator) -> None:
    server = coordinator(world_size=2, on_worker_loss="continue")
    errors: list[BaseException] = []
    ready = threading.Barrier(2)

    def replica(rank: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            job = ft.Replica(model, optimizer, coordinator=server.address, min_replicas=2, timeout=20.0)
        except BaseException as exc:
            errors.append(exc)
            return
        ddp = job.ddp()
        try:
            for step in job.steps(3):
                optimizer.zero_grad()
                ddp(torch.full((2, 4), float(step + rank))).sum().backward()
                assert job.commit()
            ready.wait(20)
            if rank == 1:
                job.close()  # leaves: the next step is averaged over rank 0 alone
                return
            for _ in job.steps(4):
                optimizer.zero_grad()
                ddp(torch.ones(2, 4)).sum().backward()
                job.commit()
        except BaseException as exc:
            errors.append(exc)
        finally:
            with contextlib.suppress(Exception):
                job.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(errors) == 1, errors
    assert "step 3 was averaged over 1 replicas, fewer than min_replicas 2: the job stops" in str(errors[0])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase", ["forward", "averaging", "commit", "optimizer"])
def test_a_rank_killed_at_any_point_of_a_step_leaves_no_replica_that_differs(
    processes: ProcessGroup, phase: str
) -> None:
    """Rank 1 kills itself at `phase` of step 150 (tests/helpers/ft_rank.py): in forward; with its
    gradients sent and their average not back (mid-collective); before the commit barrier; or
    with the step committed for every rank but not applied by it. The others' step completes (or
    is discarded by all), run restarts rank 1, it heals, and every rank ends with one state."""
    script = (sys.executable, "-m", "tests.helpers.ft_rank", "--die", f"1:150:{phase}")
    with _ft_run(processes, "--restart-lost", "1", steps=1500, script=script) as run:
        run.wait_for(rf"rank 1: dying in step 150 at {phase}", timeout=120)
        run.wait_for(r"^run: rank 1 was killed by SIGKILL; starting it again", 60)
        joined = run.wait_for(r"rank 1: joined the running job at step (\d+), state from rank \d", 120)
        assert int(joined[1]) > 150
        assert run.wait(180) == 0, run.output
        _assert_one_state(run, steps=1500)


def test_bad_settings_are_refused_naming_them(coordinator, monkeypatch) -> None:
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="min_replicas must be at least 1, got 0"):
        ft.Replica(model, optimizer, min_replicas=0)
    monkeypatch.delenv("GRADSERVER_COORDINATOR", raising=False)
    with pytest.raises(InvalidArgumentError, match=re.escape("ft.Replica needs the coordinator's address")):
        ft.Replica(model, optimizer)
    server = coordinator(world_size=1, on_worker_loss="continue")
    with (
        ft.Replica(model, optimizer, coordinator=server.address, timeout=20.0) as job,
        pytest.raises(InvalidArgumentError, match=re.escape("ft.Replica.ddp chooses its own process_group")),
    ):
        job.ddp(process_group=None)


def _a_place_left(coordinator) -> tuple[str, WorkerClient]:
    """A running job of two workers (step 0's barrier passed) whose worker 1 left: a rank that
    joins takes its place. The address, and the member that stays (the caller closes it)."""
    server = coordinator(world_size=2, on_worker_loss="continue")
    staying, leaving = connect_all(server.address, 2)
    done = [threading.Thread(target=c.barrier, args=(0,)) for c in (staying, leaving)]
    for t in done:
        t.start()
    for t in done:
        t.join(20)
    leaving.close()
    return server.address, staying


def test_a_heal_that_fails_leaves_no_member_and_no_thread(coordinator) -> None:
    address, silent = _a_place_left(coordinator)
    try:
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        quick = Timeouts(connect=10.0, join=20.0, receive=1.0, send=10.0, close=5.0)
        with pytest.raises(AbortedError, match="worker 0 sent no state within 1 s"):
            ft.Replica(model, optimizer, coordinator=address, timeout=quick)
        assert not [t for t in threading.enumerate() if t.name == "gradserver-ft" and t.is_alive()]
        # Its place is free again: another worker can take it.
        again = WorkerClient.connect(address, timeout=TEST_TIMEOUTS)
        assert again.worker_id == 1
        again.close()
    finally:
        silent.close()


@pytest.mark.timeout(240)
def test_a_donor_killed_as_it_serves_the_heal_is_followed_by_the_next_donor(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Rank 1 is killed; as rank 0 begins to give it the state, rank 0 dies too
    (tests/helpers/ft_rank.py --die-serving 0): rank 1 takes the state from rank 2, and run
    restarts rank 0, which heals in turn. Ranks 1 and 2 hold at the start of step 1400 until rank 0
    healed, so they cannot finish the job before rank 0's replacement joins (a test of the heal,
    not of how fast a process starts). Both hold, before either opens step 1400: a replacement
    takes part from the first step not yet opened, so one rank past the hold would make the heal
    wait for a step that the held rank never reaches."""
    hold = tmp_path / "rank-0-healed"
    script = (
        *(sys.executable, "-m", "tests.helpers.ft_rank", "--die-serving", "0"),
        *("--hold", f"1,2:1400:{hold}"),
    )
    with _ft_run(processes, "--restart-lost", "2", steps=1500, script=script) as run:
        run.wait_for(r"\[rank 1\] rank 1 step 200:", timeout=120)
        os.kill(_pids(run)["rank 1"], signal.SIGKILL)
        run.wait_for(r"rank 0: dying as it serves its state of step \d+", 120)
        run.wait_for(r"rank 1: joined the running job at step \d+, state from rank 2", 120)
        run.wait_for(r"rank 0: joined the running job at step \d+, state from rank [12]", 120)
        hold.touch()
        assert run.wait(180) == 0, run.output
        _assert_one_state(run, steps=1500)


@pytest.mark.timeout(240)
def test_a_replacement_that_comes_after_the_others_finished_ends_the_run_with_success(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Issue 50: rank 1 is killed late and its replacement only comes once ranks 0 and 2 have
    finished every step (tests/helpers/ft_rank.py --late-replacement). The job finished: run ends
    within seconds of the last rank (not after --rejoin-timeout), exits 0, and its last line names
    the lost rank and that its replacement found the job finished."""
    steps = 600
    script = (sys.executable, "-m", "tests.helpers.ft_rank", "--late-replacement", str(tmp_path))
    with _ft_run(processes, "--restart-lost", "2", steps=steps, script=script) as run:
        run.wait_for(r"\[rank 1\] rank 1 step 400:", timeout=120)
        os.kill(_pids(run)["rank 1"], signal.SIGKILL)
        for rank in (0, 2):
            run.wait_for(rf"rank {rank}: {steps} steps", 120)
        # The coordinator would wait --rejoin-timeout (60 s) for the replacement, then fail.
        assert run.wait(30) == 0, run.output
    last = run.lines[-1]
    assert re.fullmatch(
        r"run: all 3 ranks finished; rank 1 was lost at operation \d+ \(.+\) and its replacement "
        r"found the job finished",
        last,
    ), run.output
    finals = {int(m[1]): m[4] for m in map(FINAL.search, run.lines) if m and int(m[2]) == steps}
    assert sorted(finals) == [0, 2] and len(set(finals.values())) == 1, run.output


STARTED_COORDINATOR = re.compile(r"started coordinator \(pid (\d+)\)")


def _coordinator_pid(run: ManagedProcess) -> int:
    return [int(m[1]) for m in map(STARTED_COORDINATOR.search, run.lines) if m][-1]


@pytest.mark.timeout(240)
def test_the_coordinator_killed_is_restarted_and_the_ranks_rejoin_and_go_on(processes: ProcessGroup) -> None:
    with _ft_run(processes, "--restart-lost", "1", steps=1500) as run:
        run.wait_for(r"\[rank 1\] rank 1 step 200:", timeout=120)
        os.kill(_coordinator_pid(run), signal.SIGKILL)
        run.wait_for(r"^run: coordinator was killed by SIGKILL; starting it again on its port", 30)
        for rank in range(3):
            run.wait_for(
                rf"rank {rank} rejoined the restarted coordinator; the job goes on from step \d+", 120
            )
        assert run.wait(180) == 0, run.output
        assert run.lines[-1] == "run: all 3 ranks finished", run.output
        _assert_one_state(run, steps=1500)


@pytest.mark.timeout(300)
def test_a_step_the_dying_coordinator_released_to_some_ranks_only_is_applied_by_all(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """The coordinator dies as it releases step 150's commit: ranks 0 and 1 got the release and
    applied the step, rank 2 did not (tests/helpers/ft_rank.py --lose-release). After run
    restarted it, the ranks compare where they are and rank 2 takes step 150's result from one
    that applied it: the job ends in the very state of a run without the fault."""
    steps, flag = 400, tmp_path / "coordinator-killed"
    faulty = (sys.executable, "-m", "tests.helpers.ft_rank", "--lose-release", f"2:150:{flag}")
    with _ft_run(processes, "--restart-lost", "1", steps=steps, script=faulty) as run:
        run.wait_for(r"rank 2: lost the release of step 150", timeout=120)
        run.wait_for(r"rank 0: applied step 150", timeout=60)
        run.wait_for(r"rank 1: applied step 150", timeout=60)
        os.kill(_coordinator_pid(run), signal.SIGKILL)
        run.wait_for(r"^run: coordinator was killed by SIGKILL; starting it again on its port", 30)
        flag.touch()
        healed = run.wait_for(
            r"rank 2 joined the running job at step (\d+): took the state from rank ([01])", 120
        )
        assert healed[1] == "151"
        assert run.wait(180) == 0, run.output
        finals = _assert_one_state(run, steps=steps)
    with _ft_run(processes, steps=steps) as clean:
        assert clean.wait(180) == 0, clean.output
        assert _assert_one_state(clean, steps=steps)[0][1] == finals[0][1]


@pytest.mark.timeout(120)
def test_without_a_coordinator_back_the_ranks_fail_naming_the_step_after_the_reconnect_timeout(
    coordinator,
) -> None:
    """The coordinator's connections reset and nothing listens any more: the rank tries to
    rejoin for reconnect_timeout, then its commit raises naming the step and both failures."""
    server = coordinator(world_size=1, on_worker_loss="continue")
    host, port = server.address.rsplit(":", 1)
    proxy = FaultProxy(host, int(port)).start()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    job = ft.Replica(model, optimizer, coordinator=proxy.address, timeout=2.0, reconnect_timeout=1.0)
    ddp = job.ddp()

    def train() -> None:
        for step in job.steps(5):
            if step == 2:
                proxy.stop()  # as a coordinator's machine that went away
            optimizer.zero_grad()
            ddp(torch.full((2, 4), float(step))).sum().backward()
            assert job.commit()

    try:
        with pytest.raises(UnavailableError) as failed:
            train()
        assert "rank 0 lost the coordinator in step 2" in failed.value.message
        assert "did not come back within 1 s" in failed.value.message
        assert job.committed == 2
    finally:
        proxy.stop()
        job.close()


def test_reconnect_timeout_is_an_argument_with_an_environment_default(
    coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = coordinator(world_size=1, on_worker_loss="continue")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("GRADSERVER_FT_RECONNECT_TIMEOUT", "7.5")
    with ft.Replica(model, optimizer, coordinator=server.address) as job:
        assert job.reconnect_timeout == 7.5
    with ft.Replica(model, optimizer, coordinator=server.address, reconnect_timeout=0) as job:
        assert job.reconnect_timeout == 0
    with pytest.raises(InvalidArgumentError, match="reconnect_timeout must not be negative, got -1"):
        ft.Replica(model, optimizer, coordinator=server.address, reconnect_timeout=-1)


# --- HSDP: replica groups of FSDP2-sharded ranks ------------------------------------------------------

HSDP = re.compile(r"replica group (\d) shard (\d): (\d+) steps \((\d+) applied here\), digest (0x[0-9a-f]+)")


def _assert_one_state_per_shard(run: ManagedProcess, steps: int) -> dict[tuple[int, int], int]:
    """Both replica groups end with the same state of each shard; (group, shard) -> steps applied."""
    finals = [m for m in map(HSDP.search, run.lines) if m and int(m[3]) == steps]
    assert sorted((int(m[1]), int(m[2])) for m in finals) == [(0, 0), (0, 1), (1, 0), (1, 1)], run.output
    for shard in (0, 1):
        assert len({m[5] for m in finals if int(m[2]) == shard}) == 1, finals
    return {(int(m[1]), int(m[2])): int(m[4]) for m in finals}


@pytest.mark.timeout(300)
def test_hsdp_a_rank_killed_in_backward_restarts_its_replica_group_which_heals(
    processes: ProcessGroup,
) -> None:
    """The issue's check: 4 ranks, 2 replica groups x 2 FSDP2 shards, one rank SIGKILLed in
    backward; run restarts its whole group, both its ranks start at one step with their shards'
    state from the live group, and every shard ends identical in both groups. While the group was
    gone, the other's steps were averaged over itself alone."""
    script = (
        sys.executable,
        "-m",
        "tests.helpers.ft_rank",
        "--example",
        "ft_hsdp.py",
        "--die",
        "3:120:backward",
    )
    flags = ("--replica-group-size", "2", "--restart-lost", "1")
    with _ft_run(processes, *flags, steps=800, script=script, workers=4) as run:
        run.wait_for(r"rank 3: dying in step 120 at backward", timeout=120)
        run.wait_for(
            r"^run: rank 3 was killed by SIGKILL; starting it again with its replica group \(ranks 2-3\)", 60
        )
        first = run.wait_for(
            r"replica group 1 shard (\d): joined the running job at step (\d+), state from group 0", 120
        )
        second = run.wait_for(
            rf"replica group 1 shard {1 - int(first[1])}: joined the running job at step (\d+)", 60
        )
        assert int(first[2]) == int(second[1]) > 120  # the group's ranks start at one step
        assert run.wait(200) == 0, run.output
        applied = _assert_one_state_per_shard(run, 800)
        assert applied[(0, 0)] == applied[(0, 1)] == 800
        assert applied[(1, 0)] == applied[(1, 1)] == 800 - int(first[2])
        assert re.search(r"replica group 0 shard \d step \d+: loss \S+, averaged over 1", run.output), (
            run.output
        )


@pytest.mark.timeout(300)
def test_hsdp_a_stopped_rank_has_its_replica_group_restarted(processes: ProcessGroup) -> None:
    """SIGSTOP beyond the heartbeat: its partner waits in their group's collective, the
    coordinator declares it lost, run stops it and its partner and restarts the group."""
    flags = ("--replica-group-size", "2", "--restart-lost", "1", "--heartbeat-timeout", "2")
    with _ft_run(processes, *flags, steps=1200, workers=4, example="ft_hsdp.py") as run:
        run.wait_for(r"\[rank 1\] replica group 0 shard 1 step 200:", timeout=120)
        stopped = _pids(run)["rank 1"]
        os.kill(stopped, signal.SIGSTOP)
        run.wait_for(r"^run: rank 1 was lost \(lost: no message for [\d.]+ s.*\); stopping it", 60)
        run.wait_for(r"starting it again with its replica group \(ranks 0-1\)", 60)
        run.wait_for(r"replica group 0 shard \d: joined the running job at step \d+, state from group 1", 120)
        assert run.wait(200) == 0, run.output
        _assert_one_state_per_shard(run, 1200)
        assert not pid_alive(stopped)


def test_hsdp_a_replica_group_half_new_is_refused(coordinator, monkeypatch) -> None:
    """A rank that joined a running job while the other rank of its replica group began it (not
    a group restarted whole) is refused, naming it; it leaves nothing behind. The group's other
    rank is played by the patched collectives: it contributes "not new" to the count."""
    address, staying = _a_place_left(coordinator)
    try:
        monkeypatch.setattr(ft.dist, "all_reduce", lambda tensor, op=None, group=None: None)
        monkeypatch.setattr(ft.dist, "get_world_size", lambda group=None: 2)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        group = object()
        with pytest.raises(
            FailedPreconditionError, match="1 of the 2 ranks of this replica group joined a running"
        ):
            ft.Replica(model, optimizer, coordinator=address, timeout=20.0, replica_group=group)  # type: ignore[arg-type]
        assert not [t for t in threading.enumerate() if t.name == "gradserver-ft" and t.is_alive()]
        again = WorkerClient.connect(address, timeout=TEST_TIMEOUTS)
        assert again.worker_id == 1
        again.close()
    finally:
        staying.close()


@pytest.mark.parametrize(
    ("last", "error"),
    [
        ((2, None), "step 2: another shard of this replica group lost its coordinator"),
        ((0, 0), "step 2 was averaged over 0 replicas, fewer than min_replicas 1"),
    ],
    ids=["lost", "fewest"],
)
def test_hsdp_a_step_another_shard_failed_is_discarded_and_a_lost_one_ends_the_rank(
    coordinator, monkeypatch, last: tuple[int, int | None], error: str
) -> None:
    """The group's agreement (row FT9): this shard committed its step, the patched collective
    plays the other shard's answer. "Failed" there: this rank discards the step too. "Lost its
    coordinator" there: this rank stops with an error saying so; and so it does when the other
    shard's step was averaged over fewer replicas than `min_replicas` (each shard's job counts
    its own), though this one's was not."""
    server = coordinator(world_size=1, on_worker_loss="continue")
    answers: list[tuple[int, int | None]] = []

    def other_shard(tensor: torch.Tensor, op: object = None, group: object = None) -> None:
        if answers and tensor.dtype == torch.int64 and tensor.numel() == 2:  # [outcome, -contributors]
            outcome, contributors = answers.pop(0)
            tensor[0] = max(int(tensor[0]), outcome)
            if contributors is not None:
                tensor[1] = max(int(tensor[1]), -contributors)

    monkeypatch.setattr(ft.dist, "all_reduce", other_shard)
    monkeypatch.setattr(ft.dist, "get_world_size", lambda group=None: 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    group = object()
    with ft.Replica(model, optimizer, coordinator=server.address, timeout=20.0, replica_group=group) as job:  # type: ignore[arg-type]
        before = [p.detach().clone() for p in model.parameters()]
        for answer in (0, 1):
            answers.append((answer, None))
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            assert job.commit() is (answer == 0)
        assert job.committed == 1 and job.step == 2
        changed = [p.detach().clone() for p in model.parameters()]
        assert not all(torch.equal(a, b) for a, b in zip(before, changed, strict=True))
        answers.append(last)
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        with pytest.raises(FailedPreconditionError, match=re.escape(error)):
            job.commit()
        assert all(torch.equal(a, p) for a, p in zip(changed, model.parameters(), strict=True))


def _serve_mid_backward(rank: int, store: str, address: str, out: str) -> None:
    """One rank of a replica group of 2 FSDP2 shards: in every step's backward, after FSDP2
    gathered a layer's parameters for it and before the layer's gradient is computed, what the
    state server serves (`Replica._snapshot`, on a thread of its own as the server calls it) is
    read. It must neither disturb the backward nor serve anything but this rank's shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        nn = torch.nn
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        job = ft.Replica(model, optimizer, coordinator=address, timeout=20.0, replica_group=dist.group.WORLD)
        served: list[dict[str, torch.Tensor]] = []

        def serve(grad: torch.Tensor) -> None:
            def read() -> None:  # its tensors are the live ones: copied as they are now
                served.append({k: v.clone() for k, v in job._snapshot().tensors.items()})

            reader = threading.Thread(target=read)
            reader.start()
            reader.join(30.0)

        # Registered after FSDP2's own forward hook: in backward, this tensor hook runs after
        # FSDP2's (which gathers the layer's parameters) and before the layer's backward.
        model[2].register_forward_hook(lambda module, args, output: output.register_hook(serve) and None)
        with job:
            for step in job.steps(3):
                before = {k: v.clone() for k, v in ft.state_tensors(model, optimizer).items()}
                optimizer.zero_grad()
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).sum().backward()
                assert job.commit()
                assert len(served) == step + 1
                assert served[-1].keys() == before.keys()
                for name, value in before.items():
                    torch.testing.assert_close(served[-1][name], value, rtol=0, atol=0, msg=name)
    except BaseException as exc:
        Path(out, f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_hsdp_state_served_in_the_middle_of_a_backward_leaves_it_intact(coordinator, tmp_path) -> None:
    """A donor serves its state on the state server's thread, whenever a replacement asks, in
    the middle of a step. Reading an FSDP2 model's state there must not reshard it: backward
    then read parameters whose gathered storage was freed ("setStorage: ... storage of size
    0"), which ended the live replica group as another joined."""
    shards = [coordinator(world_size=1, on_worker_loss="continue") for _ in range(2)]
    ranks = spawn_and_join(
        _serve_mid_backward,
        [(rank, str(tmp_path / "store"), shards[rank].address, str(tmp_path)) for rank in range(2)],
        timeout_s=240,
        check_exits=False,
    )
    assert not rank_errors(tmp_path)
    assert [rank.exitcode for rank in ranks] == [0, 0]
