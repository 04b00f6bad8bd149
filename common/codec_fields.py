"""What every wire message shares: tensor keys, dtypes, shared-memory references, sample stats,
the decoder's limits, and parsing that names what was malformed.

Part of the wire codec (`gradserver.common.codec` lists its modules); with `codec_join`,
`codec_worker` and `codec_server`, the only modules that touch the generated protobuf classes
(besides the partition notice and the gRPC edge). The rules each collective key must satisfy are
`collective_rules`'; this module applies the ones a key alone can be judged by.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from google.protobuf.message import DecodeError

from ._pb import gradient_server_pb2 as pb
from .collective_rules import dtype_problem, key_problem
from .components import NonBlockComponent
from .errors import InvalidArgumentError
from .messages import (
    CollectiveKind,
    DType,
    KeyKind,
    PeerPiece,
    ReduceOp,
    SampleStats,
    ShmRef,
    TensorKey,
)

MAX_NAME_LENGTH = 256


@dataclasses.dataclass(frozen=True)
class WireLimits:
    """Bounds a decoder enforces before it trusts any size in a message."""

    chunk_elements: int
    max_tensor_elements: int
    max_blocks: int = 65536
    # The job's worker count when the decoder knows it (0: unknown): a collective's root and
    # split_bytes are then checked against it here, else only by the reduction table.
    world_size: int = 0


# The payload field of a point-to-point message, either way (read from the descriptor so it cannot drift).
PEER_DATA_FIELD = pb.PeerMessage.DESCRIPTOR.fields_by_name["data"].number


# --- keys -------------------------------------------------------------------------------------


def key_to_pb(key: TensorKey) -> pb.TensorKey:
    if key.kind is KeyKind.BLOCK:
        return pb.TensorKey(step=key.step, block=pb.BlockKey(block_idx=key.index, num_blocks=key.num_blocks))
    if key.kind is KeyKind.NON_BLOCK:
        return pb.TensorKey(step=key.step, non_block=key.index)  # type: ignore[arg-type]
    if key.kind is KeyKind.COLLECTIVE:
        return pb.TensorKey(
            step=key.step,
            collective=pb.CollectiveKey(
                group=key.index,
                op=int(key.op),  # type: ignore[arg-type]
                propagate_non_finite=key.propagate_non_finite,
                kind=int(key.collective_kind),  # type: ignore[arg-type]
                root=key.root,
                split_bytes=key.split_bytes,
            ),
        )
    return pb.TensorKey(step=key.step, whole_model=pb.WholeModelKey())


def key_from_pb(msg: pb.TensorKey, *, who: str, limits: WireLimits | None) -> TensorKey:
    """The key `msg` names, checked alone (against `limits` when given); `who` sent it."""
    kind = msg.WhichOneof("kind")
    if kind == "block":
        idx, num = msg.block.block_idx, msg.block.num_blocks
        if num == 0 or idx >= num:
            raise InvalidArgumentError(
                f"{who}, step {msg.step}: block_idx {idx} is out of range for num_blocks {num}",
                step=msg.step,
            )
        if limits is not None and num > limits.max_blocks:
            raise InvalidArgumentError(
                f"{who}, step {msg.step}: num_blocks {num} exceeds the limit of {limits.max_blocks}",
                step=msg.step,
            )
        return TensorKey.block(msg.step, idx, num)
    if kind == "non_block":
        try:
            component = NonBlockComponent(msg.non_block)
        except ValueError:
            names = ", ".join(f"{c.name}={c.value}" for c in NonBlockComponent)
            raise InvalidArgumentError(
                f"{who}, step {msg.step}: unknown non-block component {msg.non_block} (known: {names})",
                step=msg.step,
            ) from None
        return TensorKey.non_block(msg.step, component)
    if kind == "whole_model":
        return TensorKey.whole_model(msg.step)
    if kind == "collective":
        try:
            op = ReduceOp(msg.collective.op)
        except ValueError:
            names = ", ".join(f"{o.name}={o.value}" for o in ReduceOp)
            raise InvalidArgumentError(
                f"{who}, operation {msg.step} of group {msg.collective.group}: unknown reduce op "
                f"{msg.collective.op} (known: {names})",
                step=msg.step,
            ) from None
        return _collective_from_pb(msg.step, msg.collective, op, who=who, limits=limits)
    raise InvalidArgumentError(f"{who}, step {msg.step}: key names no tensor kind", step=msg.step)


def _collective_from_pb(
    step: int, msg: pb.CollectiveKey, op: ReduceOp, *, who: str, limits: WireLimits | None
) -> TensorKey:
    """A collective key; refuses an unknown kind, a root or split_bytes where the kind has none,
    and (when the world size is known) a root or split_bytes that does not fit the world."""
    context = f"{who}, operation {step} of group {msg.group}"
    try:
        kind = CollectiveKind(msg.kind)
    except ValueError:
        names = ", ".join(f"{k.name}={k.value}" for k in CollectiveKind)
        raise InvalidArgumentError(
            f"{context}: unknown collective kind {msg.kind} (known: {names})", step=step
        ) from None
    splits = tuple(msg.split_bytes)
    problem = key_problem(kind, msg.root, splits, limits.world_size if limits is not None else 0)
    if problem is not None:
        raise InvalidArgumentError(f"{context}: {problem}", step=step)
    return TensorKey.collective(
        step,
        msg.group,
        op,
        propagate_non_finite=msg.propagate_non_finite,
        kind=kind,
        root=msg.root,
        split_bytes=splits,
    )


def dtype_from_pb(value: int, *, context: str, key: TensorKey | None = None) -> DType:
    """The dtype of a chunk of `key`: BYTES for the byte-moving collective kinds and only for
    them, a float wire dtype for every reduction."""
    try:
        dtype = DType(value)
    except ValueError:
        raise InvalidArgumentError(f"{context}: unknown dtype {value}") from None
    problem = dtype_problem(key, dtype)
    if problem is not None:
        raise InvalidArgumentError(f"{context}: {problem}")
    return dtype


def shm_to_pb(ref: ShmRef) -> pb.SharedMemoryRef:
    return pb.SharedMemoryRef(name=ref.name, offset=ref.offset, length=ref.length)


def shm_from_pb(msg: pb.SharedMemoryRef, *, context: str, allowed: tuple[str, ...]) -> ShmRef:
    """A shared-memory reference; only the arenas `allowed` may be named (bounds are checked
    against the mapped arena by whoever resolves it)."""
    if msg.name not in allowed:
        raise InvalidArgumentError(
            f"{context}: shared-memory payload names arena {msg.name[:MAX_NAME_LENGTH]!r}; only "
            f"{' or '.join(repr(a) for a in allowed)} is allowed here"
        )
    return ShmRef(msg.name, msg.offset, msg.length)


def stats_to_pb(stats: SampleStats) -> pb.SampleStats:
    return pb.SampleStats(loss=stats.loss, correct=stats.correct, total=stats.total)


def peer_header(piece: PeerPiece) -> bytes:
    """A PeerMessage without its data."""
    return pb.PeerMessage(
        peer=piece.peer,
        tag=piece.tag,
        sequence=piece.sequence,
        total_bytes=piece.total_bytes,
        offset=piece.offset,
    ).SerializeToString()


_M = TypeVar(
    "_M", pb.WorkerMessage, pb.GradientChunk, pb.PeerMessage, pb.JoinRequest, pb.JoinResponse, pb.LinkProbe
)


def parse(cls: type[_M], raw: bytes, what: str) -> _M:
    """`raw` as a `cls`; malformed bytes are an InvalidArgumentError naming `what`."""
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(f"malformed {what}: {exc}") from exc
