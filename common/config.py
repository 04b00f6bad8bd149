"""Configuration helpers shared by every command: one dataclass per command, filled from flags,
environment and defaults.

Every field is a flag `--field-name` and an environment variable `GRADSERVER_FIELD_NAME`; a flag
beats the environment, which beats the default. Values are validated when the dataclass is
built (`require_setting`), so a bad value fails at start with one line naming the flag, the
variable and the value. The coordinator's dataclass is gradserver.server.config.CoordinatorConfig;
the worker's is gradserver.train.cli.WorkerConfig; `launch` and `run` have theirs beside them.

Every variable means one thing to every process that reads it (`gradserver run` hands the
coordinator and the ranks one environment): a setting whose name meant two things was renamed on
one side. A renamed field lists its old flag (`deprecated_flag`) and variable (`deprecated_env`)
in its metadata: for one release they are still read when the new ones are not given, with a
warning that names the new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import InvalidArgumentError

MIB = 1024 * 1024
ENV_PREFIX = "GRADSERVER_"

log = logging.getLogger("gradserver.config")

_T = TypeVar("_T")

# Settings that several commands read under one name, with the one meaning each has for all.
AUTH_TOKEN_HELP = "the job's shared token: the coordinator requires it on every call, workers send it"
LOG_LEVEL_HELP = "DEBUG, INFO, WARNING, ERROR"
LOG_FORMAT_HELP = "text or json (one object per line)"
# What a client of the coordinator (a worker, a torch.distributed rank) reads to reach it.
_CLIENT_SETTINGS: dict[str, dict[str, str]] = {
    "coordinator": {"help": "coordinator HOST:PORT"},
    "tls_ca": {"help": "PEM CA that signed the coordinator's certificate"},
    # GRADSERVER_TLS_CERT/_KEY are the coordinator's server certificate (`gradserver run` gives
    # both one environment); a client's certificate has names of its own.
    "tls_client_cert": {
        "help": "PEM client certificate of this worker (mutual TLS)",
        "deprecated_flag": "--tls-cert",
        "deprecated_env": "GRADSERVER_TLS_CERT",
    },
    "tls_client_key": {
        "help": "PEM private key of --tls-client-cert",
        "deprecated_flag": "--tls-key",
        "deprecated_env": "GRADSERVER_TLS_KEY",
    },
    "tls_server_name": {"help": "name to check the coordinator's certificate against"},
    "wire_dtype": {
        "help": "what gradients (floating-point sums and averages) travel as: float32, bfloat16, "
        "float16, or int8 / int4 (a float32 scale per 64 values, summed by the coordinator; not with "
        "host groups), the same on every worker; integers and byte-moving collectives stay exact"
    },
}


# A WorkerClient's deadlines when its caller gives none (gradserver.common.timeouts.Timeouts):
# each kind of wait has its own variable, the fields' names plus _TIMEOUT.
@dataclasses.dataclass(frozen=True)
class TimeoutSettings:
    """The worker library's deadlines, seconds, read from the environment when its caller gives
    no `timeout=` (and by the worker CLI when its --timeout is 0)."""

    connect_timeout: float = dataclasses.field(
        default=30.0, metadata={"help": "a worker's deadline for reaching the coordinator, seconds"}
    )
    # GRADSERVER_JOIN_TIMEOUT is the coordinator's wait for the world; the worker's Join deadline
    # had that name too.
    worker_join_timeout: float = dataclasses.field(
        default=120.0,
        metadata={
            "help": "a worker's deadline for Join, which waits for the whole world, seconds",
            "deprecated_env": "GRADSERVER_JOIN_TIMEOUT",
        },
    )
    receive_timeout: float = dataclasses.field(
        default=300.0,
        metadata={"help": "a worker's deadline for one receive or barrier (covers the reduction), seconds"},
    )
    send_timeout: float = dataclasses.field(
        default=300.0,
        metadata={"help": "a worker's deadline for handing one chunk on under back-pressure, seconds"},
    )
    close_timeout: float = dataclasses.field(
        default=10.0, metadata={"help": "a worker's deadline for flushing on close, seconds"}
    )


def environment_value(field_name: str, environ: Mapping[str, str] | None = None) -> str:
    """The raw GRADSERVER_ variable of setting `field_name` ('' when unset), for a process that
    reads one setting outside a config class: a library default (the worker's transport) or what
    a child process it starts will read (a local coordinator's chunk size and socket directory)."""
    env = os.environ if environ is None else environ
    return env.get(env_name(field_name), "")


def client_setting(name: str, default: _T) -> _T:
    """The field of a coordinator client's setting `name`, with the one meaning it has for every
    client (the worker CLI, the torch backend)."""
    return dataclasses.field(default=default, metadata=_CLIENT_SETTINGS[name])


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
    """The effective configuration, one `name = value  (source)` line per field, followed by what
    the value means where the config class says (`setting_notes()`: e.g. a value chosen later)."""
    env = os.environ if environ is None else environ
    notes_of = getattr(config, "setting_notes", None)
    notes: dict[str, str] = notes_of() if callable(notes_of) else {}
    lines = []
    for field in dataclasses.fields(config):
        _, source = _given(field, namespace, env)
        value = getattr(config, field.name)
        shown = "'***'" if field.metadata.get("secret") and value else repr(value)
        note = notes.get(field.name)
        lines.append(f"{field.name} = {shown}  ({source})" + (f"  {note}" if note else ""))
    return "\n".join(lines)


def require_setting(ok: bool, field: str, value: object, what: str) -> None:
    """Raises the one-line error naming the flag, the variable and the bad value unless `ok`."""
    if not ok:
        raise InvalidArgumentError(f"{flag_name(field)} / {env_name(field)} must be {what}, got {value!r}")


def environment_of(cls: type[Any]) -> dict[str, str]:
    """variable -> meaning (its field's help) of every GRADSERVER_ variable that `cls` reads under
    its own name; the deprecated names it still reads are `deprecated_names_of`."""
    return {env_name(f.name): str(f.metadata.get("help", "")) for f in dataclasses.fields(cls)}


def deprecated_names_of(cls: type[Any]) -> dict[str, str]:
    """old flag or variable -> the new one, for every field of `cls` that was renamed."""
    names: dict[str, str] = {}
    for field in dataclasses.fields(cls):
        if "deprecated_flag" in field.metadata:
            names[field.metadata["deprecated_flag"]] = flag_name(field.name)
        if "deprecated_env" in field.metadata:
            names[field.metadata["deprecated_env"]] = env_name(field.name)
    return names


def _deprecated_dest(field_name: str) -> str:
    return f"deprecated_{field_name}"


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type[Any], only: tuple[str, ...] | None = None
) -> None:
    """Adds one flag per dataclass field (those named in `only`, when given), and the old flag of a
    renamed one; defaults stay None so the environment can fill them."""
    for field in dataclasses.fields(cls):
        if only is not None and field.name not in only:
            continue
        help_text = (
            f"{field.metadata.get('help', '')} [env {env_name(field.name)}, default {field.default!r}]"
        )
        old_flag = field.metadata.get("deprecated_flag")
        flags = [(flag_name(field.name), field.name, help_text)]
        if old_flag:
            flags.append((old_flag, _deprecated_dest(field.name), f"deprecated: {flag_name(field.name)}"))
        for flag, dest, text in flags:
            if isinstance(field.default, bool):
                parser.add_argument(
                    flag, dest=dest, default=None, action="store_const", const="true", help=text
                )
            else:
                parser.add_argument(flag, dest=dest, default=None, help=text)


def config_from_sources(
    cls: type[Any], namespace: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Any:
    """Builds `cls` from flags (highest priority), then GRADSERVER_* variables, then defaults."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw, source = _given(field, namespace, env)
        if raw is None or raw == "":
            continue
        if source in (field.metadata.get("deprecated_flag"), field.metadata.get("deprecated_env")):
            new = flag_name(field.name) if source.startswith("--") else env_name(field.name)
            log.warning(
                "%s is deprecated and goes in the next release: use %s (%s)",
                source,
                new,
                field.metadata.get("help", field.name),
            )
        values[field.name] = _convert(field, raw, source)
    return cls(**values)


def _given(
    field: dataclasses.Field[Any], namespace: argparse.Namespace | None, env: Mapping[str, str]
) -> tuple[str | None, str]:
    """The raw value of `field` and where it came from: its flag, its old flag, its variable, its
    old variable (in that order), else (None, 'default')."""
    if namespace is not None:
        for dest, name in (
            (field.name, flag_name(field.name)),
            (_deprecated_dest(field.name), field.metadata.get("deprecated_flag", "")),
        ):
            raw = getattr(namespace, dest, None)
            if raw is not None:
                return str(raw), name
    for name in (env_name(field.name), field.metadata.get("deprecated_env", "")):
        raw = env.get(name) if name else None
        if raw:
            return raw, name
    return None, "default"


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
