"""A `WorkerClient` that joins as a given rank and runs generic collective keys.

Torch-free: it moves float32 arrays. The process group in `backend` turns tensors into them.
Each collective is one `CollectiveKey` whose step is the group's operation sequence number, so
the coordinator reduces one group's operations one after another, exactly as it reduces steps.
"""

from __future__ import annotations

import logging
import socket

import grpc
import numpy as np

from gradserver.common import codec
from gradserver.common.config import parse_address
from gradserver.common.errors import error_from_status
from gradserver.common.messages import JoinRequestIn, KeyKind, ReduceOp, TensorKey
from gradserver.common.rpc import JOIN_METHOD, worker_channel_options
from gradserver.common.security import TlsFiles, bearer_metadata
from gradserver.common.timeouts import Timeouts
from gradserver.worker.client import WorkerClient, _wait_until_reachable

log = logging.getLogger("gradserver.worker.torch")


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
        timeouts = Timeouts.of(timeout)
        parse_address(address, what="coordinator address")
        options: list[tuple[str, int | str]] = list(worker_channel_options())
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
            )
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        metadata = bearer_metadata(auth_token)
        try:
            _wait_until_reachable(channel, address, timeouts.connect, "")
            request = JoinRequestIn(
                node_id or f"{socket.gethostname()}/rank{rank}",
                0,
                backend,
                codec.PROTOCOL_VERSION,
                rank=rank,
            )
            try:
                raw = channel.unary_unary(JOIN_METHOD)(
                    codec.encode_join_request(request), timeout=timeouts.join, metadata=metadata
                )
            except grpc.RpcError as exc:
                raise error_from_status(exc.code(), exc.details() or "") from exc
            accepted = codec.decode_join_accepted(raw)
            log.info("joined %s as rank %d of %d", address, accepted.worker_id, accepted.total_workers)
            return cls(channel, accepted, timeouts, address, metadata)
        except BaseException:
            channel.close()
            raise

    def send_collective(self, sequence: int, group: int, array: np.ndarray, op: ReduceOp) -> None:
        """Contributes `array` (1-D float32) to operation `sequence` of `group`."""
        self._check_step(sequence)
        key = TensorKey.collective(sequence, group, op)
        self._send_tensor(key, np.ascontiguousarray(array, dtype="<f4").reshape(-1), ())

    def receive_collective(self, timeout: float | None = None) -> np.ndarray:
        """The result of the oldest collective this rank sent and has not received yet."""
        _, result = self._receive(KeyKind.COLLECTIVE, timeout)
        return result.array
