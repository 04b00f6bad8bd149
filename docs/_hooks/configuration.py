"""MkDocs hook: the flag tables of docs/configuration.md, generated from the `gradserver` command's
own argparse parsers.

The tables are built when the site is, from the parsers that `gradserver --help` prints, so they
cannot drift from the flags: a flag that is added, renamed or removed changes the page by itself.
Each subcommand (`coordinator`, `health`, `worker`, `launch`, `run`) gets a `### gradserver NAME`
heading, its one-line description and a table of every argument it accepts: the flag, its
environment variable, its default and its meaning.

Most flags are dataclass fields, added by gradserver.common.config.add_config_arguments: flag
`--field-name`, variable `GRADSERVER_FIELD_NAME`, and the parser's own default None (so that the
environment can fill the value). The environment variable and default of such a flag come from
its field (which also says whether it is a secret, whose value is never shown, and which old flag
or variable it replaced); a flag that has no field among the classes named in CONFIG_CLASSES falls
back to the `[env ..., default ...]` suffix of its help text, and a flag with neither (health's,
`--print-config`, the positional arguments) shows the parser's default and no variable.

mkdocs.yml lists this file under `hooks:`; `on_page_markdown` puts the tables where
configuration.md has the line `<!-- generated: gradserver flags -->`, and fails the build when
that page has lost the line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

try:
    # MkDocs reports a PluginError as one line and aborts the build.
    from mkdocs.exceptions import PluginError as _BuildError
except ImportError:  # the tests can run without MkDocs
    _BuildError = RuntimeError  # type: ignore[misc,assignment]

PAGE = "configuration.md"
MARKER = "<!-- generated: gradserver flags -->"
_MARKER_LINE = re.compile(rf"^[ \t]*{re.escape(MARKER)}[ \t]*$", re.MULTILINE)

# The dataclasses each subcommand's flags come from (see each subcommand's `register`): module,
# class name. A subcommand not named here is matched against all of them.
CONFIG_CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "coordinator": (("gradserver.server.config", "CoordinatorConfig"),),
    "worker": (("gradserver.train.cli", "WorkerConfig"),),
    "launch": (("gradserver.train.launch", "LaunchConfig"), ("gradserver.train.cli", "WorkerConfig")),
    "run": (("gradserver.train.run", "RunConfig"),),
}

# The suffix add_config_arguments gives a field's help: `[env GRADSERVER_X, default 'y']`.
_HELP_SUFFIX = re.compile(r"\s*\[env (?P<env>\S+), default (?P<default>.*)\]\s*$", re.DOTALL)
_DEPRECATED = "deprecated:"
# A flag named in running text, to be shown as code.
_FLAG_IN_TEXT = re.compile(r"(?<![\w`-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
# A variable name that holds a secret, for a flag whose field is not known.
_SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD", re.IGNORECASE)
SECRET_SHOWN = "(secret, never shown)"
NONE = "-"


# A NamedTuple, not a dataclass: a module that MkDocs (or a test) loads by path may not be in
# sys.modules, which a dataclass with postponed annotations needs.
class _Row(NamedTuple):
    flag: str
    environment: str
    default: str
    meaning: str


def flag_tables() -> str:
    """Markdown of every subcommand of `gradserver`: a heading, its summary and its flag table."""
    from gradserver.cli.main import build_parser

    sections = []
    for name, parser, summary in _subcommands(build_parser()):
        lines = [f"### gradserver {name}", ""]
        if summary:
            lines += [summary, ""]
        lines.append(options_table(parser, _config_classes(name)))
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"


def options_table(parser: argparse.ArgumentParser, config_classes: Sequence[type[Any]] = ()) -> str:
    """The Markdown table of `parser`'s arguments (all but -h/--help), one row each; the flags that
    are fields of `config_classes` take their variable, default and secrecy from the field."""
    rows = [_row(action, config_classes) for action in parser._actions if not _is_help(action)]
    lines = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [
        "| " + " | ".join(_cell(text) for text in (r.flag, r.environment, r.default, r.meaning)) + " |"
        for r in rows
    ]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replaces the marker line of configuration.md with the flag tables; other pages pass as they
    are. A configuration.md without the marker fails the build rather than go out without tables."""
    if page.file.src_uri != PAGE:
        return markdown
    tables = flag_tables()
    # A function, not a replacement string: the tables hold backslashes (`\|`).
    text, count = _MARKER_LINE.subn(lambda _: tables, markdown)
    if count == 0:
        raise _BuildError(f"{PAGE} has no line {MARKER!r}: the generated flag tables have nowhere to go")
    return text


def _subcommands(parser: argparse.ArgumentParser) -> Iterable[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line summary) of each subcommand, in the parser's order."""
    group = parser._subparsers
    if group is None:
        return
    for action in group._group_actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        for name, sub in action.choices.items():
            yield name, sub, _summary(name, sub.description or "", helps.get(name, ""))


def _summary(name: str, description: str, help_text: str) -> str:
    """The first sentence of a subcommand's description, else its help, as one line."""
    paragraph = description.strip().split("\n\n")[0]
    text = " ".join(paragraph.split()) or " ".join(help_text.split())
    if not text:
        return ""
    match = re.match(r"(.*?[.!?])(?=\s|$)", text)
    sentence = match.group(1) if match else text
    # The heading names the command already.
    for prefix in (f"`gradserver {name}`:", f"gradserver {name}:"):
        if sentence.startswith(prefix):
            sentence = sentence[len(prefix) :].strip()
    if not sentence:
        return ""
    sentence = sentence[0].upper() + sentence[1:]
    if sentence[-1] not in ".!?":
        sentence += "."
    return _flags_as_code(sentence)


def _config_classes(name: str) -> list[type[Any]]:
    import importlib

    named = CONFIG_CLASSES.get(name) or tuple(dict.fromkeys(c for cs in CONFIG_CLASSES.values() for c in cs))
    return [getattr(importlib.import_module(module), cls) for module, cls in named]


def _is_help(action: argparse.Action) -> bool:
    return isinstance(action, argparse._HelpAction)


def _row(action: argparse.Action, config_classes: Sequence[type[Any]]) -> _Row:
    help_text = action.help if action.help and action.help != argparse.SUPPRESS else ""
    suffix = _HELP_SUFFIX.search(help_text)
    meaning = help_text[: suffix.start()] if suffix else help_text
    flag = _flag_cell(action)
    if meaning.startswith(_DEPRECATED):
        return _deprecated_row(action, flag, meaning[len(_DEPRECATED) :].strip(), config_classes)
    field = _field_of(action, suffix, config_classes)
    if field is not None:
        environment = _code(_env_name(field.name))
        if "deprecated_env" in field.metadata and "deprecated_flag" not in field.metadata:
            environment += f" (old name {_code(field.metadata['deprecated_env'])} still read)"
        secret = bool(field.metadata.get("secret"))
        default = SECRET_SHOWN if secret else _value(field.default)
    elif suffix is not None:
        env = suffix.group("env")
        environment = _code(env)
        secret = _secret_env(env, config_classes)
        default = SECRET_SHOWN if secret else _literal(suffix.group("default"))
    else:
        environment = NONE
        default = _parser_default(action)
    return _Row(flag, environment, default, _flags_as_code(meaning))


def _deprecated_row(
    action: argparse.Action, flag: str, replacement: str, config_classes: Sequence[type[Any]]
) -> _Row:
    """The row of an old flag that add_config_arguments still accepts: its help names the new one."""
    environment = NONE
    for cls in config_classes:
        for field in dataclasses.fields(cls):
            if field.metadata.get("deprecated_flag") in action.option_strings and replacement == _flag_name(
                field.name
            ):
                old_env = field.metadata.get("deprecated_env")
                if old_env:
                    environment = f"{_code(old_env)} (use {_code(_env_name(field.name))})"
    meaning = f"deprecated: use {_code(replacement)} instead (still read for one release, with a warning)"
    return _Row(flag, environment, NONE, meaning)


def _field_of(
    action: argparse.Action, suffix: re.Match[str] | None, config_classes: Sequence[type[Any]]
) -> dataclasses.Field[Any] | None:
    """The dataclass field `action` was made from: its name is the action's dest, its flag is one of
    the action's and its variable and default are those the action's help states."""
    if suffix is None:
        return None
    for cls in config_classes:
        for field in dataclasses.fields(cls):
            if (
                field.name == action.dest
                and _flag_name(field.name) in action.option_strings
                and suffix.group("env") == _env_name(field.name)
                and suffix.group("default") == repr(field.default)
            ):
                return field
    return None


def _secret_env(env: str, config_classes: Sequence[type[Any]]) -> bool:
    """Whether variable `env` holds a secret: a secret field of a known class has it, or its name
    says so (when in doubt, no value is shown)."""
    for cls in (*config_classes, *_config_classes("")):
        for field in dataclasses.fields(cls):
            if _env_name(field.name) == env and field.metadata.get("secret"):
                return True
    return bool(_SECRET_NAME.search(env))


def _flag_cell(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(_code(flag) for flag in action.option_strings)
    name = action.metavar if isinstance(action.metavar, str) else action.dest
    if action.nargs == argparse.REMAINDER:
        return f"{_code(name)} (positional: everything after it)"
    return f"{_code(name)} (positional)"


def _parser_default(action: argparse.Action) -> str:
    # argparse marks a positional with nargs `...` required, yet it takes no value as well.
    if action.required and action.nargs not in (argparse.REMAINDER, argparse.ZERO_OR_MORE, argparse.OPTIONAL):
        return "required"
    if action.default is None or action.default == argparse.SUPPRESS:
        return NONE
    return _value(action.default)


def _literal(text: str) -> str:
    """A default as the help suffix states it (a repr), shown as `_value` shows a field's."""
    try:
        return _value(ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return _code(text)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return _code("true" if value else "false")
    if value == "":
        return _code('""')
    if isinstance(value, str):
        return _code(value)
    return _code(repr(value))


def _code(text: str) -> str:
    """`text` as inline code; as plain text where it holds a backtick or a pipe (a pipe in a code
    span of a table cell would be shown with its escape)."""
    if "`" in text or "|" in text:
        return text
    return f"`{text}`"


def _flags_as_code(text: str) -> str:
    """`text` with the flags it names shown as code (those outside code spans already)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if i % 2 else _FLAG_IN_TEXT.sub(r"`\1`", part) for i, part in enumerate(parts))


def _cell(text: str) -> str:
    """One table cell: on one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", r"\|") or NONE


def _env_name(field_name: str) -> str:
    from gradserver.common.config import env_name

    return env_name(field_name)


def _flag_name(field_name: str) -> str:
    from gradserver.common.config import flag_name

    return flag_name(field_name)
