"""Binding the coordinator's port: plain or TLS (optionally mutual), exclusive, and the port file;
and the grpc.aio server it binds, with its handlers, health service and token check.

A port another process listens on is refused up front with one line (`AddressInUseError`)
instead of gRPC's multi-line core log; port 0 picks a free port, which `write_port_file` records
atomically for whoever started the coordinator.
"""

from __future__ import annotations

import logging
import os
import socket

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from gradserver.common.config import parse_address
from gradserver.common.errors import Status, UnavailableError
from gradserver.common.rpc import SERVICE_NAME, server_options
from gradserver.common.security import TlsFiles

from .auth import TokenInterceptor
from .config import CoordinatorConfig
from .metrics import CoordinatorMetrics

log = logging.getLogger("gradserver.server")


class AddressInUseError(UnavailableError):
    """The coordinator's --bind address cannot be bound (another process holds it)."""


def grpc_server(
    config: CoordinatorConfig,
    handlers: dict[str, grpc.RpcMethodHandler],
    health_servicer: health.aio.HealthServicer,
    metrics: CoordinatorMetrics,
) -> grpc.aio.Server:
    """The coordinator's gRPC server (not yet bound): `handlers` by method name, the health
    service, and with --auth-token the token check (each refusal logged and counted)."""

    def refused(peer: str, code: Status, check: str) -> None:
        # The peer and the check, never a secret.
        metrics.errors.labels(code.name).inc()
        log.warning("refused a call from %s: %s", peer, check)

    interceptors = [TokenInterceptor(config.auth_token, refused)] if config.auth_token else []
    server = grpc.aio.server(
        options=server_options(config.max_message_bytes, config.heartbeat_timeout), interceptors=interceptors
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server


def bind_port(server: grpc.aio.Server, config: CoordinatorConfig) -> int:
    """Adds `config.bind` to `server` (TLS when configured); returns the bound port. A bound
    address raises `AddressInUseError` (ports are exclusive: no SO_REUSEPORT)."""
    _check_port_free(config.bind)
    try:
        port = _add_port(server, config)
    except RuntimeError as exc:
        raise AddressInUseError(f"cannot bind {config.bind}: {exc}") from None
    if port == 0:
        raise AddressInUseError(f"cannot bind {config.bind}: address in use or invalid")
    return port


def publish_endpoints(config: CoordinatorConfig, metrics: CoordinatorMetrics, port: int) -> None:
    """Once bound: the /metrics endpoint (--metrics-port) and the port file (--port-file)."""
    if config.metrics_port >= 0:
        metrics.serve(parse_address(config.bind)[0].strip("[]"), config.metrics_port)
    if config.port_file:
        write_port_file(config.port_file, port)


def write_port_file(path: str, port: int) -> None:
    """Writes the bound port to `path` atomically: a reader sees no file or the whole line."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="ascii") as handle:
        handle.write(f"{port}\n")
    os.replace(tmp, path)


def _add_port(server: grpc.aio.Server, cfg: CoordinatorConfig) -> int:
    if not cfg.tls_cert:
        return int(server.add_insecure_port(cfg.bind))
    own = TlsFiles.load(cert=cfg.tls_cert, key=cfg.tls_key, what="coordinator TLS")
    client_ca = TlsFiles.load(ca=cfg.tls_client_ca, what="coordinator TLS") if cfg.tls_client_ca else None
    assert own is not None
    credentials = grpc.ssl_server_credentials(
        [(own.key, own.cert)],
        root_certificates=client_ca.ca if client_ca else None,
        require_client_auth=client_ca is not None,
    )
    return int(server.add_secure_port(cfg.bind, credentials))


def _check_port_free(bind: str) -> None:
    """Raises AddressInUseError when another process listens on `bind`'s port, before gRPC tries
    (whose own failure is a multi-line core log). Port 0 is always free."""
    host, port = parse_address(bind)
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError:
        return  # unresolvable: gRPC's own bind reports it
    with socket.socket(family, kind, proto) as probe:
        # The same option gRPC sets: a port left in TIME_WAIT is free, a listening one is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise AddressInUseError(f"cannot bind {bind}: {exc.strerror or exc}") from None
