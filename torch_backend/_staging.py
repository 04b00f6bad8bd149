"""The host side of one collective's tensors: what is copied in before it runs and out after.

Every collective runs on host tensors, whatever device the caller's tensors are on, so there is
one code path for all of them. At the call, each of the caller's tensors is declared as read
(its bytes are the input), written (the result goes there) or both, and gets its host
counterpart: the tensor itself on the host (no copy, no allocation), else a contiguous host
buffer that `copy_in` fills from it and `copy_out` copies back into it (`_devices` moves the
bytes). One tensor declared twice has one counterpart (an in-place allreduce reads and writes the
same buffer); two views of one device tensor get one each, so a collective whose output holds its
input (FSDP's all-gather) reads the input before anything is written.

Only written tensors are copied back, and only those the collective fills entirely (a reduce's
non-root tensors are read, not written, and stay as they were).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Sequence

import torch

from ._devices import DeviceTransfers, Transfers


class Staging:
    """One collective's tensors and their host counterparts."""

    def __init__(self, what: str, tensors: Sequence[torch.Tensor], transfers: DeviceTransfers) -> None:
        self._policy = transfers
        self._transfers: Transfers | None = None
        self._mark: object = None
        self._copied: object = None
        self._staged: dict[int, _Staged] = {}  # by id() of the caller's tensor
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        staged = [t for t in tensors if transfers.stages(t)]
        if not staged:
            return
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(
                f"gradserver {what}: the tensors of one call must be on one device, "
                f"got {sorted(map(str, devices))}"
            )
        self._transfers = transfers.for_device(staged[0].device)
        self._mark = self._transfers.mark()

    @property
    def device_resident(self) -> bool:
        """Whether any tensor is copied through the host (worth overlapping with the caller)."""
        return self._transfers is not None

    def future(self) -> torch.futures.Future[list[torch.Tensor]]:
        device = self._transfers.device if self._transfers is not None else None
        if device is None:
            return torch.futures.Future()
        return torch.futures.Future(devices=[device])

    # --- declared at the call -----------------------------------------------------------------

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host tensor holding `tensor`'s bytes while the collective runs."""
        return self._declare(tensor, read=True, written=False)

    def write(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host tensor the collective writes `tensor`'s result into (all of it)."""
        return self._declare(tensor, read=False, written=True)

    def update(self, tensor: torch.Tensor) -> torch.Tensor:
        """Both: `tensor` is the input and receives the result."""
        return self._declare(tensor, read=True, written=True)

    def reads(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [self.read(t) for t in tensors]

    def writes(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [self.write(t) for t in tensors]

    def updates(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        return [self.update(t) for t in tensors]

    def _declare(self, tensor: torch.Tensor, *, read: bool, written: bool) -> torch.Tensor:
        if self._transfers is None or not self._policy.stages(tensor):
            return tensor
        staged = self._staged.get(id(tensor))
        if staged is None:
            staged = _Staged(tensor, self._transfers.host_buffer(tensor), read, written)
            self._staged[id(tensor)] = staged
        else:
            staged.read = staged.read or read
            staged.written = staged.written or written
        return staged.host

    # --- when the collective runs -------------------------------------------------------------

    def running(self) -> contextlib.AbstractContextManager[None]:
        """The block that copies in, runs the collective and copies out: after the caller's work
        issued before the call, with the copies ordered on their own stream."""
        if self._transfers is None:
            return contextlib.nullcontext()
        return self._transfers.running(self._mark)

    def copy_in(self) -> None:
        """Fills the host buffers of the tensors read (inside `running`)."""
        if self._transfers is not None:
            self._transfers.to_host([(s.tensor, s.host) for s in self._staged.values() if s.read])

    def copy_out(self) -> None:
        """Queues the copies of the results into the tensors written (inside `running`)."""
        if self._transfers is not None:
            written = [(s.host, s.tensor) for s in self._staged.values() if s.written]
            self._copied = self._transfers.to_device(written)

    def release(self) -> None:
        """Drops the host buffers (once the copies out are queued: the allocator keeps each
        until the copies that use it are done)."""
        self._staged.clear()

    def completing(self) -> contextlib.AbstractContextManager[None]:
        """Completes the Work's future inside the block: after the copies out."""
        if self._transfers is None:
            return contextlib.nullcontext()
        return self._transfers.completing(self._copied)

    def order_current(self) -> None:
        """Makes the calling thread's current stream wait for the copies out (a Work's wait)."""
        if self._transfers is not None:
            self._transfers.order_current(self._copied)


@dataclasses.dataclass(slots=True)
class _Staged:
    """A caller's tensor, its host buffer, and whether the collective reads and writes it."""

    tensor: torch.Tensor
    host: torch.Tensor
    read: bool
    written: bool
