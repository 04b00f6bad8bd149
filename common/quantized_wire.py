"""Block-quantized wire dtypes (int8 and int4, 64 values per float32 scale), numpy only.

A quantized payload is a run of RECORDS, one per block of 64 values: `[float32 scale][codes]`,
little-endian. int8: 64 codes -127..127 (68 bytes a record); int4: codes -7..7 stored +8, two a
byte, low nibble first (36 bytes a record). The last block of a tensor is padded with zeros.
Encoding: scale = the block's largest |value| / levels (127 or 7), code = round-half-even of
value / scale (one float32 division), clamped; decoding: code * scale (one float32
multiplication, correctly rounded), so the values are those torch_backend/_quantize.py gives for
the same block, bit for bit.

On the wire the element of these dtypes is a 4-byte WORD of the record stream (ITEM_SIZE 4),
not a record: the coordinator's chunks are cut every `chunk_elements` elements whatever the
dtype, and a chunk of that many 68-byte records would be 17 times the chunk bytes the job's
message limits were sized for. Records are instead laid out chunk by chunk (`pack`): each chunk
of the key's words starts with as many whole records as fit in it, and the words left over (fewer
than one record) are zero. Any chunk therefore decodes on its own, from its first byte, without
knowing the chunk size: the coordinator reduces it record by record (`reduce_records`) and
answers zeros in its tail, and the worker that sent it undoes the layout with its chunk size
(`unpack`).

Coordinator: each contribution's records are checked (a non-finite scale, an int8 code of -128
or an int4 nibble of 0 are never encoded: `BadRecord` names the record), decoded, summed in
float64 in worker-id order, divided by the count for AVG, rounded to float32 and encoded once, so
every worker gets the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .messages import DType

VALUES_PER_RECORD = 64
WORD_BYTES = 4
_F32 = np.dtype("<f4")
_U8 = np.dtype(np.uint8)
_WORD = np.dtype("<u4")
_SCALE_BYTES = 4
# Records reduced at once on the coordinator: 64 Ki values of float64, about the L2 cache.
_RECORDS_AT_ONCE = 1024


@dataclasses.dataclass(frozen=True)
class _Format:
    name: str
    levels: int
    code_bytes: int

    @property
    def record_bytes(self) -> int:
        return _SCALE_BYTES + self.code_bytes


_FORMATS = {
    DType.INT8_BLOCK64: _Format("int8", 127, VALUES_PER_RECORD),
    DType.INT4_BLOCK64: _Format("int4", 7, VALUES_PER_RECORD // 2),
}


class NonFiniteValue(ValueError):
    """A NaN or Inf among the values to encode, at `element`."""

    def __init__(self, element: int, value: float) -> None:
        super().__init__(
            f"element {element} = {value} is not finite: quantized payloads carry finite values only"
        )
        self.element = element
        self.value = value


class BadRecord(Exception):
    """Contribution `position`'s record `record` is not one an encoder makes (`why`)."""

    def __init__(self, position: int, record: int, word: int, why: str) -> None:
        super().__init__(f"contribution {position}: record {record} {why}")
        self.position = position
        self.record = record
        self.word = word
        self.why = why


class QuantizedOverflow(Exception):
    """The sum (or mean) of a value in `record` of a chunk (its first word: `word`) is beyond
    float32."""

    def __init__(self, record: int, word: int) -> None:
        super().__init__(f"the sum overflows float32 in record {record}")
        self.record = record
        self.word = word


def is_quantized(dtype: DType) -> bool:
    return dtype in _FORMATS


def record_bytes(dtype: DType) -> int:
    """Bytes of one record of `dtype` (68 for int8, 36 for int4)."""
    return _FORMATS[dtype].record_bytes


def records_for(values: int) -> int:
    """Records (blocks) that `values` values fill."""
    return -(-values // VALUES_PER_RECORD)


# --- one record stream <-> float32 -------------------------------------------------------------


def encode_records(values: np.ndarray, dtype: DType) -> np.ndarray:
    """The records (uint8, shape (blocks, record bytes)) of a 1-D float32 array of finite values;
    raises NonFiniteValue naming the first that is not."""
    fmt = _FORMATS[dtype]
    flat = np.ascontiguousarray(values, dtype=_F32).reshape(-1)
    finite = np.isfinite(flat)
    if not finite.all():
        element = int(np.flatnonzero(~finite)[0])
        raise NonFiniteValue(element, float(flat[element]))
    blocks = records_for(flat.size)
    rows = np.zeros((blocks, VALUES_PER_RECORD), dtype=_F32)
    rows.reshape(-1)[: flat.size] = flat
    # float32 / float32 and float32 / float32 again, each correctly rounded: torch's operations.
    scales = (np.abs(rows).max(axis=1, initial=np.float32(0)) / np.float32(fmt.levels)).astype(_F32)
    divisors = np.where(scales > 0, scales, np.float32(1)).astype(_F32)
    with np.errstate(over="ignore"):
        quotients = rows / divisors[:, None]
    codes = np.clip(np.rint(quotients), -fmt.levels, fmt.levels).astype(np.int8)
    records = np.empty((blocks, fmt.record_bytes), dtype=_U8)
    records[:, :_SCALE_BYTES] = scales.view(_U8).reshape(blocks, _SCALE_BYTES)
    if dtype is DType.INT8_BLOCK64:
        records[:, _SCALE_BYTES:] = codes.view(_U8)
    else:
        nibbles = (codes.astype(np.int16) + 8).astype(_U8).reshape(blocks, fmt.code_bytes, 2)
        records[:, _SCALE_BYTES:] = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    return records


def _as_records(data: bytes | memoryview | np.ndarray, dtype: DType) -> np.ndarray:
    raw = np.frombuffer(data, dtype=_U8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(_U8)
    size = _FORMATS[dtype].record_bytes
    if raw.size % size:
        raise ValueError(f"{raw.size} bytes are not whole {_FORMATS[dtype].name} records of {size} bytes")
    return raw.reshape(-1, size)


def _codes(records: np.ndarray, dtype: DType) -> np.ndarray:
    """The records' codes as int16, one row a record."""
    packed = records[:, _SCALE_BYTES:]
    if dtype is DType.INT8_BLOCK64:
        return packed.view(np.int8).astype(np.int16)
    codes = np.empty((records.shape[0], VALUES_PER_RECORD), dtype=np.int16)
    codes[:, 0::2] = (packed & 0x0F).astype(np.int16) - 8
    codes[:, 1::2] = (packed >> 4).astype(np.int16) - 8
    return codes


def _scales(records: np.ndarray) -> np.ndarray:
    scales: np.ndarray = np.ascontiguousarray(records[:, :_SCALE_BYTES]).view(_F32).reshape(-1)
    return scales


def decode_records(records: bytes | memoryview | np.ndarray, dtype: DType) -> np.ndarray:
    """The float32 values of whole records (64 a record, padding included)."""
    rows = _as_records(records, dtype)
    values: np.ndarray = _codes(rows, dtype).astype(_F32) * _scales(rows)[:, None]
    return values.reshape(-1)


def first_bad_record(records: np.ndarray, dtype: DType) -> tuple[int, str] | None:
    """(record, why) of the first record no encoder makes: a scale that is not finite, an int8
    code of -128, an int4 nibble of 0 (code -8); None when every one is sound."""
    scales = _scales(records)
    bad_scale = ~np.isfinite(scales)
    bad_code = (_codes(records, dtype) < -_FORMATS[dtype].levels).any(axis=1)
    bad = np.flatnonzero(bad_scale | bad_code)
    if not bad.size:
        return None
    record = int(bad[0])
    if bad_scale[record]:
        return record, f"has a non-finite scale ({scales[record]})"
    low = "-128" if dtype is DType.INT8_BLOCK64 else "-8 (nibble 0)"
    return record, f"holds the code {low}, outside -{_FORMATS[dtype].levels}..{_FORMATS[dtype].levels}"


# --- records laid out in chunks ---------------------------------------------------------------


def _per_chunk(dtype: DType, chunk_words: int) -> int:
    fits = chunk_words * WORD_BYTES // _FORMATS[dtype].record_bytes
    if fits < 1:
        raise ValueError(
            f"a chunk of {chunk_words * WORD_BYTES} bytes cannot hold one {_FORMATS[dtype].name} record "
            f"({_FORMATS[dtype].record_bytes} bytes)"
        )
    return fits


def words_for(values: int, dtype: DType, chunk_words: int) -> int:
    """The words of a payload of `values` values laid out in chunks of `chunk_words` (what a block
    key's component sizes, counted in values, come to on the wire)."""
    per_chunk = _per_chunk(dtype, chunk_words)
    full, left = divmod(records_for(values), per_chunk)
    return full * chunk_words + left * _FORMATS[dtype].record_bytes // WORD_BYTES


def pack(records: np.ndarray, dtype: DType, chunk_words: int) -> np.ndarray:
    """The words (little-endian uint32) that carry `records` in chunks of `chunk_words`: each chunk
    starts with as many whole records as fit, the rest of it zero; the last chunk holds the
    records left, without padding."""
    size = _FORMATS[dtype].record_bytes
    per_chunk = _per_chunk(dtype, chunk_words)
    chunk_bytes = chunk_words * WORD_BYTES
    full, left = divmod(records.shape[0], per_chunk)
    out = np.zeros(full * chunk_bytes + left * size, dtype=_U8)
    flat = records.reshape(-1)
    if full:
        out[: full * chunk_bytes].reshape(full, chunk_bytes)[:, : per_chunk * size] = flat[
            : full * per_chunk * size
        ].reshape(full, per_chunk * size)
    out[full * chunk_bytes :] = flat[full * per_chunk * size :]
    return out.view(_WORD)


def unpack(words: bytes | memoryview | np.ndarray, dtype: DType, chunk_words: int) -> np.ndarray:
    """The records (shape (records, record bytes)) that `pack` laid out in `words`."""
    raw = (
        np.frombuffer(words, dtype=_U8) if not isinstance(words, np.ndarray) else words.reshape(-1).view(_U8)
    )
    size = _FORMATS[dtype].record_bytes
    per_chunk = _per_chunk(dtype, chunk_words)
    chunk_bytes = chunk_words * WORD_BYTES
    full = raw.size // chunk_bytes
    whole = raw[: full * chunk_bytes].reshape(full, chunk_bytes)[:, : per_chunk * size].reshape(-1, size)
    return np.concatenate([whole, _as_records(raw[full * chunk_bytes :], dtype)])


def encode_words(values: np.ndarray, dtype: DType, chunk_words: int) -> np.ndarray:
    """`values` as the words of a payload: encoded, then laid out in chunks."""
    return pack(encode_records(values, dtype), dtype, chunk_words)


def decode_words(
    words: bytes | memoryview | np.ndarray, dtype: DType, chunk_words: int, size: int
) -> np.ndarray:
    """The first `size` float32 values of a payload's words."""
    return decode_records(unpack(words, dtype, chunk_words), dtype)[:size]


# --- the coordinator's reduction of one chunk --------------------------------------------------


def reduce_records(
    contributions: Sequence[bytes | memoryview],
    dtype: DType,
    *,
    divide: bool,
    count: int | None = None,
) -> bytearray:
    """The SUM (or with `divide` the mean over `count`, default one per contribution) of one
    chunk's contributions given in worker-id order, as one chunk of the same layout: the records
    at its start decoded, summed in float64 in that order, divided, rounded to float32 and encoded
    once; the words after the last whole record zero. Raises BadRecord naming the first unsound
    record (contributions in order), QuantizedOverflow when a value of the result is beyond
    float32."""
    fmt = _FORMATS[dtype]
    nbytes = len(contributions[0])
    records = nbytes // fmt.record_bytes
    rows = [
        np.frombuffer(c, dtype=_U8)[: records * fmt.record_bytes].reshape(records, fmt.record_bytes)
        for c in contributions
    ]
    for position, row in enumerate(rows):
        bad = first_bad_record(row, dtype)
        if bad is not None:
            record, why = bad
            raise BadRecord(position, record, record * fmt.record_bytes // WORD_BYTES, why)
    count = len(contributions) if count is None else count
    out = bytearray(nbytes)
    result = np.frombuffer(out, dtype=_U8)[: records * fmt.record_bytes].reshape(records, fmt.record_bytes)
    for start in range(0, records, _RECORDS_AT_ONCE):
        stop = min(start + _RECORDS_AT_ONCE, records)
        acc = decode_records(rows[0][start:stop], dtype).astype(np.float64)
        for row in rows[1:]:
            acc += decode_records(row[start:stop], dtype)
        if divide:
            acc /= count
        with np.errstate(over="ignore"):
            rounded = acc.astype(_F32)
        finite = np.isfinite(rounded)
        if not finite.all():
            record = start + int(np.flatnonzero(~finite)[0]) // VALUES_PER_RECORD
            raise QuantizedOverflow(record, record * fmt.record_bytes // WORD_BYTES)
        result[start:stop] = encode_records(rounded, dtype)
    return out
