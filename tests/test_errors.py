"""The exception hierarchy by meaning: every status the coordinator can send lands in exactly one
of StepFailed, Refused, ConnectionLost (JobEnded), Timeout or InternalError, so callers can decide
on what happened without knowing gRPC codes."""

from __future__ import annotations

import grpc
import pytest

from gradserver.common import errors, rpc
from gradserver.common.errors import Status

MEANINGS = (errors.StepFailed, errors.Refused, errors.ConnectionLost, errors.Timeout, errors.InternalError)


@pytest.mark.parametrize(
    ("status", "meaning"),
    [
        (Status.ABORTED, errors.StepFailed),
        (Status.INVALID_ARGUMENT, errors.Refused),
        (Status.ALREADY_EXISTS, errors.Refused),
        (Status.OUT_OF_RANGE, errors.Refused),
        (Status.FAILED_PRECONDITION, errors.Refused),
        (Status.UNIMPLEMENTED, errors.Refused),
        (Status.RESOURCE_EXHAUSTED, errors.Refused),
        (Status.UNAUTHENTICATED, errors.Refused),
        (Status.PERMISSION_DENIED, errors.Refused),
        (Status.UNAVAILABLE, errors.ConnectionLost),
        (Status.CANCELLED, errors.ConnectionLost),
        (Status.DEADLINE_EXCEEDED, errors.Timeout),
        (Status.INTERNAL, errors.InternalError),
        (Status.DATA_LOSS, errors.InternalError),
        (Status.UNKNOWN, errors.InternalError),
    ],
)
def test_every_status_has_exactly_one_meaning(status: Status, meaning: type[Exception]) -> None:
    error = errors.error_from_status(status, "what happened", step=7, worker_id=2)
    assert [m for m in MEANINGS if isinstance(error, m)] == [meaning]
    assert error.step == 7 and "what happened" in str(error)


def test_a_failed_step_names_its_step_culprit_and_reason() -> None:
    error = errors.error_from_status(
        Status.ABORTED, "step 25 aborted: worker 1 disconnected", step=25, worker_id=1
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


def test_status_has_exactly_the_grpc_code_names_and_numbers() -> None:
    # The wire carries the numeric value, so it must stay gRPC's for every code.
    assert {s.name: int(s) for s in Status} == {c.name: c.value[0] for c in grpc.StatusCode}


@pytest.mark.parametrize("code", list(grpc.StatusCode))
def test_the_grpc_edge_converts_every_code_both_ways(code: grpc.StatusCode) -> None:
    status = rpc.from_grpc(code)
    assert status.name == code.name and rpc.to_grpc(status) is code


def test_an_error_reads_as_its_code_name_and_message_and_travels_as_the_grpc_number() -> None:
    error = errors.error_from_status(int(Status.FAILED_PRECONDITION), "worker 3 was evicted", step=4)
    assert isinstance(error, errors.FailedPreconditionError) and error.code is Status.FAILED_PRECONDITION
    assert str(error) == "FAILED_PRECONDITION: worker 3 was evicted"
    assert int(error.code) == grpc.StatusCode.FAILED_PRECONDITION.value[0]


def test_a_status_number_that_no_code_has_is_an_internal_error_naming_unknown() -> None:
    error = errors.error_from_status(99, "what happened")
    assert errors.status_code_from_value(99) is Status.UNKNOWN
    assert type(error) is errors.InternalError and str(error) == "INTERNAL: UNKNOWN: what happened"
