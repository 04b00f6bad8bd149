"""A `WorkerClient` that joins as a given rank and runs generic collective keys.

Torch-free: it moves float32 arrays. The process group in `backend` turns tensors into them.
Each collective is one `CollectiveKey` whose step is the group's operation sequence number, so
the coordinator reduces one group's operations one after another, exactly as it reduces steps.
Only the client's public API is used: `send` and `receive` with collective keys.
"""

from __future__ import annotations

import socket

import numpy as np

from gradserver.common.messages import KeyKind, ReduceOp, TensorKey
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts
from gradserver.worker import WorkerClient


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
    ) -> CollectiveClient:
        """Like `WorkerClient.connect`, but asks the coordinator for worker id `rank`: a rank out
        of range or already taken is refused, naming it."""
        return cls.connect(
            address,
            node_id=node_id or f"{socket.gethostname()}/rank{rank}",
            device_type=backend,
            timeout=timeout,
            tls=tls,
            auth_token=auth_token,
            server_name=server_name,
            rank=rank,
        )

    def send_collective(
        self,
        sequence: int,
        group: int,
        array: np.ndarray,
        op: ReduceOp,
        *,
        into: np.ndarray | None = None,
        propagate_non_finite: bool = False,
    ) -> None:
        """Contributes `array` (1-D float32) to operation `sequence` of `group`; with `into`
        (it may be `array`) the result is written there (see `send_block_gradient`). With
        `propagate_non_finite` a NaN or Inf (or a float32 overflow) is a result, not an error."""
        key = TensorKey.collective(sequence, group, op, propagate_non_finite=propagate_non_finite)
        self.send(key, np.ascontiguousarray(array, dtype="<f4").reshape(-1), into=into)

    def receive_collective(self, timeout: float | None = None) -> np.ndarray:
        """The result of the oldest collective this rank sent and has not received yet."""
        return self.receive(KeyKind.COLLECTIVE, timeout).gradients
