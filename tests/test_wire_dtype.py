"""16-bit wire: rounding, the coordinator's single rounding, bit-identical averages on every
worker, error bounds, error feedback, float16 overflow, and the worker's flags."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from gradserver.common import codec
from gradserver.common.averaging import Averager, SumOverflow
from gradserver.common.components import NonBlockComponent
from gradserver.common.errors import GradServerError, InvalidArgumentError
from gradserver.common.messages import (
    AveragedChunkOut,
    ChunkHeader,
    ChunkIn,
    DType,
    ErrorOut,
    KeyKind,
    ReduceOp,
    TensorKey,
)
from gradserver.common.wire_dtype import (
    bf16_from_f32,
    f32_from_bf16,
    narrow,
    parse_wire_dtype,
    round_f64,
    widen,
)
from gradserver.server.reduction import ReductionTable
from gradserver.train import cli as worker_cli
from gradserver.worker import WorkerClient

from .helpers.server import TEST_TIMEOUTS, run_each

LM_HEAD = NonBlockComponent.LM_HEAD
BITS = {DType.BFLOAT16: 8, DType.FLOAT16: 11}  # significand bits, the implicit one included


def ulp16(values: np.ndarray, dtype: DType) -> np.ndarray:
    """The 16-bit dtype's spacing at |values| (normal range)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(values), 1e-30)))
    return np.exp2(exponent - (BITS[dtype] - 1))


def exchange(clients: list[WorkerClient], step: int, grads: list[np.ndarray]) -> list[np.ndarray]:
    def one(c: WorkerClient) -> np.ndarray:
        c.send_non_block_gradient(step, LM_HEAD, grads[c.worker_id])
        return c.receive_averaged_non_block().gradients

    return run_each(clients, one)


# --- rounding ---------------------------------------------------------------------------------


def test_bfloat16_rounding_matches_torch_including_ties_nan_inf_and_subnormals() -> None:
    rng = np.random.default_rng(0)
    special = np.array(
        [0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 3.39e38],
        dtype=np.float32,
    )
    values = np.concatenate([special, (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000))])
    values = values.astype(np.float32)
    # Random bit patterns reach every exponent and the NaNs with payloads in the low bits.
    values = np.concatenate(
        [values, rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view("<f4")]
    )
    got = bf16_from_f32(values)
    want = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(f32_from_bf16(got[nan])).all()
    assert np.array_equal(
        f32_from_bf16(got)[~nan],
        torch.from_numpy(want.view(np.int16).copy()).view(torch.bfloat16).float().numpy()[~nan],
    )


def _nearest_bf16(x: float) -> int:
    """Reference: the bfloat16 bits nearest to float64 `x`, ties to even, by exact arithmetic."""
    start = int(bf16_from_f32(np.array([x], np.float32))[0])
    best: tuple[Fraction, int, int] | None = None
    for bits in (start - 1, start, start + 1):
        value = float(f32_from_bf16(np.array([bits], np.uint16))[0])
        if not math.isfinite(value) or (value != 0 and math.copysign(1, value) != math.copysign(1, x)):
            continue
        candidate = (abs(Fraction(value) - Fraction(x)), bits & 1, bits)
        best = candidate if best is None or candidate < best else best
    assert best is not None
    return best[2]


def test_a_float64_mean_is_rounded_once_to_bfloat16_not_twice() -> None:
    # 1 + 2**-8 + 2**-30 is above the midpoint of 1 and 1 + 2**-7; through float32 by nearest it
    # would become the midpoint and then round (to even) down to 1.
    x = np.array([1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30)], np.float64)
    assert f32_from_bf16(round_f64(x, DType.BFLOAT16)).tolist() == [1 + 2**-7, -(1 + 2**-7)]
    rng = np.random.default_rng(1)
    wide = rng.standard_normal(3000) * 10.0 ** rng.integers(-20, 20, 3000)
    got = round_f64(wide, DType.BFLOAT16)
    assert got.tolist() == [_nearest_bf16(float(v)) for v in wide]


def test_the_coordinator_rounds_a_mean_of_four_bfloat16_values_once() -> None:
    parts = [narrow(np.array([v], np.float32), DType.BFLOAT16).tobytes() for v in (4.0, 2**-6, 2**-28, 0.0)]
    got = widen(Averager().average(parts, dtype=DType.BFLOAT16), DType.BFLOAT16)
    assert got.tolist() == [1 + 2**-7]


@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT16])
def test_a_chunk_average_is_within_half_an_ulp_of_the_exact_mean_of_what_was_sent(dtype: DType) -> None:
    rng = np.random.default_rng(2)
    sent = [narrow((rng.standard_normal(5000) * 4).astype(np.float32), dtype) for _ in range(3)]
    got = widen(Averager().average([s.tobytes() for s in sent], dtype=dtype), dtype).astype(np.float64)
    exact = np.mean([widen(s.tobytes(), dtype).astype(np.float64) for s in sent], axis=0)
    assert np.all(np.abs(got - exact) <= 0.5 * ulp16(exact, dtype))


@pytest.mark.parametrize("dtype", [DType.BFLOAT16, DType.FLOAT16])
def test_16_bit_chunks_and_averages_cross_the_codec_byte_for_byte(dtype: DType) -> None:
    payload = narrow(np.linspace(-3, 3, 1000, dtype=np.float32), dtype).tobytes()
    key = TensorKey.non_block(5, LM_HEAD)
    header = ChunkHeader(dtype, 1000, ())
    limits = codec.WireLimits(chunk_elements=1000, max_tensor_elements=10**6)
    chunk = codec.decode_worker_message(
        codec.encode_worker_event(ChunkIn(2, key, header, 0, payload)), limits
    )
    assert isinstance(chunk, ChunkIn)
    assert chunk.header.dtype is dtype and bytes(chunk.data) == payload
    out = codec.decode_server_message(codec.encode_server_event(AveragedChunkOut(key, header, 0, payload, 3)))
    assert isinstance(out, AveragedChunkOut)
    assert out.header.dtype is dtype and bytes(out.data) == payload


def test_parse_wire_dtype_names_the_choices() -> None:
    assert parse_wire_dtype("BFloat16") is DType.BFLOAT16
    with pytest.raises(ValueError, match="float32, bfloat16, float16, int8, int4"):
        parse_wire_dtype("int16")


# --- through the coordinator ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_worker_gets_the_same_bytes_within_one_ulp_of_the_exact_mean(workers, dtype: str) -> None:
    clients = workers(3, client_options={"wire_dtype": dtype})
    wire = parse_wire_dtype(dtype)
    assert all(c.wire_dtype is wire for c in clients)
    rng = np.random.default_rng(3)
    # Larger than a chunk (the test coordinator's chunk is 1 MiB of float32) so chunking runs too.
    size = 300_000
    grads = [(rng.standard_normal(size) * 3).astype(np.float32) for _ in clients]
    got = exchange(clients, 1, grads)
    assert all(g.dtype == np.float32 and g.shape == (size,) for g in got)
    assert all(g.tobytes() == got[0].tobytes() for g in got[1:])
    exact = np.mean([g.astype(np.float64) for g in grads], axis=0)
    biggest = np.max(np.abs(grads), axis=0).astype(np.float64)
    # Each input rounded by at most half an ulp of itself, the mean by half an ulp of itself.
    assert np.all(np.abs(got[0] - exact) <= ulp16(biggest, wire))
    # And the result is what the coordinator's single rounding of the sent values gives.
    sent = [widen(narrow(g, wire).tobytes(), wire).astype(np.float64) for g in grads]
    assert np.array_equal(got[0], widen(round_f64(np.mean(sent, axis=0), wire).tobytes(), wire))


@pytest.mark.parametrize("transport", ["auto", "grpc"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_key_of_float32_workers_sums_alike_over_shared_memory_and_grpc(
    workers, dtype: str, transport: str
) -> None:
    """`send(..., wire=dtype)` on workers whose own wire is float32: the SUM comes back in the
    16-bit dtype, the same bytes on every worker. With shared memory ("auto" on one host) the
    answer lies in the output arena as 16-bit values (it was read as float32, giving garbage)."""
    clients = workers(2, client_options={"transport": transport})
    wire = parse_wire_dtype(dtype)
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(1000).astype(np.float32) for _ in clients]

    def one(c: WorkerClient) -> np.ndarray:
        key = TensorKey.collective(0, 3, ReduceOp.SUM)
        c.send(key, grads[c.worker_id].copy(), wire=dtype)
        return np.asarray(c.receive(KeyKind.COLLECTIVE).gradients, dtype=np.float32).copy()

    got = run_each(clients, one)
    assert got[0].tobytes() == got[1].tobytes()
    sent = [widen(narrow(g, wire).tobytes(), wire).astype(np.float64) for g in grads]
    assert np.array_equal(got[0], widen(round_f64(sent[0] + sent[1], wire).tobytes(), wire))


def test_workers_with_different_wire_dtypes_fail_the_step_naming_both(coordinator) -> None:
    server = coordinator(world_size=2)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                WorkerClient.connect, server.address, node_id=f"mix-{d}", timeout=TEST_TIMEOUTS, wire_dtype=d
            )
            for d in ("float32", "bfloat16")
        ]
        clients = [f.result(timeout=TEST_TIMEOUTS.join + 5) for f in futures]
    try:

        def one(c: WorkerClient) -> object:
            c.send_non_block_gradient(1, LM_HEAD, np.ones(8, np.float32))
            try:
                c.receive_averaged_non_block()
            except GradServerError as exc:
                return exc
            return None

        outcomes = run_each(clients, one)
        assert all(isinstance(o, GradServerError) for o in outcomes)
        assert any("BFLOAT16" in str(o) and "FLOAT32" in str(o) for o in outcomes)
    finally:
        for c in clients:
            c.close()


def test_a_value_beyond_float16_is_refused_before_sending_naming_key_and_element(workers) -> None:
    clients = workers(2, client_options={"wire_dtype": "float16"})
    bad = np.ones(10, np.float32)
    bad[7] = 70000.0
    with pytest.raises(
        InvalidArgumentError, match=r"non-block LM_HEAD: element 7 = 70000 is beyond the float16 range"
    ):
        clients[0].send_non_block_gradient(1, LM_HEAD, bad)
    # Nothing of it was sent: the same step goes on with a good gradient.
    got = exchange(clients, 1, [np.full(10, 2.0, np.float32), np.full(10, 4.0, np.float32)])
    assert got[0].tolist() == [3.0] * 10


def test_a_float16_sum_that_overflows_fails_the_step_naming_the_key() -> None:
    reductions = ReductionTable(2, 4, 10.0)
    key = TensorKey.collective(1, 0, ReduceOp.SUM)
    out = []
    for w in range(2):
        payload = narrow(np.array([1.0, 60000.0], np.float32), DType.FLOAT16).tobytes()
        out += reductions.contribute(ChunkIn(w, key, ChunkHeader(DType.FLOAT16, 2, ()), 0, payload))
    errs = [o.event for o in out if isinstance(o.event, ErrorOut)]
    assert errs and all(e.step_failed for e in errs)
    assert f"the sum of {key} overflows float16 at element 1" in errs[0].message
    with pytest.raises(SumOverflow, match="float16 at element 1"):
        Averager().average([payload, payload], divide=False, dtype=DType.FLOAT16)


# --- error feedback ---------------------------------------------------------------------------


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_makes_the_sum_of_averages_track_the_sum_of_exact_means(
    workers, feedback: bool
) -> None:
    clients = workers(2, client_options={"wire_dtype": "bfloat16", "error_feedback": feedback})
    rng = np.random.default_rng(4)
    size, steps = 512, 24
    total_avg = np.zeros(size)
    total_exact = np.zeros(size)
    for step in range(1, steps + 1):
        # Every worker sends the same gradient, so the coordinator's mean is exact and what is
        # measured is the workers' rounding: 1 + 2**-9 + a little rounds down to 1 every time.
        g = (1 + 2**-9 + rng.uniform(0, 2**-12, size)).astype(np.float32)
        got = exchange(clients, step, [g, g])
        total_avg += got[0]
        total_exact += g.astype(np.float64)
    drift = np.max(np.abs(total_avg - total_exact))
    one_ulp = 2**-7  # bfloat16 spacing in [1, 2)
    if feedback:
        assert drift <= 0.5 * one_ulp + 1e-6
        assert clients[0]._encoder.residual(TensorKey.non_block(0, LM_HEAD)) is not None
    else:
        assert drift >= steps * 2**-9 * 0.9  # without it the bias adds up every step


def test_error_feedback_needs_a_16_bit_wire() -> None:
    with pytest.raises(InvalidArgumentError, match="16-bit"):
        WorkerClient.connect("127.0.0.1:1", wire_dtype="float32", error_feedback=True, timeout=1.0)
    with pytest.raises(InvalidArgumentError, match="not one of"):
        WorkerClient.connect("127.0.0.1:1", wire_dtype="int16", timeout=1.0)


# --- the worker's flags -----------------------------------------------------------------------


def _config(*argv: str, env: dict[str, str] | None = None) -> worker_cli.WorkerConfig:
    from gradserver.common.config import config_from_sources

    config: worker_cli.WorkerConfig = config_from_sources(
        worker_cli.WorkerConfig, worker_cli.worker_parser().parse_args(list(argv)), env or {}
    )
    return config


def test_wire_dtype_flag_and_environment_reach_the_fingerprint() -> None:
    assert worker_cli.job_fingerprint(_config())["wire_dtype"] == "float32"
    flagged = worker_cli.job_fingerprint(_config("--wire-dtype", "bfloat16", "--error-feedback"))
    assert flagged["wire_dtype"] == "bfloat16" and flagged["error_feedback"] == "True"
    from_env = _config(env={"GRADSERVER_WIRE_DTYPE": "float16"})
    assert worker_cli.check_synthetic(from_env)["wire_dtype"] == "float16"
    with pytest.raises(InvalidArgumentError, match="--wire-dtype must be one of float32, bfloat16, float16"):
        _config("--wire-dtype", "fp8")
    with pytest.raises(InvalidArgumentError, match="--error-feedback needs"):
        _config("--error-feedback")
