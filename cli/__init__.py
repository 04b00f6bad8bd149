"""gradserver.cli: the `gradserver` command, the one place that may import every side.

The dispatcher (`gradserver.cli.main`) registers `coordinator` and `health` from
gradserver.server.cli and `worker`, `launch` and `run` from gradserver.train; nothing below it imports
this package.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
