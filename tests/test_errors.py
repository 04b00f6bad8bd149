"""The exception hierarchy by meaning: every status the coordinator can send lands in exactly one
of StepFailed, Refused, ConnectionLost (JobEnded), Timeout or InternalError, so callers can decide
on what happened without knowing gRPC codes."""

from __future__ import annotations

import grpc
import pytest

from gradserver.common import errors

MEANINGS = (errors.StepFailed, errors.Refused, errors.ConnectionLost, errors.Timeout, errors.InternalError)


@pytest.mark.parametrize(
    ("status", "meaning"),
    [
        (grpc.StatusCode.ABORTED, errors.StepFailed),
        (grpc.StatusCode.INVALID_ARGUMENT, errors.Refused),
        (grpc.StatusCode.ALREADY_EXISTS, errors.Refused),
        (grpc.StatusCode.OUT_OF_RANGE, errors.Refused),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.Refused),
        (grpc.StatusCode.UNIMPLEMENTED, errors.Refused),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.Refused),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Refused),
        (grpc.StatusCode.PERMISSION_DENIED, errors.Refused),
        (grpc.StatusCode.UNAVAILABLE, errors.ConnectionLost),
        (grpc.StatusCode.CANCELLED, errors.ConnectionLost),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.Timeout),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
        (grpc.StatusCode.DATA_LOSS, errors.InternalError),
        (grpc.StatusCode.UNKNOWN, errors.InternalError),
    ],
)
def test_every_status_has_exactly_one_meaning(status: grpc.StatusCode, meaning: type[Exception]) -> None:
    error = errors.error_from_status(status, "what happened", step=7, worker_id=2)
    assert [m for m in MEANINGS if isinstance(error, m)] == [meaning]
    assert error.step == 7 and "what happened" in str(error)


def test_a_failed_step_names_its_step_culprit_and_reason() -> None:
    error = errors.error_from_status(
        grpc.StatusCode.ABORTED, "step 25 aborted: worker 1 disconnected", step=25, worker_id=1
    )
    assert isinstance(error, errors.StepFailed)
    assert (error.step, error.culprit, error.reason) == (25, 1, "step 25 aborted: worker 1 disconnected")
    # A step that failed with no culprit (a step timeout) says so with None.
    assert errors.StepFailed("step 3 timed out", step=3).culprit is None


def test_the_end_of_the_job_is_a_lost_connection_that_says_why() -> None:
    ended = errors.CoordinatorShutdownError("the coordinator is shutting down: max steps reached")
    assert isinstance(ended, errors.JobEnded) and isinstance(ended, errors.ConnectionLost)
    assert isinstance(ended, ConnectionError) and isinstance(ended, errors.UnavailableError)
    # A plain lost connection is not the end of the job.
    assert not isinstance(errors.UnavailableError("connection reset"), errors.JobEnded)


def test_meanings_keep_their_built_in_bases() -> None:
    assert issubclass(errors.Timeout, TimeoutError)
    assert issubclass(errors.ConnectionLost, ConnectionError)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.UnauthenticatedError, PermissionError)
    assert not issubclass(errors.StepFailed, errors.Refused)
