"""The one exception hierarchy of gradserver, and the status codes its errors travel as.

The coordinator reports failures as status codes (on the RPC, or inside the stream as an `Error`
message); the worker maps each code to one class here, at one boundary (`error_from_status`).
`Status` has gRPC's code names and numbers, so the wire value is the gRPC one, but this module
imports no grpc: the pure cores raise and return these without depending on the transport, and
the conversion to and from `grpc.StatusCode` lives only at the gRPC edge (`gradserver.common.rpc`).

Every class keeps the server's message and, where known, the step, the key
and the worker the error is about. Classes also derive from the matching built-in (a timeout is a
`TimeoutError`, invalid input a `ValueError`, a lost connection a `ConnectionError`) so callers can
catch either.

Callers decide by meaning, not by status code: five classes say what happened, and every
status-named class is one of them.

- `StepFailed`: this step failed for every worker, because of `culprit` (lost, bad data, NaN) or
  none (a timeout); the connection stays usable and the next step may be sent (ABORTED).
- `Refused`: this worker's own request or input was refused, naming what (INVALID_ARGUMENT,
  FAILED_PRECONDITION, RESOURCE_EXHAUSTED, UNAUTHENTICATED, PERMISSION_DENIED).
- `ConnectionLost`: the coordinator cannot be reached or the connection broke (UNAVAILABLE);
  `JobEnded`, one kind of it: the coordinator said the job is over.
- `Timeout`: a call or a wait did not finish within its deadline (DEADLINE_EXCEEDED).
- `InternalError`: a bug or an unexpected reply.
"""

from __future__ import annotations

import enum

__all__ = [
    "AbortedError",
    "ConnectionLost",
    "CoordinatorShutdownError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "GradServerError",
    "InternalError",
    "InvalidArgumentError",
    "JobEnded",
    "PermissionDeniedError",
    "Refused",
    "ResourceExhaustedError",
    "Status",
    "StepFailed",
    "Timeout",
    "UnauthenticatedError",
    "UnavailableError",
    "error_from_status",
    "status_code_from_value",
]


class Status(enum.IntEnum):
    """A status an error travels as: gRPC's code names with gRPC's numeric values (the value on
    the wire), without depending on grpc."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class GradServerError(Exception):
    """Base of every gradserver error. `code` is the status the error travels as."""

    code: Status = Status.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        key: str | None = None,
        worker_id: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.key = key
        self.worker_id = worker_id

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class StepFailed(GradServerError):
    """A step failed for every worker: `culprit` is the worker whose message or loss caused it
    (None when none did, e.g. a step timeout), `reason` says why. The connection stays usable."""

    code = Status.ABORTED

    @property
    def culprit(self) -> int | None:
        return self.worker_id

    @property
    def reason(self) -> str:
        return self.message


class Refused(GradServerError):
    """This worker's own request or input was refused; the message names what was wrong."""

    code = Status.INVALID_ARGUMENT


class ConnectionLost(GradServerError, ConnectionError):
    """The coordinator cannot be reached, or the connection to it broke."""

    code = Status.UNAVAILABLE


class JobEnded(ConnectionLost):
    """The coordinator ended the job (SIGTERM, max steps, a failed job) and said so."""


class Timeout(GradServerError, TimeoutError):
    """A call or a wait did not finish within its deadline."""

    code = Status.DEADLINE_EXCEEDED


class InvalidArgumentError(Refused, ValueError):
    """A message or argument is malformed or disagrees with what other workers sent."""

    code = Status.INVALID_ARGUMENT


class FailedPreconditionError(Refused):
    """Well-formed, but not valid now: wrong step, unknown or evicted worker, stale session."""

    code = Status.FAILED_PRECONDITION


class AbortedError(StepFailed):
    """The step failed because of another worker (lost, bad data, NaN); the stream stays usable."""

    code = Status.ABORTED


class UnavailableError(ConnectionLost):
    """The coordinator cannot be reached or the connection to it broke."""

    code = Status.UNAVAILABLE


class CoordinatorShutdownError(UnavailableError, JobEnded):
    """The coordinator told this worker that the job is over (SIGTERM, max steps)."""


class DeadlineExceededError(Timeout):
    """A call or a wait did not finish within its deadline."""

    code = Status.DEADLINE_EXCEEDED


class ResourceExhaustedError(Refused):
    """A configured limit was hit: world full, message or tensor too large, too many streams."""

    code = Status.RESOURCE_EXHAUSTED


class UnauthenticatedError(Refused, PermissionError):
    """Credentials were missing or wrong."""

    code = Status.UNAUTHENTICATED


class PermissionDeniedError(Refused, PermissionError):
    """Authenticated, but not allowed to act as this worker."""

    code = Status.PERMISSION_DENIED


class InternalError(GradServerError):
    """A bug or an unexpected reply; the message says what was seen."""

    code = Status.INTERNAL


_BY_CODE: dict[Status, type[GradServerError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        FailedPreconditionError,
        AbortedError,
        UnavailableError,
        DeadlineExceededError,
        ResourceExhaustedError,
        UnauthenticatedError,
        PermissionDeniedError,
        InternalError,
    )
}
_BY_CODE[Status.ALREADY_EXISTS] = InvalidArgumentError
_BY_CODE[Status.OUT_OF_RANGE] = InvalidArgumentError
_BY_CODE[Status.CANCELLED] = UnavailableError
_BY_CODE[Status.UNIMPLEMENTED] = FailedPreconditionError


def status_code_from_value(value: int) -> Status:
    """The Status whose numeric value is `value` (UNKNOWN for values not defined)."""
    try:
        return Status(value)
    except ValueError:
        return Status.UNKNOWN


def error_from_status(
    code: Status | int,
    message: str,
    *,
    step: int | None = None,
    key: str | None = None,
    worker_id: int | None = None,
) -> GradServerError:
    """Builds the exception for a status received from the coordinator (a `Status` or its
    numeric value, as it arrives on the wire)."""
    status = status_code_from_value(code)
    cls = _BY_CODE.get(status, InternalError)
    if cls is InternalError and status is not Status.INTERNAL:
        message = f"{status.name}: {message}"
    return cls(message, step=step, key=key, worker_id=worker_id)
