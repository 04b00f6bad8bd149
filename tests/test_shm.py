"""The same-host shared-memory path: same averages as gRPC, negotiation, fallback, isolation."""

from __future__ import annotations

import gc
import logging
import mmap
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from gradserver.common import compute_block_sizes
from gradserver.common import shm as shm_support
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import (
    FailedPreconditionError,
    GradServerError,
    InternalError,
    InvalidArgumentError,
)
from gradserver.common.messages import ChunkHeader, DType, ReduceOp, ShmRef, TensorKey
from gradserver.server import GradientServer
from gradserver.server.shm import ShmHub
from gradserver.torch._collective import CollectiveClient
from gradserver.worker import WorkerClient

from .helpers.server import TEST_TIMEOUTS, ServerThread, connect_ranks, metric, run_each
from .helpers.shm import dev_shm, memfd_mappings

pytestmark = pytest.mark.skipif(not shm_support.supported(), reason="needs Linux memfd and fd passing")

CHUNK_MIB = 1 / 64  # 4096 elements: every tensor below spans several chunks
SIZES = compute_block_sizes(32, 16, 64)


def _hub(coordinator: GradientServer) -> ShmHub | None:
    """The coordinator's shared-memory hub (None: it does not offer shared memory)."""
    hub: ShmHub | None = coordinator.features["shm"].hub
    return hub


def _poll(ready: Callable[[], bool], what: str) -> None:
    """Waits (bounded) for a condition on the coordinator's thread, which has no event for it."""
    end = time.monotonic() + TEST_TIMEOUTS.join
    while not ready():
        assert time.monotonic() < end, f"the coordinator never reached {what}"
        time.sleep(0.01)


def _data(worker: int, tag: int, size: int) -> np.ndarray:
    return np.random.default_rng([worker, tag]).standard_normal(size, dtype=np.float32)


def _workload(c: CollectiveClient) -> list[bytes]:
    """Every key kind, all sent before any result is read, for two steps."""
    w, out = c.worker_id, []
    for step in range(2):
        for block in reversed(range(3)):
            c.send_block_gradient(step, block, 3, _data(w, 100 * step + block, sum(SIZES)), SIZES)
        c.send_non_block_gradient(step, NonBlockComponent.LM_HEAD, _data(w, 100 * step + 50, 9000))
        c.send_gradients(step, _data(w, 100 * step + 60, 5000), loss=1.0 + w, correct=w, total=4)
        c.send_collective(step, 7, _data(w, 100 * step + 70, 4097), ReduceOp.SUM)
        out += [c.receive_averaged_block().gradients.tobytes() for _ in range(3)]
        out.append(c.receive_averaged_non_block().gradients.tobytes())
        out.append(c.receive_averaged().gradients.tobytes())
        out.append(c.receive_collective().tobytes())
    return out


def _workload_in_place(c: CollectiveClient) -> list[bytes]:
    """`_workload` as an in-place allreduce: every gradient is sent from a gradient_buffer with
    `into=` that buffer, and each receive must hand back that very memory."""
    w, out = c.worker_id, []
    for step in range(2):
        sizes = [sum(SIZES)] * 3 + [9000, 5000, 4097]
        tags = [2, 1, 0, 50, 60, 70]
        sent = [c.gradient_buffer(size) for size in sizes]
        for buf, tag, size in zip(sent, tags, sizes, strict=True):
            buf[:] = _data(w, 100 * step + tag, size)
        for block, buf in zip(reversed(range(3)), sent, strict=False):
            c.send_block_gradient(step, block, 3, buf, SIZES, into=buf)
        c.send_non_block_gradient(step, NonBlockComponent.LM_HEAD, sent[3], into=sent[3])
        c.send_gradients(step, sent[4], loss=1.0 + w, correct=w, total=4, into=sent[4])
        c.send_collective(step, 7, sent[5], ReduceOp.SUM, into=sent[5])
        got = [c.receive_averaged_block().gradients for _ in range(3)]
        got += [
            c.receive_averaged_non_block().gradients,
            c.receive_averaged().gradients,
            c.receive_collective(),
        ]
        for array, buf in zip(got, sent, strict=True):
            assert np.shares_memory(array, buf)
        out += [array.tobytes() for array in got]
    return out


def _reference(world: int) -> list[bytes]:
    """float64 sum in worker-id order, divided by the contributors (not for SUM), rounded once."""

    def mean(tag: int, size: int, divide: bool = True) -> bytes:
        acc = _data(0, tag, size).astype(np.float64)
        for w in range(1, world):
            acc += _data(w, tag, size)
        return (acc / world if divide else acc).astype(np.float32).tobytes()

    out = []
    for step in range(2):
        out += [mean(100 * step + block, sum(SIZES)) for block in reversed(range(3))]
        out += [mean(100 * step + 50, 9000), mean(100 * step + 60, 5000), mean(100 * step + 70, 4097, False)]
    return out


@pytest.fixture
def shm_coordinator(coordinator: Callable[..., ServerThread], tmp_path) -> Any:
    """Factory: a coordinator with small chunks whose shared-memory socket lives in tmp_path."""

    def make(**overrides: Any) -> ServerThread:
        config: dict[str, Any] = {"chunk_mib": CHUNK_MIB, "max_message_mib": 1.0, "shm_dir": str(tmp_path)}
        return coordinator(**{**config, **overrides})

    return make


def _run(
    server: ServerThread, transports: Sequence[str], fn: Callable[[CollectiveClient], Any], **kw: Any
) -> list[Any]:
    clients = connect_ranks(server.address, transports, **kw)
    try:
        assert [c.transport for c in clients] == list(transports)
        return run_each(clients, fn)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize(
    "transports",
    [("grpc", "grpc", "grpc"), ("shm", "shm", "shm"), ("shm", "grpc", "shm")],
    ids=["grpc", "shm", "mixed"],
)
def test_averages_are_bit_identical_to_the_numpy_reference_on_every_transport(
    shm_coordinator, transports
) -> None:
    before = dev_shm()
    server = shm_coordinator(world_size=3)
    results = _run(server, transports, _workload)
    want = _reference(3)
    for got in results:
        assert got == want
    moved = server.call(lambda s: s.metrics.shm_bytes._value.get())
    assert (moved > 0) == ("shm" in transports)
    assert dev_shm() == before


@pytest.mark.parametrize("transports", [("grpc", "grpc"), ("shm", "shm"), ("shm", "grpc")])
def test_an_in_place_allreduce_writes_the_same_bytes_into_the_senders_buffer(
    shm_coordinator, transports
) -> None:
    """into= the sent buffer (as gloo's all_reduce): chunk i's average overwrites chunk i only
    after every worker's chunk i was read, so the bytes are those of the separate-result path."""
    server = shm_coordinator(world_size=2)
    results = _run(server, transports, _workload_in_place)
    assert results[0] == results[1] == _reference(2)
    # With every worker on shared memory the averages (not the SUM collective's) are written
    # over the senders' own buffers: nothing goes through the output arena or is copied out.
    over_inputs = server.call(lambda s: metric(s, "gradserver_shm_averaged_over_inputs_bytes_total"))
    assert (over_inputs > 0) == (transports == ("shm", "shm"))
    if transports == ("shm", "shm"):
        gradients = 2 * 4 * (3 * sum(SIZES) + 9000 + 5000)  # two steps, bytes per recipient
        assert over_inputs == 2 * gradients


def test_an_average_over_the_inputs_needs_every_worker_to_want_it_there(shm_coordinator) -> None:
    """One worker sends from a gradient_buffer into= it, the other into a separate array: the
    average goes through the output arena to both, with the same bytes."""
    server = shm_coordinator(world_size=2)

    def work(c: CollectiveClient) -> bytes:
        buf = c.gradient_buffer(10000)
        buf[:] = _data(c.worker_id, 3, 10000)
        into = buf if c.worker_id == 0 else np.empty(10000, np.float32)
        c.send_non_block_gradient(0, NonBlockComponent.EMBEDDING, buf, into=into)
        got = c.receive_averaged_non_block().gradients
        assert np.shares_memory(got, into)
        return got.tobytes()

    results = _run(server, ["shm", "shm"], work)
    want = ((_data(0, 3, 10000).astype(np.float64) + _data(1, 3, 10000)) / 2).astype(np.float32)
    assert results == [want.tobytes()] * 2
    assert server.call(lambda s: metric(s, "gradserver_shm_averaged_over_inputs_bytes_total")) == 0
    assert server.call(lambda s: metric(s, "gradserver_shm_averaged_in_place_bytes_total")) > 0


def test_a_non_finite_value_averaged_over_the_inputs_fails_the_step_naming_its_sender(
    shm_coordinator,
) -> None:
    """In place as well, a NaN fails the step for everyone, naming the worker and the element;
    the next step of the same buffers is averaged as usual."""
    server = shm_coordinator(world_size=2)
    size = 3 * 4096 + 5  # four chunks; the NaN is in the third

    def work(c: CollectiveClient) -> tuple[str, bytes]:
        buf = c.gradient_buffer(size)
        buf[:] = _data(c.worker_id, 4, size)
        if c.worker_id == 1:
            buf[2 * 4096 + 9] = np.nan
        c.send_non_block_gradient(0, NonBlockComponent.LM_HEAD, buf, into=buf)
        try:
            c.receive_averaged_non_block()
            error = "no error"
        except GradServerError as exc:
            error = str(exc)
        buf[:] = _data(c.worker_id, 5, size)
        c.send_non_block_gradient(1, NonBlockComponent.LM_HEAD, buf, into=buf)
        c.receive_averaged_non_block()
        return error, buf.tobytes()

    results = _run(server, ["shm", "shm"], work)
    want = ((_data(0, 5, size).astype(np.float64) + _data(1, 5, size)) / 2).astype(np.float32)
    for error, step1 in results:
        assert "worker 1 sent a non-finite value" in error and "step 0" in error, error
        assert f"element {2 * 4096 + 9}" in error, error
        assert step1 == want.tobytes()


def test_into_that_cannot_take_the_average_is_refused_by_name(shm_coordinator) -> None:
    server = shm_coordinator(world_size=1)
    (c,) = connect_ranks(server.address, ["grpc"])
    try:
        grads = np.ones(100, np.float32)
        bad = {
            "dtype float64": np.zeros(100),
            "C-contiguous, writable": np.zeros(200, np.float32)[::2],
            "holds 99 elements": np.zeros(99, np.float32),
            "numpy array or a CPU torch tensor": [0.0] * 100,
        }
        frozen = np.zeros(100, np.float32)
        frozen.flags.writeable = False
        bad["C-contiguous, writable "] = frozen
        for message, into in bad.items():
            with pytest.raises(InvalidArgumentError, match=message.strip()) as info:
                c.send_non_block_gradient(0, NonBlockComponent.LM_HEAD, grads, into=into)
            assert "step 0" in str(info.value) and "lm_head" in str(info.value).lower()
        # Nothing was registered by the refusals: the same key goes through afterwards.
        c.send_non_block_gradient(0, NonBlockComponent.LM_HEAD, grads, into=grads)
        assert c.receive_averaged_non_block().gradients is not None
        assert grads.tolist() == [1.0] * 100
    finally:
        c.close()


def test_averages_are_written_into_the_output_arena_and_a_failed_one_gives_its_slot_back(
    shm_coordinator,
) -> None:
    """The averager writes straight into an output slot (no copy when it is published); a
    reduction that fails (a NaN) returns the slot it took, so none is lost for the job."""
    server = shm_coordinator(world_size=2)
    slots = server.call(lambda s: _hub(s)._slots.free_slots if _hub(s) else -1)

    def work(c: CollectiveClient) -> tuple[list[bytes], str]:
        out = _workload(c)
        bad = _data(c.worker_id, 9, 5000)
        if c.worker_id == 1:
            bad[123] = np.nan
        c.send_non_block_gradient(2, NonBlockComponent.LM_HEAD, bad)
        try:
            c.receive_averaged_non_block()
        except GradServerError as exc:
            return out, str(exc)
        return out, "no error"

    clients = connect_ranks(server.address, ["shm", "shm"])
    try:
        results = run_each(clients, work)
        for out, error in results:
            assert out == _reference(2)
            assert "worker 1 sent a non-finite value" in error and "step 2" in error, error
        assert server.call(lambda s: metric(s, "gradserver_shm_averaged_in_place_bytes_total")) > 0
        _poll(
            lambda: server.call(lambda s: _hub(s)._slots.free_slots if _hub(s) else -1) == slots,
            "every slot free",
        )
    finally:
        for c in clients:
            c.close()


def test_small_arenas_reuse_slots_and_fall_back_inline_with_the_same_bytes(shm_coordinator) -> None:
    """Arenas of 2 chunks on both sides: slots are reused many times, and chunks or averages that
    find no free slot go inline; the results do not change."""
    server = shm_coordinator(world_size=2, shm_arena_mib=2 * CHUNK_MIB)
    clients = connect_ranks(server.address, ["shm", "shm"], shm_arena_mib=2 * CHUNK_MIB)
    try:
        results = run_each(clients, _workload)
        assert server.call(lambda s: metric(s, "gradserver_shm_inline_fallbacks_total")) > 0
    finally:
        for c in clients:
            c.close()
    assert results[0] == results[1] == _reference(2)


def test_a_gradient_buffer_is_sent_without_a_copy(shm_coordinator) -> None:
    server = shm_coordinator(world_size=2)

    def work(c: CollectiveClient) -> bytes:
        buf = c.gradient_buffer(10000)
        assert not buf.any()
        buf[:] = _data(c.worker_id, 1, 10000)
        c.send_non_block_gradient(0, NonBlockComponent.EMBEDDING, buf)
        got = c.receive_averaged_non_block().gradients.tobytes()
        assert c.transport == "shm"
        assert c._link.payloads.arenas.zero_copy_bytes == 40000 and c._link.payloads.arenas.staged_bytes == 0
        return got

    results = _run(server, ["shm", "shm"], work)
    want = ((_data(0, 1, 10000).astype(np.float64) + _data(1, 1, 10000)) / 2).astype(np.float32)
    assert results == [want.tobytes()] * 2


def test_gradient_buffer_under_grpc_is_a_plain_array(shm_coordinator) -> None:
    server = shm_coordinator(world_size=1)
    (client,) = connect_ranks(server.address, ["grpc"])
    try:
        buf = client.gradient_buffer(5)
        assert buf.dtype == np.float32 and buf.shape == (5,) and not buf.any()
        with pytest.raises(InvalidArgumentError, match="non-negative element count"):
            client.gradient_buffer(-1)
    finally:
        client.close()


def test_auto_falls_back_to_grpc_with_one_info_line_and_shm_refuses(shm_coordinator, caplog) -> None:
    server = shm_coordinator(world_size=1, no_shm=True)
    with caplog.at_level(logging.INFO, logger="gradserver.worker"):
        (client,) = connect_ranks(server.address, ["auto"])
    try:
        assert client.transport == "grpc"
        lines = [r.getMessage() for r in caplog.records if "gradients go over gRPC" in r.getMessage()]
        assert len(lines) == 1 and "--no-shm" in lines[0]
    finally:
        client.close()
    with pytest.raises(FailedPreconditionError, match=r"transport 'shm' is not available.*--no-shm"):
        WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS, transport="shm")


def test_auto_falls_back_when_the_socket_cannot_be_reached(shm_coordinator, caplog) -> None:
    """As for a worker on another host: the announced path does not exist here."""
    server = shm_coordinator(world_size=1)
    path = server.call(lambda s: _hub(s).path if _hub(s) else "")
    os.unlink(path)
    with caplog.at_level(logging.INFO, logger="gradserver.worker"):
        (client,) = connect_ranks(server.address, ["auto"])
    try:
        assert client.transport == "grpc"
        assert any(
            "cannot reach the coordinator's shared-memory socket" in r.getMessage() for r in caplog.records
        )
        client.send_non_block_gradient(0, 1, np.ones(10, np.float32))
        assert client.receive_averaged_non_block().gradients.tolist() == [1.0] * 10
    finally:
        client.close()


def test_unknown_transport_is_refused_by_name(shm_coordinator, monkeypatch) -> None:
    server = shm_coordinator(world_size=1)
    monkeypatch.setenv("GRADSERVER_TRANSPORT", "carrier-pigeon")
    with pytest.raises(InvalidArgumentError, match="GRADSERVER_TRANSPORT='carrier-pigeon'"):
        WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS)


def test_a_registration_with_a_wrong_token_is_refused(shm_coordinator) -> None:
    server = shm_coordinator(world_size=1)
    (client,) = connect_ranks(server.address, ["grpc"])
    path, nonce = server.call(lambda s: (_hub(s).path, _hub(s).nonce) if _hub(s) else ("", b""))
    fd, arena = shm_support.create_arena(4096, "gradserver-test")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            assert shm_support.recv_exact(sock, shm_support.NONCE_BYTES)[0] == nonce
            hello = shm_support.HELLO.pack(0, client.session_id, client._accepted.member_token ^ 1)
            socket.send_fds(sock, [hello], [fd])
            reply, fds = shm_support.recv_exact(sock, shm_support.REPLY.size, fds=1)
            status, length = shm_support.REPLY.unpack(reply)
            text = shm_support.recv_exact(sock, length)[0].decode()
        assert status != 0 and fds == [] and "worker 0 is not a member" in text
        assert not server.call(lambda s: _hub(s).registered(0) if _hub(s) else True)
    finally:
        arena.close()
        os.close(fd)
        client.close()


def test_no_side_can_write_into_another_sides_memory(shm_coordinator) -> None:
    server = shm_coordinator(world_size=1)
    (client,) = connect_ranks(server.address, ["shm"])
    try:
        # What the coordinator reads of a worker's input arena is read-only (it writes there only
        # the averages of chunks that ask for it, "inout").
        assert server.call(lambda s: _hub(s)._peers[0].view.readonly if _hub(s) else False)
        assert client.transport == "shm"
        channel = client._link.payloads.arenas
        with pytest.raises(TypeError):
            channel._out[0:4] = b"evil"
    finally:
        client.close()
    fd, arena = shm_support.create_arena(4096, "gradserver-test")
    ro = shm_support.readonly_fd(fd)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(ro, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # sealed: a peer cannot shrink it under the reader (SIGBUS)
    finally:
        os.close(ro)
        arena.close()
        os.close(fd)


def test_an_unsealed_arena_is_refused(tmp_path) -> None:
    fd = os.memfd_create("gradserver-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(ValueError, match=r"sealable|sealed"):
            shm_support.map_readonly(fd, "the test arena")
    finally:
        os.close(fd)


def test_a_lost_workers_later_writes_cannot_change_an_average(shm_coordinator) -> None:
    """--on-worker-loss continue keeps a lost worker's complete contribution. It is copied when the
    worker is declared lost, so what the still-running process writes afterwards is not averaged."""
    server = shm_coordinator(world_size=3, on_worker_loss="continue")
    clients = connect_ranks(server.address, ["shm", "shm", "shm"])
    zombie = clients[2]
    try:
        buf = zombie.gradient_buffer(10000)
        buf[:] = _data(2, 5, 10000)
        zombie.send_non_block_gradient(0, 0, buf)
        # Once the coordinator holds the zombie's whole contribution, the zombie is lost.
        _poll(lambda: server.call(lambda s: s.metrics.traffic(2).received_bytes) == 40000, "the contribution")
        zombie._link._call.cancel()
        _poll(lambda: not server.call(lambda s: _hub(s).registered(2) if _hub(s) else False), "the loss")
        buf[:] = 1e30  # the zombie writes after it was declared lost

        def work(c: CollectiveClient) -> tuple[bytes, int]:
            c.send_non_block_gradient(0, 0, _data(c.worker_id, 5, 10000))
            avg = c.receive_averaged_non_block()
            return avg.gradients.tobytes(), avg.num_contributors

        results = run_each(clients[:2], work)
    finally:
        for c in clients:
            c.close()
    acc = _data(0, 5, 10000).astype(np.float64) + _data(1, 5, 10000) + _data(2, 5, 10000)
    assert results == [((acc / 3).astype(np.float32).tobytes(), 3)] * 2


def test_nothing_stays_mapped_after_the_job(shm_coordinator) -> None:
    server = shm_coordinator(world_size=2)
    _run(server, ["shm", "shm"], lambda c: c.send_heartbeat())
    server.stop()
    gc.collect()
    assert memfd_mappings() == []


def test_a_result_in_the_arena_outlives_its_client_and_its_mapping_goes_with_it(shm_coordinator) -> None:
    """A result kept in the worker's arena stays readable (and unchanged) after the client and
    the coordinator are gone; the arena is unmapped once the result is dropped too."""
    server = shm_coordinator(world_size=2)

    def work(c: CollectiveClient) -> np.ndarray:
        c.send_non_block_gradient(0, NonBlockComponent.EMBEDDING, _data(c.worker_id, 8, 10000))
        got = c.receive_averaged_non_block().gradients
        assert c._link.payloads.arenas.placed(got) is not None
        return got

    results = _run(server, ["shm", "shm"], work)
    server.stop()
    gc.collect()
    want = ((_data(0, 8, 10000).astype(np.float64) + _data(1, 8, 10000)) / 2).astype(np.float32)
    assert [r.tobytes() for r in results] == [want.tobytes()] * 2
    assert memfd_mappings() != []
    del results
    gc.collect()
    assert memfd_mappings() == []


def test_a_chunk_naming_shared_memory_without_an_arena_is_refused(shm_coordinator) -> None:
    server = shm_coordinator(world_size=1)
    (client,) = connect_ranks(server.address, ["grpc"])
    try:
        from gradserver.common.messages import ChunkHeader, ChunkIn, DType, ShmRef, TensorKey

        key = TensorKey.non_block(0, NonBlockComponent.LM_HEAD)
        client._link.expect(key, (), 4)
        client._sent[key.kind].append(key)
        header = ChunkHeader(DType.FLOAT32, 4, ())
        client._link.send(ChunkIn(0, key, header, 0, b"", None, ShmRef("in", 0, 16)))
        with pytest.raises(InvalidArgumentError, match="worker 0 registered no arena"):
            client.receive_averaged_non_block()
    finally:
        client.close()


def test_a_closed_arena_socket_does_not_hang_the_coordinator(shm_coordinator) -> None:
    """A client that connects and says nothing is dropped after the handshake timeout."""
    server = shm_coordinator(world_size=1, heartbeat_timeout=1.0)
    path = server.call(lambda s: _hub(s).path if _hub(s) else "")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.recv(shm_support.NONCE_BYTES)
        try:
            rest = sock.recv(100)  # the refusal (handshake timed out), then EOF
        except ConnectionResetError:
            rest = b""
        assert rest == b"" or rest[0] != 0


def test_a_reduction_split_across_threads_gives_the_same_bytes() -> None:
    from gradserver.common.averaging import Averager, NonFiniteContribution

    size = 1_000_003
    arrays = [_data(w, 9, size) for w in range(3)]
    single, split = Averager(1), Averager(4)
    try:
        for divide in (True, False):
            want = bytes(single.average([a.data for a in arrays], divide=divide))
            assert bytes(split.average([a.data for a in arrays], divide=divide)) == want
        arrays[1][size - 5] = np.nan  # in the last thread's range
        with pytest.raises(NonFiniteContribution) as caught:
            split.average([a.data for a in arrays])
        assert (caught.value.position, caught.value.element) == (1, size - 5)
    finally:
        split.close()


def test_training_over_shm_sends_from_gradient_buffers_and_matches_grpc(shm_coordinator, tmp_path) -> None:
    """The trainer's accumulators live in the client's arena (backward writes straight into what
    is sent), and the weights after training equal those trained over gRPC, bit for bit."""
    import torch

    from gradserver.train.checkpoint import load_checkpoint
    from gradserver.train.engines import CoordinatorEngine
    from gradserver.train.training import TrainConfig, train

    states = {}
    for transport in ("grpc", "shm"):
        out = tmp_path / transport
        config = TrainConfig(model="tiny", steps=2, batch_size=4, lr=1e-2, max_grad_norm=1.0, out=str(out))
        server = shm_coordinator(world_size=2, chunk_mib=4.0, max_message_mib=16.0)

        def work(c: CollectiveClient, config: TrainConfig = config) -> int:
            train(CoordinatorEngine(c), config)
            return c._link.payloads.arenas.zero_copy_bytes if c.transport == "shm" else 0

        copied = _run(server, [transport, transport], work)
        assert (min(copied) > 0) == (transport == "shm")
        states[transport] = load_checkpoint(out / "checkpoint-rank0.pt").model_state
    for name, weight in states["grpc"].items():
        assert torch.equal(states["shm"][name], weight), name


def test_connect_returns_once_the_coordinator_holds_the_stream(shm_coordinator) -> None:
    """A worker may send and leave right after connect: every peer's stream must already be
    registered then, or it is refused as opened before the world was complete."""
    server = shm_coordinator(world_size=3)
    clients = connect_ranks(server.address, ["shm", "shm", "grpc"])
    try:
        assert server.call(lambda s: sorted(s._streams.by_worker)) == [0, 1, 2]
    finally:
        for c in clients:
            c.close()


def test_another_network_namespace_counts_as_another_host() -> None:
    assert shm_support.same_network_namespace(os.getpid())
    assert not shm_support.same_network_namespace(2**22 + 1)  # above pid_max: no such process


def test_a_16_bit_wire_stays_on_grpc_and_shm_refuses_it(shm_coordinator, caplog) -> None:
    """Shared memory carries float32 only: a bfloat16 worker on the coordinator's host uses gRPC
    (auto, one INFO line naming the dtype) and transport="shm" is refused with that reason."""
    server = shm_coordinator(world_size=1)
    with caplog.at_level(logging.INFO, logger="gradserver.worker"):
        client = WorkerClient.connect(
            server.address, timeout=TEST_TIMEOUTS, transport="auto", wire_dtype="bfloat16"
        )
    try:
        assert client.transport == "grpc"
        assert any("wire dtype is bfloat16" in r.getMessage() for r in caplog.records)
        client.send_non_block_gradient(0, 1, np.full(10, 1.5, np.float32))
        assert client.receive_averaged_non_block().gradients.tolist() == [1.5] * 10
    finally:
        client.close()
    with pytest.raises(FailedPreconditionError, match=r"transport 'shm' is not available.*bfloat16"):
        WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS, transport="shm", wire_dtype="bfloat16")


def test_result_memory_a_refused_key_averages_into_stays_taken_until_its_step_fails(shm_coordinator) -> None:
    """A key sent without `into=` gets its result in the worker's arena, and its chunks are
    averaged over it. Refused (here: a chunk sent twice), the key's other chunks may still be
    averaged there, so that memory is not reused until the coordinator fails the step."""
    server = shm_coordinator(world_size=2)
    c0, c1 = connect_ranks(server.address, ["shm", "shm"])
    try:
        arena = c0._link.payloads.arenas
        free = arena._pages.free_slots
        key = TensorKey.non_block(0, NonBlockComponent.EMBEDDING)
        data = _data(0, 6, 10000)  # three chunks
        c0.send_non_block_gradient(0, NonBlockComponent.EMBEDDING, data)
        assert arena._pages.free_slots < free and arena.staged_bytes == 40000  # copied into the result
        header = ChunkHeader(DType.FLOAT32, 10000, ())
        c0._link.send_chunk(key, header, 0, data[:4096], None)  # refused: sent twice
        _poll(lambda: key in c0._link.payloads._unsettled, "the refusal")
        with pytest.raises(GradServerError, match="twice"):
            c0.receive_averaged_non_block()
        gc.collect()
        assert arena._pages.free_slots < free  # still taken: its chunks may yet be averaged there
        bad = _data(1, 6, 10000)
        bad[5] = np.nan
        c1.send_non_block_gradient(0, NonBlockComponent.EMBEDDING, bad)
        with pytest.raises(GradServerError, match="non-finite"):
            c1.receive_averaged_non_block()
        _poll(lambda: not c0._link.payloads._unsettled, "the step's failure")
        gc.collect()
        assert arena._pages.free_slots == free
    finally:
        c0.close()
        c1.close()


def test_an_average_named_outside_the_workers_own_arena_is_an_internal_error(shm_coordinator) -> None:
    """An answer naming "in" must lie inside this worker's input arena, 4-byte aligned: anything
    else is the coordinator's fault, reported by name instead of reading stray memory."""
    server = shm_coordinator(world_size=1)
    (c,) = connect_ranks(server.address, ["shm"])
    try:
        arenas = c._link.payloads.arenas
        size = len(arenas._arena)
        assert arenas.own_average(ShmRef("in", 64, 16)).size == 4
        for ref in (ShmRef("in", size - 8, 16), ShmRef("in", 2, 16), ShmRef("in", 0, 6)):
            with pytest.raises(InternalError, match="outside this worker's"):
                arenas.own_average(ref)
    finally:
        c.close()


def test_a_slot_arena_hands_out_first_fit_runs_and_counts_what_it_frees() -> None:
    arena = shm_support.SlotArena(10 * 4096, 4096)
    assert arena.count == 10 and arena.free_slots == 10
    assert [arena.take_run(3), arena.take_run(1), arena.take_run(4)] == [0, 3 * 4096, 4 * 4096]
    assert arena.free_slots == 2 and arena.take_run(3) is None
    arena.free(3 * 4096)
    arena.free(3 * 4096)  # twice: counted once
    assert arena.free_slots == 3
    assert arena.take_run(3) is None  # 3 free, but not contiguous
    arena.free(0, 3)
    assert arena.take_run(4) == 0 and arena.free_slots == 2
    with pytest.raises(IndexError):
        arena.free(9 * 4096, 2)


def test_small_buffers_take_pages_of_the_arena_not_whole_chunks(shm_coordinator) -> None:
    """With 32 MiB chunks a 1 GiB input arena holds 32 chunks; small gradient buffers and results
    take 1 MiB pages, so far more of them than that lie in the arena (sent without a copy)."""
    server = shm_coordinator(world_size=1, chunk_mib=0, max_message_mib=33.0)
    client = WorkerClient.connect(server.address, timeout=TEST_TIMEOUTS, shm_arena_mib=1024)
    try:
        assert client.transport == "shm" and client.chunk_bytes == 32 * 2**20
        arena = client._link.payloads.arenas
        buffers = [client.gradient_buffer(1000) for _ in range(100)]
        assert all(arena.placed(b) is not None for b in buffers)
        assert arena._pages.count - arena._pages.free_slots == 100
        buffers[0][:] = 2.0
        client.send_non_block_gradient(0, 1, buffers[0], into=buffers[0])
        assert client.receive_averaged_non_block().gradients.tolist() == [2.0] * 1000
        assert arena.zero_copy_bytes == 4000
    finally:
        client.close()


def test_keys_sent_in_opposite_orders_and_larger_than_the_budget_complete(shm_coordinator) -> None:
    """Worker 0 sends A then B, worker 1 B then A, each key 16 times the in-flight budget.
    Contributions in the workers' shared memory cost the coordinator nothing to hold, so they do
    not count toward the budget: counted, each worker's stream would be held back with its half
    of the other key unread, and the step would wait for its timeout."""
    server = shm_coordinator(world_size=2, max_inflight_mib=CHUNK_MIB * 2, step_timeout=30.0)
    c0, c1 = connect_ranks(server.address, ["shm", "shm"])
    elements = int(CHUNK_MIB * 2**20) // 4 * 32  # 32 chunks; the budget holds 2
    a, b = NonBlockComponent.LM_HEAD, NonBlockComponent.EMBEDDING

    def exchange(client: WorkerClient) -> dict[int, np.ndarray]:
        order = [a, b] if client.worker_id == 0 else [b, a]
        for component in order:
            client.send_non_block_gradient(0, component, _data(client.worker_id, int(component), elements))
        results = [client.receive_averaged_non_block() for _ in order]
        return {int(r.component): r.gradients for r in results}

    try:
        got = run_each([c0, c1], exchange, timeout=25.0)
        for c in (int(a), int(b)):
            total = _data(0, c, elements).astype(np.float64) + _data(1, c, elements)
            for results in got:
                np.testing.assert_array_equal(results[c], (total / 2).astype(np.float32))
        assert server.call(lambda s: metric(s, "gradserver_shm_received_bytes_total")) >= 4 * elements * 4
    finally:
        c0.close()
        c1.close()
