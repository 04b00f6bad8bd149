"""Timeouts as one value object, with environment overrides.

Every RPC and every wait in gradserver has a deadline taken from a `Timeouts`. A plain number
passed as `timeout=` sets every field; `Timeouts.from_env()` reads `GRADSERVER_<FIELD>` (seconds)
so a deployment can tune a job without code changes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from .errors import InvalidArgumentError


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
        """Defaults overridden by GRADSERVER_CONNECT_TIMEOUT, GRADSERVER_JOIN_TIMEOUT, ..."""
        env = os.environ if environ is None else environ
        overrides: dict[str, float] = {}
        for field in dataclasses.fields(cls):
            name = f"GRADSERVER_{field.name.upper()}_TIMEOUT"
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            try:
                overrides[field.name] = float(raw)
            except ValueError:
                raise InvalidArgumentError(f"{name}={raw!r} is not a number of seconds") from None
        return cls(**overrides)
