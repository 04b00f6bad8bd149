"""Partitioned coordinators: the partition map and the rule that assigns every chunk to one
partition.

K coordinator processes (partitions) share the reduction work of one job. Every partition is
started with the same map (the address of every partition, in partition order) and its own
index; workers get the map from partition 0 at Join. Chunk c of a key belongs to partition (c +
h(key)) % K, where h is a stable hash of the key's identity (its kind and index, never its step
or Python's salted `hash()`), so the chunks of one key go round the partitions and small
one-chunk keys spread across them. Both sides use this module: a partition expects, averages and
answers only its chunks; a worker sends each chunk to its owner and assembles the average from
every partition. Chunks are the ones a single coordinator would use, so each partition averages
exactly what it would: the averages are bit-identical.
"""

from __future__ import annotations

import dataclasses
import zlib

from ._pb import gradient_server_pb2 as pb
from .config import parse_address
from .errors import InvalidArgumentError
from .messages import TensorKey
from .rpc import SERVICE_NAME

NOTIFY_METHOD = f"/{SERVICE_NAME}/NotifyPartition"


def key_hash(key: TensorKey) -> int:
    """A hash of the key's identity (kind and index) that every process computes alike."""
    return zlib.crc32(f"{key.kind.value}:{key.index}".encode())


@dataclasses.dataclass(frozen=True)
class PartitionMap:
    """Every partition's address in partition order; `addresses[i]` is how workers and peers
    reach partition i."""

    addresses: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.addresses:
            raise InvalidArgumentError("the partition map needs at least one address")
        for i, address in enumerate(self.addresses):
            parse_address(address, what=f"partition map entry {i}")
        if len(set(self.addresses)) != len(self.addresses):
            raise InvalidArgumentError(
                f"the partition map lists an address twice: {','.join(self.addresses)}"
            )

    @classmethod
    def parse(cls, text: str) -> PartitionMap:
        """'HOST:PORT,HOST:PORT,...' (the --partition-map flag)."""
        return cls(tuple(part.strip() for part in text.split(",") if part.strip()))

    @property
    def count(self) -> int:
        return len(self.addresses)

    def describe(self, index: int) -> str:
        """'partition 1 (10.0.0.2:50052)': how errors name a partition."""
        return f"partition {index} ({self.addresses[index]})"

    def owner(self, key: TensorKey, chunk_index: int) -> int:
        """The partition that averages chunk `chunk_index` of `key`."""
        return (chunk_index + key_hash(key)) % self.count

    def owned_chunks(self, key: TensorKey, num_chunks: int, partition: int) -> int:
        """How many of the key's `num_chunks` chunks partition `partition` owns."""
        first = (partition - key_hash(key)) % self.count  # the first chunk index this partition owns
        return 0 if first >= num_chunks else (num_chunks - 1 - first) // self.count + 1


@dataclasses.dataclass(frozen=True)
class PartitionNotice:
    """Partition `from_partition` failed `step` (or lost a worker: `worker_lost`); see NotifyPartition."""

    from_partition: int
    partition_count: int
    step: int
    code: int
    message: str
    culprit_worker_id: int | None = None
    worker_lost: bool = False


def encode_notice(notice: PartitionNotice) -> bytes:
    msg = pb.PartitionNotice(
        from_partition=notice.from_partition,
        partition_count=notice.partition_count,
        step=notice.step,
        code=notice.code,
        message=notice.message,
        worker_lost=notice.worker_lost,
    )
    if notice.culprit_worker_id is not None:
        msg.culprit_worker_id = notice.culprit_worker_id
    return msg.SerializeToString()


def decode_notice(raw: bytes) -> PartitionNotice:
    msg = pb.PartitionNotice()
    try:
        msg.ParseFromString(raw)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError or others on garbage
        raise InvalidArgumentError(f"PartitionNotice: cannot parse {len(raw)} bytes: {exc}") from None
    culprit = msg.culprit_worker_id if msg.HasField("culprit_worker_id") else None
    return PartitionNotice(
        msg.from_partition, msg.partition_count, msg.step, msg.code, msg.message, culprit, msg.worker_lost
    )
