"""gradserver as a torch.distributed backend: `import gradserver.torch` registers "gradserver".

Its own package beside the client library (folder `torch_backend/`, installed as
`gradserver.torch`): a client of the same coordinator API as `WorkerClient`, which it builds on;
neither the client library nor the coordinator imports it, so both work without torch.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

__all__ = ["BACKEND_NAME", "register"]

BACKEND_NAME = "gradserver"


def register() -> None:
    """Registers the "gradserver" backend with torch.distributed (idempotent). The process group
    module is imported only when a group is created, so registering at `import torch` is cheap."""
    import torch.distributed as dist

    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    from .backend import create_process_group

    return create_process_group(store, rank, size, timeout)


def autoload() -> None:
    """The `torch.backends` entry point, run at `import torch`: must never break that import."""
    try:
        register()
    except Exception:  # a failure here must not make `import torch` fail
        logging.getLogger("gradserver.torch").warning(
            "could not register the gradserver torch.distributed backend", exc_info=True
        )


register()
