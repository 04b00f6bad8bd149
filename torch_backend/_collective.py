"""A `WorkerClient` that joins as a given rank and runs generic collective keys.

Torch-free: it moves float32 arrays (REDUCE, REDUCE_SCATTER) and raw bytes (ALL_GATHER,
BROADCAST, ALL_TO_ALL). The process group in `backend` turns tensors into them. Each collective is
one `CollectiveKey` whose step is the group's operation sequence number, so the coordinator runs
one group's operations one after another, exactly as it reduces steps. Only the client's public
API is used: `send` and `receive` with collective keys.
"""

from __future__ import annotations

import socket

import numpy as np

from gradserver.common.errors import InvalidArgumentError
from gradserver.common.messages import (
    BYTE_KINDS,
    QUANTIZED_DTYPES,
    CollectiveKind,
    KeyKind,
    ReduceOp,
    TensorKey,
)
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts
from gradserver.common.wire_dtype import parse_wire_dtype
from gradserver.worker import WorkerClient

_F32 = np.dtype("<f4")


class CollectiveClient(WorkerClient):
    """One rank of one process group, joined with its rank as worker id."""

    @classmethod
    def connect_as_rank(
        cls,
        address: str,
        rank: int,
        *,
        node_id: str = "",
        backend: str = "torch",
        timeout: float | Timeouts | None = None,
        tls: TlsFiles | None = None,
        auth_token: str = "",
        server_name: str = "",
        wire_dtype: str = "float32",
    ) -> CollectiveClient:
        """Like `WorkerClient.connect`, but asks the coordinator for worker id `rank`: a rank out
        of range or already taken is refused, naming it. `wire_dtype`: what float32 reductions
        travel as, except the keys sent `exact`: float32, bfloat16 or float16 (the group's
        REDUCE_SCATTERs and NaN-propagating reductions cannot travel as int8 or int4 records;
        a key may still be sent quantized with `wire=`)."""
        try:
            quantized = parse_wire_dtype(wire_dtype) in QUANTIZED_DTYPES
        except ValueError:
            quantized = False  # `connect` refuses it, naming the choices
        if quantized:
            raise InvalidArgumentError(
                f"wire dtype {wire_dtype} is not for a process group's collectives (their "
                "REDUCE_SCATTERs and NaN-propagating reductions need a float wire): use float32, "
                "bfloat16 or float16; DiLoCo's quantize= sends its own payloads quantized"
            )
        return cls.connect(
            address,
            node_id=node_id or f"{socket.gethostname()}/rank{rank}",
            device_type=backend,
            timeout=timeout,
            tls=tls,
            auth_token=auth_token,
            server_name=server_name,
            rank=rank,
            wire_dtype=wire_dtype,
            peer_memory=True,  # send/recv between ranks of one host through shared memory
        )

    def send_collective(
        self,
        sequence: int,
        group: int,
        array: np.ndarray,
        op: ReduceOp = ReduceOp.SUM,
        *,
        kind: CollectiveKind = CollectiveKind.REDUCE,
        root: int = 0,
        split_bytes: tuple[int, ...] = (),
        into: np.ndarray | None = None,
        propagate_non_finite: bool = False,
        exact: bool = False,
        wire: str | None = None,
    ) -> None:
        """Contributes `array` to operation `sequence` of `group`: 1-D float32 for REDUCE and
        REDUCE_SCATTER, raw bytes (uint8) for ALL_GATHER, BROADCAST (`root`'s bytes; the others'
        only say how many) and ALL_TO_ALL (`split_bytes[j]` of them for rank j). With `into` (it
        may be `array` for a REDUCE) the result is written there (see `send_block_gradient`).
        With `propagate_non_finite` a NaN or Inf (or a float32 overflow) is a result, not an
        error. `exact`: float32 on a 16-bit wire too; `wire`: this key's wire dtype by name, e.g.
        "int8" (a REDUCE summed by the coordinator as quantized records; `WorkerClient.send`)."""
        key = _key(sequence, group, op, kind, root, split_bytes, propagate_non_finite)
        self.send(key, _payload(array, kind), into=into, exact=exact, wire=wire)

    def run_collective(
        self,
        sequence: int,
        group: int,
        array: np.ndarray,
        op: ReduceOp = ReduceOp.SUM,
        *,
        kind: CollectiveKind = CollectiveKind.REDUCE,
        root: int = 0,
        split_bytes: tuple[int, ...] = (),
        into: np.ndarray | None = None,
        propagate_non_finite: bool = False,
        timeout: float | None = None,
        exact: bool = False,
        wire: str | None = None,
    ) -> np.ndarray:
        """`send_collective` and its receive in one call (`WorkerClient.collective`): through the
        coordinator's collective lane when every rank is on its host, else over gRPC."""
        key = _key(sequence, group, op, kind, root, split_bytes, propagate_non_finite)
        return self.collective(key, _payload(array, kind), into=into, timeout=timeout, exact=exact, wire=wire)

    def receive_collective(self, timeout: float | None = None) -> np.ndarray:
        """The result of the oldest collective this rank sent and has not received yet: float32
        for REDUCE and REDUCE_SCATTER (this rank's part), uint8 for the byte-moving kinds."""
        return self.receive(KeyKind.COLLECTIVE, timeout).gradients


def _key(
    sequence: int,
    group: int,
    op: ReduceOp,
    kind: CollectiveKind,
    root: int,
    split_bytes: tuple[int, ...],
    propagate_non_finite: bool,
) -> TensorKey:
    return TensorKey.collective(
        sequence,
        group,
        op,
        propagate_non_finite=propagate_non_finite,
        kind=kind,
        root=root,
        split_bytes=split_bytes,
    )


def _payload(array: np.ndarray, kind: CollectiveKind) -> np.ndarray:
    """A contribution as the client takes it: 1-D float32 for the reducing kinds, raw bytes for
    the others (a view when `array` already is that)."""
    if kind in BYTE_KINDS:
        if array.dtype == np.uint8 and array.ndim == 1:
            return array
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if array.dtype == _F32 and array.ndim == 1:
        return array
    return np.ascontiguousarray(array, dtype=_F32).reshape(-1)
