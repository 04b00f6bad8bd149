"""The process group's quantized SUM: a float32 tensor sent as int8 or int4 records that the
coordinator decodes, sums in float64 in rank order and requantizes once (docs/PROTOCOL.md,
"Quantized wire dtypes"), so a rank uploads one quantized payload and downloads one.

Not a torch.distributed collective (torch has no quantized all_reduce): `diloco.DiLoCo` over a
"gradserver" process group calls it for its int8/int4 pseudo-gradients (`_pg_exchange`). It is
queued in the group's operation order like every collective, so the ranks issue it where they
issue their other collectives, and it returns the usual `Work`. Every rank gets the same bytes,
decoded into the caller's tensor; the caller keeps its own quantization error (error feedback).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradserver.common.errors import InvalidArgumentError
from gradserver.common.messages import ReduceOp

from ._group_core import DEFAULT_GROUP, GroupCore
from ._tensor_bytes import flatten, host_view, scatter_into

# The wire dtypes whose records the coordinator sums (common/quantized_wire.py).
QUANTIZED_WIRES = ("int8", "int4")


class QuantizedCollectives(GroupCore):
    """`quantized_allreduce` on `GroupCore`'s calls."""

    def quantized_allreduce(self, tensor: torch.Tensor, wire: str) -> dist.Work:
        """The SUM of `tensor` (float32, CPU or CUDA) over the group, in place, sent as `wire`
        ("int8" or "int4") records: each value of the result is within half a quantization step
        of its block of 64 of the float32 sum of what the ranks sent."""
        if wire not in QUANTIZED_WIRES:
            raise InvalidArgumentError(
                f"gradserver quantized_allreduce: wire {wire!r} is not one of {', '.join(QUANTIZED_WIRES)}"
            )
        if tensor.dtype != torch.float32:
            raise InvalidArgumentError(
                f"gradserver quantized_allreduce: takes a float32 tensor, got {tensor.dtype}"
            )
        staging = self._staging("quantized_allreduce", [tensor])
        hosts = staging.updates([tensor])

        def run(sequence: int) -> None:
            flat = flatten(hosts)
            result = self._client.run_collective(
                sequence, DEFAULT_GROUP, host_view(flat), ReduceOp.SUM, timeout=self._timeout_s, wire=wire
            )
            scatter_into(hosts, torch.from_numpy(result))

        return self._operations.submit("quantized_allreduce", staging, run, [tensor])
