"""Configuration of the coordinator: one dataclass, filled from flags, environment and defaults.

Every field is a flag `--field-name` and an environment variable `GRADSERVER_FIELD_NAME`; a flag
beats the environment, which beats the default. Values are validated when the dataclass is
built, so a bad value fails at start with one line naming the flag, the variable and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from .errors import InvalidArgumentError
from .security import is_loopback

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


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """What a coordinator needs; see `gradserver coordinator --help` for each field."""

    bind: str = dataclasses.field(
        default="127.0.0.1:50051", metadata={"help": "HOST:PORT to listen on; port 0 picks a free port"}
    )
    world_size: int = dataclasses.field(default=1, metadata={"help": "number of workers in the job"})
    join_timeout: float = dataclasses.field(
        default=120.0, metadata={"help": "seconds to wait for the whole world to join"}
    )
    step_timeout: float = dataclasses.field(
        default=300.0,
        metadata={"help": "seconds a key may wait for all contributions before its step fails"},
    )
    heartbeat_timeout: float = dataclasses.field(
        default=10.0, metadata={"help": "seconds of silence after which a worker counts as lost"}
    )
    max_message_mib: float = dataclasses.field(
        default=16.0, metadata={"help": "largest gRPC message accepted, MiB"}
    )
    chunk_mib: float = dataclasses.field(default=4.0, metadata={"help": "payload bytes per chunk, MiB"})
    max_inflight_mib: float = dataclasses.field(
        default=64.0,
        metadata={"help": "per-worker MiB of unreduced contributions buffered before back-pressure"},
    )
    max_tensor_elements: int = dataclasses.field(
        default=1 << 32, metadata={"help": "largest tensor a key may declare, elements"}
    )
    max_steps: int = dataclasses.field(
        default=0,
        metadata={
            "help": "absolute step count of the job, like the workers' --steps: the job ends once step "
            "max_steps-1 is complete and every worker left, also for a resumed job (0: no limit)"
        },
    )
    drain_timeout: float = dataclasses.field(
        default=10.0, metadata={"help": "seconds a shutdown waits for steps in flight"}
    )
    rejoin_timeout: float = dataclasses.field(
        default=60.0,
        metadata={
            "help": "seconds a job whose worker was lost waits for the world to be complete again; "
            "then the coordinator exits 1 naming the lost workers"
        },
    )
    metrics_port: int = dataclasses.field(
        default=-1,
        metadata={
            "help": "serve Prometheus metrics on this port of the --bind host (0: any free port, -1: off)"
        },
    )
    port_file: str = dataclasses.field(
        default="", metadata={"help": "write the bound port to this file once serving"}
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING, ERROR"})
    log_format: str = dataclasses.field(
        default="text", metadata={"help": "text or json (one object per line)"}
    )
    tls_cert: str = dataclasses.field(default="", metadata={"help": "PEM certificate: serve TLS"})
    tls_key: str = dataclasses.field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str = dataclasses.field(
        default="", metadata={"help": "PEM CA: require client certificates signed by it (mutual TLS)"}
    )
    auth_token: str = dataclasses.field(
        default="", repr=False, metadata={"help": "shared token every call must carry", "secret": True}
    )
    on_worker_loss: str = dataclasses.field(
        default="abort",
        metadata={
            "help": "abort: a lost worker fails the step for all; continue: finish it with the survivors"
        },
    )
    insecure: bool = dataclasses.field(
        default=False, metadata={"help": "allow a non-loopback --bind without TLS or a token"}
    )

    def __post_init__(self) -> None:
        host, _ = parse_address(self.bind, what="--bind")
        _require(
            self.on_worker_loss in ("abort", "continue"),
            "on_worker_loss",
            self.on_worker_loss,
            "abort or continue",
        )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgumentError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgumentError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if not is_loopback(host) and not (self.tls_cert or self.auth_token or self.insecure):
            raise InvalidArgumentError(
                f"--bind {self.bind} accepts connections from other machines, and anyone who can connect "
                "can join the job: add --tls-cert/--tls-key or --auth-token, or --insecure to accept that"
            )
        _require(self.world_size >= 1, "world_size", self.world_size, "at least 1")
        for name in ("join_timeout", "step_timeout", "heartbeat_timeout", "drain_timeout", "rejoin_timeout"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, name, value, "a positive number of seconds")
        _require(self.chunk_mib > 0 and self.chunk_bytes >= 4, "chunk_mib", self.chunk_mib, "positive")
        _require(
            self.max_message_bytes >= self.chunk_bytes + 64 * 1024,
            "max_message_mib",
            self.max_message_mib,
            f"at least chunk_mib + 0.0625 ({self.chunk_mib + 0.0625:g})",
        )
        _require(
            self.max_inflight_mib >= self.chunk_mib,
            "max_inflight_mib",
            self.max_inflight_mib,
            f"at least chunk_mib ({self.chunk_mib:g})",
        )
        _require(self.max_tensor_elements >= 1, "max_tensor_elements", self.max_tensor_elements, ">= 1")
        _require(self.max_steps >= 0, "max_steps", self.max_steps, ">= 0")
        _require(
            -1 <= self.metrics_port <= 65535, "metrics_port", self.metrics_port, "-1 (off) or a port 0..65535"
        )
        _require(self.log_format in ("text", "json"), "log_format", self.log_format, "text or json")
        _require(
            self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
            "log_level",
            self.log_level,
            "one of DEBUG, INFO, WARNING, ERROR",
        )

    @property
    def chunk_bytes(self) -> int:
        return int(self.chunk_mib * MIB) // 4 * 4

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mib * MIB)

    @property
    def max_inflight_bytes(self) -> int:
        return int(self.max_inflight_mib * MIB)

    @property
    def heartbeat_interval(self) -> float:
        """How often workers are asked to send a heartbeat: four per timeout."""
        return self.heartbeat_timeout / 4


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


def _require(ok: bool, field: str, value: object, what: str) -> None:
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
