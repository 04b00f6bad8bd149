"""The docs site's configuration page: its flag tables are generated from the CLI's own parsers by
the MkDocs hook docs/_hooks/configuration.py, so they cannot drift from the flags.

These tests walk the real parsers themselves and check that the hook's tables name every argument
of every subcommand, with the right variable and default (from the dataclasses), that a secret's
value is never shown, that each row is one well-formed line, and that the hook puts the tables
where configuration.md asks for them and fails the build where the page has lost that line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from gradserver.cli.main import build_parser
from gradserver.server.config import CoordinatorConfig
from gradserver.train.cli import WorkerConfig
from gradserver.train.launch import LaunchConfig
from gradserver.train.run import RunConfig

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs/_hooks/configuration.py"
MARKER = "<!-- generated: gradserver flags -->"
COMMANDS = ("coordinator", "health", "worker", "launch", "run")


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_configuration_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tables(hook: ModuleType) -> str:
    text = hook.flag_tables()
    assert isinstance(text, str)
    return text


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """name -> parser of every subcommand, found from the top parser's actions."""
    parser = build_parser()
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def sections(text: str) -> dict[str, str]:
    """subcommand -> the Markdown under its `### gradserver NAME` heading."""
    parts = re.split(r"^### gradserver (\S+)[ \t]*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def cells(line: str) -> list[str]:
    """The cells of a table row, split at the pipes that are not escaped."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def rows(section: str) -> dict[str, list[str]]:
    """Every name in a row's flag cell (its backticked flags or positional) -> the row's cells."""
    found: dict[str, list[str]] = {}
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith(("| flag ", "| ---")):
            continue
        row = cells(line)
        for name in re.findall(r"`([^`]+)`", row[0]):
            found[name] = row
    return found


def row_of(tables: str, command: str, flag: str) -> list[str]:
    table = rows(sections(tables)[command])
    assert flag in table, f"no row of {flag} under gradserver {command}"
    return table[flag]


def shown(value: object) -> str:
    """How the page shows a default value."""
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == "":
        return '`""`'
    return f"`{value}`" if isinstance(value, str) else f"`{value!r}`"


def test_every_subcommand_has_a_heading_and_every_argument_a_row(tables: str) -> None:
    parsers = subcommand_parsers()
    assert set(COMMANDS) <= set(parsers)
    by_command = sections(tables)
    assert list(by_command) == list(parsers)
    for command, parser in parsers.items():
        assert f"### gradserver {command}\n" in tables
        table = rows(by_command[command])
        arguments = [action for action in parser._actions if "-h" not in action.option_strings]
        for action in arguments:
            names = action.option_strings or [action.metavar or action.dest]
            for name in names:
                assert f"`{name}`" in by_command[command], f"gradserver {command} {name} is not on the page"
                assert name in table, f"gradserver {command} {name} has no row"
            if not action.option_strings:
                assert "positional" in table[names[0]][0]
        row_lines = [line for line in by_command[command].splitlines() if line.startswith("| `")]
        assert len(row_lines) == len(arguments), f"gradserver {command}: one row per argument"
        assert "`-h`" not in by_command[command] and "`--help`" not in by_command[command]


def test_every_row_is_one_line_of_four_cells(tables: str) -> None:
    table_lines = [line for line in tables.splitlines() if line.startswith("|")]
    assert len(table_lines) > 100
    for line in table_lines:
        assert len(cells(line)) == 4, line
        assert line.endswith(" |"), line


@pytest.mark.parametrize(
    ("command", "flag", "environment", "default"),
    [
        ("coordinator", "--world-size", "`GRADSERVER_WORLD_SIZE`", "`1`"),
        ("coordinator", "--bind", "`GRADSERVER_BIND`", "`127.0.0.1:50051`"),
        ("coordinator", "--join-timeout", "`GRADSERVER_JOIN_TIMEOUT`", "`120.0`"),
        ("coordinator", "--on-worker-loss", "`GRADSERVER_ON_WORKER_LOSS`", "`abort`"),
        ("coordinator", "--insecure", "`GRADSERVER_INSECURE`", "`false`"),
        ("worker", "--batch-size", "`GRADSERVER_BATCH_SIZE`", "`8`"),
        ("worker", "--coordinator", "`GRADSERVER_COORDINATOR`", "`127.0.0.1:50051`"),
        ("worker", "--tls-client-cert", "`GRADSERVER_TLS_CLIENT_CERT`", '`""`'),
        # The same field name with each command's own default.
        ("launch", "--workers", "`GRADSERVER_WORKERS`", "`2`"),
        ("run", "--workers", "`GRADSERVER_WORKERS`", "`0`"),
        ("launch", "--run-timeout", "`GRADSERVER_RUN_TIMEOUT`", "`1800.0`"),
        ("run", "--run-timeout", "`GRADSERVER_RUN_TIMEOUT`", "`0.0`"),
        # A worker field launch shares, and flags that no variable sets.
        ("launch", "--steps", "`GRADSERVER_STEPS`", "`3`"),
        ("health", "--timeout", "-", "`5.0`"),
        ("coordinator", "--print-config", "-", "`false`"),
        ("health", "address", "-", "required"),
    ],
)
def test_known_flags_have_their_variable_and_default(
    tables: str, command: str, flag: str, environment: str, default: str
) -> None:
    _, env_cell, default_cell, _ = row_of(tables, command, flag)
    assert env_cell == environment
    assert default_cell == default


@pytest.mark.parametrize(
    ("command", "cls"),
    [
        ("coordinator", CoordinatorConfig),
        ("worker", WorkerConfig),
        ("launch", LaunchConfig),
        ("run", RunConfig),
    ],
)
def test_every_field_flag_shows_its_dataclass_variable_and_default(
    tables: str, command: str, cls: Any
) -> None:
    table = rows(sections(tables)[command])
    checked = 0
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        if flag not in table:
            assert command == "launch", f"{command} lacks {flag}"  # launch takes some worker fields only
            continue
        row = table[flag]
        assert row[1] == f"`GRADSERVER_{field.name.upper()}`", flag
        if not field.metadata.get("secret"):
            assert row[2] == shown(field.default), flag
        checked += 1
    assert checked >= 5


def test_a_secret_shows_no_value(hook: ModuleType, tables: str) -> None:
    for command in ("coordinator", "worker"):
        default = row_of(tables, command, "--auth-token")[2]
        assert "`" not in default and "secret" in default

    from gradserver.common.config import add_config_arguments

    @dataclasses.dataclass(frozen=True)
    class Settings:
        api_token: str = dataclasses.field(default="hunter2", metadata={"help": "a token", "secret": True})
        name: str = dataclasses.field(default="visible", metadata={"help": "a name"})

    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Settings)
    assert "hunter2" in parser.format_help()  # so the table below must leave it out itself
    # With the field known (its metadata says secret), and without it (its variable's name does).
    for classes in ((Settings,), ()):
        table = hook.options_table(parser, classes)
        assert "hunter2" not in table
        assert "`visible`" in table and "`GRADSERVER_API_TOKEN`" in table


@pytest.mark.parametrize(
    ("command", "old", "new", "old_env"),
    [
        ("coordinator", "--shard-map", "--partition-map", "GRADSERVER_SHARD_MAP"),
        ("worker", "--tls-cert", "--tls-client-cert", "GRADSERVER_TLS_CERT"),
        ("launch", "--backend", "--engine", "GRADSERVER_BACKEND"),
        ("run", "--timeout", "--run-timeout", None),
    ],
)
def test_a_deprecated_flag_names_its_replacement(
    tables: str, command: str, old: str, new: str, old_env: str | None
) -> None:
    _, env_cell, _, meaning = row_of(tables, command, old)
    assert "deprecated" in meaning and f"`{new}`" in meaning
    assert (f"`{old_env}`" in env_cell) if old_env else env_cell == "-"


def test_pipes_are_escaped_and_help_is_one_line(hook: ModuleType) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="a", help="fast | safe,\n   see\n--other")
    table = hook.options_table(parser)
    (line,) = [line for line in table.splitlines() if line.startswith("| `--mode`")]
    assert r"fast \| safe, see `--other`" in line
    assert len(cells(line)) == 4


def page(src_uri: str) -> Any:
    return SimpleNamespace(file=SimpleNamespace(src_uri=src_uri))


def test_the_marker_on_the_configuration_page_becomes_the_tables(hook: ModuleType) -> None:
    markdown = f"# Configuration\n\nBefore.\n\n{MARKER}\n\nAfter.\n"
    result = hook.on_page_markdown(markdown, page=page("configuration.md"), config=None, files=None)
    assert MARKER not in result
    assert result.startswith("# Configuration\n\nBefore.\n\n### gradserver coordinator\n")
    assert result.endswith("\n\nAfter.\n")
    for command in COMMANDS:
        assert f"### gradserver {command}\n" in result


def test_other_pages_are_left_as_they_are(hook: ModuleType) -> None:
    markdown = f"# Deployment\n\n{MARKER}\n"
    assert hook.on_page_markdown(markdown, page=page("deployment.md"), config=None, files=None) == markdown


def test_a_configuration_page_without_the_marker_fails_the_build(hook: ModuleType) -> None:
    with pytest.raises(Exception, match="generated: gradserver flags"):
        hook.on_page_markdown("# Configuration\n", page=page("configuration.md"), config=None, files=None)


def test_the_tables_go_in_verbatim(hook: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    # A help with a pipe puts backslashes in the tables: they must not be read as a regex template.
    monkeypatch.setattr(hook, "flag_tables", lambda: "| `--a` | - | - | x \\| y \\1 \\g<0> |\n")
    result = hook.on_page_markdown(f"{MARKER}\n", page=page("configuration.md"), config=None, files=None)
    assert result == "| `--a` | - | - | x \\| y \\1 \\g<0> |\n\n"
