"""`ProcessGroupGradServer`: a torch.distributed process group whose collectives go through a
gradserver coordinator.

Every collective is one generic collective key of the coordinator (see docs/PROTOCOL.md): the
group's operations are numbered in issue order and run one after another on one background
thread per group; each call returns a `Work` at once, completed from other threads (so a future's
callback may issue and wait for the next collective, as DDP comm hooks do). A failed collective
fails the Work's future as C++ sees it (DDP raises a RuntimeError with the message, never a crash),
and `wait()` raises the library's own error. Reductions are the coordinator's where it
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
import contextlib
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
from gradserver.common.messages import ReduceOp
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts

from ._collective import CollectiveClient
from ._coordinator import EmbeddedCoordinator, Store, coordinator_for
from ._devices import StreamOrder
from ._reductions import (
    Plan,
    from_limbs,
    plan_reduction,
    premultiplied,
    reduce_in_rank_order,
    to_limbs,
)
from ._settings import rank_settings

log = logging.getLogger("gradserver.torch")

BACKEND_NAME = "gradserver"
_DEFAULT_GROUP = 0
_groups = itertools.count()
# Opt-in: collectives refuse NaN/Inf (naming the rank and element) instead of passing them on.
_COMPLETION_THREADS = 64  # the most callbacks that may block at once (one per DDP bucket in flight)


class ProcessGroupGradServer(dist.ProcessGroup):
    """One torch process group = one membership of one coordinator (worker id = group rank)."""

    def __init__(
        self,
        client: CollectiveClient,
        coordinator: EmbeddedCoordinator | None = None,
        timeout_s: float | None = None,
        check_finite: bool = False,
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
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradserver-pg")
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

    # torch's checkpointing (DCP's state_dict, planner and saver) asks a group which devices its
    # C++ backends serve: a Python group has none, so torch found none ("Default device not
    # found, because no backend has been registered with this ProcessGroup"). Its collectives
    # take host tensors (CUDA ones are copied to the host): the CPU.
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu")]

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

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """`all_gather_into_tensor` of several tensors at once (functional collectives, FSDP2)."""
        pieces = _pieces_of_each("all_gather_into_tensor_coalesced", outputs, inputs, self.size())
        return self.allgather(pieces, inputs, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """`reduce_scatter_tensor` of several tensors at once (functional collectives, FSDP2)."""
        pieces = _pieces_of_each("reduce_scatter_tensor_coalesced", inputs, outputs, self.size())
        return self.reduce_scatter(outputs, pieces, opts)

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
        raise NotImplementedError(_point_to_point("send", self.rank(), dst, self.size()))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        raise NotImplementedError(_point_to_point("recv", self.rank(), src, self.size()))

    def barrier(self, opts: Any = None) -> dist.Work:
        def run(sequence: int) -> None:
            self._exchange(sequence, np.zeros(0, np.float32), ReduceOp.SUM)

        return self._submit("barrier", run, [torch.zeros(0)], [])

    # --- lifecycle ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leaves the coordinator and stops the embedded one (rank 0). Safe to call twice."""
        if self._closed:
            return
        with self._issue:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        # Operations cancelled before they ran: their Works must still end, or a waiter would hang.
        # (Those that ran are being completed by the completion threads.)
        for sequence, work in list(self._pending.items()):
            if not work.started:
                self._finish(
                    sequence, work, RuntimeError(f"{work.name}: the process group was shut down first")
                )
        self._completions.shutdown(wait=False)
        try:
            self._client.close()
        finally:
            if self._coordinator is not None:
                self._coordinator.stop()

    # --- internals ----------------------------------------------------------------------------

    def _exchange(
        self, sequence: int, payload: np.ndarray, op: ReduceOp, *, into: np.ndarray | None = None
    ) -> np.ndarray:
        self._client.send_collective(
            sequence, _DEFAULT_GROUP, payload, op, into=into, propagate_non_finite=not self._check_finite
        )
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
        flat = premultiplied(flat, plan)  # PREMUL_SUM's factor, on this rank's contribution
        if plan.route == "coordinator":
            payload = _host_view(flat)
            into = payload if in_place else None
            return torch.from_numpy(self._exchange(sequence, payload, plan.wire_op, into=into))
        if plan.route == "widened":
            widened = self._exchange(sequence, flat.float().numpy(), plan.wire_op)
            return torch.from_numpy(widened).to(flat.dtype)
        if plan.route == "limbs":
            return torch.from_numpy(
                from_limbs(self._exchange(sequence, to_limbs(_host_view(flat)), ReduceOp.SUM))
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
            work = _CollectiveWork(f"rank {self.rank()}: gradserver {what} (operation {sequence})", future)
            self._pending[sequence] = work
            self._executor.submit(self._run, what, sequence, run, result, work, order)
        return work

    def _run(
        self,
        what: str,
        sequence: int,
        run: Callable[[int], None],
        result: list[torch.Tensor],
        work: _CollectiveWork,
        order: StreamOrder,
    ) -> None:
        work.started = True
        outcome: list[torch.Tensor] | Exception
        try:
            with order.on_caller_stream():
                run(sequence)
            outcome = result
        except GradServerError as exc:
            message = f"rank {self.rank()}: gradserver {what} (operation {sequence}) failed: {exc.message}"
            outcome = type(exc)(message, step=exc.step, key=exc.key, worker_id=exc.worker_id)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work, not the thread
            outcome = exc if isinstance(exc, Exception) else RuntimeError(f"{work.name} failed: {exc!r}")
        try:
            self._completions.submit(self._finish, sequence, work, outcome, order)
        except RuntimeError:  # shut down meanwhile: complete it here, nobody can chain on it now
            self._finish(sequence, work, outcome, order)

    def _finish(
        self,
        sequence: int,
        work: _CollectiveWork,
        outcome: list[torch.Tensor] | Exception,
        order: StreamOrder | None = None,
    ) -> None:
        """Completes `work` (once): callbacks chained on its future run here, on the caller's
        stream for CUDA tensors."""
        if self._pending.pop(sequence, None) is None:
            return
        with order.on_caller_stream() if order is not None else contextlib.nullcontext():
            if isinstance(outcome, Exception):
                work.fail(outcome)
            else:
                work.complete(outcome)


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
        result.add_done_callback(lambda _: self._done.set())
        self._future = result.then(self._value_or_raise)

    def complete(self, tensors: list[torch.Tensor]) -> None:
        self._result.set_result(tensors)

    def fail(self, error: Exception) -> None:
        self._error = error
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
        and the collective goes on in the background, as with torch's own backends."""
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
        return self._future


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


def _point_to_point(what: str, rank: int, peer: int, size: int) -> str:
    """Why `what` (send or recv) between `rank` and `peer` is refused, and what to use instead."""
    return (
        f"gradserver {what} (rank {rank}, peer rank {peer}): point-to-point operations are not "
        f"supported: every operation of a gradserver coordinator involves all {size} ranks of its "
        "group, so it cannot relay a message between two of them; use dist.broadcast from the "
        "sender (every rank of the group calls it), or a two-rank dist.new_group([sender, "
        "receiver]) that both ranks create (every rank calls new_group) and broadcast in it"
    )


def create_process_group(
    store: Store, rank: int, size: int, timeout: datetime.timedelta
) -> ProcessGroupGradServer:
    """The creator registered with torch: finds or starts the group's coordinator, joins as `rank`.
    The default group joins GRADSERVER_COORDINATOR when it is set; every later group (a
    `dist.new_group`, a DeviceMesh dimension) gets its own embedded coordinator, also under
    `gradserver run`: a coordinator's operations involve all of its workers, so one coordinator
    cannot serve groups with other members."""
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
    return ProcessGroupGradServer(client, embedded, timeout_s, check_finite)
