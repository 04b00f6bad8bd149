"""The `gradserver` command: one entry point whose subcommands live beside what they run.

`coordinator` and `health` come from gradserver.server.cli; `worker`, `launch` and `run`
from gradserver.train. Each is imported here, inside `build_parser`, so that importing this module
loads no side. Errors of the project's hierarchy end the command with one line on stderr: exit
code 2 for bad configuration or arguments, 1 for anything else. A command that needs an optional
dependency that is not installed also exits 2, with one line naming the extra to install.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gradserver.common.errors import GradServerError, InvalidArgumentError

# The optional top-level modules, and the extra of pyproject.toml that installs each.
EXTRA_OF_MODULE = {"torch": "train", "tqdm": "train", "matplotlib": "train"}
EXTRA_NAMES = {"train": "the training extra"}


def build_parser() -> argparse.ArgumentParser:
    from gradserver.server import cli as server_cli
    from gradserver.train import cli as worker_cli
    from gradserver.train import launch
    from gradserver.train import run as run_command

    parser = argparse.ArgumentParser(
        prog="gradserver", description="Gradient averaging for data-parallel training."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    server_cli.register(commands)
    worker_cli.register(commands)
    launch.register(commands)
    run_command.register(commands)
    return parser


def missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The extra that provides the module `exc` could not find, or None if it is none of ours."""
    root = (exc.name or "").partition(".")[0]
    return EXTRA_OF_MODULE.get(root)


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
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        print(
            f"gradserver {args.command} needs {EXTRA_NAMES[extra]} (no module {exc.name!r}): "
            f"pip install 'gradserver[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
