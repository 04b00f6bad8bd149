"""What the reduction table asks the coordinator to send: one event for a set of workers.

The table does no I/O; each of its calls returns a list of `Outgoing` and the coordinator encodes
each event once and queues the same bytes on every listed worker's stream.
"""

from __future__ import annotations

import dataclasses

from gradserver.common.errors import Status
from gradserver.common.messages import ErrorOut, ServerEvent, TensorKey


@dataclasses.dataclass(frozen=True)
class Outgoing:
    """One message for the listed workers (each gets the very same encoded bytes)."""

    to: tuple[int, ...]
    event: ServerEvent


def error_to(
    w: int,
    step: int,
    code: Status,
    message: str,
    subject: TensorKey | str,
    culprit: int | None = None,
    *,
    step_failed: bool = False,
) -> Outgoing:
    key = subject if isinstance(subject, TensorKey) else None
    barrier = subject if isinstance(subject, str) else None
    event = ErrorOut(
        int(code),
        message,
        step,
        key=key,
        culprit_worker_id=culprit,
        barrier_name=barrier,
        step_failed=step_failed,
    )
    return Outgoing((w,), event)
