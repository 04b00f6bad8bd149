"""`ProcessGroupGradServer`: a torch.distributed process group whose collectives go through a
gradserver coordinator.

Every collective is one collective key of the coordinator (see docs/PROTOCOL.md, "Native
collectives"; on one host it runs through the collective lane, "The collective lane"): the
group's operations are numbered in issue order and run one after another (`_queue`); each call
returns a `Work` at once. A synchronous call's `wait()` runs its operation on the caller's thread
and completes it there; an operation nobody waits for that way (async, or waited for through its
future, as DDP's reducer does) runs on the group's thread and is completed from other threads (so
a future's callback may issue and wait for the next collective, as DDP comm hooks do). A failed
collective fails the Work's future as C++ sees it (DDP raises a RuntimeError with the message,
never a crash), and `wait()` raises the library's own error.

What each call is on the coordinator:
- allreduce: a REDUCE where the coordinator can reduce (float64 sums in rank order rounded once
  to float32, so SUM and AVG are bit-identical on every rank and independent of arrival order),
  else an ALL_GATHER and a reduction in rank order on every rank: `_reductions` says which op and
  dtype goes which way.
- reduce_scatter (and its single-tensor and coalesced forms): a REDUCE_SCATTER on the same routes
  (each rank sends its input once and receives only its part, the bytes an allreduce would give
  there); the ops the coordinator cannot reduce: an ALL_TO_ALL of the pieces, reduced in rank
  order by the rank that keeps them.
- reduce: a REDUCE_SCATTER whose root's part is all of it (`split_bytes`): the root alone receives
  the result; the ops the coordinator cannot reduce, an allreduce the root keeps.
- send, recv, isend, irecv, recv from any source: point-to-point messages (`WorkerClient.send_to`,
  `receive_from`; docs/PROTOCOL.md "Point-to-point"), outside the group's numbered operations.
- allgather, all_gather_into_tensor: an ALL_GATHER of raw bytes (any dtype, byte-identical).
- broadcast: a BROADCAST (the root's bytes, once; the others send none).
- alltoall, all_to_all_single (uneven split sizes too): an ALL_TO_ALL of raw bytes; gather is
  one toward the root (the others receive nothing), scatter one from the root.
Results are written straight into a contiguous host output where nothing can overwrite its input
meanwhile, else copied in; the caller's tensors keep their storage (`_tensor_bytes.host_view`,
never `Tensor.numpy()`, which would make it non-resizable). Every collective runs on host tensors:
CUDA tensors are copied into pinned host buffers once and their results back, on a copy stream of
the group ordered after the caller's work by events (`_staging`, `_devices`); host tensors are
used where they are. The group is torch's backend for each device type it serves (cpu and cuda
for "gradserver": `_device_types`, `_get_backend`; `_registration`). A rank that is lost makes
every other rank's pending and later Work fail with the coordinator's error naming it (worker
ids are the group's ranks).

Where the code is: this module holds the group (`ProcessGroupGradServer`: its identity for torch,
its device types, the former names of its collectives, shutdown) and `create_process_group`, the
creator registered with torch. Its collectives come from its bases, one family each:
`_reduce_collectives`, `_byte_collectives` and `_point_to_point`, all on `_group_core.GroupCore`
(the state they share). Works, their queue and their completion are `_work`; tensors as host bytes
`_tensor_bytes`; the checks of a call's arguments `_arguments`.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradserver.common.errors import InvalidArgumentError
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts

from ._byte_collectives import ByteCollectives
from ._collective import CollectiveClient
from ._coordinator import EmbeddedCoordinator, Store, coordinator_for
from ._devices import DeviceTransfers
from ._point_to_point import PointToPoint
from ._quantized_collectives import QuantizedCollectives
from ._reduce_collectives import ReduceCollectives
from ._registration import BACKEND_NAME, DEVICE_TYPES
from ._settings import rank_settings

log = logging.getLogger("gradserver.torch")


class ProcessGroupGradServer(PointToPoint, ReduceCollectives, ByteCollectives, QuantizedCollectives):
    """One torch process group = one membership of one coordinator (worker id = group rank)."""

    def __init__(
        self,
        client: CollectiveClient,
        coordinator: EmbeddedCoordinator | None = None,
        timeout_s: float | None = None,
        check_finite: bool = False,
        *,
        devices: Sequence[str] = DEVICE_TYPES,
        transfers: DeviceTransfers | None = None,
    ) -> None:
        super().__init__(client, timeout_s, check_finite, transfers)
        self._coordinator = coordinator
        self._devices = tuple(devices)
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name and description in its C++ backends, which a Python group does
    # not have: without these, DeviceMesh (FSDP2, DTensor) fails with "ProcessGroup name not set".
    # (torch's own test_c10d_pypg.py overrides them the same way.)
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    # --- the group as its own backend for each device type ----------------------------------
    # torch registers a C++ backend per device type in a group and asks the group for them
    # (`_device_types`, `_get_backend(device)`): DCP and object collectives pick their device
    # from the first, FSDP2, DeviceMesh and init_process_group(device_id=...) call the second.
    # A Python group replaces the whole group in torch (`_new_process_group_helper`), so it has
    # no C++ backends and torch's own answers are "none". This group serves every device type
    # it was created for (cpu and cuda for "gradserver"; one of them for "cpu:gradserver" or
    # "cuda:gradserver"), and is itself the backend of each.

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(d) for d in self._devices]

    def _get_backend(self, device: torch.device | str) -> ProcessGroupGradServer:  # type: ignore[override]
        kind = torch.device(device).type
        if kind not in self._devices:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    # What torch asks of a backend it got from `_get_backend`: none of these abilities (NCCL's
    # communicator splitting, coalescing, tensor allocation, time estimates, shrinking).
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    supports_shrinking = False

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False

    # --- the former names of collectives ------------------------------------------------------
    # Those of all_gather_single, reduce_scatter_single, their coalesced forms and
    # all_to_all_single, which older torch releases call (their `dist.all_gather_into_tensor` is
    # `group._allgather_base(...)`) and torch 2.13 keeps as deprecated aliases. Without them, such a
    # call reaches the C++ base class, which looks for a C++ backend and fails: "No backend type
    # associated with device type cuda".
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.all_gather_single(output, input, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.reduce_scatter_single(output, input, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    # --- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leaves the coordinator and stops the embedded one (rank 0). Safe to call twice."""
        if not self._operations.close():
            return
        try:
            self._client.close()
        finally:
            if self._coordinator is not None:
                self._coordinator.stop()


def create_process_group(
    store: Store,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    *,
    devices: Sequence[str] = DEVICE_TYPES,
) -> ProcessGroupGradServer:
    """The creator registered with torch: finds or starts the group's coordinator, joins as `rank`.
    The default group joins GRADSERVER_COORDINATOR when it is set; every later group (a
    `dist.new_group`, a DeviceMesh dimension) gets its own embedded coordinator, also under
    `gradserver run`: a coordinator's operations involve all of its workers, so one coordinator
    cannot serve groups with other members. `devices`: the device types it serves
    (`_registration`)."""
    timeout_s = timeout.total_seconds()
    settings = rank_settings()
    timeouts = Timeouts(connect=min(timeout_s, 60.0), join=timeout_s, receive=timeout_s)
    tls = TlsFiles.load(
        settings.tls_ca, settings.tls_client_cert, settings.tls_client_key, what="gradserver backend TLS"
    )
    if tls is not None and tls.ca is None:
        raise InvalidArgumentError(
            "GRADSERVER_TLS_CLIENT_CERT needs GRADSERVER_TLS_CA to verify the coordinator"
        )
    # The default group is being created exactly while torch has none yet.
    membership = coordinator_for(
        store, rank, size, timeout_s, settings, default_group=not dist.is_initialized()
    )
    embedded = membership.embedded
    try:
        client = CollectiveClient.connect_as_rank(
            membership.address,
            rank,
            node_id=f"{os.uname().nodename}/pid{os.getpid()}/rank{rank}",
            timeout=timeouts,
            # An embedded coordinator serves no TLS (its token protects it); the external one may.
            tls=tls if membership.external else None,
            auth_token=membership.auth_token,
            server_name=settings.tls_server_name,
            wire_dtype=settings.wire_dtype,
        )
    except BaseException:
        if embedded is not None:
            embedded.stop()
        raise
    log.info("rank %d of %d joined the gradserver coordinator at %s", rank, size, membership.address)
    check_finite = settings.torch_check_finite
    return ProcessGroupGradServer(client, embedded, timeout_s, check_finite, devices=devices)
