"""How a tensor is cut into chunks: the same element offsets on every worker.

A tensor of `total` elements travels as chunks of `chunk_elements` (the last one shorter). Every
worker cuts at the same offsets so the coordinator can reduce chunk i as soon as all workers sent
it, holding only chunks in flight, never whole tensors. A tensor of 0 elements is one empty chunk,
so it still completes like any other key.
"""

from __future__ import annotations

from collections.abc import Iterator

from .errors import InvalidArgumentError, ResourceExhaustedError


def payload_nbytes(data: bytes | memoryview | None) -> int:
    """The length in bytes of a chunk's payload (a memoryview's `len` counts its items)."""
    if data is None:
        return 0
    return data.nbytes if isinstance(data, memoryview) else len(data)


def chunk_count(total: int, chunk_elements: int) -> int:
    if chunk_elements <= 0:
        raise InvalidArgumentError(f"chunk size must be positive, got {chunk_elements} elements")
    return max(1, -(-total // chunk_elements))


def chunk_spans(total: int, chunk_elements: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of every chunk of a tensor of `total` elements, in order."""
    for index in range(chunk_count(total, chunk_elements)):
        offset = index * chunk_elements
        yield offset, min(chunk_elements, total - offset)


def expected_chunk_length(total: int, chunk_elements: int, offset: int, *, context: str) -> int:
    """Length a chunk at `offset` must have; raises naming `context` when the offset is not one
    of the tensor's chunk offsets."""
    if offset % chunk_elements != 0 or (offset >= total and not (offset == 0 and total == 0)):
        raise InvalidArgumentError(
            f"{context}: chunk offset {offset} is not a multiple of the chunk size "
            f"{chunk_elements} inside a tensor of {total} elements"
        )
    return min(chunk_elements, total - offset)


def check_chunk_length(total: int, chunk_elements: int, offset: int, got: int, *, context: str) -> None:
    """Raises unless a chunk at `offset` holds exactly the elements its span needs."""
    if got > chunk_elements:
        raise ResourceExhaustedError(
            f"{context}: chunk of {got} elements exceeds the chunk size of {chunk_elements}"
        )
    want = expected_chunk_length(total, chunk_elements, offset, context=context)
    if got != want:
        raise InvalidArgumentError(
            f"{context}: chunk at offset {offset} holds {got} elements, expected {want} "
            f"(tensor of {total} elements)"
        )
