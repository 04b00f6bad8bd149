"""`gradserver coordinator`: run a GradientServer until SIGTERM/SIGINT or --max-steps."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from gradserver.common.config import CoordinatorConfig, add_config_arguments, config_from_sources
from gradserver.common.logs import configure_logging

from .coordinator import GradientServer


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "coordinator",
        help="run the coordinator",
        description="Run the gradient coordinator. Every flag can also be set by the "
        "environment variable shown with it.",
    )
    add_config_arguments(parser, CoordinatorConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config: CoordinatorConfig = config_from_sources(CoordinatorConfig, args)
    configure_logging(config.log_level, "coordinator")
    return asyncio.run(serve(config))


async def serve(config: CoordinatorConfig) -> int:
    server = GradientServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop, f"received {sig.name}")
    await server.wait_for_termination()
    return 0
