"""The `gradserver` command: one entry point whose subcommands live beside what they run.

`coordinator` comes from gradserver.server.cli; `worker` and `launch` from gradserver.worker.
Errors of the project's hierarchy end the command with one line on stderr: exit code 2 for bad
configuration or arguments, 1 for anything else.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import GradServerError, InvalidArgumentError


def build_parser() -> argparse.ArgumentParser:
    from gradserver.server import cli as server_cli
    from gradserver.worker import cli as worker_cli
    from gradserver.worker import launch

    parser = argparse.ArgumentParser(
        prog="gradserver", description="Gradient averaging for data-parallel training."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    server_cli.register(commands)
    worker_cli.register(commands)
    launch.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except InvalidArgumentError as exc:
        print(f"gradserver {args.command}: {exc.message}", file=sys.stderr)
        return 2
    except GradServerError as exc:
        print(f"gradserver {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
