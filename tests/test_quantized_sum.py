"""Quantized wire dtypes through a real coordinator: the coordinator sums int8/int4 records and
answers one quantized result, the same bytes to every worker; unsound records and the
collectives whose sum would not be the coordinator's are refused."""

from __future__ import annotations

import numpy as np
import pytest

from gradserver.common import quantized_wire as qw
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import GradServerError, InvalidArgumentError
from gradserver.common.messages import CollectiveKind, DType, ReduceOp, TensorKey
from gradserver.worker import WorkerClient

from .helpers.server import TEST_TIMEOUTS, connect_all, run_each, run_each_outcome

LM_HEAD = NonBlockComponent.LM_HEAD
WIRES = {"int8": DType.INT8_BLOCK64, "int4": DType.INT4_BLOCK64}


def _reference(grads: list[np.ndarray], dtype: DType, divide: bool) -> np.ndarray:
    """What the coordinator must answer: each worker's records decoded, summed in float64 in
    worker order, divided, encoded once, decoded."""
    size = grads[0].size
    decoded = [qw.decode_records(qw.encode_records(g, dtype), dtype)[:size].astype(np.float64) for g in grads]
    total = decoded[0]
    for d in decoded[1:]:
        total = total + d
    if divide:
        total = total / len(grads)
    return qw.decode_records(qw.encode_records(total.astype(np.float32), dtype), dtype)[:size]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire", ["int8", "int4"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_every_worker_gets_the_coordinators_one_quantized_sum(workers, wire: str, op: ReduceOp) -> None:
    clients = workers(3, client_options={"wire_dtype": wire})
    assert all(c.wire_dtype is WIRES[wire] for c in clients)
    rng = np.random.default_rng(5)
    # Several of the test coordinator's chunks (1 MiB of words), so the layout's tails run too.
    size = 1_000_003
    grads = [rng.standard_t(3, size).astype(np.float32) for _ in clients]

    def one(c: WorkerClient) -> np.ndarray:
        return c.collective(TensorKey.collective(1, 0, op), grads[c.worker_id])

    got = run_each(clients, one)
    assert all(g.dtype == np.float32 and g.shape == (size,) for g in got)
    assert all(g.tobytes() == got[0].tobytes() for g in got[1:])
    expected = _reference(grads, WIRES[wire], op is ReduceOp.AVG)
    assert got[0].tobytes() == expected.tobytes()


@pytest.mark.timeout(120)
def test_a_per_call_wire_on_a_float32_client_and_training_keys(workers) -> None:
    clients = workers(2)  # float32 clients, on this host: shared memory and the collective lane
    rng = np.random.default_rng(6)
    grads = [rng.standard_normal(5000).astype(np.float32) for _ in clients]

    def one(c: WorkerClient) -> np.ndarray:
        return c.collective(TensorKey.collective(1, 0, ReduceOp.SUM), grads[c.worker_id], wire="int8")

    got = run_each(clients, one)
    assert got[0].tobytes() == got[1].tobytes() == _reference(grads, DType.INT8_BLOCK64, False).tobytes()

    def training(c: WorkerClient) -> np.ndarray:
        c.send(TensorKey.non_block(1, LM_HEAD), grads[c.worker_id], wire="int4")
        return c.receive_averaged_non_block().gradients

    got = run_each(clients, training)
    assert got[0].tobytes() == got[1].tobytes() == _reference(grads, DType.INT4_BLOCK64, True).tobytes()


@pytest.mark.timeout(120)
def test_error_feedback_keeps_what_the_records_lost_for_the_next_step(workers) -> None:
    clients = workers(2, client_options={"wire_dtype": "int8", "error_feedback": True})
    values = np.linspace(-1, 1, 640).astype(np.float32)
    key = TensorKey.non_block(1, LM_HEAD)

    def one(c: WorkerClient) -> np.ndarray:
        c.send(key, values)
        return c.receive_averaged_non_block().gradients

    run_each(clients, one)
    sent = qw.decode_records(qw.encode_records(values, DType.INT8_BLOCK64), DType.INT8_BLOCK64)[:640]
    residual = clients[0]._encoder.residual(key)
    assert residual is not None and residual.tobytes() == (values - sent).tobytes()


@pytest.mark.timeout(120)
def test_an_unsound_record_fails_the_step_naming_the_worker(workers) -> None:
    clients = workers(2, client_options={"wire_dtype": "int8"})
    encoder = clients[1]._encoder
    honest = encoder.encode

    def spoiled(key: TensorKey, array: np.ndarray) -> np.ndarray:
        records = honest(key, array).copy()
        records[2, 7:8].view(np.int8)[0] = -128
        return records

    encoder.encode = spoiled  # type: ignore[method-assign]

    def one(c: WorkerClient) -> np.ndarray:
        return c.collective(TensorKey.collective(1, 0, ReduceOp.SUM), np.ones(1000, np.float32))

    outcomes = run_each_outcome(clients, one)
    assert all(isinstance(o, GradServerError) for o in outcomes)
    assert all("worker 1 sent a INT8_BLOCK64 record that holds the code -128" in str(o) for o in outcomes)


@pytest.mark.timeout(120)
def test_reduce_scatter_is_refused_in_a_quantized_dtype_before_sending(workers) -> None:
    clients = workers(2, client_options={"wire_dtype": "int8"})
    key = TensorKey.collective(1, 0, ReduceOp.SUM, kind=CollectiveKind.REDUCE_SCATTER)
    with pytest.raises(InvalidArgumentError, match="REDUCE_SCATTER SUM of group 0 cannot carry INT8_BLOCK64"):
        clients[0].send(key, np.ones(128, np.float32))
    # Nothing was sent: the same operation goes on in float32.
    got = run_each(clients, lambda c: c.collective(key, np.ones(128, np.float32), exact=True))
    assert got[0].tolist() == [2.0] * 64


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_each_worker_moves_one_quantized_payload_each_way(coordinator, wire: str) -> None:
    server = coordinator(world_size=3)
    clients = connect_all(server.address, 3, TEST_TIMEOUTS, wire_dtype=wire)
    try:
        size = 64 * 4000
        grads = [np.full(size, float(c.worker_id + 1), np.float32) for c in clients]
        coordinator_side = server.server
        assert coordinator_side is not None
        before = [coordinator_side.traffic(w) for w in range(3)]
        run_each(
            clients, lambda c: c.collective(TensorKey.collective(1, 0, ReduceOp.SUM), grads[c.worker_id])
        )
        after = [coordinator_side.traffic(w) for w in range(3)]
        # One payload up and one down: records of 64 values (1.0625 or 0.5625 bytes a value, and
        # less than a record of padding per chunk), not N payloads down as a gather would.
        payload = size // 64 * qw.record_bytes(WIRES[wire])
        for w in range(3):
            received = after[w].received_bytes - before[w].received_bytes
            sent = after[w].sent_bytes - before[w].sent_bytes
            assert received == sent, (w, received, sent)
            assert payload <= received < payload * 1.01, (w, received, payload)
    finally:
        for c in clients:
            c.close()


@pytest.mark.timeout(120)
def test_a_quantized_partial_sum_is_refused_by_the_codec() -> None:
    from gradserver.common import collective_rules

    key = TensorKey.non_block(1, LM_HEAD)
    assert collective_rules.partial_sum_problem(key, 0, (0, 1), 4) is None
    problem = collective_rules.partial_sum_problem(key, 0, (0, 1), 4, DType.INT8_BLOCK64)
    assert problem is not None and "a partial sum of quantized records would be requantized" in problem


def test_a_process_groups_client_refuses_a_quantized_wire_before_connecting() -> None:
    from gradserver.torch._collective import CollectiveClient

    with pytest.raises(InvalidArgumentError, match="wire dtype int8 is not for a process group"):
        CollectiveClient.connect_as_rank("127.0.0.1:1", 0, wire_dtype="int8", timeout=1.0)
