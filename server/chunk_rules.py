"""Whether one chunk fits its key: the shape a native collective needs in this world, and
agreement with what the key's other contributors declared.

Pure checks for the reduction table, returning what is wrong (None: nothing). Either failure
fails the chunk's step, naming the sender: a chunk that disagrees with the others cannot be
averaged with them, and a collective whose shape does not fit the world cannot complete. A new
collective's rules of this kind go here (`native_problem` for the shape of its key in a world,
`identity_mismatch` for what every rank must declare alike); what a routed collective checks
across one rank's own chunks is its slot's (server/slots.py, `RoutedSlot`).
"""

from __future__ import annotations

from gradserver.common.errors import Status
from gradserver.common.messages import ChunkHeader, ChunkIn, CollectiveKind, KeyKind, TensorKey


def native_problem(chunk: ChunkIn, expected: frozenset[int], world_size: int) -> tuple[Status, str] | None:
    """What makes `chunk` of a native collective impossible in this world (code, message):
    its shape, or a step that does not expect every rank (`expected`)."""
    key, w, n = chunk.key, chunk.worker_id, world_size
    if key.kind is not KeyKind.COLLECTIVE or key.collective_kind is CollectiveKind.REDUCE:
        return None
    if key.collective_kind is CollectiveKind.BROADCAST and key.root >= n:
        return (
            Status.INVALID_ARGUMENT,
            f"worker {w} sent {key}, but the root {key.root} is not a rank of {n} workers",
        )
    if key.collective_kind is CollectiveKind.ALL_TO_ALL and len(key.split_bytes) != n:
        return Status.INVALID_ARGUMENT, (
            f"worker {w} sent {key} with {len(key.split_bytes)} split_bytes, one per rank of {n} "
            "workers is needed"
        )
    total = chunk.header.total_elements
    if key.collective_kind is CollectiveKind.REDUCE_SCATTER and key.split_bytes:
        if len(key.split_bytes) != n or sum(key.split_bytes) != 4 * total:
            return Status.INVALID_ARGUMENT, (
                f"worker {w} sent {key} of {total} elements with split_bytes "
                f"{list(key.split_bytes)}: one per rank of {n} workers, summing to {4 * total}, needed"
            )
    elif key.collective_kind is CollectiveKind.REDUCE_SCATTER and total % n:
        return Status.INVALID_ARGUMENT, (
            f"worker {w} sent {key} of {total} elements, which is not divisible by the {n} ranks"
        )
    if expected != frozenset(range(n)):
        absent = ", ".join(str(v) for v in range(n) if v not in expected)
        return (
            Status.ABORTED,
            f"{key} needs every rank, but worker(s) {absent} take no part in step {key.step}",
        )
    return None


def declares_alike(key: TensorKey, header: ChunkHeader, chunk: ChunkIn) -> bool:
    """Whether `chunk` declares everything `identity_mismatch` and `size_mismatch` compare as
    `key` and `header` do (the common case, checked without building any message)."""
    got = chunk.key
    return chunk.header == header and (
        got.num_blocks,
        got.op,
        got.propagate_non_finite,
        got.collective_kind,
        got.root,
    ) == (key.num_blocks, key.op, key.propagate_non_finite, key.collective_kind, key.root)


def identity_mismatch(key: TensorKey, header: ChunkHeader, chunk: ChunkIn, other: str) -> str | None:
    """What `chunk` declares unlike the key's first contributor (`other`, "worker 0's"), which
    declared `key` and `header`: the key's fields and the sizes of its components."""
    w, got = chunk.worker_id, chunk.header
    if chunk.key.num_blocks != key.num_blocks:
        return (
            f"worker {w} sent {chunk.key} with num_blocks {chunk.key.num_blocks}, but {other} says "
            f"{key.num_blocks}"
        )
    if chunk.key.collective_kind != key.collective_kind or chunk.key.root != key.root:
        return f"worker {w} sent {chunk.key}, but {other} is {key}"
    if chunk.key.op != key.op:
        return f"worker {w} sent {chunk.key}, but {other} is {key.op.name}"
    if chunk.key.propagate_non_finite != key.propagate_non_finite:
        return (
            f"worker {w} sent {chunk.key} with propagate_non_finite {chunk.key.propagate_non_finite}, "
            f"but {other} has {key.propagate_non_finite}"
        )
    if got.component_sizes != header.component_sizes:
        return (
            f"worker {w} sent {chunk.key} with component_sizes {list(got.component_sizes)}, "
            f"which differ from {other} {list(header.component_sizes)}"
        )
    return None


def size_mismatch(header: ChunkHeader, chunk: ChunkIn, other: str) -> str | None:
    """`chunk` declares another total or dtype than the key's first contributor (`other`)."""
    got = chunk.header
    if got.total_elements != header.total_elements or got.dtype != header.dtype:
        return (
            f"worker {chunk.worker_id} sent {chunk.key} as {got.total_elements} {got.dtype.name} elements, "
            f"but {other} has {header.total_elements} {header.dtype.name} elements"
        )
    return None
