"""gradserver as a torch.distributed backend: `import gradserver.torch` registers "gradserver".

Its own package beside the client library (folder `torch_backend/`, installed as
`gradserver.torch`): a client of the same coordinator API as `WorkerClient`, which it builds on;
neither the client library nor the coordinator imports it, so both work without torch.
"""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any

from ._registration import BACKEND_NAME, DEVICE_TYPES, device_backends, served_devices

__all__ = ["BACKEND_NAME", "register"]


def register() -> None:
    """Registers the "gradserver" backend with torch.distributed for cpu and cuda tensors
    (idempotent). The process group module is imported only when a group is created, so
    registering at `import torch` is cheap."""
    import torch.distributed as dist

    dist.Backend.register_backend(BACKEND_NAME, _create, devices=list(DEVICE_TYPES))


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    # torch's frame that builds the group (the caller) says which device types it gives this
    # backend; a string that gives one to another backend is refused here, before a coordinator
    # starts.
    try:
        devices = served_devices(device_backends(sys._getframe(1)))
    except ValueError:
        _refuse_together(store, size, timeout)
        raise
    from .backend import create_process_group

    return create_process_group(store, rank, size, timeout, devices=devices)


def _refuse_together(store: Any, size: int, timeout: datetime.timedelta) -> None:
    """Waits (through the group's store, up to `timeout`) until every rank refuses: torch built
    the backends of the devices before this one already (gloo for "cpu:gloo,cuda:gradserver"),
    and a rank that dropped its gloo connections while a peer still made them would give that
    peer a "Connection closed by peer" instead of the refusal."""
    # Counted across attempts on one store (a refused group's name is taken again by the next).
    count = store.add("gradserver/refused", 1)
    done = f"gradserver/refused-all/{(count - 1) // size}"
    if count % size == 0:
        store.set(done, "1")
    try:
        store.wait([done], timeout)
    except Exception:  # the refusal matters more than the wait for the others
        log = logging.getLogger("gradserver.torch")
        log.warning("not every rank refused the group in time", exc_info=True)


def autoload() -> None:
    """The `torch.backends` entry point, run at `import torch`: must never break that import."""
    try:
        register()
    except Exception:  # a failure here must not make `import torch` fail
        logging.getLogger("gradserver.torch").warning(
            "could not register the gradserver torch.distributed backend", exc_info=True
        )


register()
