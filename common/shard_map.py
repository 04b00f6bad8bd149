"""Sharded coordinators: the shard map and the rule that assigns every chunk to one shard.

K coordinator processes (shards) share the reduction work of one job. Every shard is started
with the same map (the address of every shard, in shard order) and its own index; workers get
the map from shard 0 at Join. Chunk c of a key belongs to shard (c + h(key)) % K, where h is a
stable hash of the key's identity (its kind and index, never its step or Python's salted
`hash()`), so the chunks of one key go round the shards and small one-chunk keys spread across
them. Both sides use this module: a shard expects, averages and answers only its chunks; a worker
sends each chunk to its owner and assembles the average from every shard. Chunks are the
unsharded chunks, so each shard averages exactly what one coordinator would: the averages are
bit-identical.
"""

from __future__ import annotations

import dataclasses
import zlib

from ._pb import gradient_server_pb2 as pb
from .config import parse_address
from .errors import InvalidArgumentError
from .messages import TensorKey
from .rpc import SERVICE_NAME

NOTIFY_METHOD = f"/{SERVICE_NAME}/NotifyShard"


def key_hash(key: TensorKey) -> int:
    """A hash of the key's identity (kind and index) that every process computes alike."""
    return zlib.crc32(f"{key.kind.value}:{key.index}".encode())


@dataclasses.dataclass(frozen=True)
class ShardMap:
    """Every shard's address in shard order; `addresses[i]` is how workers and peers reach shard i."""

    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.addresses:
            raise InvalidArgumentError("the shard map needs at least one address")
        for i, address in enumerate(self.addresses):
            parse_address(address, what=f"shard map entry {i}")
        if len(set(self.addresses)) != len(self.addresses):
            raise InvalidArgumentError(f"the shard map lists an address twice: {','.join(self.addresses)}")

    @classmethod
    def parse(cls, text: str) -> ShardMap:
        """'HOST:PORT,HOST:PORT,...' (the --shard-map flag)."""
        return cls(tuple(part.strip() for part in text.split(",") if part.strip()))

    @property
    def count(self) -> int:
        return len(self.addresses)

    def describe(self, index: int) -> str:
        """'shard 1 (10.0.0.2:50052)': how errors name a shard."""
        return f"shard {index} ({self.addresses[index]})"

    def owner(self, key: TensorKey, chunk_index: int) -> int:
        """The shard that averages chunk `chunk_index` of `key`."""
        return (chunk_index + key_hash(key)) % self.count

    def owned_chunks(self, key: TensorKey, num_chunks: int, shard: int) -> int:
        """How many of the key's `num_chunks` chunks shard `shard` owns."""
        first = (shard - key_hash(key)) % self.count  # the first chunk index this shard owns
        return 0 if first >= num_chunks else (num_chunks - 1 - first) // self.count + 1


@dataclasses.dataclass(frozen=True)
class ShardNotice:
    """Shard `from_shard` failed `step` (or lost a worker: `worker_lost`); see NotifyShard."""

    from_shard: int
    shard_count: int
    step: int
    code: int
    message: str
    culprit_worker_id: int | None = None
    worker_lost: bool = False


def encode_notice(notice: ShardNotice) -> bytes:
    msg = pb.ShardNotice(
        from_shard=notice.from_shard,
        shard_count=notice.shard_count,
        step=notice.step,
        code=notice.code,
        message=notice.message,
        worker_lost=notice.worker_lost,
    )
    if notice.culprit_worker_id is not None:
        msg.culprit_worker_id = notice.culprit_worker_id
    return msg.SerializeToString()


def decode_notice(raw: bytes) -> ShardNotice:
    msg = pb.ShardNotice()
    try:
        msg.ParseFromString(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError or others on garbage
        raise InvalidArgumentError(f"ShardNotice: cannot parse {len(raw)} bytes: {exc}") from None
    culprit = msg.culprit_worker_id if msg.HasField("culprit_worker_id") else None
    return ShardNotice(
        msg.from_shard, msg.shard_count, msg.step, msg.code, msg.message, culprit, msg.worker_lost
    )
