"""The rules of each collective, in one place: what a key may carry, what its contributions must
look like, how long each rank's result is, how it is answered, and what a host group does with it.

Pure functions of `gradserver.common.messages` types, no protobuf and no I/O: the codec applies
the rules that one message can be judged by, the client checks a contribution before it is
sent, and the coordinator's reduction table and the workers' links ask how a key is placed and
answered (docs/PROTOCOL.md, "Native collectives" and "Host groups"). The kinds:

| kind | dtype | result of rank r, for S elements sent by each |
| --- | --- | --- |
| REDUCE | a float or quantized wire dtype | the S-element SUM or AVG |
| ALL_GATHER | BYTES | every rank's S bytes in rank order (N·S) |
| BROADCAST | BYTES | the root's S bytes (non-root ranks send one header-only chunk) |
| REDUCE_SCATTER | a float wire dtype | rank r's part of the SUM or AVG (S/N, or split_bytes[r] / 4) |
| ALL_TO_ALL | BYTES | what every rank sent r, in rank order (only known once all have sent) |

Problems are returned as text without a subject (no worker, step or key): each caller names
these its own way and raises the error its side of the wire raises.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from .messages import ALLOWED_DTYPES, BYTE_KINDS, QUANTIZED_DTYPES, CollectiveKind, DType, KeyKind, TensorKey

__all__ = [
    "BYTE_KINDS",
    "HANDED_KINDS",
    "MAX_HOST_GROUP",
    "all_to_all_result_length",
    "ascending_ids",
    "chunk_problem",
    "dtype_problem",
    "handed_on_hosts",
    "header_only",
    "key_problem",
    "moves_bytes",
    "needs_every_rank",
    "partial_sum_problem",
    "quantized_problem",
    "quantized_sum_exact",
    "result_in_pieces",
    "result_length",
    "scatter_parts",
    "served_by_partitions",
    "shape_problem",
    "summed_on_hosts",
]

# The most workers one host group (and so one partial sum) may cover.
MAX_HOST_GROUP = 1024
# The kinds whose result is the same for every rank, so a host group gets it once.
HANDED_KINDS = frozenset({CollectiveKind.REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.BROADCAST})
# The kinds that carry a root, and those that carry split_bytes (ALL_TO_ALL always has them).
_ROOTED_KINDS = frozenset({CollectiveKind.BROADCAST})
_SPLIT_KINDS = frozenset({CollectiveKind.ALL_TO_ALL, CollectiveKind.REDUCE_SCATTER})


# --- what a key is --------------------------------------------------------------------------


def moves_bytes(key: TensorKey) -> bool:
    """Whether `key` moves raw bytes unreduced (ALL_GATHER, BROADCAST, ALL_TO_ALL): its chunks
    carry DType.BYTES and only it."""
    return key.kind is KeyKind.COLLECTIVE and key.collective_kind in BYTE_KINDS


def _native(key: TensorKey) -> bool:
    """A collective other than REDUCE: one whose result differs from an average of chunks."""
    return key.kind is KeyKind.COLLECTIVE and key.collective_kind is not CollectiveKind.REDUCE


def result_in_pieces(key: TensorKey) -> bool:
    """Whether `key`'s result arrives as pieces at any offsets (every collective kind but
    REDUCE), counted in elements instead of chunks."""
    return _native(key)


def needs_every_rank(key: TensorKey) -> bool:
    """Whether `key` fails when one of its ranks is lost (every collective kind but REDUCE),
    instead of completing without it."""
    return _native(key)


def served_by_partitions(key: TensorKey) -> bool:
    """Whether partitioned coordinators can serve `key`, each averaging its own chunks: every
    key but the collective kinds other than REDUCE, which need the whole contribution in one
    place."""
    return not _native(key)


def header_only(key: TensorKey, worker_id: int) -> bool:
    """A BROADCAST's non-root ranks send one chunk with the root's size and no payload."""
    return (
        key.kind is KeyKind.COLLECTIVE
        and key.collective_kind is CollectiveKind.BROADCAST
        and worker_id != key.root
    )


# --- what one message may carry ---------------------------------------------------------------


def key_problem(kind: CollectiveKind, root: int, split_bytes: Sequence[int], world: int = 0) -> str | None:
    """What is wrong with a collective key on its own: a root or split_bytes where `kind` has
    none, uneven REDUCE_SCATTER parts that are not float32 bytes, and (when the job's worker
    count `world` is known, else 0) a root or split_bytes that do not fit the world."""
    splits = list(split_bytes)
    if root and kind not in _ROOTED_KINDS:
        return f"root {root} is only for BROADCAST, not {kind.name}"
    if splits and kind not in _SPLIT_KINDS:
        return f"split_bytes are only for ALL_TO_ALL and REDUCE_SCATTER, not {kind.name}"
    if kind is CollectiveKind.REDUCE_SCATTER and any(b % 4 for b in splits):
        return f"REDUCE_SCATTER split_bytes {splits} must be float32 bytes (multiples of 4)"
    if world and kind is CollectiveKind.BROADCAST and root >= world:
        return f"BROADCAST root {root} is out of range for {world} workers"
    if world and splits and len(splits) != world:
        return f"{kind.name} has {len(splits)} split_bytes, one per worker needs {world}"
    if world and kind is CollectiveKind.ALL_TO_ALL and not splits:
        return f"ALL_TO_ALL has 0 split_bytes, one per worker needs {world}"
    return None


def dtype_problem(key: TensorKey | None, dtype: DType) -> str | None:
    """What is wrong with a chunk of `key` (None: a dtype outside any key, such as a joiner's
    wire dtype) in `dtype`: BYTES belongs to the byte-moving kinds and only to them, every
    reduction takes a float wire dtype."""
    if key is not None and moves_bytes(key):
        if dtype is not DType.BYTES:
            return f"{key.collective_kind.name} moves raw bytes: dtype must be BYTES, got {dtype.name}"
        return None
    if dtype is DType.BYTES:
        return "dtype BYTES is never reduced; only ALL_GATHER, BROADCAST and ALL_TO_ALL carry it"
    if dtype not in ALLOWED_DTYPES:
        allowed = ", ".join(d.name for d in sorted(ALLOWED_DTYPES))
        state = "missing" if dtype is DType.UNSPECIFIED else f"{dtype.name} is reserved"
        return f"dtype {state}; allowed: {allowed}"
    if dtype in QUANTIZED_DTYPES and key is not None and not quantized_sum_exact(key):
        return quantized_problem(key, dtype)
    return None


def quantized_sum_exact(key: TensorKey) -> bool:
    """Whether a quantized dtype's sum of `key` is one rounding of the whole sum: where the
    coordinator sums every contribution's records itself (REDUCE and the training keys), not a
    REDUCE_SCATTER (its parts are cut at float32 elements, not at records)."""
    return key.kind is not KeyKind.COLLECTIVE or key.collective_kind is CollectiveKind.REDUCE


def quantized_problem(key: TensorKey, dtype: DType) -> str:
    """Why `key` cannot carry the quantized `dtype`."""
    return (
        f"{key.describe()} cannot carry {dtype.name}: quantized records are summed by the "
        "coordinator only (REDUCE and the training keys), send it as a float dtype"
    )


def chunk_problem(key: TensorKey, worker_id: int, total: int, offset: int, length: int) -> str | None:
    """What one chunk of a collective (`length` payload bytes at element `offset` of a
    contribution of `total`) must satisfy on its own."""
    if key.kind is not KeyKind.COLLECTIVE:
        return None
    if header_only(key, worker_id) and (offset or length):
        return (
            f"worker {worker_id} is not the root ({key.root}) of a BROADCAST: it sends one "
            f"header-only chunk (offset 0, no payload), got {length} bytes at offset {offset}"
        )
    if key.collective_kind is CollectiveKind.ALL_TO_ALL and sum(key.split_bytes) != total:
        return (
            f"ALL_TO_ALL split_bytes {list(key.split_bytes)} sum to {sum(key.split_bytes)}, "
            f"but the contribution declares {total} bytes"
        )
    return None


# --- shapes and result lengths ------------------------------------------------------------------


def shape_problem(key: TensorKey, size: int, world: int) -> str | None:
    """What makes a contribution of `size` elements (bytes for the byte-moving kinds) to `key`
    impossible among `world` workers: uneven REDUCE_SCATTER parts that do not cover it, even
    ones it does not divide into, a BROADCAST root outside the world, ALL_TO_ALL split_bytes
    that are not one per worker summing to it."""
    if key.kind is not KeyKind.COLLECTIVE:
        return None
    kind, splits = key.collective_kind, key.split_bytes
    if kind is CollectiveKind.REDUCE_SCATTER and splits:
        if len(splits) != world or sum(splits) != 4 * size:
            return (
                f"split_bytes {list(splits)} must hold one entry per worker ({world}) and "
                f"sum to the {4 * size} float32 bytes sent"
            )
    elif kind is CollectiveKind.REDUCE_SCATTER and size % world:
        return f"{size} elements do not split into {world} equal parts, one per worker"
    elif kind is CollectiveKind.BROADCAST and key.root >= world:
        return f"root {key.root} is out of range for {world} workers"
    elif kind is CollectiveKind.ALL_TO_ALL and (len(splits) != world or sum(splits) != size):
        return (
            f"split_bytes {list(splits)} must hold one entry per worker ({world}) and "
            f"sum to the {size} bytes sent"
        )
    return None


def scatter_parts(key: TensorKey, size: int, world: int) -> tuple[int, ...]:
    """The elements of each rank's part of a REDUCE_SCATTER of `size` elements, in rank order:
    the key's split_bytes as float32 elements, else `world` equal parts (the shape checked by
    `shape_problem`)."""
    if key.split_bytes:
        return tuple(b // 4 for b in key.split_bytes)
    return (size // world,) * world


def result_length(key: TensorKey, size: int, world: int, rank: int) -> int | None:
    """How many elements (bytes for the byte-moving kinds) rank `rank`'s result of `key` holds
    when each rank sends `size` among `world` workers (a shape `shape_problem` accepts); None
    for an ALL_TO_ALL, whose length depends on what the others send
    (`all_to_all_result_length`)."""
    if key.kind is not KeyKind.COLLECTIVE:
        return size
    kind = key.collective_kind
    if kind is CollectiveKind.REDUCE_SCATTER:
        return key.split_bytes[rank] // 4 if key.split_bytes else size // world
    if kind is CollectiveKind.ALL_GATHER:
        return size * world
    if kind is CollectiveKind.ALL_TO_ALL:
        return None
    return size


def all_to_all_result_length(split_bytes_by_rank: Sequence[Sequence[int]], rank: int) -> int:
    """The bytes rank `rank` receives from an ALL_TO_ALL, given every rank's split_bytes in rank
    order: what each of them sends it."""
    return sum(splits[rank] for splits in split_bytes_by_rank)


# --- host groups ----------------------------------------------------------------------------------


def summed_on_hosts(key: TensorKey) -> bool:
    """Whether a host group sums `key`'s contributions before they cross its link: every
    reduction but whole-model keys (whose sample stats are per worker): block and non-block
    gradients, REDUCE and REDUCE_SCATTER collectives."""
    if key.kind is KeyKind.WHOLE_MODEL:
        return False
    return key.kind is not KeyKind.COLLECTIVE or key.collective_kind not in BYTE_KINDS


def handed_on_hosts(key: TensorKey) -> bool:
    """Whether a host group gets `key`'s result once, through one of its members, who hands it to
    the others on their host: what is the same for every rank (a REDUCE's or a gradient's
    average, an ALL_GATHER's or a BROADCAST's bytes), unlike a REDUCE_SCATTER's or an
    ALL_TO_ALL's parts."""
    if key.kind is KeyKind.WHOLE_MODEL:
        return False
    return key.kind is not KeyKind.COLLECTIVE or key.collective_kind in HANDED_KINDS


def ascending_ids(ids: Sequence[int], world: int) -> bool:
    """Whether `ids` (not empty) are distinct worker ids below `world`, in increasing order: how a
    host group, a host's peers and a partial sum's workers are listed."""
    return all(a < b for a, b in itertools.pairwise(ids)) and ids[-1] < world


def partial_sum_problem(
    key: TensorKey, sender: int, covers: Sequence[int], world: int, dtype: DType = DType.FLOAT32
) -> str | None:
    """What is wrong with a partial sum from `sender` covering the workers `covers` (not empty) of
    a world of `world` workers (0: unknown), judged alone: whether they are the sender's host
    group is the coordinator's to judge. A quantized partial sum never is: its records would be
    requantized before the coordinator's sum."""
    if len(covers) > MAX_HOST_GROUP:
        return f"a partial sum covers {len(covers)} workers, above the limit of {MAX_HOST_GROUP}"
    if not ascending_ids(covers, world or 2**32) or sender not in covers:
        return f"covers {list(covers)} must be distinct worker ids in increasing order, the sender among them"
    if not summed_on_hosts(key):
        return f"{key.describe()} is not summed on hosts: only block, non-block and REDUCE keys are"
    if dtype in QUANTIZED_DTYPES:
        return (
            f"{key.describe()} in {dtype.name} is not summed on hosts: a partial sum of quantized "
            "records would be requantized; the coordinator sums them"
        )
    return None
