"""Point-to-point messages between workers (`WorkerClient.send_to` / `receive_from`), end to end
with a real coordinator and real clients in this process, and the coordinator's relay
(server/relay.py `PeerRelay`) as the pure core it is.

Each end-to-end scenario runs on both paths a message can take:
- "relay": workers that did not ask to share memory (`peer_memory=False`) send through the
  coordinator, in pieces of the job's chunk size (0.25 MiB here, so a large message is many
  pieces);
- "shared memory": workers of one host that asked for it (`peer_memory=True`, the coordinator
  with `on_worker_loss="abort"`, the only policy it offers them under) write into a per-pair ring
  of 4 MiB (`peer_rings.capacity_for`), so a large message streams through it while both run.
Every test first checks which path its clients took (`Mailbox.transport`, `Mailbox.same_host`),
so a path that silently fell back to the other is a failure, not a pass. A mixed job (two workers
sharing memory and one that does not) has every pair exchange messages.

`BIG` (9 MiB + 5 bytes) is larger than a ring, many chunks long and not a multiple of 8 bytes.
Payloads are random bytes reinterpreted as each dtype (NaN payloads, negative zeros, subnormals),
compared byte for byte. Nothing sleeps to synchronise: a test waits on an operation with a
timeout (or, where a wait would move bytes it must not, polls a receive's `done` until a
deadline), and the fixture checks that no mailbox sender thread outlives its client.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import pytest

from gradserver.common.errors import (
    AbortedError,
    DeadlineExceededError,
    GradServerError,
    InvalidArgumentError,
    Status,
    UnavailableError,
)
from gradserver.common.messages import ErrorOut, JoinAccepted, MemberJoinedOut, PeerDeliveredOut, PeerPiece
from gradserver.server.membership import Member
from gradserver.server.outgoing import Outgoing
from gradserver.server.relay import AfterWritten, PeerRelay, Relayed
from gradserver.worker import Timeouts, WorkerClient
from gradserver.worker.transports import Mailbox, PeerReceive
from gradserver.worker.transports.peer_rings import capacity_for

from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_each, run_each
from .helpers.shm import assert_nothing_mapped

MIB = 2**20
CHUNK_MIB = 0.25
RING = 4 * MIB  # a ring's capacity for 2 or 3 workers of one host
BIG = 9 * MIB + 5
HEARTBEAT = 1.0
MARGIN = 3.0  # what a wait that must end "at once" (or at the heartbeat bound) may take beyond it
SENDER_THREAD = "gradserver-p2p-send-"
PATHS = {"relay": False, "shared memory": True}
# What a wait without a timeout of its own allows (the client's receive timeout).
TIMEOUTS = dataclasses.replace(TEST_TIMEOUTS, receive=10.0)


# --- payloads ------------------------------------------------------------------------------------


def random_bytes(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def payload(dtype: Any, count: int, seed: int) -> np.ndarray:
    """`count` elements of `dtype` holding random bits (random True/False for bool)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return random_bytes(count, seed) % 2 == 1
    return random_bytes(count * dtype.itemsize, seed).view(dtype)


def same_bytes(got: np.ndarray, expected: np.ndarray) -> bool:
    return got.dtype == np.uint8 and got.tobytes() == np.ascontiguousarray(expected).tobytes()


# --- a job of real clients -----------------------------------------------------------------------

Job = Callable[..., tuple[ServerThread, list[WorkerClient]]]


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def sender_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(SENDER_THREAD)}


@pytest.fixture
def job(coordinator: Callable[..., ServerThread]) -> Iterator[Job]:
    """Factory: job(peer_memory, n=2, timeouts=TIMEOUTS, **config) -> a coordinator (0.25
    MiB chunks, the given config) and n clients joined as ranks 0..n-1; `peer_memory` is one bool
    for all or one per rank. Closes them all afterwards and checks that no mailbox sender thread
    is left."""
    made: list[WorkerClient] = []
    before = sender_threads()

    def make(
        peer_memory: bool | Sequence[bool],
        n: int = 2,
        timeouts: Timeouts = TIMEOUTS,
        **config: Any,
    ) -> tuple[ServerThread, list[WorkerClient]]:
        config.setdefault("chunk_mib", CHUNK_MIB)
        # A stream whose worker vanished may hold the coordinator's stop for this long.
        config.setdefault("drain_timeout", 2.0)
        server = coordinator(world_size=n, **config)
        memory = [peer_memory] * n if isinstance(peer_memory, bool) else list(peer_memory)
        clients = join(server.address, memory, timeouts)
        made.extend(clients)
        assert [c.worker_id for c in clients] == list(range(n))
        return server, clients

    try:
        yield make
    finally:
        for client in made:
            client.close()
    left = {t.name for t in sender_threads() - before if t.is_alive()}
    assert not left, f"mailbox sender threads outlived their clients: {sorted(left)}"
    assert_nothing_mapped(what="memfd:gradserver-p2p")  # every host's mailboxes let go


def join(address: str, peer_memory: Sequence[bool], timeouts: Timeouts = TIMEOUTS) -> list[WorkerClient]:
    per_rank = [{"node_id": f"p2p-{rank}", "peer_memory": memory} for rank, memory in enumerate(peer_memory)]
    return connect_each(address, per_rank, timeouts)


def joined(job: Job, path: str, n: int = 2, **config: Any) -> tuple[ServerThread, list[WorkerClient]]:
    """A job of n workers that all take `path` to each other (checked)."""
    server, clients = job(PATHS[path], n, **config)
    for client in clients:
        expect_path(client, path, [c.worker_id for c in clients if c is not client])
    return server, clients


def expect_path(client: WorkerClient, path: str, peers: Sequence[int]) -> None:
    mailbox = client._mailbox
    if path == "shared memory":
        assert mailbox.transport == "shared memory"
        assert mailbox._rings is not None and mailbox._rings.capacity == RING
        assert all(mailbox.same_host(p) for p in peers)
    else:
        assert mailbox.transport == "coordinator"
        assert not any(mailbox.same_host(p) for p in peers)


def names(error: object, *words: str) -> bool:
    """Whether the error's text names every one of `words` (as whole words)."""
    return all(re.search(rf"(?<![\w-]){re.escape(w)}(?!\w)", str(error)) for w in words)


def until(condition: Callable[[], bool], what: str, timeout: float = MARGIN) -> None:
    """Polls `condition` (state another thread changes) until it holds; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.005)


def send_outcome(client: WorkerClient, peer: int, data: np.ndarray, timeout: float) -> BaseException | None:
    """How a send ends: None when delivered, else the error `send_to` or its `wait` raised."""
    try:
        client.send_to(peer, data, tag=3).wait(timeout)
    except GradServerError as exc:
        return exc
    return None


# --- round trips ---------------------------------------------------------------------------------


def cases(chunk_bytes: int) -> list[tuple[str, np.ndarray]]:
    """Messages of many dtypes and sizes: empty, 4 bytes, 13 bytes, around a chunk and a ring,
    larger than a ring and many chunks long."""
    nan_payload = np.array([0x7FC00001], np.uint32).view(np.float32)
    specials = np.array([-0.0, np.inf, -np.inf, np.nan, 5e-324, -1.5], np.float64)
    return [
        ("empty", np.zeros(0, np.uint8)),
        ("4 bytes", nan_payload),
        ("13 bytes", payload(np.int8, 13, 1)),
        ("float64 specials", specials),
        ("int64", payload(np.int64, 1001, 2)),
        ("bool", payload(np.bool_, 77, 3)),
        ("float16 odd", payload(np.float16, 333, 4)),
        ("complex64 2-d", payload(np.complex64, 7 * 11, 5).reshape(7, 11)),
        ("strided view", payload(np.float32, 3000, 6)[::3]),
        ("one chunk", payload(np.uint8, chunk_bytes, 7)),
        ("a chunk and 1 byte", payload(np.uint8, chunk_bytes + 1, 8)),
        ("fills the ring", payload(np.uint8, RING - 16, 9)),
        ("the ring's size", payload(np.float32, RING // 4, 10)),
        ("big", payload(np.uint8, BIG, 11)),
    ]


@pytest.mark.timeout(60)
def test_round_trips_are_byte_exact_for_every_dtype_and_size(job: Job, path: str) -> None:
    _, clients = joined(job, path)
    chunk = clients[0].chunk_bytes
    assert chunk == int(CHUNK_MIB * MIB)
    assert BIG > RING == capacity_for(2) == capacity_for(3) and 30 * chunk < BIG and BIG % 8

    def exchange(client: WorkerClient) -> None:
        peer = 1 - client.worker_id
        mine = cases(chunk)
        sends = [client.send_to(peer, data, tag=tag) for tag, (_, data) in enumerate(mine)]
        for tag, (name, expected) in enumerate(mine):
            if tag % 2:  # into a buffer of the message's dtype and shape
                into = np.full_like(np.ascontiguousarray(expected), 0x5A if expected.dtype != bool else 0)
                got = client.receive_from(peer, tag=tag, into=into).wait()
                assert np.shares_memory(got, into) or into.size == 0, name
                assert into.tobytes() == np.ascontiguousarray(expected).tobytes(), name
            else:
                receive = client.receive_from(peer, tag=tag)
                got = receive.wait()
                assert receive.sender == peer, name
            assert same_bytes(got, expected), f"{name}: {got.size} bytes, {expected.nbytes} expected"
        for send in sends:
            send.wait()

    run_each(clients, exchange)


@pytest.mark.timeout(60)
def test_messages_with_one_tag_arrive_in_the_order_sent(job: Job, path: str) -> None:
    _, clients = joined(job, path)
    sizes = [0, 1, 8, 13, 4, clients[0].chunk_bytes + 3, 5 * MIB + 1] * 3 + [3, 5, 7, 9] * 50
    messages = [payload(np.uint8, size, seed) for seed, size in enumerate(sizes)]
    sends = [clients[0].send_to(1, m, tag=7) for m in messages]
    for i, expected in enumerate(messages):
        got = clients[1].receive_from(0, tag=7).wait()
        assert same_bytes(got, expected), f"message {i} of {len(messages)}: {got.size} bytes"
    for send in sends:
        send.wait()


@pytest.mark.timeout(60)
def test_receives_posted_before_and_after_the_message_arrives(job: Job, path: str) -> None:
    _, (c0, c1) = joined(job, path)
    # Before: posted first, the message then lands in them (with and without a buffer of their own).
    small, big = payload(np.float32, 25, 1), payload(np.uint8, BIG, 2)
    into = np.zeros(BIG, np.uint8)
    early = [c1.receive_from(0, tag=1), c1.receive_from(0, tag=2, into=into)]
    sends = [c0.send_to(1, small, tag=1), c0.send_to(1, big, tag=2)]
    assert same_bytes(early[0].wait(), small)
    assert same_bytes(early[1].wait(), big) and same_bytes(into, big)
    for send in sends:
        send.wait()
    # After: the sends are complete (in the receiver's ring, or queued for it by the coordinator)
    # before the receives are posted.
    late = [payload(np.uint8, 13, 3), payload(np.uint8, 0, 4), payload(np.int64, 100, 5)]
    for tag, data in enumerate(late, start=3):
        c0.send_to(1, data, tag=tag).wait()
    into = np.zeros(100, np.int64)
    assert same_bytes(c1.receive_from(0, tag=5, into=into).wait(), late[2])
    assert np.array_equal(into, late[2])
    for tag, data in enumerate(late[:2], start=3):
        receive = c1.receive_from(0, tag=tag)
        assert same_bytes(receive.wait(), data) and receive.sender == 0


@pytest.mark.timeout(60)
def test_tags_are_matched_whatever_order_the_receives_come_in(job: Job, path: str) -> None:
    _, (c0, c1) = joined(job, path)
    first, second = payload(np.uint8, BIG, 1), payload(np.float64, 9, 2)
    # Tag 2 is received while tag 1, sent before it and larger than a ring, is still arriving.
    sends = [c0.send_to(1, first, tag=1), c0.send_to(1, second, tag=2)]
    assert same_bytes(c1.receive_from(0, tag=2).wait(), second)
    assert same_bytes(c1.receive_from(0, tag=1).wait(), first)
    for send in sends:
        send.wait()
    # Both posted before anything is sent (tag 2 first), waited for in the other order.
    r2, r1 = c1.receive_from(0, tag=2), c1.receive_from(0, tag=1)
    sends = [c0.send_to(1, first, tag=1), c0.send_to(1, second, tag=2)]
    assert same_bytes(r1.wait(), first)
    assert same_bytes(r2.wait(), second)
    for send in sends:
        send.wait()


@pytest.mark.timeout(60)
def test_a_receive_from_any_worker_names_each_sender(job: Job, path: str) -> None:
    _, clients = joined(job, path, n=3)
    c0, c1, c2 = clients
    sent = {1: payload(np.uint8, 1001, 1), 2: payload(np.uint8, BIG, 2)}
    anyone = [c0.receive_from(None, tag=4), c0.receive_from(None, tag=4)]
    other_tag = c1.send_to(0, payload(np.uint8, 5, 3), tag=5)  # a receive of tag 4 never takes it
    sends = [c1.send_to(0, sent[1], tag=4), c2.send_to(0, sent[2], tag=4)]
    got = {}
    for receive in anyone:
        data = receive.wait()
        got[receive.sender] = data
    assert sorted(got) == [1, 2]
    for sender, data in got.items():
        assert same_bytes(data, sent[sender]), f"from worker {sender}"
    five = c0.receive_from(None, tag=5)
    assert same_bytes(five.wait(), payload(np.uint8, 5, 3)) and five.sender == 1
    for send in [*sends, other_tag]:
        send.wait()


@pytest.mark.timeout(60)
def test_every_worker_sends_before_it_receives_around_a_ring(job: Job, path: str) -> None:
    _, clients = joined(job, path, n=3)
    world = len(clients)

    def ring(client: WorkerClient) -> np.ndarray:
        w = client.worker_id
        send = client.send_to((w + 1) % world, payload(np.uint8, BIG, w), tag=9)
        receive = client.receive_from((w - 1) % world, tag=9)
        got = receive.wait()
        send.wait()
        assert receive.sender == (w - 1) % world
        return got

    for w, got in enumerate(run_each(clients, ring)):
        assert same_bytes(got, payload(np.uint8, BIG, (w - 1) % world)), f"worker {w}"


@pytest.mark.timeout(60)
def test_two_workers_each_waiting_for_their_own_big_send_do_not_deadlock(job: Job, path: str) -> None:
    _, clients = joined(job, path)

    def send_then_receive(client: WorkerClient) -> np.ndarray:
        peer = 1 - client.worker_id
        client.send_to(peer, payload(np.uint8, BIG, client.worker_id), tag=1).wait()
        return client.receive_from(peer, tag=1).wait()

    for w, got in enumerate(run_each(clients, send_then_receive)):
        assert same_bytes(got, payload(np.uint8, BIG, 1 - w)), f"worker {w}"


# --- refusals and failures -----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("posted", ["before", "after"])
def test_a_receive_into_a_buffer_of_the_wrong_size_fails_naming_both_sizes_and_the_sender(
    job: Job, path: str, posted: str
) -> None:
    _, (c0, c1) = joined(job, path)
    wrong = [(13, 10)] if posted == "after" else [(13, 10), (BIG, BIG - 1)]
    for tag, (size, buffer) in enumerate(wrong):
        if posted == "before":
            receive = c1.receive_from(0, tag=tag, into=np.zeros(buffer, np.uint8))
            send = c0.send_to(1, payload(np.uint8, size, tag), tag=tag)
        else:
            send = c0.send_to(1, payload(np.uint8, size, tag), tag=tag)
            send.wait()
            receive = c1.receive_from(0, tag=tag, into=np.zeros(buffer, np.uint8))
        with pytest.raises(InvalidArgumentError) as info:
            receive.wait()
        assert names(info.value, f"{size} bytes", str(buffer), "worker 0"), info.value
        send.wait()  # delivered: the refusal is the receiver's
    # What came after each refused message is intact: the stream between the two goes on.
    after = payload(np.uint8, 29, 99)
    c0.send_to(1, after, tag=0).wait()
    assert same_bytes(c1.receive_from(0, tag=0, into=np.zeros(29, np.uint8)).wait(), after)


@pytest.mark.timeout(60)
def test_a_wait_that_times_out_raises_and_the_receive_can_still_complete(job: Job, path: str) -> None:
    _, (c0, c1) = joined(job, path)
    receive = c1.receive_from(0, tag=8)
    for timeout in (0.2, 0.5):
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            receive.wait(timeout)
        assert timeout <= time.monotonic() - started < timeout + MARGIN
    data = payload(np.uint8, BIG, 1)
    send = c0.send_to(1, data, tag=8)
    assert same_bytes(receive.wait(), data) and receive.sender == 0
    send.wait()


@pytest.mark.timeout(60)
def test_a_send_larger_than_the_ring_times_out_until_its_receiver_reads(job: Job) -> None:
    _, (c0, c1) = joined(job, "shared memory")
    data = payload(np.uint8, BIG, 1)
    send = c0.send_to(1, data, tag=2)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        send.wait(0.3)
    assert 0.3 <= time.monotonic() - started < 0.3 + MARGIN
    assert same_bytes(c1.receive_from(0, tag=2).wait(), data)
    send.wait()


@pytest.mark.timeout(60)
def test_a_worker_out_of_range_is_refused_naming_it(job: Job, path: str) -> None:
    _, (c0, c1) = joined(job, path)
    for peer in (2, 7, -1):
        with pytest.raises(InvalidArgumentError) as info:
            c0.send_to(peer, np.zeros(4, np.uint8)).wait()
        assert names(info.value, f"worker {peer}"), info.value
        with pytest.raises(InvalidArgumentError) as info:
            c0.receive_from(peer).wait()
        assert names(info.value, f"worker {peer}"), info.value
    # The refusals cost the client nothing.
    data = payload(np.uint8, 13, 1)
    c0.send_to(1, data).wait()
    assert same_bytes(c1.receive_from(0).wait(), data)


@pytest.mark.timeout(60)
def test_a_worker_sends_to_itself(job: Job, path: str) -> None:
    _, (c0, _c1) = joined(job, path)
    data = payload(np.float32, 1000, 1)
    c0.send_to(0, data, tag=3).wait()
    receive = c0.receive_from(0, tag=3)
    assert same_bytes(receive.wait(), data) and receive.sender == 0
    receive = c0.receive_from(None, tag=4)
    c0.send_to(0, data, tag=4).wait()
    assert same_bytes(receive.wait(), data) and receive.sender == 0


@pytest.mark.timeout(60)
def test_a_worker_that_left_is_named_by_what_waited_for_it_and_by_sends_to_it(job: Job, path: str) -> None:
    """A clean close under on_worker_loss="abort" does not end the job (server/job.py: only a
    loss moves it to restarting): the others go on, and what concerns the worker that left
    fails naming it. The receive posted before it left is also what tells the test that the
    survivor has heard of the departure (a shared-memory send has no coordinator to refuse it)."""
    server, (c0, c1, c2) = joined(job, path, n=3)
    waiting = c0.receive_from(1, tag=6)
    c1.close()
    started = time.monotonic()
    with pytest.raises(GradServerError) as info:
        waiting.wait(MARGIN)
    assert not isinstance(info.value, DeadlineExceededError), info.value
    assert names(info.value, "worker 1"), info.value
    assert time.monotonic() - started < MARGIN
    for size in (13, BIG):
        error = send_outcome(c0, 1, payload(np.uint8, size, 1), MARGIN)
        assert isinstance(error, GradServerError), f"a send of {size} bytes to worker 1 was delivered"
        assert not isinstance(error, DeadlineExceededError), error
        assert names(error, "worker 1"), error
    assert server.call(lambda s: s._job.state.value) == "running"
    # The job goes on between the others.
    data = payload(np.uint8, 1000, 2)
    c2.send_to(0, data, tag=6).wait()
    assert same_bytes(c0.receive_from(2, tag=6).wait(), data)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["stream cancelled", "silent"])
def test_a_receive_waiting_on_a_lost_worker_fails_naming_it_within_the_heartbeat_bound(
    job: Job, path: str, how: str
) -> None:
    _, (c0, c1) = joined(job, path, heartbeat_timeout=HEARTBEAT, rejoin_timeout=30.0)
    waiting = c0.receive_from(1, tag=5)
    started = time.monotonic()
    if how == "stream cancelled":  # as a crashed process's connection ends
        c1._link.abort_with(UnavailableError("the test cut this worker off"))  # type: ignore[attr-defined]
    else:  # as a hung process: its heartbeats stop, its connection stays
        c1._link._stop_heartbeat.set()  # type: ignore[attr-defined]
    with pytest.raises(GradServerError) as info:
        waiting.wait(HEARTBEAT + MARGIN)
    elapsed = time.monotonic() - started
    assert not isinstance(info.value, DeadlineExceededError), info.value
    assert names(info.value, "worker 1"), info.value
    assert elapsed < HEARTBEAT + MARGIN


@pytest.mark.timeout(60)
def test_closing_a_client_fails_its_pending_operations_and_leaves_no_thread(job: Job, path: str) -> None:
    _, (c0, _c1) = joined(job, path)
    # Larger than one piece and than the ring: the mailbox's sender thread finishes it.
    send = c0.send_to(1, payload(np.uint8, BIG, 1), tag=1)
    receive = c0.receive_from(1, tag=2)
    assert any(t.name == f"{SENDER_THREAD}0" for t in sender_threads())
    c0.close()
    with pytest.raises(UnavailableError, match="closed"):
        receive.wait(MARGIN)
    outcome: UnavailableError | None = None
    try:  # the coordinator may have queued it for worker 1 already
        send.wait(MARGIN)
    except UnavailableError as exc:
        outcome = exc
    assert outcome is None or "closed" in str(outcome), outcome
    assert not [t.name for t in sender_threads() if t.name == f"{SENDER_THREAD}0" and t.is_alive()]
    with pytest.raises(UnavailableError, match="closed"):
        c0.send_to(1, np.zeros(4, np.uint8))
    with pytest.raises(UnavailableError, match="closed"):
        c0.receive_from(1)


@pytest.mark.timeout(60)
def test_a_receive_from_a_worker_that_left_fails_at_once_saying_what_it_was_once(job: Job, path: str) -> None:
    _, (c0, c1, _c2) = joined(job, path, n=3)
    waiting = c0.receive_from(1, tag=99)
    c1.close()
    until(lambda: waiting.done, "worker 0 hears that worker 1 left")
    started = time.monotonic()
    with pytest.raises(GradServerError) as info:
        c0.receive_from(1, tag=6).wait(MARGIN)
    assert time.monotonic() - started < 1.0
    assert not isinstance(info.value, DeadlineExceededError), info.value
    message = str(info.value)
    assert names(message, "worker 1", "tag 6"), message
    assert message.count("worker 0:") == 1, message


@pytest.mark.timeout(60)
def test_what_a_worker_sent_before_it_left_can_still_be_received(job: Job, path: str) -> None:
    """docs/PROTOCOL.md "Point-to-point": after a worker left, receives from it fail, but what it
    sent before (its send complete) can still be received."""
    _, (c0, c1, _c2) = joined(job, path, n=3)
    data = payload(np.uint8, 13, 1)
    c1.send_to(0, data, tag=5).wait()
    waiting = c0.receive_from(1, tag=99)
    c1.close()
    # Heard of it: the receive in flight fails (under abort every one does). Its `done` is
    # polled rather than waited for, since a wait would read worker 1's ring meanwhile.
    until(lambda: waiting.done, "worker 0 hears that worker 1 left")
    with pytest.raises(GradServerError, match="worker 1"):
        waiting.wait(0)
    assert same_bytes(c0.receive_from(1, tag=5).wait(MARGIN), data)


@pytest.mark.timeout(60)
def test_after_a_departure_fails_what_was_in_flight_the_survivors_messages_arrive_intact(
    job: Job, path: str
) -> None:
    """Under on_worker_loss="abort" a departure fails every send and receive in flight, also a
    send between two survivors that was half way through (larger than the ring, its receiver
    not reading yet); the next messages between them must arrive whole and in order."""
    _, (c0, c1, c2) = joined(job, path, n=3)
    half_way = c0.send_to(2, payload(np.uint8, BIG, 1), tag=1)
    waiting = c2.receive_from(0, tag=9)
    c1.close()
    with pytest.raises(GradServerError) as info:
        waiting.wait(MARGIN)
    assert not isinstance(info.value, DeadlineExceededError), info.value
    assert names(info.value, "worker 1"), info.value
    # Through shared memory it is stuck in the full ring; the relay may have delivered it first.
    outcome: GradServerError | None = None
    try:
        half_way.wait(MARGIN)
    except GradServerError as exc:
        outcome = exc
    if path == "shared memory" or outcome is not None:
        assert outcome is not None and not isinstance(outcome, DeadlineExceededError), outcome
        assert names(outcome, "worker 1"), outcome
    after = [payload(np.uint8, 13, 2), payload(np.uint8, 2 * MIB + 3, 3)]
    sends = [c0.send_to(2, data, tag=5) for data in after]
    for i, data in enumerate(after):
        assert same_bytes(c2.receive_from(0, tag=5).wait(MARGIN), data), f"message {i} after the abort"
    for send in sends:
        send.wait(MARGIN)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["the others", "the newcomer"])
def test_a_worker_that_takes_the_place_of_one_that_left_exchanges_messages(
    job: Job, path: str, first: str
) -> None:
    """Under on_worker_loss="abort" a place a worker left may be taken again (server/job.py: a
    clean leave keeps the job running, a loss moves it to restarting until --rejoin-timeout);
    the newcomer exchanges messages with the others, whoever speaks first."""
    quick = Timeouts(connect=2.0, join=10.0, receive=10.0, send=10.0, close=5.0)
    server, (c0, c1) = joined(job, path)
    waiting = c0.receive_from(1, tag=1)
    c1.close()
    with pytest.raises(GradServerError):
        waiting.wait(MARGIN)  # worker 0 heard of the departure
    newcomer = WorkerClient.connect(
        server.address, node_id="p2p-newcomer", timeout=quick, rank=1, peer_memory=PATHS[path]
    )
    try:
        assert newcomer.worker_id == 1
        there, back = payload(np.uint8, 1001, 1), payload(np.uint8, 13, 2)
        if first == "the newcomer":
            newcomer.send_to(0, back, tag=3).wait(MARGIN)
            # Worker 0 refuses a receive from worker 1 until it has heard from the newcomer.
            assert same_bytes(receive_once_heard(c0, 1, tag=3).wait(MARGIN), back)
        c0.send_to(1, there, tag=2).wait(MARGIN)
        assert same_bytes(newcomer.receive_from(0, tag=2).wait(MARGIN), there)
        if first == "the others":
            newcomer.send_to(0, back, tag=3).wait(MARGIN)
            assert same_bytes(c0.receive_from(1, tag=3).wait(MARGIN), back)
    finally:
        newcomer.close()


def receive_once_heard(client: WorkerClient, peer: int, tag: int) -> PeerReceive:
    """A receive from `peer`, posted again while it is refused (`peer` left, and `client` has not
    heard from its replacement yet), until `MARGIN` passes."""
    deadline = time.monotonic() + MARGIN
    while True:
        try:
            return client.receive_from(peer, tag=tag)
        except AbortedError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.005)


@pytest.mark.timeout(60)
def test_large_sends_to_two_peers_at_once_complete_whichever_peer_reads_first(job: Job, path: str) -> None:
    """Worker 0 has a send larger than a ring (and than a piece) under way to each of two
    peers; worker 2 reads its message first, then worker 1 reads its own."""
    _, (c0, c1, c2) = joined(job, path, n=3)
    to_1, to_2 = payload(np.uint8, BIG, 1), payload(np.uint8, BIG, 2)
    sends = [c0.send_to(1, to_1, tag=1), c0.send_to(2, to_2, tag=1)]
    assert same_bytes(c2.receive_from(0, tag=1).wait(MARGIN), to_2)
    assert same_bytes(c1.receive_from(0, tag=1).wait(MARGIN), to_1)
    for send in sends:
        send.wait(MARGIN)


# --- which path -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_memory_is_shared_only_where_a_lost_worker_aborts_the_job(job: Job) -> None:
    _, clients = job(True, 2, on_worker_loss="continue")
    for client in clients:
        expect_path(client, "relay", [1 - client.worker_id])
    data = payload(np.uint8, 3 * int(CHUNK_MIB * MIB) + 1, 1)
    clients[0].send_to(1, data).wait()
    assert same_bytes(clients[1].receive_from(0).wait(), data)


@pytest.mark.timeout(60)
def test_a_mixed_job_exchanges_messages_between_every_pair(job: Job) -> None:
    """Workers 0 and 1 share memory; worker 2 did not ask to, so it talks through the
    coordinator with both, while 0 and 1 use their ring."""
    _, clients = job([True, True, False], 3)
    c0, c1, c2 = clients
    assert c0._mailbox.transport == c1._mailbox.transport == "shared memory"
    assert c2._mailbox.transport == "coordinator"
    assert c0._mailbox.same_host(1) and c1._mailbox.same_host(0)
    assert not any(c._mailbox.same_host(2) for c in (c0, c1))
    assert not any(c2._mailbox.same_host(p) for p in (0, 1))

    def message(sender: int, receiver: int, size: int) -> np.ndarray:
        return payload(np.uint8, size, 100 * sender + 10 * receiver + (size > 100))

    def exchange(client: WorkerClient) -> list[tuple[int, int]]:
        w = client.worker_id
        peers = [p for p in range(3) if p != w]
        sends = [client.send_to(p, message(w, p, size), tag=size > 100) for p in peers for size in (13, BIG)]
        anyone = [client.receive_from(None, tag=0) for _ in peers]
        for p in peers:
            assert same_bytes(client.receive_from(p, tag=1).wait(), message(p, w, BIG)), (p, w)
        senders = []
        for receive in anyone:
            assert same_bytes(receive.wait(), message(receive.sender, w, 13)), (receive.sender, w)
            senders.append((receive.sender, w))
        for send in sends:
            send.wait()
        return sorted(senders)

    heard = [pair for pairs in run_each(clients, exchange) for pair in pairs]
    assert sorted(heard) == sorted((s, r) for r in range(3) for s in range(3) if s != r)


# --- PeerRelay, pure ------------------------------------------------------------------------------


def relay(world: int = 3, *, host_peers: bool = True, open_streams: Sequence[int] = (0, 1, 2)) -> PeerRelay:
    streaming = set(open_streams)
    made = PeerRelay(world, host_peers=host_peers, streaming=lambda w: w in streaming)
    made.open_streams = streaming  # type: ignore[attr-defined]  # the test opens more
    return made


def pieces(receiver: int, tag: int, sequence: int, data: bytes, piece: int) -> list[PeerPiece]:
    return [
        PeerPiece(receiver, tag, sequence, len(data), offset, data[offset : offset + piece])
        for offset in range(0, max(1, len(data)), piece)
    ]


def member(worker_id: int, peer_host_id: str) -> Member:
    return Member(worker_id, f"node-{worker_id}", "cpu", 0, 0, 0.0, peer_host_id=peer_host_id)


def refusal(out: Relayed) -> ErrorOut:
    assert len(out) == 1
    assert isinstance(out[0].event, ErrorOut)
    return out[0].event


@pytest.mark.timeout(10)
def test_relay_forwards_each_piece_naming_the_sender_and_tells_the_sender_at_the_last_one() -> None:
    r = relay()
    data = bytes(range(250))
    out = [item for p in pieces(2, 7, 4, data, 100) for item in r.forward(0, p)]
    # Each piece to the receiver, and its notice to the sender once the receiver's stream wrote it.
    assert out == [
        Outgoing((2,), PeerPiece(0, 7, 4, 250, 0, data[:100])),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 4, 100))),
        Outgoing((2,), PeerPiece(0, 7, 4, 250, 100, data[100:200])),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 4, 200))),
        Outgoing((2,), PeerPiece(0, 7, 4, 250, 200, data[200:])),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 4, 250))),
    ]
    # An empty message is one piece.
    assert r.forward(1, PeerPiece(0, -3, 0, 0, 0, b"")) == [
        Outgoing((0,), PeerPiece(1, -3, 0, 0, 0, b"")),
        AfterWritten(0, Outgoing((1,), PeerDeliveredOut(0, 0, 0))),
    ]


@pytest.mark.timeout(10)
def test_relay_holds_pieces_for_a_stream_not_open_yet_and_releases_them_in_order() -> None:
    r = relay(open_streams=(0, 1))
    first, second = bytes(range(30)), b"xyz"
    held = [r.forward(0, p) for p in pieces(2, 1, 0, first, 10)]
    held += [r.forward(1, p) for p in pieces(2, 1, 0, second, 10)]
    assert held == [[]] * 4
    assert r.forward(0, PeerPiece(1, 5, 1, 1, 0, b"!")) == [
        Outgoing((1,), PeerPiece(0, 5, 1, 1, 0, b"!")),
        AfterWritten(1, Outgoing((0,), PeerDeliveredOut(1, 1, 1))),
    ]
    r.open_streams.add(2)  # type: ignore[attr-defined]
    assert r.opened(2) == [
        Outgoing((2,), PeerPiece(0, 1, 0, 30, 0, first[:10])),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 0, 10))),
        Outgoing((2,), PeerPiece(0, 1, 0, 30, 10, first[10:20])),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 0, 20))),
        Outgoing((2,), PeerPiece(0, 1, 0, 30, 20, first[20:])),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 0, 30))),
        Outgoing((2,), PeerPiece(1, 1, 0, 3, 0, second)),
        AfterWritten(2, Outgoing((1,), PeerDeliveredOut(2, 0, 3))),
    ]
    assert r.opened(2) == []
    assert r.forward(0, PeerPiece(2, 1, 2, 1, 0, b"?")) == [
        Outgoing((2,), PeerPiece(0, 1, 2, 1, 0, b"?")),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 2, 1))),
    ]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("sender", "receiver", "gone", "code", "why"),
    [
        (0, 3, None, Status.INVALID_ARGUMENT, "workers 0..2"),
        (0, 99, None, Status.INVALID_ARGUMENT, "workers 0..2"),
        (1, 1, None, Status.INVALID_ARGUMENT, "itself"),
        (0, 2, "left", Status.ABORTED, "it left: left the job"),
        (0, 2, "lost", Status.ABORTED, "it was lost: no message for 5 s"),
    ],
)
def test_relay_refusals_name_the_receiver_tag_and_sequence(
    sender: int, receiver: int, gone: str | None, code: Status, why: str
) -> None:
    r = relay()
    if gone is not None:
        reason = "left the job" if gone == "left" else "no message for 5 s"
        r.worker_gone(receiver, reason, lost=gone == "lost")
    out = r.forward(sender, PeerPiece(receiver, 42, 17, 8, 0, b"12345678"))
    assert [item.to for item in out] == [(sender,)]  # to the sender alone, no delivery notice
    error = refusal(out)
    assert error.code == int(code)
    assert error.culprit_worker_id == receiver
    assert error.peer_message == PeerPiece(receiver, 42, 17, 8, 0, b"")
    assert names(error.message, f"worker {receiver}", "tag 42", "17", f"worker {sender}"), error.message
    assert why in error.message


@pytest.mark.timeout(10)
def test_relay_drops_what_it_held_for_a_worker_that_is_gone_and_takes_its_replacement() -> None:
    r = relay(open_streams=(0, 1))
    assert r.forward(0, PeerPiece(2, 0, 0, 4, 0, b"held")) == []
    r.worker_gone(2, "disconnected", lost=True)
    assert refusal(r.forward(0, PeerPiece(2, 0, 1, 1, 0, b"x"))).code == Status.ABORTED
    r.open_streams.add(2)  # type: ignore[attr-defined]
    # Nothing of what its predecessor was sent; the others hear that a replacement joined.
    assert r.opened(2) == [Outgoing((0, 1), MemberJoinedOut(2))]
    assert r.forward(0, PeerPiece(2, 0, 2, 1, 0, b"y")) == [
        Outgoing((2,), PeerPiece(0, 0, 2, 1, 0, b"y")),
        AfterWritten(2, Outgoing((0,), PeerDeliveredOut(2, 2, 1))),
    ]


@pytest.mark.timeout(10)
def test_relay_offers_shared_memory_only_to_members_of_one_host() -> None:
    members = [
        member(0, "host-a"),
        member(1, "host-b"),
        member(2, "host-a"),
        member(3, ""),
        member(4, "host-b"),
    ]
    members.append(member(5, "host-c"))  # alone on its host
    r = relay(world=6)
    offers = [r.offer_to(m, members) for m in members]
    assert [o.get("host_peers") for o in offers] == [(0, 2), (1, 4), (0, 2), None, (1, 4), None]
    assert offers[0]["peer_key"] == offers[2]["peer_key"]
    assert offers[1]["peer_key"] == offers[4]["peer_key"]
    assert offers[0]["peer_key"] != offers[1]["peer_key"]
    assert len(offers[0]["peer_key"]) >= 16
    assert offers[3] == offers[5] == {}
    # Asked again (a replacement joining), the same key.
    assert r.offer_to(members[2], members) == offers[2]
    assert all(relay(world=6, host_peers=False).offer_to(m, members) == {} for m in members)


@pytest.mark.timeout(10)
def test_relay_reset_forgets_the_job() -> None:
    members = [member(0, "host-a"), member(1, "host-a")]
    r = relay(open_streams=(0, 1))
    key = r.offer_to(members[0], members)["peer_key"]
    r.worker_gone(1, "left the job", lost=False)
    assert r.forward(0, PeerPiece(2, 0, 0, 1, 0, b"h")) == []  # held for 2
    r.reset()
    assert r.offer_to(members[0], members)["peer_key"] != key
    assert r.forward(0, PeerPiece(1, 0, 1, 1, 0, b"z")) == [
        Outgoing((1,), PeerPiece(0, 0, 1, 1, 0, b"z")),
        AfterWritten(1, Outgoing((0,), PeerDeliveredOut(1, 1, 1))),
    ]
    r.open_streams.add(2)  # type: ignore[attr-defined]
    assert r.opened(2) == []


# --- the relay's window ---------------------------------------------------------------------------


class _RecordingLink:
    """A link that only records what the mailbox sends (no coordinator: the test answers)."""

    def __init__(self) -> None:
        self.sent: list[PeerPiece] = []
        self.sink: Any = None
        self.lock = threading.Lock()

    def on_peer_messages(self, sink: Any) -> None:
        self.sink = sink

    def send(self, event: Any) -> None:
        with self.lock:
            self.sent.append(event)

    def bytes_sent(self) -> int:
        with self.lock:
            return sum(len(p.data) for p in self.sent)


@pytest.mark.timeout(30)
def test_a_relayed_send_keeps_at_most_a_window_of_bytes_its_receivers_stream_has_not_written() -> None:
    """The coordinator tells the sender when the receiver's stream wrote each piece
    (`PeerDelivered` up to a byte); without those notices a sender stops at its window, so what
    waits at the coordinator for a slow receiver stays bounded; each notice lets more go, and
    the send completes with the last one."""
    link = _RecordingLink()
    chunk = 64 * 1024
    accepted = JoinAccepted(0, 2, 1, 1, 1, chunk, 1 << 30, 1 << 28, 1.0, 5.0, 60.0, 0)
    mailbox = Mailbox(cast(Any, link), accepted, 10.0, None)
    try:
        window = max(16 * chunk, 4 * MIB)
        data = payload(np.uint8, 3 * window + 5, 1)
        send = mailbox.send(1, 7, data)
        deadline = time.monotonic() + 10
        while link.bytes_sent() < window and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.2)  # the sender thread would go on here if nothing held it
        assert link.bytes_sent() == window and not send.done
        acked = 0
        while acked < data.size:
            with link.lock:
                ends = [p.offset + len(p.data) for p in link.sent]
            fresh = [end for end in ends if end > acked]
            if not fresh:
                assert time.monotonic() < deadline, "the sender stopped with room in its window"
                time.sleep(0.001)
                continue
            acked = fresh[0]
            link.sink.peer_message(PeerDeliveredOut(1, send.sequence, acked))
            assert link.bytes_sent() <= acked + window
        send.wait(5)
        assert b"".join(bytes(p.data) for p in link.sent) == data.tobytes()
    finally:
        mailbox.close()
