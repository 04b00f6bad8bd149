"""Who is calling: the shared-token check on every RPC, and the host part of a peer address.

With `--auth-token` every call must carry the token (gradserver.common.security compares it in
constant time); health checks are exempt, since container probes and load balancers make them
without credentials. TLS and client certificates are set up where the port is bound
(`binding`).
"""

from __future__ import annotations

from typing import Any

import grpc

from gradserver.common.security import AUTH_METADATA, token_matches

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string: 'ipv4:127.0.0.1:5555' -> 'ipv4:127.0.0.1',
    'ipv6:[::1]:5555' -> 'ipv6:[::1]'; every unix-socket peer is on this host."""
    if peer.startswith("unix"):
        return "unix"
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call without the shared token (UNAUTHENTICATED), except health checks, which
    container probes and load balancers make without credentials. Each refusal is reported with
    the peer and which check failed (never the token)."""

    def __init__(self, token: str, on_reject: Any) -> None:
        self._token = token
        self._on_reject = on_reject

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        metadata = details.invocation_metadata
        if details.method.startswith(_HEALTH_PREFIX) or token_matches(metadata, self._token):
            return handler
        check = (
            "wrong auth token" if any(k == AUTH_METADATA for k, _ in metadata or ()) else "missing auth token"
        )
        message = f"{details.method}: missing or wrong auth token"
        on_reject = self._on_reject

        async def deny(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            on_reject(context.peer(), grpc.StatusCode.UNAUTHENTICATED, f"{details.method}: {check}")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
