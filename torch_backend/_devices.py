"""How a collective's device tensors reach the host and come back, ordered with the caller's work.

The coordinator reduces host bytes, so a collective on device tensors copies its inputs to the
host and its results back (`_staging` says which tensors go which way). This module moves them.

CUDA (`CudaTransfers`, one per device and group):
- At the call, an event is recorded on the caller's current stream: the inputs are ready there.
- The group's thread makes the group's copy stream wait for that event, on the GPU: the copies
  wait for the caller's work issued before the call, never for what it issues after (the rest of
  DDP's backward keeps running). The inputs go into pinned host buffers with non_blocking copies
  on the copy stream, and the thread waits for an event recorded after them: those copies only,
  not the device or the caller's stream. A pageable copy instead blocks the calling thread inside
  cudaMemcpyAsync and runs at a fraction of the bandwidth.
- The results go back with non_blocking copies on the same copy stream (so the next operation's
  copies to the host see them), and the device tensors are marked as used there
  (`record_stream`), so the caching allocator keeps their memory until the copies are done.
- The Work's future is CUDA-aware and is completed with a completion stream current that waited
  for those copies: torch records its events there, and whoever waits (`Work.wait()`,
  `future.wait()`, DDP's reducer at the end of backward) makes its own stream wait for the
  copies. Nothing stalls the caller's stream before that wait.
- Pinned buffers come from torch's caching host allocator: torch records an event for every
  non_blocking copy from or to one, and reuses a freed buffer for a request of its size class
  only once those events have passed, so steady-state training allocates none and never reuses
  a buffer a copy still reads.

Any other device (`BlockingTransfers`, the fallback that needs no CUDA): plain copies that return
when done, into pageable host memory. Correct everywhere, without overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch


class Transfers(Protocol):
    """Copies between one device and the host, for the collectives of one group."""

    @property
    def device(self) -> torch.device | None:
        """The device a Work's future must be aware of (None: a plain future)."""
        ...

    def mark(self) -> object:
        """Where the caller's work stands at the call (on the caller's thread)."""
        ...

    def running(self, mark: object) -> contextlib.AbstractContextManager[None]:
        """Runs a block (on whichever thread runs the operation) after the caller's work up to
        `mark`, with the copy stream current."""
        ...

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor of `like`'s shape and dtype, to copy through."""
        ...

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies each (device, host) pair's device tensor into its host buffer; returns once
        the host holds them (inside `running`)."""
        ...

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> object:
        """Queues the copy of each (host, device) pair's host buffer into its device tensor
        (inside `running`); returns what `completing` and `order_current` wait for."""
        ...

    def completing(self, copied: object) -> contextlib.AbstractContextManager[None]:
        """Completes a future inside the block: after the copies `copied` stands for."""
        ...

    def order_current(self, copied: object) -> None:
        """Makes the calling thread's current stream wait for the copies `copied` stands for."""
        ...


class BlockingTransfers:
    """Plain copies, done when they return, through pageable host memory."""

    device: torch.device | None = None

    def mark(self) -> object:
        return None

    def running(self, mark: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for device_tensor, host in pairs:
            host.copy_(device_tensor.detach())

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> object:
        for host, device_tensor in pairs:
            device_tensor.detach().copy_(host)
        return None

    def completing(self, copied: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def order_current(self, copied: object) -> None:
        return None


class CudaTransfers:
    """Pinned buffers and non_blocking copies on a copy stream of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device: torch.device | None = device
        self._device = device
        self._copies = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # Only waits for the copies back of one operation at a time: torch records the future's
        # events on it, and an event recorded on the copy stream itself could also cover later
        # operations' copies queued there meanwhile.
        self._completions = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def mark(self) -> object:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self._device))
        return event

    def running(self, mark: object) -> contextlib.AbstractContextManager[None]:
        return self._on_copy_stream(mark)

    @contextlib.contextmanager
    def _on_copy_stream(self, mark: object) -> Iterator[None]:
        with torch.cuda.stream(self._copies):
            if isinstance(mark, torch.cuda.Event):
                self._copies.wait_event(mark)
            yield

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def to_host(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        for device_tensor, host in pairs:
            host.copy_(device_tensor.detach(), non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self._copies)
        done.synchronize()  # this thread only, for these copies only (the GIL is released)

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> object:
        if not pairs:
            return None
        for host, device_tensor in pairs:
            device_tensor.detach().copy_(host, non_blocking=True)
            device_tensor.record_stream(self._copies)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(self._copies)
        return copied

    def completing(self, copied: object) -> contextlib.AbstractContextManager[None]:
        return self._on_completion_stream(copied)

    @contextlib.contextmanager
    def _on_completion_stream(self, copied: object) -> Iterator[None]:
        with torch.cuda.stream(self._completions):
            if isinstance(copied, torch.cuda.Event):
                self._completions.wait_event(copied)
            yield

    def order_current(self, copied: object) -> None:
        if isinstance(copied, torch.cuda.Event):
            torch.cuda.current_stream(self._device).wait_event(copied)


class DeviceTransfers:
    """Which tensors a group stages through the host, and the transfers of each device (made
    when first needed: a CUDA stream per device and group)."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, Transfers] = {}

    def stages(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` must be copied through a host buffer for a collective: a device
        tensor, or a conjugate or negative view (its memory is not its value; a copy resolves
        it both ways). Other host tensors are used where they are: no copy."""
        return tensor.device.type != "cpu" or tensor.is_conj() or tensor.is_neg()

    def for_device(self, device: torch.device) -> Transfers:
        transfers = self._by_device.get(device)
        if transfers is None:
            if device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                transfers = CudaTransfers(torch.device("cuda", index))
            else:
                transfers = BlockingTransfers()
            transfers = self._by_device.setdefault(device, transfers)
        return transfers
