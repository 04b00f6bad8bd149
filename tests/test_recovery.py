"""Live recovery through the client library: a worker that joins a running job takes the state
of a live member, checked byte for byte, and the replicas stay bit-identical; state digests
name and evict a diverged replica (in one process: a real coordinator and real clients)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import re
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from gradserver.common import compute_block_sizes
from gradserver.common.errors import (
    AbortedError,
    ConnectionLost,
    FailedPreconditionError,
    GradServerError,
    InvalidArgumentError,
)
from gradserver.common.messages import BarrierIn, StartAtIn
from gradserver.server.digests import vote
from gradserver.server.membership import Member
from gradserver.server.recovery import recovery_offer
from gradserver.server.reduction import ReductionTable
from gradserver.worker import StateSnapshot, WorkerClient, state_digest

from .helpers.server import TEST_TIMEOUTS, connect_all, run_each, run_each_outcome, wait_pending

SIZES = compute_block_sizes(8, 4, 16)
TOTAL = sum(SIZES)


class Replica:
    """A toy data-parallel replica: weights and a momentum buffer, one block key per step; its
    gradient depends on its state and its worker id, so a stale replica would diverge."""

    def __init__(
        self, client: WorkerClient, state: dict[str, np.ndarray] | None = None, step: int = 0
    ) -> None:
        self.client = client
        self.step = step
        if state is None:
            rng = np.random.default_rng(7)
            state = {
                "w": rng.standard_normal(TOTAL).astype(np.float32),
                "m": np.zeros(TOTAL, np.float32),
                "count": np.zeros(1, np.int64),
            }
        self.state = state
        client.offer_state(lambda: StateSnapshot(self.step, self.state, b"position %d" % self.step))

    def run_step(self) -> None:
        w, m = self.state["w"], self.state["m"]
        grad = (np.sin(w * (self.step + 1)) + 0.01 * self.client.worker_id).astype(np.float32)
        self.client.send_block_gradient(self.step, 0, 1, grad, SIZES)
        avg = self.client.receive_averaged_block().gradients
        with self.client.updating_state():
            m *= np.float32(0.9)
            m += avg
            w -= np.float32(0.01) * m
            self.state["count"] += 1
            self.step += 1

    def run_until(self, last: int) -> None:
        while self.step <= last:
            self.run_step()


def _in_threads(*calls: Callable[[], object]) -> list[object]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(60) for f in [pool.submit(c) for c in calls]]


def test_a_replacement_takes_the_state_and_the_replicas_stay_identical(coordinator) -> None:
    server = coordinator(world_size=3, on_worker_loss="continue")
    clients = connect_all(server.address, 3)
    replicas = [Replica(c) for c in clients]
    try:
        _in_threads(*[lambda r=r: r.run_until(2) for r in replicas])
        clients[2].close()  # leaves; the others go on
        survivors = [threading.Thread(target=r.run_until, args=(9,), daemon=True) for r in replicas[:2]]
        for t in survivors:
            t.start()
        newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
        assert newcomer.worker_id == 2
        assert newcomer.recovery_step is not None and newcomer.recovery_step >= 3
        got = newcomer.recover()
        assert got.step == newcomer.recovery_step and got.donor in (0, 1)
        assert got.extra == b"position %d" % got.step
        late = Replica(newcomer, {k: np.array(v) for k, v in got.tensors.items()}, got.step)
        late.run_until(9)
        for t in survivors:
            t.join(60)
            assert not t.is_alive()
        everyone = [replicas[0], replicas[1], late]
        for r in everyone[1:]:
            for name in ("w", "m", "count"):
                np.testing.assert_array_equal(r.state[name], everyone[0].state[name])
        assert int(late.state["count"][0]) == 10
        assert len({state_digest(r.state) for r in everyone}) == 1
        newcomer.close()
    finally:
        for c in clients:
            c.close()


# --- faults during a transfer ----------------------------------------------------------------------


def _survivors_then_a_newcomer(
    coordinator, world: int = 3, **options
) -> tuple[list[WorkerClient], WorkerClient]:
    """`world` workers; the last leaves after step 0 opened (a barrier), and a newcomer joins in
    its place: it takes part from step 1 and asks the others, in id order, for their state."""
    server = coordinator(world_size=world, on_worker_loss="continue", **options)
    clients = connect_all(server.address, world)
    _in_threads(*[lambda c=c: c.barrier(0) for c in clients])
    clients[-1].close()
    newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
    assert (newcomer.recovery_step, newcomer.worker_id) == (1, world - 1)
    return clients[:-1], newcomer


def _state(worker: int) -> dict[str, np.ndarray]:
    """Eight tensors of 256 KiB and a few small ones of other dtypes, distinct per worker."""
    state = {f"t{i}": np.full(2**16, i + 100 * worker, np.float32) for i in range(8)}
    state["ids"] = np.arange(7, dtype=np.int64) * (worker + 1)
    state["flags"] = np.array([True, False, worker % 2 == 0])
    state["empty"] = np.zeros((0, 3), np.float16)
    return state


def _scripted_donor(
    client: WorkerClient, step: int, state: dict[str, np.ndarray], *, send: int, corrupt: bool = False
) -> threading.Thread:
    """A donor that answers one request with a true manifest, then sends only the first `send`
    tensors (`corrupt`: the first with one byte flipped) and leaves the job: the faults a real
    donor shows when it dies or its memory goes bad mid-transfer."""
    from gradserver.worker import recovery

    mailbox = client._mailbox

    def run() -> None:
        request = mailbox.receive(None, recovery._REQUEST_TAG)
        request.wait(20)
        entries = recovery._entries(state)
        manifest = {
            "step": step,
            "tensors": [list(dataclasses.astuple(e)) for e, _ in entries],
            "extra": [0, 0],
            "digest": recovery._digest_of([e for e, _ in entries]),
        }
        sends = [
            mailbox.send(
                request.sender, recovery._MANIFEST_TAG, np.frombuffer(json.dumps(manifest).encode(), np.uint8)
            )
        ]
        for i, (_, data) in enumerate([x for x in entries if x[0].nbytes][:send]):
            sent = data
            if corrupt and i == 0:
                sent = data.copy()
                sent[len(sent) // 2] ^= 0x10
            sends.append(mailbox.send(request.sender, recovery._DATA_TAG, sent))
        with contextlib.suppress(GradServerError):  # the newcomer may be gone already
            for s in sends:
                s.wait(20)
        if not corrupt:
            client.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_donor_lost_mid_transfer_is_followed_by_the_next_donor(coordinator) -> None:
    survivors, newcomer = _survivors_then_a_newcomer(coordinator)
    try:
        donor = _scripted_donor(survivors[0], 1, _state(0), send=3)
        honest = _state(1)
        survivors[1].offer_state(lambda: StateSnapshot(1, honest, b"from 1"))
        got = newcomer.recover(timeout=10)
        donor.join(20)
        assert (got.step, got.donor, got.extra) == (1, 1, b"from 1")
        assert set(got.tensors) == set(honest)
        for name, value in honest.items():
            assert got.tensors[name].dtype == value.dtype and got.tensors[name].shape == value.shape
            np.testing.assert_array_equal(got.tensors[name], value)
        assert got.digest == state_digest(honest) == state_digest(got.tensors)
    finally:
        for c in [*survivors, newcomer]:
            c.close()


def test_a_corrupted_tensor_is_caught_and_never_handed_back(coordinator) -> None:
    survivors, newcomer = _survivors_then_a_newcomer(coordinator, world=2)
    try:
        _scripted_donor(survivors[0], 1, _state(0), send=8, corrupt=True)
        with pytest.raises(AbortedError) as caught:
            newcomer.recover(timeout=10)
        message = caught.value.message
        # The first tensor with bytes, in name order, is the one flipped.
        assert "worker 0: the state's flags from worker 0 fails its CRC-32 check" in message
        assert "holds no state it could train with" in message
    finally:
        for c in [*survivors, newcomer]:
            c.close()


def test_no_donor_that_answers_is_a_clear_error_naming_each(coordinator) -> None:
    survivors, newcomer = _survivors_then_a_newcomer(coordinator)
    try:
        # Worker 0 offers nothing; worker 1 offers a state that never reaches step 1.
        survivors[1].offer_state(lambda: StateSnapshot(0, _state(1)), timeout=1)
        with pytest.raises(AbortedError) as caught:
            newcomer.recover(timeout=2)
        message = caught.value.message
        assert "worker 2 could not take the state of step 1 from any donor" in message
        assert "worker 0: worker 0 sent no state within 2 s (does it offer one?" in message
        assert "worker 1: it refused: worker 1 did not reach step 1 within 1 s" in message
    finally:
        for c in [*survivors, newcomer]:
            c.close()


def test_a_donor_past_the_step_refuses_naming_both_steps(coordinator) -> None:
    survivors, newcomer = _survivors_then_a_newcomer(coordinator, world=2)
    try:
        survivors[0].offer_state(lambda: StateSnapshot(5, _state(0)))
        with pytest.raises(AbortedError, match="worker 0 has applied 5 steps, past the boundary of step 1"):
            newcomer.recover(timeout=5)
    finally:
        for c in [*survivors, newcomer]:
            c.close()


def test_a_donor_waits_for_its_step_and_a_transfer_holds_its_update_back(coordinator) -> None:
    survivors, newcomer = _survivors_then_a_newcomer(coordinator, world=2)
    donor = survivors[0]
    state = _state(0)
    step = [0]
    donor.offer_state(lambda: StateSnapshot(step[0], state))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(newcomer.recover, 10)
            with pytest.raises(concurrent.futures.TimeoutError):
                pending.result(0.3)  # the donor is still in step 0
            with donor.updating_state():
                state["t0"] += 1
                step[0] = 1
            got = pending.result(20)
        np.testing.assert_array_equal(got.tensors["t0"], state["t0"])
        assert got.step == 1
    finally:
        for c in [*survivors, newcomer]:
            c.close()


def _replicas_then_a_newcomer(coordinator) -> tuple[list[WorkerClient], list[Replica], WorkerClient]:
    """Three replicas run steps 0-2; worker 2 leaves, and a newcomer joins in its place (the
    caller closes every client)."""
    server = coordinator(world_size=3, on_worker_loss="continue")
    clients = connect_all(server.address, 3)
    try:
        replicas = [Replica(c) for c in clients]
        _in_threads(*[lambda r=r: r.run_until(2) for r in replicas])
        clients[2].close()
        newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients, replicas, newcomer


def test_the_newcomer_lost_mid_transfer_leaves_the_job_going(coordinator) -> None:
    clients, replicas, newcomer = _replicas_then_a_newcomer(coordinator)
    try:

        def leave(done: int, total: int) -> None:
            newcomer.close()  # dies with part of the state

        with pytest.raises(GradServerError):
            newcomer.recover(progress=leave)
        # The survivors' step 3 completes without it, and the donor's update is not held back.
        _in_threads(*[lambda r=r: r.run_until(4) for r in replicas[:2]])
        assert replicas[0].step == replicas[1].step == 5
        np.testing.assert_array_equal(replicas[0].state["w"], replicas[1].state["w"])
    finally:
        for c in clients:
            c.close()


def test_a_coordinator_stopped_mid_transfer_fails_the_recovery_as_a_lost_connection(coordinator) -> None:
    server = coordinator(world_size=2, on_worker_loss="continue")
    clients = connect_all(server.address, 2)
    try:
        _in_threads(*[lambda c=c: c.barrier(0) for c in clients])
        clients[1].close()
        newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
        clients[0].offer_state(lambda: StateSnapshot(1, _state(0)))
        stopped = threading.Event()

        def stop(done: int, total: int) -> None:
            if not stopped.is_set():
                stopped.set()
                server.stop()

        # Its donor is gone with the coordinator (it hears that first, or the link's end): either
        # way it fails at once, saying so, with nothing handed back.
        started = time.monotonic()
        with pytest.raises((ConnectionLost, AbortedError), match=r"shutting down|coordinator"):
            newcomer.recover(timeout=10, progress=stop)
        assert time.monotonic() - started < 10
        newcomer.close()
    finally:
        for c in clients:
            c.close()


# --- the library's surface ----------------------------------------------------------------------


def test_the_survivors_hear_where_a_replacement_takes_part_from(coordinator) -> None:
    survivors, newcomer = _survivors_then_a_newcomer(coordinator)
    try:
        survivors[0].offer_state(lambda: StateSnapshot(1, _state(0)))
        newcomer.recover(timeout=10)
        for c in survivors:
            deadline = time.monotonic() + 10
            while c.replacements() != [(2, 1)] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert c.replacements() == [(2, 1)]
    finally:
        for c in [*survivors, newcomer]:
            c.close()


def test_recover_without_a_running_job_and_reserved_tags_are_refused(workers) -> None:
    a, b = workers(2)
    assert a.recovery_step is None
    with pytest.raises(
        FailedPreconditionError, match="worker 0 joined as the job began: there is no state to recover"
    ):
        a.recover()
    reserved = -(2**62)
    with pytest.raises(
        InvalidArgumentError, match=f"tag {reserved} is reserved for gradserver's own messages"
    ):
        a.send_to(1, np.zeros(1), tag=reserved)
    with pytest.raises(InvalidArgumentError, match="is reserved"):
        b.receive_from(0, tag=reserved + 3)
    a.offer_state(lambda: StateSnapshot(0, {}))
    with pytest.raises(FailedPreconditionError, match="worker 0 already offers its state"):
        a.offer_state(lambda: StateSnapshot(0, {}))


def test_torch_tensors_of_any_dtype_come_back_exactly() -> None:
    torch = pytest.importorskip("torch")
    from gradserver.worker.recovery import _entries, _restore

    tensors = {
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "f64": torch.randn(4, dtype=torch.float64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 2),
        "i8": torch.arange(-4, 4, dtype=torch.int8),
        "view": torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
    }
    back = {e.name: _restore(e, data.copy()) for e, data in _entries(tensors)}
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape, name
        torch.testing.assert_close(back[name], value, rtol=0, atol=0)
    assert state_digest(back) == state_digest(tensors)
    changed = dict(tensors, f64=tensors["f64"].clone())
    changed["f64"][2] = torch.nextafter(changed["f64"][2], torch.tensor(1e9, dtype=torch.float64))
    assert state_digest(changed) != state_digest(tensors)


# --- state digests ----------------------------------------------------------------------------------


def test_a_replica_whose_digest_differs_is_named_evicted_and_never_averaged_with(workers) -> None:
    clients = workers(3, on_worker_loss="continue")
    digests = [0x1234, 0x1234, 0xBAD]
    outcomes = run_each_outcome(clients, lambda c: c.check_state(0, digests[c.worker_id]))
    assert outcomes[0] is None and outcomes[1] is None
    error = outcomes[2]
    assert isinstance(error, GradServerError)
    assert (
        "worker 2 evicted: its state at step 0 (digest 0x0000000000000bad) differs from that of workers 0, 1"
        in str(error)
    )
    # The two that agree go on alone: their next average is theirs only.
    results = run_each(
        clients[:2],
        lambda c: (
            c.send_block_gradient(0, 0, 1, np.full(TOTAL, float(c.worker_id), np.float32), SIZES),
            c.receive_averaged_block(),
        )[1],
    )
    assert [r.num_contributors for r in results] == [2, 2]
    np.testing.assert_array_equal(results[0].gradients, np.full(TOTAL, 0.5, np.float32))


def test_without_a_majority_the_step_fails_for_everyone_naming_each_digest(workers) -> None:
    clients = workers(2)
    outcomes = run_each_outcome(clients, lambda c: c.check_state(4, 0xA0 + c.worker_id))
    for error in outcomes:
        assert isinstance(error, FailedPreconditionError), error
        assert (
            "the replicas differ and no majority holds one state "
            "(worker 0 0x00000000000000a0, worker 1 0x00000000000000a1)" in error.message
        )


def test_a_digest_barrier_takes_digests_from_every_arrival_or_none(coordinator) -> None:
    server = coordinator(world_size=2)
    a, b = connect_all(server.address, 2)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(a.check_state, 0, 7)
            wait_pending(server, 0)  # a's arrival (with a digest) opened the barrier
            with pytest.raises(
                InvalidArgumentError,
                match=re.escape(
                    "worker 1 arrived at step 0 barrier 'gradserver.state' without a state digest"
                ),
            ):
                b.barrier(0, "gradserver.state")
            b.check_state(0, 7)
            first.result(20)
        with pytest.raises(InvalidArgumentError, match="a state digest is a 64-bit unsigned integer"):
            a.check_state(1, -1)
    finally:
        for c in (a, b):
            c.close()


# --- the coordinator's pure parts -----------------------------------------------------------------


def _member(worker_id: int, committed_step: int | None = None) -> Member:
    return Member(worker_id, f"n{worker_id}", "cpu", 0, token=1, last_seen=0.0, committed_step=committed_step)


def test_the_plan_names_the_step_and_the_longest_standing_donors_first() -> None:
    members = [_member(w) for w in range(4)]
    first = {0: 0, 1: 5, 2: 9, 3: 0}.__getitem__
    assert recovery_offer(members[2], members, first_step=first, resume_step=None) == {
        "recovery_step": 9,
        "donors": (0, 3, 1),
    }
    # Joined as the job began (or before any step opened): nothing to recover.
    assert recovery_offer(members[0], members, first_step=lambda w: 0, resume_step=None) == {}
    # Two that joined at the same boundary are not each other's donors.
    same = {0: 0, 1: 4, 2: 4, 3: 0}.__getitem__
    assert recovery_offer(members[1], members, first_step=same, resume_step=None)["donors"] == (0, 3)


def test_a_worker_without_state_joining_a_resumed_job_recovers_from_those_that_report_one() -> None:
    members = [_member(0, 12), _member(1), _member(2, 12)]
    plan = recovery_offer(members[1], members, first_step=lambda w: 0, resume_step=12)
    assert plan == {"recovery_step": 12, "donors": (0, 2)}
    assert recovery_offer(members[0], members, first_step=lambda w: 0, resume_step=12) == {}


def test_the_vote_releases_a_strict_majority_only() -> None:
    verdict = vote(3, "gradserver.state", {0: 5, 1: 5, 2: 6})
    assert verdict.agreed == {0, 1} and set(verdict.diverged) == {2} and verdict.undecided is None
    assert "differs from that of workers 0, 1" in verdict.diverged[2]
    tie = vote(3, "gradserver.state", {0: 5, 1: 5, 2: 6, 3: 6})
    assert tie.undecided is not None and not tie.agreed and not tie.diverged
    assert vote(3, "s", {0: 1, 1: 2, 2: 3}).undecided is not None
    assert vote(3, "s", {4: 9}).agreed == {4}


def test_a_donor_still_serves_long_after_its_receive_timeout(coordinator, monkeypatch) -> None:
    from gradserver.worker import recovery

    monkeypatch.setattr(recovery, "_IDLE_WAIT_S", 0.1)
    server = coordinator(world_size=2, on_worker_loss="continue")
    quick = dataclasses.replace(TEST_TIMEOUTS, receive=0.2)
    clients = connect_all(server.address, 2, quick)
    try:
        _in_threads(*[lambda c=c: c.barrier(0) for c in clients])
        state = _state(0)
        clients[0].offer_state(lambda: StateSnapshot(1, state), timeout=5)
        clients[1].close()
        time.sleep(1.0)  # many of the donor's waits (and its receive timeout) pass idle
        newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
        got = newcomer.recover(timeout=10)
        assert got.donor == 0 and state_digest(got.tensors) == state_digest(state)
        newcomer.close()
    finally:
        for c in clients:
            c.close()


def test_the_trainers_state_moves_to_another_trainer_bit_for_bit() -> None:
    """What the built-in trainer offers (`state_tensors`, `state_extra`) loads into a fresh
    trainer (`load_state`) with the same digest, and both then take identical steps."""
    torch = pytest.importorskip("torch")
    from gradserver.train.corpus import TokenWindows, corpus_bytes
    from gradserver.train.engines import LocalEngine, LocalHub
    from gradserver.train.model import TransformerLM, model_config
    from gradserver.train.trainer import DistributedTrainer
    from gradserver.worker import decode_extra, encode_extra

    cfg = model_config("tiny")
    data = TokenWindows(corpus_bytes(), cfg.max_seq_len)

    def trainer(seed: int) -> DistributedTrainer:
        return DistributedTrainer(
            TransformerLM(cfg, seed=seed), LocalEngine(LocalHub(1), 0), max_grad_norm=1.0
        )

    donor, fresh = trainer(0), trainer(1)
    for step in range(3):
        donor.train_step([data.batch([step, step + 7])])
    assert state_digest(fresh.state_tensors()) != state_digest(donor.state_tensors())
    extra = decode_extra(encode_extra(donor.state_extra()))
    fresh.load_state(donor.step, {k: v.clone() for k, v in donor.state_tensors().items()}, extra)
    assert fresh.step == 3
    assert state_digest(fresh.state_tensors()) == state_digest(donor.state_tensors())
    assert torch.equal(
        torch.get_rng_state(), torch.frombuffer(bytearray(extra["torch_rng"]), dtype=torch.uint8)
    )
    for t in (donor, fresh):
        t.train_step([data.batch([3, 11])])
    assert state_digest(fresh.state_tensors()) == state_digest(donor.state_tensors())
    for name, value in donor.model.state_dict().items():
        torch.testing.assert_close(fresh.model.state_dict()[name], value, rtol=0, atol=0)


# --- a replacement that takes part from a later step (replica groups: issue 37) ------------------


def test_a_replacement_that_starts_later_is_not_waited_for_and_takes_that_steps_state(coordinator) -> None:
    clients, replicas, newcomer = _replicas_then_a_newcomer(coordinator)
    try:
        planned = newcomer.recovery_step
        assert planned is not None
        last = planned + 4
        # The survivors' steps `planned` and `planned + 1` would wait for the newcomer; after
        # start_at they complete without it.
        survivors = [threading.Thread(target=r.run_until, args=(last,), daemon=True) for r in replicas[:2]]
        for t in survivors:
            t.start()
        newcomer.start_at(planned + 2)
        assert newcomer.recovery_step == planned + 2
        got = newcomer.recover()
        assert got.step == planned + 2 and got.extra == b"position %d" % got.step
        late = Replica(newcomer, {k: np.array(v) for k, v in got.tensors.items()}, got.step)
        late.run_until(last)
        for t in survivors:
            t.join(60)
            assert not t.is_alive()
        everyone = [replicas[0], replicas[1], late]
        assert len({state_digest(r.state) for r in everyone}) == 1
        assert int(late.state["count"][0]) == last + 1
        # Every survivor heard the later first step, in place of the first announcement.
        for c in clients[:2]:
            assert c.replacements() == [(2, planned + 2)]
        newcomer.close()
    finally:
        for c in [*clients, newcomer]:
            c.close()


def test_start_at_refuses_an_earlier_step_a_worker_that_began_the_job_and_one_that_contributed(
    coordinator,
) -> None:
    server = coordinator(world_size=2, on_worker_loss="continue")
    clients = connect_all(server.address, 2)
    try:
        with pytest.raises(FailedPreconditionError, match="worker 0 joined as the job began"):
            clients[0].start_at(5)
        _in_threads(*[lambda c=c: c.barrier(0) for c in clients])
        clients[1].close()
        newcomer = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)
        assert newcomer.recovery_step == 1
        with pytest.raises(InvalidArgumentError, match="takes part from step 1: it cannot start at step 0"):
            newcomer.start_at(0)
        newcomer.start_at(1)  # its own step: nothing to do
        _in_threads(lambda: clients[0].barrier(1), lambda: newcomer.barrier(1))
        with pytest.raises(
            FailedPreconditionError, match="already took part in a step: start_at comes before"
        ):
            newcomer.start_at(3)
        _in_threads(lambda: clients[0].barrier(2), lambda: newcomer.barrier(2))  # nothing changed
        newcomer.close()
    finally:
        for c in clients:
            c.close()


def test_the_table_refuses_a_later_first_step_from_a_worker_that_sent_something() -> None:
    """The coordinator's own check (the client library checks first, so only another client
    reaches it): a worker that already arrived at a barrier cannot move its first step."""
    table = ReductionTable(2, 1024, 10.0, on_worker_loss="continue")
    table.barrier(BarrierIn(0, 0, ""))
    table.worker_lost(1, "left")
    table.worker_joined(1)
    assert table.first_step(1) == 1
    [refusal] = table.start_at(StartAtIn(1, 0))
    assert "before its first step 1" in refusal.event.message
    table.barrier(BarrierIn(1, 1, ""))
    [refusal] = table.start_at(StartAtIn(1, 3))
    assert refusal.to == (1,) and "after it sent step 1" in refusal.event.message
    assert table.first_step(1) == 1
