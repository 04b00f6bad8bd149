"""Workers that differ from the job (their fingerprint: model, seed, lr, ...) are refused at Join,
naming every differing field with both values, without disturbing the members already joined;
checked with bare Joins and with the real worker CLI."""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Mapping

import grpc
import pytest

from gradserver.common import codec
from gradserver.common.messages import JoinAccepted, JoinRequestIn
from gradserver.common.rpc import JOIN_METHOD, worker_channel_options
from gradserver.server import membership as membership_module

from .helpers.fingerprints import JOB
from .helpers.logwait import log_waiter
from .helpers.processes import ProcessGroup
from .helpers.training import train_worker


def _join(address: str, node: str, fingerprint: Mapping[str, str], timeout: float = 20.0) -> JoinAccepted:
    """A bare Join with a fingerprint (raises grpc.RpcError when refused)."""
    with grpc.insecure_channel(address, options=worker_channel_options()) as channel:
        request = JoinRequestIn(node, 0, "cpu", codec.PROTOCOL_VERSION, None, dict(fingerprint))
        raw = channel.unary_unary(JOIN_METHOD)(codec.encode_join_request(request), timeout=timeout)
    return codec.decode_join_accepted(raw)


@pytest.mark.parametrize(
    ("fingerprint", "differences"),
    [
        ({**JOB, "seed": "1", "lr": "0.01"}, "lr 0.01 != 0.003 (job), seed 1 != 0 (job)"),
        ({"model": "tiny", "seed": "0"}, "lr (missing) != 0.003 (job)"),
        ({**JOB, "accumulate": "2"}, "accumulate 2 != (missing) (job)"),
        ({**JOB, "model": "small"}, "model small != tiny (job)"),
    ],
    ids=["different-values", "missing-field", "extra-field", "one-value"],
)
def test_a_joiner_that_differs_from_the_job_is_refused(coordinator, fingerprint, differences) -> None:
    server = coordinator(world_size=2, heartbeat_timeout=60.0)
    # The waiter listens before the Join goes: a line logged before it was attached is not seen.
    with log_waiter() as logs, concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_join, server.address, "a", JOB)
        logs.wait_for(r"worker 0 joined: node 'a'")
        with pytest.raises(grpc.RpcError) as refused:
            _join(server.address, "b", fingerprint)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details() == f"node 'b' does not match the job: {differences}"
        # The refusal took no place and disturbed nobody: a matching joiner completes the world.
        matching = pool.submit(_join, server.address, "c", JOB)
        ids = sorted([first.result(30).worker_id, matching.result(30).worker_id])
    assert ids == [0, 1]
    assert (
        server.call(
            lambda s: s.metrics.registry.get_sample_value(
                "gradserver_errors_total", {"code": "FAILED_PRECONDITION"}
            )
        )
        == 1
    )


def test_fingerprint_differences_name_every_field() -> None:
    fingerprint_differences = membership_module.fingerprint_differences
    assert fingerprint_differences(JOB, JOB) == []
    assert fingerprint_differences({}, {}) == []
    assert fingerprint_differences({"a": "1", "b": "2"}, {"b": "3", "c": "4"}) == [
        "a 1 != (missing) (job)",
        "b 2 != 3 (job)",
        "c (missing) != 4 (job)",
    ]


@pytest.mark.processes
@pytest.mark.parametrize(
    ("flags", "field", "ours", "job"),
    [
        (["--seed", "1"], "seed", "1", "0"),
        (["--lr", "0.01"], "lr", "0.01", "0.003"),
        (["--model", "small"], "model.name", "small", "tiny"),
    ],
)
def test_a_worker_with_different_settings_is_refused_at_join(
    coordinator, processes: ProcessGroup, flags: list[str], field: str, ours: str, job: str
) -> None:
    """Whichever joins second is refused, naming the field with both values (its own first)."""
    server = coordinator(world_size=2, join_timeout=60.0)
    same = train_worker(processes, server.address, "same")
    other = train_worker(processes, server.address, "other", *flags)
    refused = processes.wait_any([same, other], timeout=120)
    assert refused.proc.returncode not in (0, None), refused.output
    own, theirs = (ours, job) if refused is other else (job, ours)
    assert re.search(rf"{re.escape(field)} {re.escape(own)} != {re.escape(theirs)}", refused.output), (
        refused.output
    )
