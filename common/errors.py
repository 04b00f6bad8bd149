"""The one exception hierarchy of gradserver, and its mapping to and from gRPC status codes.

The coordinator reports failures as gRPC status codes (on the RPC, or inside the stream as an
`Error` message); the worker maps each code to one class here, at one boundary
(`error_from_status`). Every class keeps the server's message and, where known, the step, the key
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

import grpc

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
    "StepFailed",
    "Timeout",
    "UnauthenticatedError",
    "UnavailableError",
    "error_from_status",
]


class GradServerError(Exception):
    """Base of every gradserver error. `code` is the gRPC status the error travels as."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

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

    code = grpc.StatusCode.ABORTED

    @property
    def culprit(self) -> int | None:
        return self.worker_id

    @property
    def reason(self) -> str:
        return self.message


class Refused(GradServerError):
    """This worker's own request or input was refused; the message names what was wrong."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ConnectionLost(GradServerError, ConnectionError):
    """The coordinator cannot be reached, or the connection to it broke."""

    code = grpc.StatusCode.UNAVAILABLE


class JobEnded(ConnectionLost):
    """The coordinator ended the job (SIGTERM, max steps, a failed job) and said so."""


class Timeout(GradServerError, TimeoutError):
    """A call or a wait did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InvalidArgumentError(Refused, ValueError):
    """A message or argument is malformed or disagrees with what other workers sent."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(Refused):
    """Well-formed, but not valid now: wrong step, unknown or evicted worker, stale session."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(StepFailed):
    """The step failed because of another worker (lost, bad data, NaN); the stream stays usable."""

    code = grpc.StatusCode.ABORTED


class UnavailableError(ConnectionLost):
    """The coordinator cannot be reached or the connection to it broke."""

    code = grpc.StatusCode.UNAVAILABLE


class CoordinatorShutdownError(UnavailableError, JobEnded):
    """The coordinator told this worker that the job is over (SIGTERM, max steps)."""


class DeadlineExceededError(Timeout):
    """A call or a wait did not finish within its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class ResourceExhaustedError(Refused):
    """A configured limit was hit: world full, message or tensor too large, too many streams."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnauthenticatedError(Refused, PermissionError):
    """Credentials were missing or wrong."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(Refused, PermissionError):
    """Authenticated, but not allowed to act as this worker."""

    code = grpc.StatusCode.PERMISSION_DENIED


class InternalError(GradServerError):
    """A bug or an unexpected reply; the message says what was seen."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[GradServerError]] = {
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
_BY_CODE[grpc.StatusCode.ALREADY_EXISTS] = InvalidArgumentError
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgumentError
_BY_CODE[grpc.StatusCode.CANCELLED] = UnavailableError
_BY_CODE[grpc.StatusCode.UNIMPLEMENTED] = FailedPreconditionError


def status_code_from_value(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode whose numeric value is `value` (UNKNOWN for values not defined)."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def error_from_status(
    code: grpc.StatusCode,
    message: str,
    *,
    step: int | None = None,
    key: str | None = None,
    worker_id: int | None = None,
) -> GradServerError:
    """Builds the exception for a status received from the coordinator."""
    cls = _BY_CODE.get(code, InternalError)
    if cls is InternalError and code is not grpc.StatusCode.INTERNAL:
        message = f"{code.name}: {message}"
    return cls(message, step=step, key=key, worker_id=worker_id)
