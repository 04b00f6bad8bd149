"""Configuration helpers shared by every command: one dataclass per command, filled from flags,
environment and defaults.

Every field is a flag `--field-name` and an environment variable `GRADSERVER_FIELD_NAME`; a flag
beats the environment, which beats the default. Values are validated when the dataclass is
built (`require_setting`), so a bad value fails at start with one line naming the flag, the
variable and the value. The coordinator's dataclass is gradserver.server.config.CoordinatorConfig;
the worker's is gradserver.train.cli.WorkerConfig.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from .errors import InvalidArgumentError

MIB = 1024 * 1024
ENV_PREFIX = "GRADSERVER_"


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def parse_address(value: str, *, what: str = "address") -> tuple[str, int]:
    """Splits HOST:PORT (IPv6 as [::1]:PORT); raises naming the value when it is not one."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise InvalidArgumentError(f"{what} {value!r} is not HOST:PORT with a port 0..65535")
    return host, int(port_text)


def describe_config(
    config: Any, namespace: argparse.Namespace | None, environ: Mapping[str, str] | None = None
) -> str:
    """The effective configuration, one `name = value  (source)` line per field."""
    env = os.environ if environ is None else environ
    lines = []
    for field in dataclasses.fields(config):
        if namespace is not None and getattr(namespace, field.name, None) is not None:
            source = flag_name(field.name)
        elif env.get(env_name(field.name)):
            source = env_name(field.name)
        else:
            source = "default"
        value = getattr(config, field.name)
        shown = "'***'" if field.metadata.get("secret") and value else repr(value)
        lines.append(f"{field.name} = {shown}  ({source})")
    return "\n".join(lines)


def require_setting(ok: bool, field: str, value: object, what: str) -> None:
    """Raises the one-line error naming the flag, the variable and the bad value unless `ok`."""
    if not ok:
        raise InvalidArgumentError(f"{flag_name(field)} / {env_name(field)} must be {what}, got {value!r}")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    """Adds one flag per dataclass field; defaults stay None so the environment can fill them."""
    for field in dataclasses.fields(cls):
        help_text = (
            f"{field.metadata.get('help', '')} [env {env_name(field.name)}, default {field.default!r}]"
        )
        if isinstance(field.default, bool):
            parser.add_argument(
                flag_name(field.name),
                dest=field.name,
                default=None,
                action="store_const",
                const="true",
                help=help_text,
            )
        else:
            parser.add_argument(flag_name(field.name), dest=field.name, default=None, help=help_text)


def config_from_sources(
    cls: type[Any], namespace: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Any:
    """Builds `cls` from flags (highest priority), then GRADSERVER_* variables, then defaults."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(namespace, field.name, None) if namespace is not None else None
        source = flag_name(field.name)
        if raw is None:
            raw = env.get(env_name(field.name))
            source = env_name(field.name)
        if raw is None or raw == "":
            continue
        values[field.name] = _convert(field, raw, source)
    return cls(**values)


def _convert(field: dataclasses.Field[Any], raw: str, source: str) -> Any:
    kind: type[Any] = type(field.default)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise InvalidArgumentError(f"{source}={raw!r} is not a boolean (true/false)")
    try:
        if kind is int:
            return int(raw, 0)
        if kind is float:
            return float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{source}={raw!r} is not a valid {kind.__name__}") from None
    return str(raw)
