"""gRPC plumbing shared by both sides: method paths, call metadata, channel options, and the one
conversion between gradserver's `Status` and `grpc.StatusCode`.

Method paths come from the service descriptor of the generated module, so they cannot drift from
the .proto. Messages travel as raw bytes through gRPC (no serializer is registered) and are
decoded by `gradserver.common.codec`, which turns malformed bytes into INVALID_ARGUMENT instead
of a transport error.
"""

from __future__ import annotations

import grpc

from ._pb import gradient_server_pb2 as pb
from .errors import Status

_SERVICE = pb.DESCRIPTOR.services_by_name["GradientServer"]
SERVICE_NAME: str = _SERVICE.full_name
JOIN_METHOD = f"/{SERVICE_NAME}/{_SERVICE.methods_by_name['Join'].name}"
EXCHANGE_METHOD = f"/{SERVICE_NAME}/{_SERVICE.methods_by_name['Exchange'].name}"
PROBE_METHOD = f"/{SERVICE_NAME}/{_SERVICE.methods_by_name['Probe'].name}"

# Call metadata of an Exchange stream: who is speaking, in which coordinator session.
META_WORKER_ID = "x-gradserver-worker-id"
META_SESSION_ID = "x-gradserver-session-id"
META_MEMBER_TOKEN = "x-gradserver-member-token"

# Room for the header fields around a chunk's payload.
MESSAGE_OVERHEAD_BYTES = 64 * 1024


# Transport keepalive: a worker pings every KEEPALIVE_TIME_MS and drops a connection whose peer
# does not answer within KEEPALIVE_TIMEOUT_MS, so a coordinator that is stopped (SIGSTOP) or cut
# off is noticed even while no message is due. The coordinator allows pings that often.
KEEPALIVE_TIME_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 10_000


# How far beyond --max-message-mib gRPC still delivers a message, so the coordinator can refuse it
# with a reason; beyond this gRPC cuts the stream itself.
OVERSIZE_SLACK = 4


def server_options(max_message_bytes: int, heartbeat_timeout_s: float = 10.0) -> list[tuple[str, int]]:
    """Options for the coordinator: message limits, exclusive port, permission for workers'
    keepalive, and its own keepalive: a backstop for the one state in which heartbeats cannot be
    seen. While the coordinator holds a worker's stream back (in-flight budget full) it reads
    nothing from it, heartbeats included; an HTTP/2 ping is still answered by a live worker's
    transport, so a stopped one is dropped within 2.5 heartbeat timeouts (a ping every half
    timeout, each given two timeouts). Everywhere else the heartbeat check (one timeout) comes
    first and names the cause."""
    timeout = max(1, int(heartbeat_timeout_s * 1000))
    half, twice = max(1, timeout // 2), 2 * timeout
    return [
        # gRPC would end the stream of a message above the limit in a way the server sees only as
        # a cancellation; the coordinator checks the limit itself (naming the worker and size)
        # and lets gRPC cut only what is far beyond it.
        ("grpc.max_receive_message_length", max_message_bytes * OVERSIZE_SLACK),
        ("grpc.max_send_message_length", max_message_bytes),
        # Exclusive port: a second coordinator on a bound address fails to start instead of
        # sharing the port's connections with the first.
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.keepalive_time_ms", half),
        ("grpc.keepalive_timeout_ms", twice),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC core times a sent ping out after ping_timeout_ms (60 s by default), not after
        # keepalive_timeout_ms, and spaces pings by min_time_between_pings_ms: both must follow
        # the heartbeat timeout, or a stopped worker is found only a minute later.
        ("grpc.http2.min_time_between_pings_ms", half),
        ("grpc.http2.ping_timeout_ms", twice),
    ]


def worker_channel_options() -> list[tuple[str, int]]:
    """Options for a worker's channel. Sizes are unlimited on this side: the coordinator is
    trusted to send what the worker asked for, and enforces its own limits on what it receives."""
    return [
        ("grpc.max_receive_message_length", -1),
        ("grpc.max_send_message_length", -1),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def stream_metadata(worker_id: int, session_id: int, member_token: int) -> tuple[tuple[str, str], ...]:
    return (
        (META_WORKER_ID, str(worker_id)),
        (META_SESSION_ID, str(session_id)),
        (META_MEMBER_TOKEN, str(member_token)),
    )


# Built from the names: a name grpc lacks fails at import, and a code a later grpc adds fails
# tests/test_errors.py's comparison of the two enums instead of passing silently as UNKNOWN.
_TO_GRPC: dict[Status, grpc.StatusCode] = {status: grpc.StatusCode[status.name] for status in Status}
_FROM_GRPC: dict[grpc.StatusCode, Status] = {code: status for status, code in _TO_GRPC.items()}


def to_grpc(status: Status) -> grpc.StatusCode:
    """The grpc.StatusCode to abort an RPC with or report on it for `status`."""
    return _TO_GRPC[status]


def from_grpc(code: grpc.StatusCode) -> Status:
    """The Status of a code gRPC reported (on a failed call, or an RpcError)."""
    return _FROM_GRPC.get(code, Status.UNKNOWN)
