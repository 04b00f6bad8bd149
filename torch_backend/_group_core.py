"""The state and calls every collective of a `ProcessGroupGradServer` is built on.

`GroupCore` is the base of the group's collective families (`_reduce_collectives`,
`_byte_collectives`, `_point_to_point`) and of the group itself (`backend`): the rank's
`CollectiveClient`, the group's timeout and NaN check, how device tensors go through the host
(`_staging`, `_devices`) and its Work engine (`_work.Operations`). Each collective declares its
tensors to a `Staging` at the call (read, written or both) and runs on their host counterparts:
the caller's own host tensors, or host buffers that device tensors are copied into before it runs
and out of after. On the coordinator each is one collective key of the group's coordinator,
whose step is the operation's sequence number; the one-key calls here are those the families
share.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from gradserver.common.messages import CollectiveKind, ReduceOp

from ._collective import CollectiveClient
from ._devices import DeviceTransfers
from ._staging import Staging
from ._work import SMALL_BYTES, Operations

# The `group` of every collective key this process group sends: its coordinator serves it alone.
DEFAULT_GROUP = 0


class GroupCore(dist.ProcessGroup):
    """What the group's collectives share: its client (joined with the group rank as worker id),
    timeout, NaN check, staging and Work engine, and the one-key calls to the coordinator."""

    def __init__(
        self,
        client: CollectiveClient,
        timeout_s: float | None,
        check_finite: bool,
        transfers: DeviceTransfers | None,
    ) -> None:
        # C++ reads the rank and size given here (the stubs only know the store overload).
        super().__init__(client.worker_id, client.total_workers)  # type: ignore[call-arg]
        self._client = client
        self._timeout_s = timeout_s
        # torch.distributed semantics unless asked: NaN/Inf pass through a collective as with gloo
        # (GradScaler relies on every rank seeing the Inf); with the check, they fail it, naming
        # the rank and the element.
        self._check_finite = check_finite
        # Which tensors go through the host and how (`_devices`, `_staging`).
        self._transfers = transfers if transfers is not None else DeviceTransfers()
        self._operations = Operations(client.worker_id)

    def _exchange(
        self,
        sequence: int,
        payload: np.ndarray,
        op: ReduceOp,
        *,
        kind: CollectiveKind = CollectiveKind.REDUCE,
        into: np.ndarray | None = None,
        split_bytes: tuple[int, ...] = (),
        exact: bool = False,
    ) -> np.ndarray:
        """One coordinator reduction of float32 `payload`: all of it (REDUCE) or this rank's
        part (REDUCE_SCATTER: equal parts, or `split_bytes` of float32 bytes per rank).
        `exact`: float32 on the wire whatever GRADSERVER_WIRE_DTYPE says (integer limbs)."""
        return self._client.run_collective(
            sequence,
            DEFAULT_GROUP,
            payload,
            op,
            kind=kind,
            into=into,
            split_bytes=split_bytes,
            propagate_non_finite=not self._check_finite,
            timeout=self._timeout_s,
            exact=exact,
        )

    def _gather_rows(self, sequence: int, mine: np.ndarray) -> np.ndarray:
        """Every rank's `mine` (uint8, one length on every rank) as rows, in rank order: one
        ALL_GATHER."""
        gathered = self._client.run_collective(
            sequence, DEFAULT_GROUP, mine, kind=CollectiveKind.ALL_GATHER, timeout=self._timeout_s
        )
        return gathered.reshape(self.size(), mine.size)

    def _all_to_all(
        self, sequence: int, data: np.ndarray, splits: tuple[int, ...], *, into: np.ndarray | None = None
    ) -> np.ndarray:
        """One ALL_TO_ALL: `splits[j]` bytes of `data` go to rank j; returns what every rank sent
        this one, in rank order (written into `into` when given: it must hold exactly that)."""
        return self._client.run_collective(
            sequence,
            DEFAULT_GROUP,
            data,
            kind=CollectiveKind.ALL_TO_ALL,
            split_bytes=splits,
            into=into,
            timeout=self._timeout_s,
        )

    def _broadcast(
        self, sequence: int, data: np.ndarray, root: int, *, into: np.ndarray | None
    ) -> np.ndarray:
        """One BROADCAST of the root's bytes `data` (a non-root rank's only say how many); the
        result is written into `into` when given."""
        return self._client.run_collective(
            sequence,
            DEFAULT_GROUP,
            data,
            kind=CollectiveKind.BROADCAST,
            root=root,
            into=into,
            timeout=self._timeout_s,
        )

    def _small_on_host(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether a call may take a small call's short path: one non-empty contiguous strided
        tensor of at most SMALL_BYTES that is not staged (its own memory is sent and written)."""
        if len(tensors) != 1:
            return False
        tensor = tensors[0]
        return (
            not self._transfers.stages(tensor)
            and tensor.layout == torch.strided
            and tensor.is_contiguous()
            and 0 < tensor.numel() * tensor.element_size() <= SMALL_BYTES
        )

    def _staging(self, what: str, tensors: Sequence[torch.Tensor]) -> Staging:
        """The host side of one call's tensors (raises ValueError for tensors on two devices)."""
        return Staging(what, tensors, self._transfers)
