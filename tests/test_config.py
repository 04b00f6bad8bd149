"""Configuration and timeouts: flags beat environment beats defaults; bad values are one clear error."""

from __future__ import annotations

import argparse

import pytest

from gradserver.common import errors
from gradserver.common.config import add_config_arguments, config_from_sources
from gradserver.common.errors import InvalidArgumentError, Status
from gradserver.common.timeouts import Timeouts
from gradserver.server.config import CoordinatorConfig


def parse(argv: list[str], env: dict[str, str]) -> CoordinatorConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, CoordinatorConfig)
    return config_from_sources(CoordinatorConfig, parser.parse_args(argv), env)


def test_flag_beats_environment_beats_default() -> None:
    config = parse(["--world-size", "4"], {"GRADSERVER_WORLD_SIZE": "3", "GRADSERVER_STEP_TIMEOUT": "9.5"})
    assert config.world_size == 4 and config.step_timeout == 9.5
    assert config.join_timeout == CoordinatorConfig().join_timeout


def test_heartbeat_default_is_at_most_ten_seconds() -> None:
    assert CoordinatorConfig().heartbeat_timeout <= 10
    # The chunk size is chosen per job (32 MiB on one host through shared memory, 8 MiB over
    # loopback gRPC, 0.25 MiB across hosts): buffers sized by a chunk are sized for the largest.
    assert CoordinatorConfig().chunk_auto and CoordinatorConfig().chunk_bytes == 32 * 2**20


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--max-message-mib", "1", "--chunk-mib", "4"], "--max-message-mib"),
        (["--max-inflight-mib", "1"], "--max-inflight-mib"),
        (["--log-level", "LOUD"], "--log-level"),
        (["--max-steps", "-1"], "--max-steps"),
    ],
)
def test_invalid_values_name_flag_and_variable(argv: list[str], text: str) -> None:
    with pytest.raises(InvalidArgumentError, match=text):
        parse(argv, {})


def test_timeouts_value_object() -> None:
    assert Timeouts.of(3.0).receive == 3.0
    assert Timeouts.from_env({"GRADSERVER_RECEIVE_TIMEOUT": "7"}).receive == 7.0
    with pytest.raises(InvalidArgumentError, match="timeout receive must be a positive"):
        Timeouts(receive=0)
    with pytest.raises(InvalidArgumentError, match="GRADSERVER_SEND_TIMEOUT='x'"):
        Timeouts.from_env({"GRADSERVER_SEND_TIMEOUT": "x"})


@pytest.mark.parametrize(
    ("status", "cls", "builtin"),
    [
        (Status.INVALID_ARGUMENT, errors.InvalidArgumentError, ValueError),
        (Status.DEADLINE_EXCEEDED, errors.DeadlineExceededError, TimeoutError),
        (Status.UNAVAILABLE, errors.UnavailableError, ConnectionError),
        (Status.ABORTED, errors.AbortedError, errors.GradServerError),
        (Status.FAILED_PRECONDITION, errors.FailedPreconditionError, errors.GradServerError),
        (Status.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError, errors.GradServerError),
        (Status.UNAUTHENTICATED, errors.UnauthenticatedError, PermissionError),
        (Status.DATA_LOSS, errors.InternalError, errors.GradServerError),
    ],
)
def test_every_status_maps_to_one_class_of_the_hierarchy(status, cls, builtin) -> None:
    error = errors.error_from_status(status, "what happened", step=3)
    assert type(error) is cls and isinstance(error, builtin) and isinstance(error, errors.GradServerError)
    assert "what happened" in str(error) and error.step == 3
    assert errors.status_code_from_value(int(status)) is status
