"""The seam between DiLoCo's outer steps and what carries their averages across replicas.

DiLoCo (diloco.py) builds each fragment's payload and turns the result into the outer gradient;
an `OuterExchange` only moves the payload: a SUM of a float32 vector over the replicas, or a
gather of every replica's bytes in rank order. Two implementations, each in its own module:

- `_pg_exchange.ProcessGroupExchange`: a torch.distributed process group (the "gradserver"
  backend): an async SUM all_reduce or all_gather, waited for when the outer step is due. A lost
  rank ends the job.
- `_ft_exchange.FtExchange`: an `ft.Replica`'s WorkerClient: each exchange is one fault-tolerant
  step of the coordinator, summed over the replicas that take part and committed behind a barrier;
  a step that failed is discarded by every replica (`Landing.wait` gives None), and a replica
  that joins the running job takes a live one's state, outer state included, at an exchange.
  With `at_boundary(overlap=True)` the step runs on a thread of its own while the inner steps go
  on, and a joining replica takes a copy of the state made at the exchange's boundary.
"""

from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor


class Landing(Protocol):
    """One exchange on its way."""

    def wait(self) -> torch.Tensor | None:
        """The exchange's result (the summed vector, or every replica's bytes one row each), the
        same bytes on every replica; None when the exchange was discarded by every replica.
        Called by the training thread; the same answer every time. May raise `Resumed`."""
        ...


class OuterState(Protocol):
    """What an exchange that heals replicas needs of DiLoCo: its state at an exchange."""

    def outer_tensors(self) -> dict[str, torch.Tensor]:
        """The outer state's tensors by name (`outer/...`), no copies."""
        ...

    def outer_extra(self) -> dict[str, Any]:
        """The outer state's other values (JSON-friendly)."""
        ...

    def load_outer(self, tensors: dict[str, Any], extra: dict[str, Any]) -> None:
        """Takes what `outer_tensors` and `outer_extra` gave on another replica."""
        ...


class OuterExchange(Protocol):
    """Moves DiLoCo's payloads between the replicas (see the module's docstring)."""

    replicas: int  # the replicas a payload has a slot for (the world)
    rank: int  # this replica's slot
    gathers: bool  # whether `gather` is offered: else quantized payloads are summed dequantized
    # the formats `quantized_sum` takes ("int8", "int4": records the coordinator sums and
    # requantizes once; "bf16": bfloat16 values it sums and rounds once); others are gathered
    summed_formats: frozenset[str]
    # an exchange may be discarded (`Landing.wait` gives None), replicas join at one, and only
    # one exchange is on its way at a time: DiLoCo waits for it before it sends the next
    heals: bool

    def check_identical(self, params: list[tuple[str, torch.Tensor]]) -> None:
        """Refuses replicas that start from different parameters, naming the first that differs."""
        ...

    def sum(self, vector: torch.Tensor) -> Landing:
        """The SUM of `vector` (float32) over the replicas taking part."""
        ...

    def quantized_sum(self, values: torch.Tensor, extra: torch.Tensor, wire: str) -> Landing:
        """The SUM of [values, extra] over the replicas taking part: `values` travel as `wire`
        (one of `summed_formats`), which the coordinator sums and requantizes (rounds) once,
        `extra` as exact float32; the landed vector is the decoded sum of `values`, then the sum
        of `extra`."""
        ...

    def gather(self, piece: torch.Tensor) -> Landing:
        """Every replica's `piece` (uint8, the same size everywhere), in rank order."""
        ...

    def attach(self, state: OuterState) -> bool:
        """Tells the exchange whose outer state it carries (a heal takes it). True: this replica
        joined a running job and `state` now holds a live replica's, taken at that replica's
        exchange (checked byte for byte), which this one takes part in next."""
        ...

    def at_boundary(self, *, overlap: bool) -> contextlib.AbstractContextManager[None]:
        """Entered once an exchange's payload is built, around the call that sends it: the state
        is at the exchange's boundary, which a joining replica may take until the result is in.
        `overlap`: the caller goes on with inner steps before it waits for the result, so an
        exchange that heals copies that state now and runs in the background; else the call
        returns with the result in (the state is held still meanwhile)."""
        ...


def structure_digest(params: list[tuple[str, torch.Tensor]]) -> int:
    """56 bits of the parameters' names, dtypes and (this rank's) shapes, in order."""
    text = ";".join(f"{name}:{p.dtype}:{tuple(local_part(p).shape)}" for name, p in params)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def parameter_digests(params: list[tuple[str, torch.Tensor]]) -> list[int]:
    """The CRC-32 of each parameter's bytes (this rank's shard of a sharded one)."""
    return [
        zlib.crc32(local_part(p).detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        for _, p in params
    ]


def local_part(value: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's parameters), or the tensor itself."""
    return value.to_local() if isinstance(value, DTensor) else value


# The names of the two entries DiLoCo checks beside the parameters: its settings at the start,
# and where a loaded checkpoint is.
SETTINGS = "outer/settings"
POSITION = "outer/position"


def mismatch(rank: int, name: str, among: str) -> str:
    """The message of a replica whose `name` (a parameter, or `SETTINGS` / `POSITION`) differs
    from the others' (`among`: which replicas, as each exchange can tell)."""
    if name == SETTINGS:
        return (
            f"replica {rank}: the DiLoCo settings differ {among}: every replica must run with the same "
            "sync_every, fragments, delay, keep_local, quantize, block and flush"
        )
    if name == POSITION:
        return (
            f"replica {rank}: parameter {name!r} differs {among}: every replica must load a checkpoint "
            "of the same step (each its own)"
        )
    return (
        f"replica {rank}: parameter {name!r} differs {among}: every replica must start from the same "
        "weights (seed the model's initialisation, or load one checkpoint)"
    )


class Resumed(Exception):
    """Raised out of an exchange when this replica took a live replica's state meanwhile (it
    rejoined a restarted coordinator behind the others): DiLoCo goes on from that state."""


@contextlib.contextmanager
def nothing_held(*, overlap: bool) -> Iterator[None]:
    """`at_boundary` of an exchange that heals no replica."""
    yield
