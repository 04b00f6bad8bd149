"""Timeouts as one value object, with environment overrides.

Every RPC and every wait in gradserver has a deadline taken from a `Timeouts`. A plain number
passed as `timeout=` sets every field; `Timeouts.from_env()` reads `GRADSERVER_<FIELD>_TIMEOUT`
(seconds; the Join deadline is GRADSERVER_WORKER_JOIN_TIMEOUT, since GRADSERVER_JOIN_TIMEOUT is
the coordinator's wait for the world) so a deployment can tune a job without code changes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping

from .errors import InvalidArgumentError

log = logging.getLogger("gradserver.config")
# The worker's Join deadline had the coordinator's name for its wait for the world; the old name
# is still read (with a warning) for one release when the new one is not set.
_RENAMED = {"join": ("GRADSERVER_WORKER_JOIN_TIMEOUT", "GRADSERVER_JOIN_TIMEOUT")}


def timeout_env_name(field: str) -> str:
    """The variable that overrides Timeouts.`field`."""
    return _RENAMED[field][0] if field in _RENAMED else f"GRADSERVER_{field.upper()}_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds allowed for each kind of wait on the worker side.

    connect: reaching the coordinator. join: Join, which waits for the whole world.
    receive: one receive or barrier call (covers the step's reduction). send: handing one chunk
    to the transport when the coordinator applies back-pressure. close: flushing on close().
    """

    connect: float = 30.0
    join: float = 120.0
    receive: float = 300.0
    send: float = 300.0
    close: float = 10.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(
                    f"timeout {field.name} must be a positive number of seconds, got {value!r}"
                )

    @classmethod
    def of(cls, value: float | Timeouts | None) -> Timeouts:
        """Normalises a user's `timeout=` argument: None keeps the defaults (and env overrides)."""
        if value is None:
            return cls.from_env()
        if isinstance(value, Timeouts):
            return value
        return cls(connect=value, join=value, receive=value, send=value, close=value)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Timeouts:
        """Defaults overridden by GRADSERVER_CONNECT_TIMEOUT, GRADSERVER_WORKER_JOIN_TIMEOUT, ..."""
        env = os.environ if environ is None else environ
        overrides: dict[str, float] = {}
        for field in dataclasses.fields(cls):
            name = timeout_env_name(field.name)
            raw = env.get(name)
            old = _RENAMED.get(field.name, ("", ""))[1]
            if not raw and old and env.get(old):
                log.warning("%s is deprecated and goes in the next release: use %s", old, name)
                name, raw = old, env[old]
            if raw is None or raw == "":
                continue
            try:
                overrides[field.name] = float(raw)
            except ValueError:
                raise InvalidArgumentError(f"{name}={raw!r} is not a number of seconds") from None
        return cls(**overrides)
