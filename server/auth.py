"""Who is calling: the shared-token check on every RPC, the member behind an Exchange stream,
and the host part of a peer address.

With `--auth-token` every call must carry the token (gradserver.common.security compares it in
constant time); health checks are exempt, since container probes and load balancers make them
without credentials. An Exchange stream names its member with the metadata Join handed out, and
under mutual TLS presents the certificate that member joined with. TLS and client certificates
are set up where the port is bound (`binding`).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from gradserver.common.errors import FailedPreconditionError, GradServerError, PermissionDeniedError, Status
from gradserver.common.rpc import META_MEMBER_TOKEN, META_SESSION_ID, META_WORKER_ID, to_grpc
from gradserver.common.security import AUTH_METADATA, peer_identity, token_matches

from .membership import Member, Membership

log = logging.getLogger("gradserver.server")

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def client_identity(context: grpc.aio.ServicerContext[Any, Any], tls_client_ca: str) -> str | None:
    """The client certificate's name under mutual TLS; None otherwise."""
    if not tls_client_ca:
        return None
    return peer_identity(context.auth_context())


def stream_member(
    context: grpc.aio.ServicerContext[Any, Any], membership: Membership, tls_client_ca: str
) -> Member:
    """The member an Exchange stream acts as; raises (and logs) naming why it may not."""
    metadata = {k: v for k, v in context.invocation_metadata() or ()}
    try:
        worker_id = int(metadata[META_WORKER_ID])
        session_id = int(metadata[META_SESSION_ID])
        token = int(metadata[META_MEMBER_TOKEN])
    except (KeyError, ValueError, TypeError):
        log.warning("refused an Exchange from %s: no membership metadata", context.peer())
        raise FailedPreconditionError(
            f"Exchange needs metadata {META_WORKER_ID}, {META_SESSION_ID} and {META_MEMBER_TOKEN} from Join"
        ) from None
    try:
        member = membership.authenticate(worker_id, session_id, token)
    except GradServerError as exc:
        log.warning("refused an Exchange from %s: %s", context.peer(), exc.message)
        raise
    presented = client_identity(context, tls_client_ca)
    if member.identity is not None and presented != member.identity:
        log.warning(
            "refused an Exchange from %s: certificate %r does not match worker %d's %r",
            context.peer(),
            presented,
            worker_id,
            member.identity,
        )
        raise PermissionDeniedError(
            f"worker {worker_id} joined as certificate {member.identity!r}; this connection "
            f"presents {presented!r} and cannot act as it",
            worker_id=worker_id,
        )
    return member


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
            on_reject(context.peer(), Status.UNAUTHENTICATED, f"{details.method}: {check}")
            await context.abort(to_grpc(Status.UNAUTHENTICATED), message)

        if handler is not None and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)
