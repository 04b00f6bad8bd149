"""Outer steps (DiLoCo) over `gradserver.torch.ft`, as a user runs them: `gradserver run --workers 3
--restart-lost 1 -- python examples/diloco_ft.py`, faults injected by
tests/helpers/ft_diloco_rank.py (keyed by rank and inner step). Each exchange is one
fault-tolerant step: without a fault the global weights are bit-identical on every replica after
every outer step and equal to the process-group DiLoCo's (examples/diloco.py, same seeds); a rank
killed mid-inner-phase is restarted, the others' exchanges meanwhile are averaged over the two of
them, the replacement takes a live rank's state at the next exchange and joins there, and every
rank ends with the same global weights, at the fault-free run's loss. In one process: bad input
refused by name.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gradserver.common.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError
from gradserver.common.timeouts import Timeouts
from gradserver.torch import _ft_exchange, ft
from gradserver.torch.diloco import DiLoCo

from .helpers.processes import ROOT, ManagedProcess, ProcessGroup, pid_alive

STARTED = re.compile(r"started (rank \d+) \(pid (\d+)\)")
OUTER = re.compile(r"rank (\d) outer (\d+) at inner step (\d+): global (0x[0-9a-f]+), averaged over (\d+)")
FINAL = re.compile(
    r"rank (\d): (\d+) inner steps, (\d+) outer steps \((\d+) discarded\), global sha256 ([0-9a-f]+), "
    r"held-out loss (\S+)"
)
JOINED = re.compile(
    r"rank (\d): joined the running job at step (\d+) \(inner step (\d+)\), state from rank (\d)"
)


@contextlib.contextmanager
def _run(
    processes: ProcessGroup, name: str, *command: str, workers: int = 3, run_flags: tuple[str, ...] = ()
) -> Iterator[ManagedProcess]:
    run = processes.gradserver(
        "run",
        "--workers",
        str(workers),
        "--restart-lost",
        "1",
        *run_flags,
        "--",
        *command,
        name=name,
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        yield run
    finally:
        run.ensure_ended()
        for pid in {int(m[2]) for m in map(STARTED.search, run.lines) if m}:
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _faulty(*flags: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "tests.helpers.ft_diloco_rank", *flags)


def _example(*flags: str) -> tuple[str, ...]:
    return (sys.executable, str(ROOT / "examples" / "diloco_ft.py"), *flags)


def _one_state(run: ManagedProcess, steps: int) -> tuple[str, float]:
    """Every rank ended at `steps` with the same global weights: their sha256 and held-out loss."""
    finals = {
        int(m[1]): (m[5], float(m[6])) for m in map(FINAL.search, run.lines) if m and int(m[2]) == steps
    }
    assert sorted(finals) == [0, 1, 2], run.output
    assert len(set(finals.values())) == 1, finals
    return finals[0]


def _digests_agree(run: ManagedProcess) -> dict[int, set[int]]:
    """Every outer step's global digest, equal on every rank that printed it: the ranks that did,
    by outer step."""
    seen: dict[int, dict[int, str]] = {}
    for m in filter(None, map(OUTER.search, run.lines)):
        seen.setdefault(int(m[2]), {})[int(m[1])] = m[4]
    for outer, digests in seen.items():
        assert len(set(digests.values())) == 1, (outer, digests)
    return {outer: set(digests) for outer, digests in seen.items()}


STREAMING = ("--fragments", "2", "--delay", "3", "--keep-local", "0.5", "--quantize", "int8")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("streaming", [(), STREAMING], ids=["diloco", "streaming-int8"])
def test_without_a_fault_the_global_weights_are_identical_and_those_of_the_process_group(
    processes: ProcessGroup, streaming: tuple[str, ...]
) -> None:
    """Streaming too: over ft each exchange runs while the next 3 inner steps do, as over the
    process group, and ends in the same bits."""
    flags = ("--steps", "100", "--sync-every", "20", *streaming)
    outers = 10 if streaming else 5  # 2 fragments: an outer step of each every period
    with (
        _run(processes, "ft", *_example(*flags)) as ft_run,
        _run(processes, "pg", sys.executable, str(ROOT / "examples" / "diloco.py"), *flags) as pg_run,
    ):
        assert ft_run.wait(180) == 0, ft_run.output
        assert pg_run.wait(180) == 0, pg_run.output
    by_outer = _digests_agree(ft_run)
    # The last streaming exchange lands in the flush, after the loop's last print.
    printed = outers - 1 if streaming else outers
    assert by_outer == {outer: {0, 1, 2} for outer in range(1, printed + 1)}, by_outer
    sha256, _ = _one_state(ft_run, 100)
    process_group = set(re.findall(r'"param_sha256": "([0-9a-f]+)"', pg_run.output))
    assert process_group == {sha256}, (process_group, sha256)
    assert all(int(m[5]) == 3 for m in map(OUTER.search, ft_run.lines) if m)


@pytest.mark.timeout(240)
def test_a_rank_killed_mid_inner_phase_rejoins_at_the_next_exchange_at_the_fault_free_loss(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Rank 1 dies in inner step 250 (period 13, exchanges every 20 steps); ranks 0 and 2 hold at
    inner step 270 until its replacement asks for their state, so that it joins mid-job (it would
    otherwise start after they finished: a test of the heal, not of how fast a process starts).
    The replacement takes the state at the exchange of inner step 280 and takes part from there."""
    flags = ("--steps", "600", "--sync-every", "20", "--decay", "--noise", "0.1", "--batch", "256")
    faults = ("--die", "1:250:inner", "--hold", f"0,2:270:{tmp_path / 'joined'}")
    with (
        _run(processes, "faulty", *_faulty(*faults, *flags)) as faulty,
        _run(processes, "fault-free", *_example(*flags)) as fault_free,
    ):
        faulty.wait_for(r"rank 1: dying in inner step 250", timeout=120)
        faulty.wait_for(r"^run: rank 1 was killed by SIGKILL; starting it again", 60)
        joined = faulty.wait_for(JOINED.pattern, 120)
        # The job's step 14: step 0 checked the start, exchange k is step k + 1.
        assert (int(joined[2]), int(joined[3])) == (14, 280) and joined[4] in ("0", "2"), joined[0]
        assert faulty.wait(180) == 0, faulty.output
        assert fault_free.wait(180) == 0, fault_free.output
    assert faulty.lines[-1] == "run: all 3 ranks finished", faulty.output
    by_outer = _digests_agree(faulty)
    # The exchanges while rank 1 was gone were averaged over the two others.
    assert re.search(r"rank [02] outer 13 at inner step 260: .*averaged over 2", faulty.output), faulty.output
    assert by_outer[16] == {0, 1, 2}, by_outer
    _, loss = _one_state(faulty, 600)
    _, fault_free_loss = _one_state(fault_free, 600)
    print(f"held-out loss: {loss:.6f} with the fault, {fault_free_loss:.6f} without")
    assert abs(loss - fault_free_loss) <= 0.01 * fault_free_loss


HSDP_JOINED = re.compile(
    r"replica group (\d) shard (\d): joined the running job at step (\d+) \(inner step (\d+)\), "
    r"state from group (\d)"
)
HSDP_FINAL = re.compile(
    r"replica group (\d) shard (\d): (\d+) steps \((\d+) applied here\), digest (0x[0-9a-f]+)"
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "streaming",
    [(), ("--fragments", "2", "--delay", "3", "--quantize", "int8")],
    ids=["diloco", "streaming-int8"],
)
def test_hsdp_replica_groups_take_outer_steps_and_a_restarted_group_heals_at_an_exchange(
    processes: ProcessGroup, tmp_path: Path, streaming: tuple[str, ...]
) -> None:
    """HSDP over ft with outer steps: 4 ranks, 2 replica groups x 2 FSDP2 shards
    (examples/ft_hsdp.py --outer-steps 10), each shard's exchange a step of its own job. Rank 3
    dies in inner step 35; ranks 0 and 1 (the other group) hold at inner step 60 until a
    replacement asks for their state. run restarts group 1 whole; its two ranks line up on one
    exchange and take each shard's state (global weights and outer state included) from group 0
    there; every shard's global weights end identical in both groups. Streaming: 2 fragments
    (an exchange every 5 inner steps), each overlapping the next 3 inner steps, int8 payloads."""
    flags = ("--example", "ft_hsdp.py", "--steps", "200", "--outer-steps", "10", *streaming)
    faults = ("--die", "3:35:inner", "--hold", f"0,1:60:{tmp_path / 'joined'}")
    groups = ("--replica-group-size", "2")
    with _run(processes, "hsdp", *_faulty(*faults, *flags), workers=4, run_flags=groups) as run:
        run.wait_for(r"rank 3: dying in inner step 35", timeout=120)
        run.wait_for(r"^run: rank 3 was killed by SIGKILL; starting it again with its replica group", 60)
        first = run.wait_for(HSDP_JOINED.pattern, 120)
        shard = 1 - int(first[2])
        second = run.wait_for(
            rf"replica group 1 shard {shard}: joined the running job at step (\d+) \(inner step (\d+)\)", 60
        )
        # Both shards at one exchange, past the hold: exchange k is the job's step k + 1.
        assert first[1] == "1" and first[5] == "0", first[0]
        assert (first[3], first[4]) == (second[1], second[2]), (first[0], second[0])
        every = 5 if streaming else 10  # inner steps from one exchange to the next
        assert int(first[3]) * every >= 60 and int(first[4]) == every * int(first[3]), first[0]
        assert run.wait(180) == 0, run.output
    finals = [m for m in map(HSDP_FINAL.search, run.lines) if m and int(m[3]) == 200]
    assert sorted((int(m[1]), int(m[2])) for m in finals) == [(0, 0), (0, 1), (1, 0), (1, 1)], run.output
    for shard in (0, 1):
        assert len({m[5] for m in finals if int(m[2]) == shard}) == 1, finals
    applied = {(int(m[1]), int(m[2])): int(m[4]) for m in finals}
    # Each group applied its exchanges on both its shards alike (one discarded where the lost
    # group's rank died while an overlapped exchange was on its way, on both; the flush of
    # streaming adds one); the restarted group only those from its join on.
    assert applied[(0, 0)] == applied[(0, 1)] > applied[(1, 0)] == applied[(1, 1)], applied


@pytest.mark.timeout(240)
def test_streaming_int8_survives_a_rank_killed_after_it_sent_its_payload(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """int8 with error feedback, 2 fragments (exchanges at inner steps 10 and 20 of each period),
    delay 3, keep_local 0.5: rank 1 dies with its payload of the exchange at inner step 50 sent.
    The replacement joins at a fragment's exchange, with the averages still to be applied taken
    from its donor, and every rank ends with the same global weights."""
    flags = (
        *("--steps", "200", "--sync-every", "20", "--quantize", "int8"),
        *("--fragments", "2", "--delay", "3", "--keep-local", "0.5"),
    )
    faults = ("--die", "1:50:exchange", "--hold", f"0,2:75:{tmp_path / 'joined'}")
    with _run(processes, "faulty", *_faulty(*faults, *flags)) as faulty:
        faulty.wait_for(r"rank 1: dying in step 5 \(an exchange\), its payload sent", timeout=120)
        joined = faulty.wait_for(JOINED.pattern, 180)
        assert (int(joined[2]), int(joined[3])) == (8, 80), joined[0]  # step 0 checked the start
        assert faulty.wait(180) == 0, faulty.output
    by_outer = _digests_agree(faulty)
    # When rank 1's records reached the coordinator before it died, they count in that exchange's
    # sum and its [w, counts] do not: every rank discards that exchange (FT17), one fewer. The
    # replacement took the count with the state.
    discarded = {int(m[4]) for m in map(FINAL.search, faulty.lines) if m}
    assert discarded in ({0}, {1}), faulty.output
    last = 19 - discarded.pop()
    assert by_outer[last] == {0, 1, 2}, by_outer  # the 20th lands in close()
    _, loss = _one_state(faulty, 200)
    assert loss < 0.01


@pytest.mark.timeout(240)
def test_a_replacement_that_arrives_in_the_final_flush_takes_part_in_it(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """Streaming (2 fragments, delay 3, keep_local 0.5): rank 1 dies with its payload of the last
    period's last exchange (inner step 200) sent, and ranks 0 and 2 are held in `flush` until the
    replacement asks for a live rank's state. It takes the state at the flush's exchange, inner
    step 200, takes part in the rest of the flush (weighing 0) and ends with the others' global
    weights; its own `flush` then sends nothing."""
    flags = (
        *("--steps", "200", "--sync-every", "20"),
        *("--fragments", "2", "--delay", "3", "--keep-local", "0.5"),
    )
    faults = ("--die", "1:199:exchange", "--hold", f"0,2:flush:{tmp_path / 'joined'}")
    with _run(processes, "flush", *_faulty(*faults, *flags)) as run:
        run.wait_for(r"rank 1: dying in step \d+ \(an exchange\), its payload sent", timeout=120)
        joined = run.wait_for(JOINED.pattern, 180)
        assert int(joined[3]) == 200, joined[0]
        assert int(joined[2]) >= 21, joined[0]  # past the start's check and the 20 exchanges
        assert run.wait(180) == 0, run.output
    finals = {int(m[1]): (m[3], m[4]) for m in map(FINAL.search, run.lines) if m}
    assert len(set(finals.values())) == 1, finals  # the same outer and discarded counts
    _, loss = _one_state(run, 200)
    assert loss < 0.01


STARTED_COORDINATOR = re.compile(r"started coordinator \(pid (\d+)\)")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("streaming", [(), STREAMING], ids=["diloco", "streaming-int8"])
def test_the_coordinator_killed_is_restarted_and_the_replicas_rejoin_and_go_on(
    processes: ProcessGroup, streaming: tuple[str, ...]
) -> None:
    """Streaming too: there the exchange the coordinator dies in may be on its way beside the
    inner steps, and each replica rejoins when it waits for its result."""
    with _run(processes, "ft", *_example("--steps", "400", "--sync-every", "20", *streaming)) as run:
        run.wait_for(r"rank 1 outer 5 at inner step \d+", timeout=120)
        coordinator = [int(m[1]) for m in map(STARTED_COORDINATOR.search, run.lines) if m][-1]
        os.kill(coordinator, signal.SIGKILL)
        run.wait_for(r"^run: coordinator was killed by SIGKILL; starting it again on its port", 30)
        for rank in range(3):
            run.wait_for(
                rf"rank {rank} rejoined the restarted coordinator; the job goes on from step \d+", 120
            )
        assert run.wait(180) == 0, run.output
    assert run.lines[-1] == "run: all 3 ranks finished", run.output
    assert _digests_agree(run)[39 if streaming else 20] == {0, 1, 2}
    _one_state(run, 400)


def _train_into_nan(outer: DiLoCo, model: torch.nn.Module, inner: torch.optim.Optimizer) -> None:
    """Two inner steps (one outer step), the second of which makes the weights NaN."""
    for step in outer.steps(2):
        loss = model(torch.ones(2, 4)).sum() * (float("nan") if step == 1 else 1.0)
        loss.backward()
        inner.step()
        inner.zero_grad()


def test_bad_input_is_refused_by_name(coordinator) -> None:
    server = coordinator(world_size=1, on_worker_loss="continue")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with ft.Replica(model, inner, coordinator=server.address, timeout=20.0) as job:
        with pytest.raises(InvalidArgumentError, match="sync_every must be at least 1 inner step, got 0"):
            job.diloco(sync_every=0)
        with pytest.raises(InvalidArgumentError, match="unknown quantization format 'int3'"):
            job.diloco(sync_every=4, quantize="int3")
        with pytest.raises(InvalidArgumentError, match=re.escape("ft.Replica.diloco chooses its own group")):
            job.diloco(sync_every=4, group=None)
        with pytest.raises(InvalidArgumentError, match="DiLoCo takes a group or an exchange, not both"):
            DiLoCo(model, inner, sync_every=4, group=object(), exchange=object())  # type: ignore[arg-type]
        outer = job.diloco(sync_every=2)
        with pytest.raises(FailedPreconditionError, match="this replica already runs outer steps"):
            job.diloco(sync_every=2)
        with outer, pytest.raises(FailedPreconditionError) as refused:
            _train_into_nan(outer, model, inner)
        assert re.search(
            r"outer step at inner step 2: the pseudo-gradient of parameters 0\.weight\.\.2\.bias holds NaN "
            r"or Inf on replicas 0 \(\d+ values\)",
            str(refused.value),
        ), refused.value
    second = coordinator(world_size=1, on_worker_loss="continue")
    other = ft.Replica(model, inner, coordinator=second.address, timeout=20.0)
    with other:
        other.ddp()
        with pytest.raises(FailedPreconditionError, match="this replica already averages through ddp"):
            other.diloco(sync_every=2)


Run = Callable[[ft.Replica, torch.nn.Module, torch.optim.Optimizer], Any]


def _ft_replicas(address: str, run: Run, replicas: int = 2) -> dict[int, Any]:
    """`run(job, model, inner)` on `replicas` ft replicas (threads) of one seeded MLP joined to
    `address`, each with its AdamW and closed afterwards: what each returned (or the exception it
    raised), by worker id."""
    import copy
    import threading

    torch.manual_seed(0)
    start = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    results: dict[int, Any] = {}
    unjoined: list[Exception] = []

    def replica() -> None:
        model = copy.deepcopy(start)  # the replicas start from the same weights
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            job = ft.Replica(model, inner, coordinator=address, timeout=30.0)
        except Exception as exc:
            unjoined.append(exc)
            return
        try:
            results[job.client.worker_id] = run(job, model, inner)
        except Exception as exc:
            results[job.client.worker_id] = exc
        finally:
            job.close()  # also its receiver thread, and what a client closed early left mapped

    threads = [threading.Thread(target=replica) for _ in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(100)
    assert not unjoined, unjoined
    assert sorted(results) == list(range(replicas)), results
    return results


def _succeeded(results: dict[int, Any]) -> dict[int, Any]:
    errors = {rank: r for rank, r in results.items() if isinstance(r, BaseException)}
    assert not errors, errors
    return results


def _inner_step(model: torch.nn.Module, generator: torch.Generator) -> int:
    """The backward pass of one batch of the regression the in-process tests train; its size."""
    x = torch.randn(32, 16, generator=generator)
    torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
    return len(x)


def _moved(address: str, quantize: str | None) -> dict[int, tuple[int, int, dict[str, torch.Tensor]]]:
    """Two ft replicas, 12 inner steps, an outer step every 4, on `address`'s coordinator: each
    one's bytes sent and received and how far its global weights moved from the start."""

    def run(job: ft.Replica, model: torch.nn.Module, inner: torch.optim.Optimizer) -> Any:
        begun = {name: p.detach().clone() for name, p in model.named_parameters()}
        generator = torch.Generator().manual_seed(job.client.worker_id + 1)
        with job.diloco(sync_every=4, quantize=quantize) as outer:
            for _ in outer.steps(12):
                _inner_step(model, generator)
                inner.step()
                inner.zero_grad()
        moved = {name: g - begun[name] for name, g in outer.global_tensors().items()}
        return outer.sent_bytes, outer.received_bytes, moved

    return _succeeded(_ft_replicas(address, run))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("quantize", "error"), [("bf16", 0.01), ("int8", 0.01), ("int4", 0.2)])
def test_quantized_exchanges_are_summed_by_the_coordinator_one_payload_each_way(
    coordinator, quantize: str, error: float
) -> None:
    """Over ft, int8/int4 pseudo-gradients travel as records that the coordinator sums and
    requantizes once, bf16 ones as bfloat16 values it sums and rounds once to bfloat16: each
    replica sends one payload and receives one (plus [w, counts] in float32), every replica
    applies the same bytes, and the global weights move as float32's do, within `error`
    (relative: measured 0.14% for bf16, 0.20% for int8, 4.4% for int4)."""
    from gradserver.common import quantized_wire
    from gradserver.common.messages import DType

    results = _moved(coordinator(world_size=2, on_worker_loss="continue").address, quantize)
    exact = _moved(coordinator(world_size=2, on_worker_loss="continue").address, None)[0][2]
    numel = 16 * 64 + 64 + 64 + 1
    if quantize == "bf16":
        values = 2 * numel  # half of float32's, where it used to travel as float32
    else:
        dtype = {"int8": DType.INT8_BLOCK64, "int4": DType.INT4_BLOCK64}[quantize]
        values = quantized_wire.records_for(numel) * quantized_wire.record_bytes(dtype)
    per_exchange = values + 4 * (1 + 2)
    for sent, received, _ in results.values():
        assert sent == received == 3 * per_exchange
    moved = results[0][2]
    for name, value in moved.items():
        assert torch.equal(results[1][2][name], value), name
    got = torch.cat([moved[name].reshape(-1) for name in exact])
    want = torch.cat([value.reshape(-1) for value in exact.values()])
    relative = float((got - want).norm() / want.norm())
    print(f"{quantize}: the global weights moved {relative:.4%} away from float32's")
    assert relative < error


@pytest.mark.timeout(120)
def test_an_exchange_runs_while_the_next_inner_steps_do(coordinator) -> None:
    """Streaming over ft (2 fragments exchanged at inner steps 4 and 8 of each period of 8,
    delay 3): rank 0 sends its exchange of inner step 4 and goes on training; rank 1 sends its
    part only once rank 0 has taken two more inner steps. Were the exchange not overlapped, rank
    0 would wait in it for rank 1's part, and rank 1 for rank 0's steps. Both end with the same
    global weights, every exchange applied."""
    import threading

    went_on = threading.Event()  # rank 0 took inner step 6 while its exchange of step 4 was out

    def run(job: ft.Replica, model: torch.nn.Module, inner: torch.optim.Optimizer) -> Any:
        rank = job.client.worker_id
        generator = torch.Generator().manual_seed(rank + 1)
        try:
            with job.diloco(sync_every=8, fragments=2, delay=3) as outer:
                for step in outer.steps(16):
                    if rank == 0 and step == 6:
                        went_on.set()
                    if rank == 1 and step == 3:  # its step 4 (index 3) ends with its send
                        assert went_on.wait(30), "rank 0 did not go on while its exchange was out"
                    _inner_step(model, generator)
                    inner.step()
                    inner.zero_grad()
        except BaseException:
            went_on.set()  # let the other one fail fast, not time out
            raise
        return outer.outer_steps, outer.global_tensors()

    address = coordinator(world_size=2, on_worker_loss="continue").address
    results = _succeeded(_ft_replicas(address, run))
    # Every exchange's thread was waited for: none is left behind.
    assert not [t for t in threading.enumerate() if t.name == "gradserver-outer-exchange"]
    # 2 periods of 2 fragments, and the flush's outer step of fragment 0 (sent at inner step 12).
    assert results[0][0] == results[1][0] == 5, results
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name


class _Gone(Exception):
    """Ends a replica's run as if its process had died (its client closed first)."""


@pytest.mark.timeout(120)
def test_a_replica_lost_between_the_parts_of_a_quantized_sum_makes_every_replica_discard_it(
    coordinator,
) -> None:
    """int8 over ft: an exchange is two keys of one step, the records of wΔ and [w, counts].
    Worker 2 sends its records of exchange 1 and leaves before its [w, counts]: its complete
    records stay counted (3 contributors) and the weights are summed over 2, so Σ wᵢΔᵢ / Σ wᵢ
    would be half as large again as the average. Both others discard the exchange (what it
    carried goes with their next one) and end with the same global weights."""

    def run(job: ft.Replica, model: torch.nn.Module, inner: torch.optim.Optimizer) -> Any:
        rank = job.client.worker_id
        if rank == 2:
            client, send = job.client, job.client.send

            def send_then_leave(key: Any, array: Any, **options: Any) -> None:
                send(key, array, **options)
                if key.step == 2 and options.get("wire") == "int8":  # step 0 checked the start
                    client.close()  # after its records: they are complete, and counted
                    raise _Gone

            client.send = send_then_leave  # type: ignore[method-assign]
        generator = torch.Generator().manual_seed(rank + 1)
        with job.diloco(sync_every=4, quantize="int8") as outer:
            for _ in outer.steps(12):
                outer.count(_inner_step(model, generator))
                inner.step()
                inner.zero_grad()
        return outer.outer_steps, outer.discarded, outer.global_tensors()

    address = coordinator(world_size=3, on_worker_loss="continue").address
    results = _ft_replicas(address, run, replicas=3)
    assert isinstance(results.pop(2), _Gone), results
    _succeeded(results)
    # Exchanges 0 and 2 applied, exchange 1 discarded on both.
    assert results[0][:2] == results[1][:2] == (2, 1), results
    for name, value in results[0][2].items():
        assert torch.equal(results[1][2][name], value), name


def test_replicas_that_start_from_different_weights_are_refused_by_name(coordinator) -> None:
    """Over ft the start is checked too (one step of the job): every replica raises, naming the
    first parameter that differs."""

    def run(job: ft.Replica, model: torch.nn.Module, inner: torch.optim.Optimizer) -> Any:
        if job.client.worker_id == 1:
            with torch.no_grad():
                model[2].bias += 1e-6
        return job.diloco(sync_every=4)

    results = _ft_replicas(coordinator(world_size=2, on_worker_loss="continue").address, run)
    for rank, error in results.items():
        assert isinstance(error, FailedPreconditionError), error
        assert f"replica {rank}: parameter '2.bias' differs across the 2 replicas that took part" in str(
            error
        ), error


@pytest.mark.timeout(120)
def test_a_whole_ft_job_resumed_from_checkpoints_ends_as_the_job_that_never_stopped(coordinator) -> None:
    """Streaming int8 over ft (H = 4, 2 fragments, delay 1, keep_local 0.5): 12 inner steps and
    the flush in one job, and the same saved after inner step 6 (an exchange on its way) by
    every replica, every process gone, and taken up by new replicas of a new coordinator's job:
    the same global weights and models, bit for bit. Replicas that loaded different steps'
    states are refused, naming the position."""
    options = {"sync_every": 4, "fragments": 2, "delay": 1, "keep_local": 0.5, "quantize": "int8"}

    def train(
        outer: DiLoCo, model: torch.nn.Module, inner: torch.optim.Optimizer, rank: int, last: int
    ) -> None:
        for step in outer.steps(last):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
            outer.count(len(x))
            inner.step()
            inner.zero_grad()
            outer.step()

    def flat(tensors: Any) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()

    def straight(job: ft.Replica, model: torch.nn.Module, inner: torch.optim.Optimizer) -> Any:
        outer = job.diloco(**options)
        train(outer, model, inner, job.client.worker_id, 12)
        outer.flush()
        return flat(outer.global_tensors().values()), flat(model.parameters())

    saved: dict[int, dict[int, bytes]] = {5: {}, 6: {}}

    def first_half(job: ft.Replica, model: torch.nn.Module, inner: torch.optim.Optimizer) -> Any:
        outer = job.diloco(**options)
        for at in (5, 6):
            train(outer, model, inner, job.client.worker_id, at)
            buffer = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "inner": inner.state_dict(), "outer": outer.state_dict()},
                buffer,
            )
            saved[at][job.client.worker_id] = buffer.getvalue()
        return None

    def resumed(at: dict[int, int]) -> Run:
        def run(job: ft.Replica, model: torch.nn.Module, inner: torch.optim.Optimizer) -> Any:
            rank = job.client.worker_id
            assert job.healed is None
            outer = job.diloco(**options)  # from the seeded weights: the start is checked
            state = torch.load(io.BytesIO(saved[at[rank]][rank]), weights_only=True)
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["inner"])
            outer.load_state_dict(state["outer"])
            begun = outer.inner_step
            train(outer, model, inner, rank, 12)
            outer.flush()
            return flat(outer.global_tensors().values()), flat(model.parameters()), begun

        return run

    new = lambda: coordinator(world_size=2, on_worker_loss="continue").address  # noqa: E731
    want = _ft_replicas(new(), straight)
    _ft_replicas(new(), first_half)
    got = _ft_replicas(new(), resumed({0: 6, 1: 6}))
    for rank in (0, 1):
        assert not isinstance(got[rank], Exception), got[rank]
        assert got[rank][2] == 6
        assert torch.equal(got[rank][0], want[rank][0]) and torch.equal(got[rank][1], want[rank][1]), rank
    assert torch.equal(got[0][0], got[1][0])
    mixed = _ft_replicas(new(), resumed({0: 5, 1: 6}))
    for rank in (0, 1):
        assert isinstance(mixed[rank], FailedPreconditionError), mixed[rank]
        assert f"replica {rank}: parameter 'outer/position' differs" in str(mixed[rank]), mixed[rank]


def test_an_exchange_that_outlives_its_deadlines_raises_naming_its_step(monkeypatch) -> None:
    """The training thread waits for an overlapped exchange no longer than the sum of its calls'
    deadlines: a step stuck in a wait none of them covers raises, naming it, instead of hanging."""
    release = threading.Event()

    class Stuck:
        replica = SimpleNamespace(step=7, client=SimpleNamespace(timeouts=Timeouts.of(0.05)))

        def _attempt(self, step: int, parts: object) -> None:
            release.wait(30.0)

    monkeypatch.setattr(_ft_exchange, "_JOIN_SLACK_S", 0.1)
    flight = _ft_exchange._InFlight(Stuck(), [(torch.zeros(1), None)])  # type: ignore[arg-type]
    try:
        with pytest.raises(
            DeadlineExceededError, match=r"outer step 7: its exchange did not end within 0\.25 s"
        ):
            flight.wait()
    finally:
        release.set()
