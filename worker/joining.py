"""Reaching a coordinator and joining it: the gRPC channel, the link probe and the Join call,
with progress lines while the coordinator cannot be reached and errors naming the address and the
limit."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import grpc

from gradserver.common import codec
from gradserver.common.errors import Status, UnavailableError, error_from_status
from gradserver.common.messages import JoinAccepted, JoinRequestIn
from gradserver.common.rpc import JOIN_METHOD, PROBE_METHOD, from_grpc, worker_channel_options
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts

log = logging.getLogger("gradserver.worker")

# Progress while reaching the coordinator: a line every fifth of the connect timeout, within
# these bounds, so a long wait says what it is doing and a short one stays quiet enough.
_PROGRESS_MIN_S = 0.1
_PROGRESS_MAX_S = 5.0

# The link probe before Join (`measure_link`): rounds of an empty probe and one with a payload;
# the first round only opens the way (HTTP/2 windows grow, a link's burst allowance is spent), and
# of the others the slowest payload less the fastest empty probe is the payload's time on the
# link. 1 MiB takes ~40 ms at 200 Mbit/s and still stands out from a call's fixed cost at 10
# Gbit/s; a difference below timer noise reads as the fastest rate.
_PROBE_BYTES = 1 << 20
_PROBE_ROUNDS = 3
_FASTEST_RATE = 100e9


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
    """Reaches the coordinator (or partition) at `address` and joins; the channel stays open.
    Partition 0 (or the one coordinator) first gets a link probe, whose rate the Join reports."""
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
        if request.partition_index is None:  # partitions 1..K-1 adopt partition 0's chunk size
            rate = measure_link(channel, timeouts.connect, metadata)
            request = dataclasses.replace(request, link_bytes_per_s=rate)
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


def measure_link(channel: grpc.Channel, timeout: float, metadata: tuple[tuple[str, str], ...]) -> int:
    """Bytes per second this worker's link to the coordinator carried during a probe; 0 when
    unknown (a coordinator without the Probe call, or a probe slower than `timeout`). The
    coordinator sizes a job's chunks from its members' rates (docs/PROTOCOL.md, "Services"). Workers
    joining at once share the coordinator's link, so each measures about its share of it: the
    share a step's chunks get too."""
    probe = channel.unary_unary(PROBE_METHOD)
    empty, full = codec.encode_link_probe(0), codec.encode_link_probe(_PROBE_BYTES)
    fastest_empty, slowest_full = math.inf, 0.0
    try:
        for round_ in range(_PROBE_ROUNDS):
            took = []
            for raw in (empty, full):
                started = time.perf_counter()
                probe(raw, timeout=timeout, metadata=metadata)
                took.append(time.perf_counter() - started)
            if round_:
                fastest_empty, slowest_full = min(fastest_empty, took[0]), max(slowest_full, took[1])
    except grpc.RpcError as exc:
        code = from_grpc(exc.code())
        if code in (Status.UNIMPLEMENTED, Status.DEADLINE_EXCEEDED):
            log.info("link probe: %s (chunk size left to the coordinator)", exc.details() or code.name)
            return 0
        raise error_from_status(code, f"link probe: {exc.details() or code.name}") from exc
    spent = max(slowest_full - fastest_empty, _PROBE_BYTES / _FASTEST_RATE)
    rate = int(_PROBE_BYTES / spent)
    log.debug("link probe: %.0f Mbit/s", rate * 8 / 1e6)
    return rate
