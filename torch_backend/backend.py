"""`ProcessGroupGradServer`: a torch.distributed process group whose collectives go through a
gradserver coordinator.

Every collective is one generic collective key of the coordinator (see docs/PROTOCOL.md): the
group's operations are numbered in issue order and run one after another on one background
thread per group; each call returns a `Work` at once. Reductions are the coordinator's where it
can (float64 sums in rank order rounded once to float32, so SUM and AVG are bit-identical on
every rank and independent of arrival order), else an allgather and a reduction in rank order on
every rank: `_reductions` says which op and dtype goes which way. Broadcast and allgather move the
raw bytes of any dtype exactly: each byte travels as a float32 in [0, 255], and the ranks that do
not own a segment send zeros, so a SUM reproduces the owner's bytes. reduce_scatter is an
allreduce keeping this rank's part; alltoall an allgather keeping this rank's pieces. CUDA tensors
are copied to the host once and back on the caller's stream (`_devices`). A rank that is lost
makes every other rank's pending and later Work fail with the coordinator's error naming it
(worker ids are the group's ranks).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradserver.common.errors import GradServerError, InvalidArgumentError
from gradserver.common.messages import ReduceOp
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts

from ._collective import CollectiveClient
from ._coordinator import EmbeddedCoordinator, Store, coordinator_for
from ._devices import StreamOrder
from ._reductions import Plan, from_limbs, plan_reduction, reduce_in_rank_order, to_limbs

log = logging.getLogger("gradserver.torch")

BACKEND_NAME = "gradserver"
_DEFAULT_GROUP = 0
_groups = itertools.count()
_external_lock = threading.Lock()
_external_groups: list[str] = []  # the address of the one group joined to GRADSERVER_COORDINATOR


class ProcessGroupGradServer(dist.ProcessGroup):
    """One torch process group = one membership of one coordinator (worker id = group rank)."""

    def __init__(
        self,
        client: CollectiveClient,
        coordinator: EmbeddedCoordinator | None = None,
        timeout_s: float | None = None,
    ) -> None:
        # C++ reads the rank and size given here (the stubs only know the store overload).
        super().__init__(client.worker_id, client.total_workers)  # type: ignore[call-arg]
        self._client = client
        self._coordinator = coordinator
        self._timeout_s = timeout_s
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradserver-pg")
        self._sequence = itertools.count()
        self._issue = threading.Lock()
        self._closed = False

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # --- collectives ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        op = (
            opts.reduceOp
            if isinstance(opts, dist.AllreduceOptions | dist.AllreduceCoalescedOptions)
            else opts
        )
        plan = plan_reduction("allreduce", op, [t.dtype for t in tensors], self.size())

        def run(sequence: int) -> None:
            _scatter_into(tensors, self._reduce(sequence, _flatten(tensors), plan, in_place=True))

        return self._submit("allreduce", run, tensors, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """An allreduce of every input, keeping this rank's part: each rank sends N times its output."""
        size, rank = self.size(), self.rank()
        op = opts.reduceOp if isinstance(opts, dist.ReduceScatterOptions) else opts
        inputs = [t for group in input_tensors for t in group]
        plan = plan_reduction("reduce_scatter", op, [t.dtype for t in [*inputs, *output_tensors]], size)
        _check_pieces("reduce_scatter", output_tensors, input_tensors, size)

        def run(sequence: int) -> None:
            reduced = self._reduce(sequence, _flatten(inputs), plan)
            offset = 0
            for output, group in zip(output_tensors, input_tensors, strict=True):
                n = output.numel()
                start = offset + rank * n
                output.copy_(reduced[start : start + n].reshape(output.shape))
                offset += sum(t.numel() for t in group)

        return self._submit("reduce_scatter", run, output_tensors, [*inputs, *output_tensors])

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """Through an allgather (each rank sends 4 * N times its input bytes); equal pieces only."""
        size, rank = self.size(), self.rank()
        _check_pieces("alltoall", output_tensors, [input_tensors], size)
        if len(output_tensors) != size or len({t.numel() for t in [*input_tensors, *output_tensors]}) > 1:
            raise ValueError("gradserver alltoall: every input and output tensor must have the same numel")

        def run(sequence: int) -> None:
            mine = np.concatenate([_bytes_of(t) for t in input_tensors])
            segments = self._gather_bytes(sequence, mine)
            piece = mine.size // size
            for r, output in enumerate(output_tensors):
                _write_bytes_into([output], segments[r][rank * piece : (rank + 1) * piece])

        return self._submit("alltoall", run, output_tensors, [*input_tensors, *output_tensors])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if isinstance(opts, dist.BroadcastOptions) else 0
        if not 0 <= root < self.size():
            raise ValueError(f"broadcast: root rank {root} is out of range for a group of {self.size()}")

        def run(sequence: int) -> None:
            _write_bytes_into(tensors, self._broadcast_bytes(sequence, tensors, root))

        return self._submit("broadcast", run, tensors, tensors)

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        size = self.size()
        for i, outputs in enumerate(output_tensors):
            if len(outputs) != size:
                raise ValueError(f"allgather: output list {i} holds {len(outputs)} tensors, the group {size}")

        def run(sequence: int) -> None:
            mine = np.concatenate([_bytes_of(t) for t in input_tensors]) if input_tensors else np.zeros(0)
            segments = self._gather_bytes(sequence, mine.astype(np.uint8))
            for r in range(size):
                _write_bytes_into([outputs[r] for outputs in output_tensors], segments[r])

        flat_outputs = [t for outputs in output_tensors for t in outputs]
        return self._submit("allgather", run, flat_outputs, [*input_tensors, *flat_outputs])

    # --- the single-tensor and rooted forms, built on the collectives above -------------------
    # torch.distributed calls these by name on the group object (FSDP uses the first two).

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """`all_gather_into_tensor`: `output` holds every rank's `input`, in rank order."""
        pieces = _equal_pieces("all_gather_into_tensor", output, self.size(), like=input)
        return self.allgather([pieces], [input], opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """`reduce_scatter_tensor`: rank r gets the reduction of every rank's piece r of `input`."""
        pieces = _equal_pieces("reduce_scatter_tensor", input, self.size(), like=output)
        return self.reduce_scatter([output], [pieces], opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        """Equal splits along dim 0 (what the split sizes may also say); uneven ones are refused."""
        size = self.size()
        for name, splits, tensor in (
            ("output", output_split_sizes, output),
            ("input", input_split_sizes, input),
        ):
            if splits and (len(splits) != size or len(set(splits)) > 1 or sum(splits) != tensor.shape[0]):
                raise NotImplementedError(
                    f"gradserver all_to_all_single: {name}_split_sizes {list(splits)} are uneven; "
                    f"only equal splits of dim 0 are supported (a group of {size})"
                )
        return self.alltoall(
            _equal_pieces("all_to_all_single", output, size), _equal_pieces("all_to_all_single", input, size)
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """An allreduce whose result the root keeps; the other ranks' tensors are left as they were."""
        root = _root("reduce", opts, self.size())
        targets = tensors if self.rank() == root else [t.clone() for t in tensors]
        return self.allreduce(targets, opts.reduceOp)

    def gather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """An allgather whose result only the root keeps."""
        size, root = self.size(), _root("gather", opts, self.size())
        if len(input_tensors) != 1:
            raise ValueError(f"gradserver gather: expected one input tensor, got {len(input_tensors)}")
        if self.rank() == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != size:
                raise ValueError(f"gradserver gather: the root needs a gather_list of {size} tensors")
            outputs = output_tensors[0]
        else:
            outputs = [torch.empty_like(input_tensors[0]) for _ in range(size)]
        return self.allgather([outputs], input_tensors)

    def scatter(  # type: ignore[override]
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """The root's list broadcast; each rank keeps its own piece."""
        size, rank, root = self.size(), self.rank(), _root("scatter", opts, self.size())
        if len(output_tensors) != 1:
            raise ValueError(f"gradserver scatter: expected one output tensor, got {len(output_tensors)}")
        (output,) = output_tensors
        if rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != size:
                raise ValueError(f"gradserver scatter: the root needs a scatter_list of {size} tensors")
            if any(t.shape != output.shape or t.dtype != output.dtype for t in input_tensors[0]):
                raise ValueError("gradserver scatter: every scatter_list tensor must match the output tensor")
        pieces = list(input_tensors[0]) if rank == root else [torch.empty_like(output) for _ in range(size)]

        def run(sequence: int) -> None:
            result = self._broadcast_bytes(sequence, pieces, root)
            nbytes = output.numel() * output.element_size()
            _write_bytes_into([output], result[rank * nbytes : (rank + 1) * nbytes])

        return self._submit("scatter", run, [output], [output, *pieces])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        raise NotImplementedError(
            "gradserver supports collectives only: point-to-point send is not supported"
        )

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        raise NotImplementedError(
            "gradserver supports collectives only: point-to-point recv is not supported"
        )

    def barrier(self, opts: Any = None) -> dist.Work:
        def run(sequence: int) -> None:
            self._exchange(sequence, np.zeros(0, np.float32), ReduceOp.SUM)

        return self._submit("barrier", run, [torch.zeros(0)], [])

    # --- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leaves the coordinator and stops the embedded one (rank 0). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        try:
            self._client.close()
        finally:
            if self._coordinator is not None:
                self._coordinator.stop()

    # --- internals ----------------------------------------------------------------------------

    def _exchange(
        self, sequence: int, payload: np.ndarray, op: ReduceOp, *, into: np.ndarray | None = None
    ) -> np.ndarray:
        self._client.send_collective(sequence, _DEFAULT_GROUP, payload, op, into=into)
        return self._client.receive_collective(self._timeout_s)

    def _broadcast_bytes(self, sequence: int, tensors: Sequence[torch.Tensor], root: int) -> np.ndarray:
        """The root's bytes of `tensors` (uint8) on every rank: the root sends them as float32,
        the others zeros of the same length (their tensors' sizes), and the SUM is the root's."""
        data = np.concatenate([_bytes_of(t) for t in tensors]) if tensors else np.zeros(0, np.uint8)
        payload = data.astype(np.float32) if self.rank() == root else np.zeros(data.size, np.float32)
        return self._exchange(sequence, payload, ReduceOp.SUM).astype(np.uint8)

    def _gather_bytes(self, sequence: int, mine: np.ndarray) -> np.ndarray:
        """Every rank's `mine` (uint8, one length on every rank) as rows, in rank order: each rank
        puts its bytes (as float32) in its own segment and zeros elsewhere, and the SUM of x and
        zeros is x."""
        size, rank = self.size(), self.rank()
        payload = np.zeros(mine.size * size, np.float32)
        payload[rank * mine.size : (rank + 1) * mine.size] = mine
        gathered = self._exchange(sequence, payload, ReduceOp.SUM).astype(np.uint8)
        return gathered.reshape(size, mine.size) if mine.size else np.zeros((size, 0), np.uint8)

    def _reduce(
        self, sequence: int, flat: torch.Tensor, plan: Plan, *, in_place: bool = False
    ) -> torch.Tensor:
        """`flat` (a 1-D host tensor) reduced over the group as `plan` says, in its dtype. With
        `in_place` (an allreduce, whose tensors take the result anyway) a float32 result is
        written into `flat` itself, which may be the caller's tensor: no result is allocated."""
        if plan.route == "coordinator":
            payload = flat.numpy()
            into = payload if in_place and payload.flags.writeable else None
            return torch.from_numpy(self._exchange(sequence, payload, plan.wire_op, into=into))
        if plan.route == "widened":
            widened = self._exchange(sequence, flat.float().numpy(), plan.wire_op)
            return torch.from_numpy(widened).to(flat.dtype)
        if plan.route == "limbs":
            return torch.from_numpy(
                from_limbs(self._exchange(sequence, to_limbs(flat.numpy()), ReduceOp.SUM))
            )
        rows = self._gather_bytes(sequence, _bytes_of(flat))
        parts = [torch.from_numpy(row.copy()).view(flat.dtype) for row in rows]
        return reduce_in_rank_order(parts, plan.op)

    def _submit(
        self,
        what: str,
        run: Callable[[int], None],
        result: list[torch.Tensor],
        tensors: Sequence[torch.Tensor],
    ) -> dist.Work:
        order = StreamOrder(what, tensors)
        future = order.future()
        with self._issue:
            if self._closed:
                raise RuntimeError(f"gradserver {what}: this process group was shut down")
            sequence = next(self._sequence)
            self._executor.submit(self._run, what, sequence, run, result, future, order)
        return _FutureWork(future)

    def _run(
        self,
        what: str,
        sequence: int,
        run: Callable[[int], None],
        result: list[torch.Tensor],
        future: torch.futures.Future[list[torch.Tensor]],
        order: StreamOrder,
    ) -> None:
        try:
            with order.on_caller_stream():
                run(sequence)
                future.set_result(result)
        except GradServerError as exc:
            message = f"rank {self.rank()}: gradserver {what} (operation {sequence}) failed: {exc.message}"
            error = type(exc)(message, step=exc.step, key=exc.key, worker_id=exc.worker_id)
            future.set_exception(error)  # type: ignore[arg-type]  # the stubs mistype it
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work, not the thread
            future.set_exception(exc)  # type: ignore[arg-type]


class _FutureWork(dist.Work):
    """A Work whose wait() and get_future() raise the collective's error. (torch 2.13's
    `_create_work_from_future` returns a Work whose wait and future swallow it: a lost rank
    would pass unnoticed and leave tensors unreduced.)"""

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        # The collective itself is bounded (the coordinator's step timeout, the receive timeout).
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes (a copy on the host)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)


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


def _write_bytes_into(tensors: Sequence[torch.Tensor], data: np.ndarray) -> None:
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            raw = torch.from_numpy(np.ascontiguousarray(data[offset : offset + nbytes]))
            tensor.copy_(raw.view(tensor.dtype).reshape(tensor.shape))
        offset += nbytes


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, in order, as one contiguous 1-D host tensor (one copy)."""
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
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        piece = result[offset : offset + n]
        # An in-place allreduce of one contiguous host tensor already left the result there.
        if not (tensor.is_contiguous() and n and tensor.data_ptr() == piece.data_ptr()):
            tensor.copy_(piece.reshape(tensor.shape))
        offset += n


def create_process_group(
    store: Store, rank: int, size: int, timeout: datetime.timedelta
) -> ProcessGroupGradServer:
    """The creator registered with torch: finds or starts the coordinator, joins as `rank`."""
    timeout_s = timeout.total_seconds()
    address, embedded = coordinator_for(store, rank, size, timeout_s)
    if embedded is None and os.environ.get("GRADSERVER_COORDINATOR"):
        with _external_lock:
            if _external_groups:
                raise NotImplementedError(
                    "gradserver: dist.new_group subgroups need the embedded coordinator; with "
                    "GRADSERVER_COORDINATOR set only the default process group is supported"
                )
            _external_groups.append(address)
    timeouts = Timeouts(connect=min(timeout_s, 60.0), join=timeout_s, receive=timeout_s)
    tls = TlsFiles.load(
        os.environ.get("GRADSERVER_TLS_CA", ""),
        os.environ.get("GRADSERVER_TLS_CERT", ""),
        os.environ.get("GRADSERVER_TLS_KEY", ""),
        what="gradserver backend TLS",
    )
    if tls is not None and tls.ca is None:
        raise InvalidArgumentError("GRADSERVER_TLS_CERT needs GRADSERVER_TLS_CA to verify the coordinator")
    try:
        client = CollectiveClient.connect_as_rank(
            address,
            rank,
            node_id=f"{os.uname().nodename}/pid{os.getpid()}/rank{rank}",
            timeout=timeouts,
            tls=tls,
            auth_token=os.environ.get("GRADSERVER_AUTH_TOKEN", ""),
            server_name=os.environ.get("GRADSERVER_TLS_SERVER_NAME", ""),
        )
    except BaseException:
        if embedded is not None:
            embedded.stop()
        raise
    log.info("rank %d of %d joined the gradserver coordinator at %s", rank, size, address)
    return ProcessGroupGradServer(client, embedded, timeout_s)
