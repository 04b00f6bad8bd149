"""`gradserver coordinator` runs a GradientServer until SIGTERM/SIGINT or its job ends: exit 0
when the job finished (or on a signal), 1 when it failed (one ERROR line names the cause), 2 when
the configuration is bad or the --bind address is already in use (one line, no traceback).
`gradserver health HOST:PORT` asks a coordinator's standard gRPC health service (for container
health checks: exit 0 when SERVING, 1 otherwise)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from gradserver.common.config import (
    add_config_arguments,
    config_from_sources,
    describe_config,
    parse_address,
)
from gradserver.common.logs import configure_logging
from gradserver.common.security import TlsFiles

from .binding import AddressInUseError
from .config import CoordinatorConfig
from .coordinator import GradientServer

log = logging.getLogger("gradserver.server.cli")


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "coordinator",
        help="run the coordinator",
        description="Run the gradient coordinator. Every flag can also be set by the "
        "environment variable shown with it.",
    )
    add_config_arguments(parser, CoordinatorConfig)
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )
    parser.set_defaults(run=run)
    health_parser: argparse.ArgumentParser = commands.add_parser(
        "health", help="check a coordinator's gRPC health (exit 0 when SERVING)"
    )
    health_parser.add_argument("address", help="coordinator HOST:PORT")
    health_parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    health_parser.add_argument("--service", default="", help="service name ('' is the whole server)")
    health_parser.add_argument("--tls-ca", default="", help="PEM CA of the coordinator's certificate (TLS)")
    # A client's certificate, named as the worker's is (--tls-cert is the coordinator's own);
    # the old names stay accepted.
    health_parser.add_argument(
        "--tls-client-cert",
        "--tls-cert",
        dest="tls_cert",
        default="",
        help="PEM client certificate (mutual TLS); --tls-cert is its old name",
    )
    health_parser.add_argument(
        "--tls-client-key",
        "--tls-key",
        dest="tls_key",
        default="",
        help="PEM private key of --tls-client-cert; --tls-key is its old name",
    )
    health_parser.set_defaults(run=run_health)


def run_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    parse_address(args.address, what="address")
    tls = TlsFiles.load(args.tls_ca, args.tls_cert, args.tls_key, what="health TLS")
    if tls is not None:
        credentials = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
        channel = grpc.secure_channel(args.address, credentials)
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}")
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def run(args: argparse.Namespace) -> int:
    # Read first: the sooner, the smaller the window in which a parent that dies goes unnoticed.
    parent = os.getppid()
    config: CoordinatorConfig = config_from_sources(CoordinatorConfig, args)
    if args.print_config:
        print(describe_config(config, args))
        return 0
    configure_logging(config.log_level, "coordinator", config.log_format)
    return asyncio.run(serve(config, parent))


async def serve(config: CoordinatorConfig, parent: int | None = None) -> int:
    server = GradientServer(config)
    try:
        await server.start()
    except AddressInUseError as exc:
        print(f"gradserver coordinator: {exc.message}", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop, f"received {sig.name}")
    watch = None
    if config.exit_with_parent:
        parent = os.getppid() if parent is None else parent
        watch = asyncio.create_task(_stop_when_parent_exits(server, parent))
    await server.wait_for_termination()
    if watch is not None:
        watch.cancel()
    return server.exit_code


_PARENT_POLL_S = 0.25


async def _stop_when_parent_exits(server: GradientServer, parent: int) -> None:
    """--exit-with-parent: a coordinator that a process started for itself (the torch backend's
    rank 0) must not outlive it, SIGKILL included. An orphan is re-parented (to init or a
    subreaper), so its parent pid changes. A parent that is pid 1 itself (a container's main
    process) is watched like any other."""
    while True:
        if os.getppid() != parent:
            log.warning("its parent process (pid %d) exited: stopping", parent)
            server.request_stop(f"stopped: the coordinator's parent process (pid {parent}) exited")
            return
        await asyncio.sleep(_PARENT_POLL_S)
