"""Reaching a coordinator and joining it: the gRPC channel and the Join call, with progress
lines while the coordinator cannot be reached and errors naming the address and the limit."""

from __future__ import annotations

import logging
import time

import grpc

from gradserver.common import codec
from gradserver.common.errors import Status, UnavailableError, error_from_status
from gradserver.common.messages import JoinAccepted, JoinRequestIn
from gradserver.common.rpc import JOIN_METHOD, from_grpc, worker_channel_options
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts

log = logging.getLogger("gradserver.worker")

# Progress while reaching the coordinator: a line every fifth of the connect timeout, within
# these bounds, so a long wait says what it is doing and a short one stays quiet enough.
_PROGRESS_MIN_S = 0.1
_PROGRESS_MAX_S = 5.0


def _wait_until_reachable(channel: grpc.Channel, address: str, limit: float, hint: str) -> None:
    """Waits (at most `limit` s) until the channel connects, logging progress now and then;
    raises UnavailableError naming the address and how long it was tried."""
    ready = grpc.channel_ready_future(channel)
    interval = min(_PROGRESS_MAX_S, max(_PROGRESS_MIN_S, limit / 5))
    started = time.monotonic()
    try:
        while True:
            remaining = started + limit - time.monotonic()
            if remaining <= 0:
                raise UnavailableError(
                    f"cannot reach the coordinator at {address}: tried for {limit:g} s "
                    f"(the connect timeout){hint}"
                )
            try:
                ready.result(timeout=min(interval, remaining))
                return
            except grpc.FutureTimeoutError:
                elapsed = time.monotonic() - started
                if elapsed < limit:
                    log.info(
                        "still trying to reach the coordinator at %s (%.1f s of %g s)",
                        address,
                        elapsed,
                        limit,
                    )
    finally:
        ready.cancel()


def join_at(
    address: str,
    request: JoinRequestIn,
    timeouts: Timeouts,
    tls: TlsFiles | None,
    server_name: str,
    metadata: tuple[tuple[str, str], ...],
) -> tuple[grpc.Channel, JoinAccepted]:
    """Reaches the coordinator (or partition) at `address` and joins; the channel stays open."""
    options: list[tuple[str, int | str]] = list(worker_channel_options())
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if tls is not None:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
        )
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    try:
        hint = " (a TLS handshake may have failed: check --tls-ca and certificates)" if tls else ""
        _wait_until_reachable(channel, address, timeouts.connect, hint)
        join = channel.unary_unary(JOIN_METHOD)
        try:
            raw = join(codec.encode_join_request(request), timeout=timeouts.join, metadata=metadata)
        except grpc.RpcError as exc:
            code, details = from_grpc(exc.code()), exc.details() or ""
            if code is Status.DEADLINE_EXCEEDED and "join timed out" not in details:
                details = f"join did not complete within {timeouts.join:g} s ({details})"
            raise error_from_status(code, details) from exc
        accepted = codec.decode_join_accepted(raw)
        log.info("joined %s as worker %d of %d", address, accepted.worker_id, accepted.total_workers)
        return channel, accepted
    except BaseException:
        channel.close()
        raise
