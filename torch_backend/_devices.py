"""Where a collective's tensors live, and how the background thread orders itself with the caller.

CPU tensors need nothing. CUDA tensors (all on one device) are copied to the host once and back:
at the call, an event is recorded on the caller's current stream; the group's thread waits for
that event (so it reads what the caller's kernels wrote), copies to the host on the caller's
stream, and enqueues the copy back on that same stream, so kernels the caller issues on it after
`wait()` see the result. The Work's future is CUDA-aware (created for the device, completed on
the caller's stream), as torch's own backends do for DDP's communication hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class StreamOrder:
    """The caller's stream for the tensors of one call (None for CPU tensors)."""

    def __init__(self, what: str, tensors: Sequence[torch.Tensor]) -> None:
        self.device: torch.device | None = None
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        if not any(t.is_cuda for t in tensors):
            return
        devices = {t.device for t in tensors}
        cuda = {d for d in devices if d.type == "cuda"}
        if len(devices) > 1:
            raise ValueError(
                f"gradserver {what}: the tensors of one call must be on one device, "
                f"got {sorted(map(str, devices))}"
            )
        self.device = cuda.pop()
        self._stream = torch.cuda.current_stream(self.device)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(self._stream)

    def future(self) -> torch.futures.Future[list[torch.Tensor]]:
        if self.device is None:
            return torch.futures.Future()
        return torch.futures.Future(devices=[self.device])

    def on_caller_stream(self) -> contextlib.AbstractContextManager[None]:
        """Runs the block (on the group's thread) after the caller's work that was queued before
        the call, with the caller's stream current: copies in and out are ordered on it."""
        if self._stream is None or self._event is None:
            return contextlib.nullcontext()
        return self._on_stream()

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        assert self._event is not None and self._stream is not None
        self._event.synchronize()
        with torch.cuda.stream(self._stream):
            yield
