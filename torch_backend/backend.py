"""`ProcessGroupGradServer`: a torch.distributed process group whose collectives go through a
gradserver coordinator.

Every collective is one generic collective key of the coordinator (see docs/PROTOCOL.md): the
group's operations are numbered in issue order and run one after another on one background
thread per group; each call returns a `Work` at once. Reductions are the coordinator's: float64
sums in rank order rounded once to float32, so SUM and AVG are bit-identical on every rank and
independent of arrival order. Broadcast and allgather move the raw bytes of any dtype exactly:
each byte travels as a float32 in [0, 255], and the ranks that do not own a segment send zeros,
so a SUM reproduces the owner's bytes. A rank that is lost makes every other rank's pending and
later Work fail with the coordinator's error naming it (worker ids are the group's ranks).
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

log = logging.getLogger("gradserver.torch")

BACKEND_NAME = "gradserver"
_DEFAULT_GROUP = 0
_REDUCE_OPS = {dist.ReduceOp.SUM: ReduceOp.SUM, dist.ReduceOp.AVG: ReduceOp.AVG}
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
        op = opts.reduceOp if isinstance(opts, dist.AllreduceOptions) else opts
        wire_op = _wire_op(op if op is not None else dist.ReduceOp.SUM)
        integer = _check_allreduce_dtypes(tensors, wire_op, self.size())

        def run(sequence: int) -> None:
            flat = [t.detach().reshape(-1).to("cpu") for t in tensors]
            values = (flat[0] if len(flat) == 1 else torch.cat(flat)).contiguous().numpy()
            if integer:
                result = _from_limbs(self._exchange(sequence, _to_limbs(values), ReduceOp.SUM))
            else:
                result = self._exchange(sequence, values, wire_op)
            _scatter_into(tensors, torch.from_numpy(result))

        return self._submit("allreduce", run, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        root = opts.rootRank if isinstance(opts, dist.BroadcastOptions) else 0
        if not 0 <= root < self.size():
            raise ValueError(f"broadcast: root rank {root} is out of range for a group of {self.size()}")

        def run(sequence: int) -> None:
            data = np.concatenate([_bytes_of(t) for t in tensors]) if tensors else np.zeros(0, np.uint8)
            payload = data.astype(np.float32) if self.rank() == root else np.zeros(data.size, np.float32)
            result = self._exchange(sequence, payload, ReduceOp.SUM)
            _write_bytes_into(tensors, result.astype(np.uint8))

        return self._submit("broadcast", run, tensors)

    def allgather(  # type: ignore[override]
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        size, rank = self.size(), self.rank()
        for i, outputs in enumerate(output_tensors):
            if len(outputs) != size:
                raise ValueError(f"allgather: output list {i} holds {len(outputs)} tensors, the group {size}")

        def run(sequence: int) -> None:
            mine = np.concatenate([_bytes_of(t) for t in input_tensors]) if input_tensors else np.zeros(0)
            payload = np.zeros(mine.size * size, np.float32)
            payload[rank * mine.size : (rank + 1) * mine.size] = mine
            gathered = self._exchange(sequence, payload, ReduceOp.SUM).astype(np.uint8)
            segments = gathered.reshape(size, mine.size) if mine.size else np.zeros((size, 0), np.uint8)
            for r in range(size):
                _write_bytes_into([outputs[r] for outputs in output_tensors], segments[r])

        flat_outputs = [t for outputs in output_tensors for t in outputs]
        return self._submit("allgather", run, flat_outputs)

    def barrier(self, opts: Any = None) -> dist.Work:
        def run(sequence: int) -> None:
            self._exchange(sequence, np.zeros(0, np.float32), ReduceOp.SUM)

        return self._submit("barrier", run, [torch.zeros(0)])

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

    def _exchange(self, sequence: int, payload: np.ndarray, op: ReduceOp) -> np.ndarray:
        self._client.send_collective(sequence, _DEFAULT_GROUP, payload, op)
        return self._client.receive_collective(self._timeout_s)

    def _submit(self, what: str, run: Callable[[int], None], result: list[torch.Tensor]) -> dist.Work:
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        with self._issue:
            if self._closed:
                raise RuntimeError(f"gradserver {what}: this process group was shut down")
            sequence = next(self._sequence)
            self._executor.submit(self._run, what, sequence, run, result, future)
        return _FutureWork(future)

    def _run(
        self,
        what: str,
        sequence: int,
        run: Callable[[int], None],
        result: list[torch.Tensor],
        future: torch.futures.Future[list[torch.Tensor]],
    ) -> None:
        try:
            run(sequence)
        except GradServerError as exc:
            message = f"rank {self.rank()}: gradserver {what} (operation {sequence}) failed: {exc.message}"
            error = type(exc)(message, step=exc.step, key=exc.key, worker_id=exc.worker_id)
            future.set_exception(error)  # type: ignore[arg-type]  # the stubs mistype it
            return
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the Work, not the thread
            future.set_exception(exc)  # type: ignore[arg-type]
            return
        future.set_result(result)


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


def _wire_op(op: Any) -> ReduceOp:
    for torch_op, wire in _REDUCE_OPS.items():
        if op == torch_op:
            return wire
    names = [n for n in ("PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM") if _is_op(op, n)]
    raise NotImplementedError(f"gradserver allreduce supports SUM and AVG, not {names[0] if names else op}")


def _is_op(op: Any, name: str) -> bool:
    try:
        return bool(op == getattr(dist.ReduceOp, name))
    except (AttributeError, TypeError):
        return False


_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
# An integer travels as four 16-bit limbs of its 64-bit two's complement; a sum of up to 256
# limbs stays below 2**24, so float32 holds it exactly.
_LIMBS = 4
_MAX_INTEGER_RANKS = 256


def _check_allreduce_dtypes(tensors: Sequence[torch.Tensor], op: ReduceOp, size: int) -> bool:
    """True for an exact integer SUM; raises TypeError naming a dtype it cannot reduce exactly."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"gradserver allreduce: tensors of one call must share a dtype, got {dtypes}")
    dtype = dtypes.pop() if dtypes else torch.float32
    if dtype == torch.float32:
        return False
    if dtype in _INTEGER_DTYPES and op is ReduceOp.SUM and size <= _MAX_INTEGER_RANKS:
        return True
    raise TypeError(
        f"gradserver allreduce: dtype {dtype} with {op.name} is not supported; the coordinator "
        "reduces float32 exactly (SUM and AVG) and integers exactly (SUM); convert other dtypes "
        "with .float() and back, where that rounding is acceptable"
    )


def _to_limbs(values: np.ndarray) -> np.ndarray:
    unsigned = values.astype(np.int64).view(np.uint64)
    limbs = [(unsigned >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(_LIMBS)]
    return np.stack(limbs, axis=1).astype(np.float32).reshape(-1)


def _from_limbs(sums: np.ndarray) -> np.ndarray:
    limbs = sums.reshape(-1, _LIMBS).astype(np.uint64)
    total = np.zeros(limbs.shape[0], np.uint64)
    for k in range(_LIMBS):
        total += limbs[:, k] << np.uint64(16 * k)  # wraps modulo 2**64, like the integer sum
    return total.view(np.int64)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes (a copy on the host)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)


def _write_bytes_into(tensors: Sequence[torch.Tensor], data: np.ndarray) -> None:
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            raw = torch.from_numpy(np.ascontiguousarray(data[offset : offset + nbytes]))
            tensor.copy_(raw.view(tensor.dtype).reshape(tensor.shape))
        offset += nbytes


def _scatter_into(tensors: Sequence[torch.Tensor], result: torch.Tensor) -> None:
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        tensor.copy_(result[offset : offset + n].reshape(tensor.shape))
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
