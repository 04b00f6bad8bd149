"""Deterministic averaging: worker-id order, float64 accuracy, exact single-worker pass-through."""

from __future__ import annotations

import numpy as np
import pytest

from gradserver.common.averaging import _BLOCK as BLOCK  # block boundaries are what these tests cross
from gradserver.common.averaging import _IN_PLACE_BLOCK as IN_PLACE_BLOCK
from gradserver.common.averaging import Averager, InPlace, NonFiniteContribution
from gradserver.common.messages import DType


def _parts(n: int, size: int = 4096) -> list[bytes]:
    rng = np.random.default_rng(n)
    return [
        (rng.standard_normal(size) * 10.0 ** rng.integers(-3, 3)).astype("<f4").tobytes() for _ in range(n)
    ]


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_matches_float64_mean_within_half_an_ulp(n: int) -> None:
    parts = _parts(n)
    got = np.frombuffer(bytes(Averager().average(parts)), "<f4").astype(np.float64)
    want = np.mean([np.frombuffer(p, "<f4").astype(np.float64) for p in parts], axis=0)
    # One rounding of an exact float64 sum: at most half a float32 ulp away.
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= 0.5 * ulp + 1e-45)


def test_cancellation_does_not_lose_relative_accuracy() -> None:
    a = np.array([1e8, 1.0, -3.0], "<f4")
    b = np.array([-1e8, 2.0, 3.0], "<f4")
    got = np.frombuffer(Averager().average([a.tobytes(), b.tobytes()]), "<f4")
    assert got.tolist() == [0.0, 1.5, 0.0]


def test_single_contribution_comes_back_byte_for_byte() -> None:
    part = _parts(1)[0]
    assert Averager().average([part]) is part


def test_scratch_reuse_across_sizes_keeps_results_independent() -> None:
    averager = Averager()
    big, small = _parts(2, 200_000), _parts(3, 100)
    first = bytes(averager.average(big))
    assert bytes(averager.average(small)) == bytes(Averager().average(small))
    assert bytes(averager.average(big)) == first


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_input_names_the_contribution_and_element(value: float) -> None:
    parts = [np.ones(10, "<f4"), np.ones(10, "<f4"), np.ones(10, "<f4")]
    parts[2][6] = value
    with pytest.raises(NonFiniteContribution) as info:
        Averager().average([p.tobytes() for p in parts])
    assert (info.value.position, info.value.element) == (2, 6)


def test_opposite_infinities_are_caught() -> None:
    a, b = np.array([np.inf], "<f4"), np.array([-np.inf], "<f4")
    with pytest.raises(NonFiniteContribution):
        Averager().average([a.tobytes(), b.tobytes()])


def _finite_float32_bits(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random float32 values over every finite bit pattern: subnormals, zeros of both signs, the
    largest values (whose sums overflow float32) and everything between."""
    bits = rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32)
    exponent = (bits >> np.uint32(23)) & np.uint32(0xFF)
    bits[exponent == 0xFF] &= np.uint32(0xFF7FFFFF)  # inf/NaN patterns -> the largest binade
    return bits.view("<f4")


@pytest.mark.parametrize("divide", [True, False])
def test_two_contributions_give_the_float64_paths_bytes(divide: bool) -> None:
    """The float32 path for two workers must give exactly the bytes of the float64 sum rounded
    once, including subnormal results, cancellation, signed zeros and sums beyond float32."""
    rng = np.random.default_rng(7)
    size = 3 * BLOCK + 123  # several blocks and a partial one
    a = _finite_float32_bits(rng, size)
    b = _finite_float32_bits(rng, size)
    # Near-cancelling pairs, subnormal neighbours and values sharing a's binade.
    b[:2000] = -a[:2000] * np.float32(1.0000001)
    b[2000:4000] = np.float32(1e-45) * rng.integers(-8, 8, 2000).astype("<f4")
    a[2000:4000] = np.float32(1.2e-38) * rng.standard_normal(2000).astype("<f4")
    b[4000:6000] = np.nextafter(a[4000:6000], np.float32(np.inf))
    exact = a.astype(np.float64) + b.astype(np.float64)
    if divide:
        want = (exact / 2).astype("<f4")
    else:
        # A SUM beyond float32 is refused, so compare only sums that fit.
        fits = np.abs(exact) <= np.finfo(np.float32).max
        a, b, exact = a[fits], b[fits], exact[fits]
        with np.errstate(over="ignore"):
            want = exact.astype("<f4")
    assert not divide or (np.abs(exact) > np.finfo(np.float32).max).any(), "no overflowing sum tested"
    for threads in (1, 3):
        got = np.frombuffer(Averager(threads).average([a.tobytes(), b.tobytes()], divide=divide), "<f4")
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("workers", [2, 3, 5])
@pytest.mark.parametrize("divide", [True, False])
def test_a_small_chunk_gives_the_bytes_of_the_same_elements_in_a_large_one(
    workers: int, divide: bool
) -> None:
    """Chunks of up to 4096 elements (small collectives) take a one-pass path; its bytes must be
    those the block path gives the same elements, overflowing sums and subnormals included."""
    rng = np.random.default_rng(11 + workers)
    size = 2 * BLOCK + 17
    inputs = [_finite_float32_bits(rng, size) for _ in range(workers)]
    averager = Averager()
    with np.errstate(over="ignore", invalid="ignore"):
        large = np.frombuffer(
            averager.average([x.tobytes() for x in inputs], divide=divide, finite_only=False), "<f4"
        )
        for start, length in ((0, 1), (5, 4096), (BLOCK + 70000, 333)):
            small = averager.average(
                [x[start : start + length].tobytes() for x in inputs], divide=divide, finite_only=False
            )
            assert bytes(small) == large[start : start + length].tobytes()


@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_an_average_in_place_has_the_bytes_of_one_into_a_buffer_over_every_input(
    workers: int, threads: int
) -> None:
    """`InPlace` (the shared-memory path's `into=` the buffer sent): every contribution is
    overwritten with the same bytes the ordinary path gives, large sums and subnormals included,
    over several blocks and a ragged tail."""
    rng = np.random.default_rng(31 + workers)
    size = 3 * IN_PLACE_BLOCK + 1001
    inputs = [_finite_float32_bits(rng, size) for _ in range(workers)]
    want = bytes(Averager().average([x.tobytes() for x in inputs]))
    buffers = [bytearray(x.tobytes()) for x in inputs]
    averager = Averager(threads)
    result = averager.average(
        [memoryview(b).toreadonly() for b in buffers], out=InPlace(tuple(memoryview(b) for b in buffers))
    )
    assert bytes(result) == want
    assert all(bytes(b) == want for b in buffers)


def test_a_non_finite_value_in_place_names_its_culprit_and_leaves_its_block_as_sent() -> None:
    """A block is written over the inputs only once its average is finite: the culprit and its
    element are found as on the ordinary path, and the failing block (and what follows) still
    holds what was sent."""
    size = 4 * IN_PLACE_BLOCK
    inputs = [np.random.default_rng(w).standard_normal(size, dtype=np.float32) for w in range(2)]
    inputs[1][2 * IN_PLACE_BLOCK + 7] = np.inf
    buffers = [bytearray(x.tobytes()) for x in inputs]
    with pytest.raises(NonFiniteContribution) as info:
        Averager().average(
            [memoryview(b).toreadonly() for b in buffers], out=InPlace(tuple(memoryview(b) for b in buffers))
        )
    assert (info.value.position, info.value.element) == (1, 2 * IN_PLACE_BLOCK + 7)
    for sent, buffer in zip(inputs, buffers, strict=True):
        assert bytes(buffer)[2 * IN_PLACE_BLOCK * 4 :] == sent[2 * IN_PLACE_BLOCK :].tobytes()


def test_in_place_is_only_for_means_of_finite_float32_values() -> None:
    """A sum may overflow in a block after earlier blocks were overwritten, which would make the
    culprit unfindable: refused, as are 16-bit payloads and a lone contribution."""
    buffers = [bytearray(16), bytearray(16)]
    out = InPlace(tuple(memoryview(b) for b in buffers))
    for kwargs in ({"divide": False}, {"finite_only": False}, {"dtype": DType.BFLOAT16}):
        with pytest.raises(ValueError, match="float32 means"):
            Averager().average([bytes(b) for b in buffers], out=out, **kwargs)


@pytest.mark.parametrize("workers", [3, 4, 8])
def test_a_mean_of_any_count_is_the_float64_sum_divided_and_rounded_once(workers: int) -> None:
    """Over every finite float32 pattern (subnormals and the largest values included), the mean
    is the rank-order float64 sum divided by the count and rounded once, also where a power of
    two divides by multiplying with its inverse."""
    rng = np.random.default_rng(41 + workers)
    inputs = [_finite_float32_bits(rng, 3 * BLOCK + 7) for _ in range(workers)]
    acc = inputs[0].astype(np.float64)
    for x in inputs[1:]:
        acc = acc + x.astype(np.float64)
    with np.errstate(over="ignore"):
        want = (acc / workers).astype(np.float32)
    assert np.isfinite(want).all()
    got = Averager().average([x.tobytes() for x in inputs])
    assert bytes(got) == want.tobytes()
