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
meanwhile, else copied in; the caller's tensors keep their storage (`_host_view`, never
`Tensor.numpy()`, which would make it non-resizable). Every collective runs on host tensors:
CUDA tensors are copied into pinned host buffers once and their results back, on a copy stream of
the group ordered after the caller's work by events (`_staging`, `_devices`); host tensors are
used where they are. The group is torch's backend for each device type it serves (cpu and cuda
for "gradserver": `_device_types`, `_get_backend`; `_registration`). A rank that is lost makes
every other rank's pending and later Work fail with the coordinator's error naming it (worker
ids are the group's ranks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradserver.common.errors import DeadlineExceededError, GradServerError, InvalidArgumentError
from gradserver.common.messages import CollectiveKind, ReduceOp
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts
from gradserver.worker import PeerReceive, PeerSend

from ._collective import CollectiveClient
from ._coordinator import EmbeddedCoordinator, Store, coordinator_for
from ._devices import DeviceTransfers
from ._queue import OperationQueue, Queued
from ._reductions import (
    Plan,
    from_limbs,
    plan_reduction,
    premultiplied,
    reduce_in_rank_order,
    to_limbs,
)
from ._registration import BACKEND_NAME, DEVICE_TYPES
from ._settings import rank_settings
from ._staging import Staging

log = logging.getLogger("gradserver.torch")

_DEFAULT_GROUP = 0
_groups = itertools.count()
# Opt-in: collectives refuse NaN/Inf (naming the rank and element) instead of passing them on.
_COMPLETION_THREADS = 64  # the most callbacks that may block at once (one per DDP bucket in flight)
# An operation nobody waits for yet is run by the group's thread after this delay, unless it is
# larger than _EAGER_BYTES (host bytes of every tensor involved): then at once, so it overlaps
# with the caller's work (DDP's backward). A synchronous call waits at once and runs it itself.
_PICKUP_DELAY_S = 0.0002
_EAGER_BYTES = 1 << 20
# The group's thread looks for such operations this often while they keep coming, and sleeps
# until the next one after this long without any.
_POLL_S = 0.002
_IDLE_S = 1.0


class ProcessGroupGradServer(dist.ProcessGroup):
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
        # C++ reads the rank and size given here (the stubs only know the store overload).
        super().__init__(client.worker_id, client.total_workers)  # type: ignore[call-arg]
        self._client = client
        self._coordinator = coordinator
        self._timeout_s = timeout_s
        # torch.distributed semantics unless asked: NaN/Inf pass through a collective as with gloo
        # (GradScaler relies on every rank seeing the Inf); with the check, they fail it, naming
        # the rank and the element.
        self._check_finite = check_finite
        self._devices = tuple(devices)
        # Which tensors go through the host and how (`_devices`, `_staging`).
        self._transfers = transfers if transfers is not None else DeviceTransfers()
        # Operations run in issue order, one at a time: on the thread that waits for one (a
        # synchronous call), or on the group's own thread (`_queue`).
        self._queue: OperationQueue[_Operation] = OperationQueue(
            self._run,
            self._ran_in_background,
            pickup_delay_s=_PICKUP_DELAY_S,
            poll_s=_POLL_S,
            idle_s=_IDLE_S,
            name="gradserver-pg",
        )
        # Works are completed on other threads than the one that runs the collectives: torch runs
        # a future's callbacks on the thread that completes it, and a callback that issues a
        # collective and waits for it (DDP comm hooks such as PowerSGD) would otherwise wait for
        # the very thread it blocks. One blocked callback holds one thread; more start as needed.
        self._completions = concurrent.futures.ThreadPoolExecutor(
            _COMPLETION_THREADS, thread_name_prefix="gradserver-pg-done"
        )
        self._pending: dict[int, _CollectiveWork] = {}
        self._sequence = itertools.count()
        self._issue = threading.Lock()
        self._closed = False
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

    # --- collectives ------------------------------------------------------------------------
    # Each declares its tensors to a `Staging` at the call (read, written or both) and runs on
    # their host counterparts: the caller's own host tensors, or host buffers that device
    # tensors are copied into before it runs and out of after (`_staging`).

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = (
            opts.reduceOp
            if isinstance(opts, dist.AllreduceOptions | dist.AllreduceCoalescedOptions)
            else opts
        )
        plan = plan_reduction("allreduce", op, [t.dtype for t in tensors], self.size())
        staging = self._staging("allreduce", tensors)
        hosts = staging.updates(tensors)

        def run(sequence: int) -> None:
            _scatter_into(hosts, self._reduce(sequence, _flatten(hosts), plan, in_place=True))

        return self._submit("allreduce", staging, run, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """One REDUCE_SCATTER of every input: this rank's contribution holds its pieces grouped
        by destination rank (piece r of every input, for each r in turn), so the part the
        coordinator returns to rank r is its outputs, in order."""
        _check_pieces("reduce_scatter", output_tensors, input_tensors, self.size())
        staging = self._staging("reduce_scatter", [*output_tensors, *itertools.chain(*input_tensors)])
        inputs = [staging.reads(group) for group in input_tensors]
        outputs = staging.writes(output_tensors)
        by_rank = [group[r] for r in range(self.size()) for group in inputs]
        return self._reduce_scatter("reduce_scatter", staging, outputs, by_rank, opts, output_tensors)

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """One ALL_TO_ALL: input j goes to rank j, output j comes from rank j (any sizes)."""
        size = self.size()
        if len(output_tensors) != size or len(input_tensors) != size:
            raise ValueError(
                f"gradserver alltoall: {len(input_tensors)} inputs and {len(output_tensors)} outputs "
                f"for a group of {size}; it takes one of each per rank"
            )
        staging = self._staging("alltoall", [*input_tensors, *output_tensors])
        inputs, outputs = staging.reads(input_tensors), staging.writes(output_tensors)

        def run(sequence: int) -> None:
            splits = tuple(_nbytes(t) for t in inputs)
            result = self._all_to_all(sequence, _concat_bytes(inputs), splits)
            _write_bytes_into(outputs, result, what=f"rank {self.rank()}: gradserver alltoall")

        return self._submit("alltoall", staging, run, output_tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """One BROADCAST: the root sends its bytes once, the others only say how many."""
        root = opts.rootRank if isinstance(opts, dist.BroadcastOptions) else 0
        if not 0 <= root < self.size():
            raise ValueError(f"broadcast: root rank {root} is out of range for a group of {self.size()}")
        is_root = self.rank() == root
        staging = self._staging("broadcast", tensors)
        hosts = staging.reads(tensors) if is_root else staging.writes(tensors)

        def run(sequence: int) -> None:
            nbytes = sum(_nbytes(t) for t in hosts)
            data = _concat_bytes(hosts) if is_root else np.empty(nbytes, np.uint8)
            into = _host_bytes(hosts[0]) if len(hosts) == 1 else None
            result = self._client.run_collective(
                sequence,
                _DEFAULT_GROUP,
                data,
                kind=CollectiveKind.BROADCAST,
                root=root,
                into=into,
                timeout=self._timeout_s,
            )
            _write_bytes_into(hosts, result, what=f"rank {self.rank()}: gradserver broadcast")

        return self._submit("broadcast", staging, run, tensors)

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """One ALL_GATHER of this rank's inputs (their bytes, concatenated)."""
        size = self.size()
        for i, outputs in enumerate(output_tensors):
            if len(outputs) != size:
                raise ValueError(f"allgather: output list {i} holds {len(outputs)} tensors, the group {size}")
        flat_outputs = [t for outputs in output_tensors for t in outputs]
        staging = self._staging("allgather", [*input_tensors, *flat_outputs])
        inputs = staging.reads(input_tensors)
        hosts = [staging.writes(outputs) for outputs in output_tensors]
        return self._allgather("allgather", staging, hosts, inputs, flat_outputs)

    def _allgather(
        self,
        what: str,
        staging: Staging,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        result: list[torch.Tensor],
    ) -> dist.Work:
        def run(sequence: int) -> None:
            rows = self._gather_rows(sequence, _concat_bytes(inputs))
            for r in range(self.size()):
                _write_bytes_into(
                    [pieces[r] for pieces in outputs], rows[r], what=f"rank {self.rank()}: gradserver {what}"
                )

        return self._submit(what, staging, run, result)

    # --- the single-tensor and rooted forms, built on the collectives above -------------------
    # torch.distributed calls these by name on the group object (FSDP uses the first two).

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """`all_gather_into_tensor`: `output` holds every rank's `input`, in rank order (one
        ALL_GATHER, written straight into `output` when it is a contiguous host tensor)."""
        _equal_pieces("all_gather_into_tensor", output, self.size(), like=input)
        staging = self._staging("all_gather_into_tensor", [input, output])
        host_input, host_output = staging.read(input), staging.write(output)

        def run(sequence: int) -> None:
            data = _concat_bytes([host_input])
            # Pieces of the result may arrive while this rank still sends: the output can take
            # them directly unless the input lies in it elsewhere than in this rank's own piece
            # (which receives the very bytes it holds).
            flat = host_output.reshape(-1)
            own = flat.chunk(self.size())[self.rank()] if host_output.numel() else host_output
            into = None
            if not _overlaps(host_input, host_output) or _same_memory(host_input, own):
                into = _host_bytes(host_output)
            result = self._client.run_collective(
                sequence,
                _DEFAULT_GROUP,
                data,
                kind=CollectiveKind.ALL_GATHER,
                into=into,
                timeout=self._timeout_s,
            )
            what = f"rank {self.rank()}: gradserver all_gather_into_tensor"
            _write_bytes_into([host_output], result, what=what)

        return self._submit("all_gather_into_tensor", staging, run, [output])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """`reduce_scatter_tensor`: rank r gets the reduction of every rank's piece r of `input`
        (its pieces already lie in rank order: `input` is sent as it is)."""
        _equal_pieces("reduce_scatter_tensor", input, self.size(), like=output)
        staging = self._staging("reduce_scatter_tensor", [input, output])
        host_input, host_output = staging.read(input), staging.write(output)
        what = "reduce_scatter_tensor"
        return self._reduce_scatter(what, staging, [host_output], [host_input], opts, [output])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """`all_gather_into_tensor` of several tensors at once (functional collectives, FSDP2)."""
        what = "all_gather_into_tensor_coalesced"
        _pieces_of_each(what, outputs, inputs, self.size())
        staging = self._staging(what, [*inputs, *outputs])
        host_inputs, host_outputs = staging.reads(inputs), staging.writes(outputs)
        pieces = _pieces_of_each(what, host_outputs, host_inputs, self.size())
        return self._allgather(what, staging, pieces, host_inputs, outputs)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """`reduce_scatter_tensor` of several tensors at once (functional collectives, FSDP2)."""
        what = "reduce_scatter_tensor_coalesced"
        _pieces_of_each(what, inputs, outputs, self.size())
        staging = self._staging(what, [*inputs, *outputs])
        host_inputs, host_outputs = staging.reads(inputs), staging.writes(outputs)
        pieces = _pieces_of_each(what, host_inputs, host_outputs, self.size())
        by_rank = [group[r] for r in range(self.size()) for group in pieces]
        return self._reduce_scatter(what, staging, host_outputs, by_rank, opts, outputs)

    # The former names of the four above and of all_to_all_single, which older torch releases
    # call (their `dist.all_gather_into_tensor` is `group._allgather_base(...)`) and torch 2.13
    # keeps as deprecated aliases. Without them, such a call reaches the C++ base class, which
    # looks for a C++ backend and fails: "No backend type associated with device type cuda".
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

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        """One ALL_TO_ALL of slices along dim 0: equal ones, or the (uneven) split sizes given."""
        size, rank = self.size(), self.rank()
        in_splits = _split_bytes("all_to_all_single", "input", input, input_split_sizes, size)
        out_splits = _split_bytes("all_to_all_single", "output", output, output_split_sizes, size)
        staging = self._staging("all_to_all_single", [input, output])
        host_input, host_output = staging.read(input), staging.write(output)

        def run(sequence: int) -> None:
            # Pieces of the result may arrive while this rank still sends its input.
            into = None if _overlaps(host_input, host_output) else _host_bytes(host_output)
            result = self._all_to_all(sequence, _concat_bytes([host_input]), in_splits, into=into)
            if result.size != sum(out_splits):
                raise ValueError(
                    f"rank {rank}: gradserver all_to_all_single received {result.size} bytes, but "
                    f"output_split_sizes {list(output_split_sizes)} hold {sum(out_splits)}"
                )
            _write_bytes_into([host_output], result, what=f"rank {rank}: gradserver all_to_all_single")

        return self._submit("all_to_all_single", staging, run, [output])

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Only the root gets the reduction (the other ranks' tensors are left as they were): a
        REDUCE_SCATTER whose root's part is all of it and every other part empty, so the result's
        bytes (an allreduce's) go to the root alone. The ops the coordinator cannot reduce (MAX,
        PRODUCT, ...): an allreduce of raw bytes whose result the root keeps."""
        root = _root("reduce", opts, self.size())
        plan = plan_reduction("reduce", opts.reduceOp, [t.dtype for t in tensors], self.size())
        is_root = self.rank() == root
        if plan.route not in ("coordinator", "widened", "limbs"):
            targets = tensors if is_root else [t.clone() for t in tensors]
            return self.allreduce(targets, opts.reduceOp)
        staging = self._staging("reduce", tensors)
        hosts = staging.updates(tensors) if is_root else staging.reads(tensors)

        def run(sequence: int) -> None:
            result = self._reduce(sequence, _flatten(hosts), plan, root=root)
            if is_root:
                _scatter_into(hosts, result)

        return self._submit("reduce", staging, run, tensors)

    def gather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """An ALL_TO_ALL toward the root: every rank sends its bytes to the root only, and the
        other ranks receive nothing."""
        size, rank, root = self.size(), self.rank(), _root("gather", opts, self.size())
        if len(input_tensors) != 1:
            raise ValueError(f"gradserver gather: expected one input tensor, got {len(input_tensors)}")
        outputs: list[torch.Tensor] = []
        if rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != size:
                raise ValueError(f"gradserver gather: the root needs a gather_list of {size} tensors")
            outputs = output_tensors[0]
        (tensor,) = input_tensors
        staging = self._staging("gather", [tensor, *outputs])
        host, hosts = staging.read(tensor), staging.writes(outputs)

        def run(sequence: int) -> None:
            splits = tuple(_nbytes(host) if r == root else 0 for r in range(size))
            result = self._all_to_all(sequence, _concat_bytes([host]), splits)
            _write_bytes_into(hosts, result, what=f"rank {rank}: gradserver gather to rank {root}")

        return self._submit("gather", staging, run, outputs)

    def scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """An ALL_TO_ALL from the root: the root sends piece r to rank r, the others send nothing."""
        size, rank, root = self.size(), self.rank(), _root("scatter", opts, self.size())
        if len(output_tensors) != 1:
            raise ValueError(f"gradserver scatter: expected one output tensor, got {len(output_tensors)}")
        (output,) = output_tensors
        pieces: list[torch.Tensor] = []
        if rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != size:
                raise ValueError(f"gradserver scatter: the root needs a scatter_list of {size} tensors")
            if any(t.shape != output.shape or t.dtype != output.dtype for t in input_tensors[0]):
                raise ValueError("gradserver scatter: every scatter_list tensor must match the output tensor")
            pieces = list(input_tensors[0])
        staging = self._staging("scatter", [output, *pieces])
        host_pieces, host_output = staging.reads(pieces), staging.write(output)

        def run(sequence: int) -> None:
            splits = tuple(_nbytes(t) for t in host_pieces) if rank == root else (0,) * size
            into = None if any(_overlaps(t, host_output) for t in host_pieces) else _host_bytes(host_output)
            result = self._all_to_all(sequence, _concat_bytes(host_pieces), splits, into=into)
            _write_bytes_into([host_output], result, what=f"rank {rank}: gradserver scatter from rank {root}")

        return self._submit("scatter", staging, run, [output])

    # --- point-to-point ---------------------------------------------------------------------
    # Not operations of the group: only two ranks take part, so they take no sequence number and
    # never wait for the group's queue (a rank may send while its collectives are under way).

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """`isend`/`send`: this rank's bytes of the tensor to rank `dstRank` (the Work completes
        once they are delivered: in its shared-memory ring, or written to its stream by the
        coordinator). A device tensor is copied to the host first, here: the send starts now."""
        tensor = _single("send", tensors)
        name = f"rank {self.rank()}: gradserver send to rank {dstRank} (tag {tag})"
        staging = self._staging("send", [tensor])
        host = staging.read(tensor)
        with staging.running():
            staging.copy_in()
        staging.release()
        operation = self._client.send_to(dstRank, _bytes_of(host), tag=tag)
        # The host copy is read until the message is delivered: the Work keeps it.
        return _PeerWork(name, operation, [tensor], self._timeout_s, self._completions, staging, keep=host)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """`irecv`/`recv` from rank `srcRank`: the next message with `tag` from it fills the tensor."""
        return self._receive(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """`recv` with `src=None`: the next message with `tag` from any rank (`_source_rank()`)."""
        return self._receive(tensors, None, tag)

    def _receive(self, tensors: list[torch.Tensor], source: int | None, tag: int) -> dist.Work:
        tensor = _single("recv", tensors)
        who = "any rank" if source is None else f"rank {source}"
        name = f"rank {self.rank()}: gradserver recv from {who} (tag {tag})"
        staging = self._staging("recv", [tensor])
        host = staging.write(tensor)
        into = _host_bytes(host)
        buffer = np.empty(_nbytes(host), np.uint8) if into is None else None
        operation = self._client.receive_from(source, tag=tag, into=into if buffer is None else buffer)

        def write_back() -> None:
            if buffer is not None:
                _write_bytes_into([host], buffer, what=name)
            with staging.running():
                staging.copy_out()
            staging.release()

        return _PeerWork(name, operation, [tensor], self._timeout_s, self._completions, staging, write_back)

    def barrier(self, opts: Any = None) -> dist.Work:
        def run(sequence: int) -> None:
            self._exchange(sequence, np.zeros(0, np.float32), ReduceOp.SUM)

        return self._submit("barrier", self._staging("barrier", []), run, [torch.zeros(0)])

    # --- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leaves the coordinator and stops the embedded one (rank 0). Safe to call twice."""
        if self._closed:
            return
        with self._issue:
            self._closed = True
        # Operations that never ran: their Works must still end, or a waiter would hang. (Those
        # that ran are being completed by the completion threads.)
        for operation in self._queue.close():
            error = RuntimeError(f"{operation.work.name}: the process group was shut down first")
            self._finish(operation.sequence, operation.work, error)
        self._completions.shutdown(wait=False)
        try:
            self._client.close()
        finally:
            if self._coordinator is not None:
                self._coordinator.stop()

    # --- internals ----------------------------------------------------------------------------

    def _exchange(
        self,
        sequence: int,
        payload: np.ndarray,
        op: ReduceOp,
        *,
        kind: CollectiveKind = CollectiveKind.REDUCE,
        into: np.ndarray | None = None,
        split_bytes: tuple[int, ...] = (),
    ) -> np.ndarray:
        """One coordinator reduction of float32 `payload`: all of it (REDUCE) or this rank's
        part (REDUCE_SCATTER: equal parts, or `split_bytes` of float32 bytes per rank)."""
        return self._client.run_collective(
            sequence,
            _DEFAULT_GROUP,
            payload,
            op,
            kind=kind,
            into=into,
            split_bytes=split_bytes,
            propagate_non_finite=not self._check_finite,
            timeout=self._timeout_s,
        )

    def _reduce_scatter(
        self,
        what: str,
        staging: Staging,
        outputs: list[torch.Tensor],
        in_rank_order: list[torch.Tensor],
        opts: Any,
        result: list[torch.Tensor],
    ) -> dist.Work:
        """Reduces `in_rank_order` (host tensors: what goes to rank 0, then rank 1, ...) over the
        group; this rank's part lands in `outputs` (host tensors; `result`, the caller's, are the
        Work's)."""
        op = opts.reduceOp if isinstance(opts, dist.ReduceScatterOptions) else opts
        plan = plan_reduction(what, op, [t.dtype for t in [*in_rank_order, *outputs]], self.size())

        def run(sequence: int) -> None:
            # Pieces of the part stream in as the coordinator reduces each chunk, which every
            # rank has sent by then: the output takes them directly unless it lies in the input
            # elsewhere than in this rank's own part (whose bytes were sent before they arrive).
            flat = _flatten(in_rank_order)
            own = flat.chunk(self.size())[self.rank()] if flat.numel() else flat
            into = None
            if len(outputs) == 1 and (not _overlaps(flat, outputs[0]) or _same_memory(outputs[0], own)):
                into = _host_bytes(outputs[0])
            mine = self._reduce(sequence, flat, plan, scatter=True, into=into)
            _scatter_into(outputs, mine)

        return self._submit(what, staging, run, result)

    def _gather_rows(self, sequence: int, mine: np.ndarray) -> np.ndarray:
        """Every rank's `mine` (uint8, one length on every rank) as rows, in rank order: one
        ALL_GATHER."""
        gathered = self._client.run_collective(
            sequence, _DEFAULT_GROUP, mine, kind=CollectiveKind.ALL_GATHER, timeout=self._timeout_s
        )
        return gathered.reshape(self.size(), mine.size)

    def _all_to_all(
        self, sequence: int, data: np.ndarray, splits: tuple[int, ...], *, into: np.ndarray | None = None
    ) -> np.ndarray:
        """One ALL_TO_ALL: `splits[j]` bytes of `data` go to rank j; returns what every rank sent
        this one, in rank order (written into `into` when given: it must hold exactly that)."""
        return self._client.run_collective(
            sequence,
            _DEFAULT_GROUP,
            data,
            kind=CollectiveKind.ALL_TO_ALL,
            split_bytes=splits,
            into=into,
            timeout=self._timeout_s,
        )

    def _reduce(
        self,
        sequence: int,
        flat: torch.Tensor,
        plan: Plan,
        *,
        in_place: bool = False,
        scatter: bool = False,
        into: np.ndarray | None = None,
        root: int | None = None,
    ) -> torch.Tensor:
        """`flat` (a 1-D host tensor) reduced over the group as `plan` says, in its dtype: all of
        it, or with `scatter` this rank's part (its `1/size` of `flat`, in rank order). With
        `in_place` (an allreduce, whose tensors take the result anyway) a float32 result is
        written into `flat` itself, which may be the caller's tensor; `into` (the bytes of the
        float32 result's destination) does the same for a scatter: no result is allocated. With
        `root` (a reduce; the coordinator's routes only) the result goes to that rank alone: a
        REDUCE_SCATTER whose root's part is everything (the others get an empty tensor)."""
        kind = CollectiveKind.REDUCE_SCATTER if scatter or root is not None else CollectiveKind.REDUCE
        flat = premultiplied(flat, plan)  # PREMUL_SUM's factor, on this rank's contribution
        in_place = in_place or root == self.rank()

        def exchange(payload: np.ndarray, op: ReduceOp, into: np.ndarray | None = None) -> np.ndarray:
            splits = () if root is None else tuple(payload.size * 4 * (r == root) for r in range(self.size()))
            return self._exchange(sequence, payload, op, kind=kind, into=into, split_bytes=splits)

        if plan.route == "coordinator":
            payload = _host_view(flat)
            target = payload if in_place else None if into is None else into.view(np.float32)
            result = exchange(payload, plan.wire_op, target)
            return flat if in_place else torch.from_numpy(result)
        if plan.route == "widened":
            widened = exchange(flat.float().numpy(), plan.wire_op)
            return torch.from_numpy(widened).to(flat.dtype)
        if plan.route == "limbs":
            limbs = exchange(to_limbs(_host_view(flat)), ReduceOp.SUM)
            return torch.from_numpy(from_limbs(limbs))
        size, mine = self.size(), _bytes_of(flat)
        if scatter:
            # Piece j of every rank goes to rank j, which reduces the pieces in rank order.
            piece = mine.size // size
            rows = self._all_to_all(sequence, mine, (piece,) * size).reshape(size, piece)
        else:
            rows = self._gather_rows(sequence, mine)
        parts = [torch.from_numpy(row.copy()).view(flat.dtype) for row in rows]
        return reduce_in_rank_order(parts, plan.op)

    def _staging(self, what: str, tensors: Sequence[torch.Tensor]) -> Staging:
        """The host side of one call's tensors (raises ValueError for tensors on two devices)."""
        return Staging(what, tensors, self._transfers)

    def _submit(
        self,
        what: str,
        staging: Staging,
        run: Callable[[int], None],
        result: list[torch.Tensor],
    ) -> dist.Work:
        """Queues `run` (the collective on the staged host tensors); the Work's value is `result`,
        the caller's tensors."""
        future = staging.future()
        with self._issue:
            if self._closed:
                raise RuntimeError(f"gradserver {what}: this process group was shut down")
            sequence = next(self._sequence)
            work = _CollectiveWork(f"rank {self.rank()}: gradserver {what} (operation {sequence})", future)
            operation = _Operation(what, sequence, run, result, work, staging)
            self._pending[sequence] = work
            # Device tensors are always worth overlapping: their copies to the host and back
            # alone take longer than a small collective.
            eager = staging.device_resident or staging.nbytes > _EAGER_BYTES
            queued = self._queue.submit(operation, eager=eager)
        work.run_here = functools.partial(self._run_here, queued)
        work.expedite = functools.partial(self._queue.expedite, queued)
        return work

    def _run_here(self, queued: Queued[_Operation], deadline: float) -> None:
        """A waiter's turn: runs the operation on the waiter's thread and completes it there,
        when it comes first (no thread hand-off for a synchronous call)."""
        if self._queue.run_if_first(queued, deadline):
            operation = queued.item
            assert operation.outcome is not None
            self._finish(operation.sequence, operation.work, operation.outcome, operation.staging)

    def _run(self, operation: _Operation) -> None:
        operation.outcome = self._outcome(operation)
        # The collective's closure holds the host buffers: a Work the caller keeps (DDP keeps a
        # step's) must not keep them from being reused.
        operation.run = _ran

    def _ran_in_background(self, operation: _Operation) -> None:
        """Completes an operation that another thread than its waiter's ran (the group's, or a
        waiter of a later one), on a completion thread: a callback chained on its future may
        issue and wait for the next collective."""
        assert operation.outcome is not None
        args = (operation.sequence, operation.work, operation.outcome, operation.staging)
        try:
            self._completions.submit(self._finish, *args)
        except RuntimeError:  # shut down meanwhile: complete it here, nobody can chain on it now
            self._finish(*args)

    def _outcome(self, operation: _Operation) -> list[torch.Tensor] | Exception:
        """Runs one collective (device tensors copied in before, results copied out after): its
        result tensors, or the exception to fail its Work with."""
        what, sequence, work, staging = operation.what, operation.sequence, operation.work, operation.staging
        work.started = True
        outcome: list[torch.Tensor] | Exception
        try:
            with staging.running():
                staging.copy_in()
                operation.run(sequence)
                staging.copy_out()
            outcome = operation.result
        except GradServerError as exc:
            message = f"rank {self.rank()}: gradserver {what} (operation {sequence}) failed: {exc.message}"
            outcome = type(exc)(message, step=exc.step, key=exc.key, worker_id=exc.worker_id)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work, not the thread
            outcome = exc if isinstance(exc, Exception) else RuntimeError(f"{work.name} failed: {exc!r}")
        finally:
            staging.release()
        return outcome

    def _finish(
        self,
        sequence: int,
        work: _CollectiveWork,
        outcome: list[torch.Tensor] | Exception,
        staging: Staging | None = None,
    ) -> None:
        """Completes `work` (once): callbacks chained on its future run here; for device tensors,
        after the copies of the results (torch records the future's events behind them)."""
        if self._pending.pop(sequence, None) is None:
            return
        with staging.completing() if staging is not None else contextlib.nullcontext():
            if isinstance(outcome, Exception):
                work.fail(outcome)
            else:
                work.complete(outcome)


def _ran(sequence: int) -> None:
    raise RuntimeError(f"gradserver: operation {sequence} ran already")


@dataclasses.dataclass
class _Operation:
    """One issued collective: what runs it, its Work and, once run, its outcome."""

    what: str
    sequence: int
    run: Callable[[int], None]
    result: list[torch.Tensor]
    work: _CollectiveWork
    staging: Staging
    outcome: list[torch.Tensor] | Exception | None = None


class _CollectiveWork(dist.Work):
    """The Work of one collective: `wait()` raises the collective's own error (the library's
    exception, naming the lost rank), and `get_future()` is a future that C++ sees as failed.

    Why two futures: torch's Python `Future.set_exception` completes the C++ future *successfully*
    with the exception object as its value (an unwrap function re-raises it only for Python
    callers). DDP's reducer reads that value in C++ as a list of tensors, finds none and indexes
    past the end: every surviving rank segfaulted when a collective failed during backward. The
    future handed out is therefore `then`-chained on the result: a callback that raises marks the
    chained future as failed in C++, so DDP raises a RuntimeError carrying the message.
    (torch 2.13's `_create_work_from_future` is no alternative: its wait and future swallow the
    error, so a lost rank would pass unnoticed and leave tensors unreduced.)"""

    def __init__(self, name: str, result: torch.futures.Future[list[torch.Tensor]]) -> None:
        super().__init__()
        self.name = name
        self.started = False  # set by the group's thread when the collective begins
        self._result = result
        self._done = threading.Event()
        self._error: Exception | None = None
        # The chained future, made when first asked for (most calls never ask: a synchronous
        # collective only waits), which costs a callback less per operation.
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        self._future_lock = threading.Lock()
        # Set by the group: runs the operation on the waiting thread when it comes first.
        self.run_here: Callable[[float], None] | None = None
        # Set by the group: the operation will be waited for through its future (DDP's reducer,
        # comm hooks), never through wait(): the group's thread takes it at once.
        self.expedite: Callable[[], None] | None = None

    def complete(self, tensors: list[torch.Tensor]) -> None:
        # Before the future: its callbacks run inside set_result and may ask is_completed().
        self._done.set()
        self._result.set_result(tensors)

    def fail(self, error: Exception) -> None:
        self._error = error
        self._done.set()
        self._result.set_exception(error)  # type: ignore[arg-type]  # the stubs mistype it

    def _value_or_raise(self, result: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
        if self._error is not None:
            # A fresh exception without the worker thread's traceback: C++ keeps only its text,
            # which then ends with one frame instead of the whole collective's stack.
            raise type(self._error)(*self._error.args).with_traceback(None)
        return result.value()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Waits for the collective (bounded by the coordinator's step timeout and the receive
        timeout) or, given a positive `timeout`, at most that long: then DeadlineExceededError,
        and the collective goes on in the background, as with torch's own backends. Without a
        timeout (a synchronous call), an operation nobody has started yet runs right here."""
        synchronous = timeout is None or not timeout.total_seconds()
        if synchronous and self.run_here is not None and not self._done.is_set():
            self.run_here(float("inf"))
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if seconds > 0 and not self._done.wait(seconds):
            raise DeadlineExceededError(
                f"{self.name} did not complete within the {seconds:g} s given to wait()"
            )
        self._result.wait()  # raises the collective's error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        with self._future_lock:
            if self._future is None:
                self._future = self._result.then(self._value_or_raise)
                if self.expedite is not None:
                    self.expedite()
            return self._future


class _PeerWork(dist.Work):
    """The Work of a send or receive: `wait()` moves the bytes (a receive's waiter reads them
    in, then copies them into a device tensor on the group's copy stream, which the waiter's
    stream then waits for) and raises the operation's error (naming the peer rank), bounded by
    the group's timeout or the `timeout` given; `get_future()` completes on a completion thread
    that waits."""

    def __init__(
        self,
        name: str,
        operation: PeerSend | PeerReceive,
        tensors: list[torch.Tensor],
        timeout_s: float | None,
        completions: concurrent.futures.ThreadPoolExecutor,
        staging: Staging,
        write_back: Callable[[], None] | None = None,
        *,
        keep: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self._operation = operation
        self._tensors = tensors  # kept until complete: a send reads them, a receive writes them
        self._timeout_s = timeout_s
        self._completions = completions
        self._staging = staging
        self._write_back = write_back
        self._keep = keep  # a send's host copy, read until the message is delivered
        self._finished = False
        self._lock = threading.Lock()
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._complete(timeout)
        self._staging.order_current()
        return True

    def _complete(self, timeout: datetime.timedelta | None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        bound = seconds if seconds > 0 else self._timeout_s
        try:
            self._operation.wait(bound)
        except DeadlineExceededError:
            raise DeadlineExceededError(f"{self.name} did not complete within {bound:g} s") from None
        except GradServerError as exc:
            raise type(exc)(f"{self.name} failed: {exc.message}", worker_id=exc.worker_id) from None
        with self._lock:
            if not self._finished:
                self._finished = True
                self._keep = None
                if self._write_back is not None:
                    self._write_back()

    def is_completed(self) -> bool:
        return self._operation.done and (self._write_back is None or self._finished)

    def is_success(self) -> bool:
        return self._operation.done and self._operation.error is None

    def _source_rank(self) -> int:
        """The rank a receive's message came from (what `dist.recv(src=None)` returns)."""
        assert isinstance(self._operation, PeerReceive)
        return self._operation.sender

    def source_rank(self) -> int:
        return self._source_rank()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        with self._lock:
            if self._future is not None:
                return self._future
            future = self._staging.future()
            self._future = future

        def complete() -> None:
            try:
                self._complete(None)
            except Exception as exc:  # noqa: BLE001 - the future carries any failure
                future.set_exception(RuntimeError(str(exc)))  # type: ignore[arg-type]
            else:
                with self._staging.completing():
                    future.set_result(self._tensors)

        self._completions.submit(complete)
        return future


def _single(what: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"gradserver {what}: expected one tensor, got {len(tensors)}")
    return tensors[0]


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes on the host: a view of its memory when it is a contiguous host
    tensor (read it within the collective), else of a copy."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return _host_view(flat.view(torch.uint8))


def _host_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over the memory of `tensor` (contiguous, on the host), for the duration of one
    collective. Not `Tensor.numpy()`: that marks the storage as not resizable for good, and the
    caller's tensor must stay as it was (`resize_` works after a collective, as with gloo). The
    view must not outlive the collective, which holds the tensor meanwhile."""
    dtype = _numpy_dtype(tensor.dtype)
    if not tensor.numel():
        return np.zeros(0, dtype)
    return np.asarray(_TensorMemory(tensor, dtype))


class _TensorMemory:
    """Exposes a contiguous host tensor's memory to numpy; the array's `base` keeps the tensor."""

    def __init__(self, tensor: torch.Tensor, dtype: np.dtype[Any]) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "data": (tensor.data_ptr(), False),
            "shape": (tensor.numel(),),
            "typestr": dtype.str,
            "version": 3,
        }


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype of a torch dtype (TypeError for those numpy lacks, e.g. bfloat16)."""
    return torch.empty(0, dtype=dtype).numpy().dtype


def _root(what: str, opts: Any, size: int) -> int:
    root = int(opts.rootRank)
    if not 0 <= root < size:
        raise ValueError(f"gradserver {what}: root rank {root} is out of range for a group of {size}")
    return root


def _equal_pieces(
    what: str, tensor: torch.Tensor, size: int, like: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """`tensor` cut into `size` equal views along dim 0 (each the shape and dtype of `like`, when
    given), so a collective writing the pieces writes `tensor`."""
    if not tensor.is_contiguous():
        raise ValueError(f"gradserver {what}: the tensors must be contiguous")
    if like is not None:
        if tensor.numel() != like.numel() * size or tensor.dtype != like.dtype:
            raise ValueError(
                f"gradserver {what}: a {tensor.dtype} tensor of {tensor.numel()} elements cannot hold "
                f"{size} pieces of {like.numel()} {like.dtype} elements"
            )
        return [piece.view(like.shape) for piece in tensor.reshape(-1).chunk(size)]
    if tensor.dim() == 0 or tensor.shape[0] % size:
        raise ValueError(
            f"gradserver {what}: dim 0 of shape {tuple(tensor.shape)} does not split into {size} equal pieces"
        )
    return list(tensor.chunk(size))


def _pieces_of_each(
    what: str, tensors: Sequence[torch.Tensor], likes: Sequence[torch.Tensor], size: int
) -> list[list[torch.Tensor]]:
    """Each of `tensors` cut into `size` pieces shaped like its partner in `likes`."""
    if len(tensors) != len(likes):
        raise ValueError(f"gradserver {what}: {len(tensors)} tensors for {len(likes)} partners")
    return [_equal_pieces(what, tensor, size, like=like) for tensor, like in zip(tensors, likes, strict=True)]


def _write_bytes_into(tensors: Sequence[torch.Tensor], data: np.ndarray, *, what: str) -> None:
    """The bytes of `data` into `tensors`, in order; they must hold exactly that many. A tensor
    whose memory the result was received into (`_host_bytes`) already holds its bytes."""
    needed = sum(_nbytes(t) for t in tensors)
    if data.size != needed:
        raise ValueError(f"{what}: received {data.size} bytes for tensors holding {needed}")
    offset = 0
    for tensor in tensors:
        nbytes = _nbytes(tensor)
        if nbytes and not _lies_at(tensor, data, offset):
            raw = torch.from_numpy(np.ascontiguousarray(data[offset : offset + nbytes]))
            tensor.copy_(raw.view(tensor.dtype).reshape(tensor.shape))
        offset += nbytes


def _lies_at(tensor: torch.Tensor, data: np.ndarray, offset: int) -> bool:
    """Whether `tensor`'s memory is `data`'s bytes from `offset` (the result was received there)."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.data_ptr() == int(data.__array_interface__["data"][0]) + offset
    )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect (same device)."""
    if a.device != b.device or not _nbytes(a) or not _nbytes(b):
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end = a_start + (a.untyped_storage().nbytes() if not a.is_contiguous() else _nbytes(a))
    b_end = b_start + (b.untyped_storage().nbytes() if not b.is_contiguous() else _nbytes(b))
    return a_start < b_end and b_start < a_end


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors cover exactly the same bytes."""
    return (
        a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
        and a.data_ptr() == b.data_ptr()
        and _nbytes(a) == _nbytes(b)
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _concat_bytes(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """The tensors' bytes, in order (a view of the one tensor's memory when it is a contiguous
    host tensor, else a copy)."""
    if len(tensors) == 1:
        return _bytes_of(tensors[0])
    if not tensors:
        return np.zeros(0, np.uint8)
    return np.concatenate([_bytes_of(t) for t in tensors])


def _host_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """The bytes of `tensor`'s own memory, for a collective to write its result straight there;
    None when it is not a contiguous host tensor (the result is copied in afterwards)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return _host_view(tensor.detach().reshape(-1).view(torch.uint8))


def _split_bytes(
    what: str, name: str, tensor: torch.Tensor, splits: Sequence[int], size: int
) -> tuple[int, ...]:
    """The bytes of each of the `size` slices of `tensor` along dim 0: equal ones when `splits`
    is empty, else those `splits` (rows per rank)."""
    if not tensor.is_contiguous():
        raise ValueError(f"gradserver {what}: the {name} tensor must be contiguous")
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = _nbytes(tensor) // rows if rows else 0
    if not splits:
        if rows % size:
            raise ValueError(
                f"gradserver {what}: dim 0 of the {name} shape {tuple(tensor.shape)} does not split into "
                f"{size} equal pieces; give {name}_split_sizes"
            )
        return (rows // size * row_bytes,) * size
    if len(splits) != size or any(n < 0 for n in splits) or sum(splits) != rows:
        raise ValueError(
            f"gradserver {what}: {name}_split_sizes {list(splits)} must hold {size} non-negative sizes "
            f"summing to dim 0 of the {name} shape {tuple(tensor.shape)}"
        )
    return tuple(int(n) * row_bytes for n in splits)


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, in order, as one contiguous 1-D host tensor (one copy; none for a
    single contiguous host tensor, whose flat view it is)."""
    if len(tensors) == 1 and not tensors[0].is_cuda and tensors[0].is_contiguous():
        return tensors[0].detach().view(-1)
    flat = [t.detach().reshape(-1).to("cpu") for t in tensors]
    return (flat[0] if len(flat) == 1 else torch.cat(flat)).contiguous()


def _check_pieces(
    what: str, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], size: int
) -> None:
    if len(outputs) != len(inputs) and what == "reduce_scatter":
        raise ValueError(f"gradserver {what}: {len(outputs)} outputs for {len(inputs)} input lists")
    for i, group in enumerate(inputs):
        if len(group) != size:
            raise ValueError(
                f"gradserver {what}: input list {i} holds {len(group)} tensors, the group {size}"
            )
        if what == "reduce_scatter" and any(t.numel() != outputs[i].numel() for t in group):
            raise ValueError(f"gradserver {what}: input list {i} has tensors of another size than output {i}")


def _scatter_into(tensors: Sequence[torch.Tensor], result: torch.Tensor) -> None:
    if len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].data_ptr() == result.data_ptr():
        return  # an in-place allreduce of one contiguous host tensor: the result is there already
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        piece = result[offset : offset + n]
        # An in-place allreduce of one contiguous host tensor already left the result there.
        if not (tensor.is_contiguous() and n and tensor.data_ptr() == piece.data_ptr()):
            tensor.copy_(piece.reshape(tensor.shape))
        offset += n


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
        )
    except BaseException:
        if embedded is not None:
            embedded.stop()
        raise
    log.info("rank %d of %d joined the gradserver coordinator at %s", rank, size, membership.address)
    check_finite = settings.torch_check_finite
    return ProcessGroupGradServer(client, embedded, timeout_s, check_finite, devices=devices)
