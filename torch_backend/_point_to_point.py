"""The point-to-point operations of the process group: send, recv, recv from any source (and so
torch's isend, irecv and batch_isend_irecv).

Messages between two ranks (`WorkerClient.send_to`, `receive_from`; docs/PROTOCOL.md
"Point-to-point"), not operations of the group: only two ranks take part, so they take no
sequence number and never wait for the group's queue (a rank may send while its collectives are
under way). Their Work is a `_work.PeerWork`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ._arguments import single_tensor
from ._group_core import GroupCore
from ._tensor_bytes import bytes_of, host_bytes, nbytes_of, write_bytes_into
from ._work import PeerWork


class PointToPoint(GroupCore):
    """send, recv and recv_anysource, on `GroupCore`'s client and staging."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """`isend`/`send`: this rank's bytes of the tensor to rank `dstRank` (the Work completes
        once they are delivered: in its shared-memory ring, or written to its stream by the
        coordinator). A device tensor is copied to the host first, here: the send starts now."""
        tensor = single_tensor("send", tensors)
        name = f"rank {self.rank()}: gradserver send to rank {dstRank} (tag {tag})"
        staging = self._staging("send", [tensor])
        host = staging.read(tensor)
        with staging.running():
            staging.copy_in()
        staging.release()
        operation = self._client.send_to(dstRank, bytes_of(host), tag=tag)
        # The host copy is read until the message is delivered: the Work keeps it.
        return PeerWork(
            name, operation, [tensor], self._timeout_s, self._operations.completions, staging, keep=host
        )

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """`irecv`/`recv` from rank `srcRank`: the next message with `tag` from it fills the tensor."""
        return self._receive(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """`recv` with `src=None`: the next message with `tag` from any rank (`_source_rank()`)."""
        return self._receive(tensors, None, tag)

    def _receive(self, tensors: list[torch.Tensor], source: int | None, tag: int) -> dist.Work:
        tensor = single_tensor("recv", tensors)
        who = "any rank" if source is None else f"rank {source}"
        name = f"rank {self.rank()}: gradserver recv from {who} (tag {tag})"
        staging = self._staging("recv", [tensor])
        host = staging.write(tensor)
        into = host_bytes(host)
        buffer = np.empty(nbytes_of(host), np.uint8) if into is None else None
        operation = self._client.receive_from(source, tag=tag, into=into if buffer is None else buffer)

        def write_back() -> None:
            if buffer is not None:
                write_bytes_into([host], buffer, what=name)
            with staging.running():
                staging.copy_out()
            staging.release()

        return PeerWork(
            name, operation, [tensor], self._timeout_s, self._operations.completions, staging, write_back
        )
