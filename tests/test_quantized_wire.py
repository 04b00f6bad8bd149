"""The block-quantized wire codec (common/quantized_wire.py): records, their error bound, the
chunk layout, the coordinator's reduction of one chunk, and agreement with the torch codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradserver.common import quantized_wire as qw
from gradserver.common.averaging import Averager, NonFiniteContribution, SumOverflow
from gradserver.common.messages import DType
from gradserver.common.wire_dtype import parse_wire_dtype
from gradserver.torch import _quantize

FORMATS = {DType.INT8_BLOCK64: "int8", DType.INT4_BLOCK64: "int4"}
LEVELS = {DType.INT8_BLOCK64: 127, DType.INT4_BLOCK64: 7}


def test_the_names_parse_and_records_have_the_documented_sizes() -> None:
    assert parse_wire_dtype("int8") is DType.INT8_BLOCK64
    assert parse_wire_dtype("INT4") is DType.INT4_BLOCK64
    assert qw.record_bytes(DType.INT8_BLOCK64) == 68
    assert qw.record_bytes(DType.INT4_BLOCK64) == 36
    records = qw.encode_records(np.arange(65, dtype=np.float32), DType.INT8_BLOCK64)
    assert records.shape == (2, 68)
    # The scale first, little-endian float32: the block's largest |value| / 127.
    assert records[0, :4].view("<f4")[0] == np.float32(63) / np.float32(127)


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("size", [1, 63, 64, 65, 1000, 4097])
def test_a_round_trip_is_within_half_a_scale_and_equals_the_torch_codec_bit_for_bit(
    dtype: DType, size: int
) -> None:
    rng = np.random.default_rng(size)
    values = rng.standard_t(3, size=size).astype(np.float32)
    values[size // 2] = 0.0
    records = qw.encode_records(values, dtype)
    decoded = qw.decode_records(records, dtype)[:size]
    scales = np.repeat(records[:, :4].copy().view("<f4").reshape(-1), 64)[:size]
    # Rounding to the nearest code costs at most half a step (plus the division's own rounding).
    assert np.all(np.abs(decoded - values) <= scales * (0.5 + 1e-6))
    torch_format = FORMATS[dtype]
    expected = _quantize.decode(_quantize.encode(torch.from_numpy(values), torch_format), torch_format, size)
    assert decoded.view(np.uint32).tobytes() == expected.numpy().view(np.uint32).tobytes()


def test_non_finite_values_are_refused_naming_the_element() -> None:
    values = np.ones(100, np.float32)
    values[70] = np.inf
    with pytest.raises(qw.NonFiniteValue, match="element 70 = inf"):
        qw.encode_records(values, DType.INT8_BLOCK64)


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("chunk_words", [17, 18, 40, 1000])
def test_records_laid_out_in_chunks_decode_chunk_by_chunk(dtype: DType, chunk_words: int) -> None:
    if chunk_words * 4 < qw.record_bytes(dtype):
        pytest.skip("a chunk smaller than a record")
    values = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    words = qw.encode_words(values, dtype, chunk_words)
    records = qw.encode_records(values, dtype)
    assert np.array_equal(qw.unpack(words, dtype, chunk_words), records)
    # Every chunk starts with whole records: decoding each on its own gives the same values.
    raw = words.view(np.uint8)
    pieces = []
    for start in range(0, words.size, chunk_words):
        chunk = raw[start * 4 : (start + chunk_words) * 4]
        whole = chunk.size // qw.record_bytes(dtype) * qw.record_bytes(dtype)
        assert not chunk[whole:].any()  # the tail is zero
        pieces.append(qw.decode_records(chunk[:whole], dtype))
    assert np.array_equal(np.concatenate(pieces)[:5000], qw.decode_words(words, dtype, chunk_words, 5000))


def test_a_chunk_smaller_than_a_record_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold one int8 record"):
        qw.encode_words(np.ones(3, np.float32), DType.INT8_BLOCK64, 16)


@pytest.mark.parametrize("dtype", list(FORMATS))
@pytest.mark.parametrize("divide", [True, False])
def test_the_coordinator_sums_in_float64_in_order_and_encodes_once(dtype: DType, divide: bool) -> None:
    rng = np.random.default_rng(7)
    chunk_words = 200  # 11 int8 records a chunk, 12 words of tail
    payloads = [
        qw.encode_words(rng.standard_normal(3000).astype(np.float32), dtype, chunk_words) for _ in range(3)
    ]
    averager = Averager()
    got = []
    for start in range(0, payloads[0].size, chunk_words):
        chunk = [p[start : start + chunk_words].tobytes() for p in payloads]
        out = bytes(averager.average(chunk, divide=divide, dtype=dtype))
        assert len(out) == len(chunk[0])
        got.append(np.frombuffer(out, "<u4"))
    result = np.concatenate(got)
    decoded = [qw.decode_words(p, dtype, chunk_words, 3000).astype(np.float64) for p in payloads]
    reference = decoded[0] + decoded[1] + decoded[2]
    if divide:
        reference /= 3
    expected = qw.encode_words(reference.astype(np.float32), dtype, chunk_words)
    assert result.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    ("dtype", "spoil", "why"),
    [
        (DType.INT8_BLOCK64, lambda r: r[1, :4].view("<f4").__setitem__(0, np.nan), "non-finite scale"),
        (DType.INT8_BLOCK64, lambda r: r[1, 10:11].view(np.int8).__setitem__(0, -128), "code -128"),
        (DType.INT4_BLOCK64, lambda r: r[1, 10:11].__setitem__(0, 0x80), "nibble 0"),
    ],
)
def test_an_unsound_record_is_refused_naming_the_contribution(dtype: DType, spoil, why: str) -> None:
    good = qw.encode_records(np.ones(200, np.float32), dtype)
    bad = good.copy()
    spoil(bad)
    with pytest.raises(NonFiniteContribution, match=why) as caught:
        Averager().average([good.tobytes(), bad.tobytes()], dtype=dtype)
    assert caught.value.position == 1
    assert caught.value.element == qw.record_bytes(dtype) // 4  # record 1's first word


def test_a_sum_beyond_float32_is_refused() -> None:
    big = qw.encode_records(np.full(64, 3e38, np.float32), DType.INT8_BLOCK64).tobytes()
    with pytest.raises(SumOverflow, match="float32"):
        Averager().average([big, big], divide=False, dtype=DType.INT8_BLOCK64)
