"""Timeouts as one value object, with environment overrides.

Every RPC and every wait in gradserver has a deadline taken from a `Timeouts`. A plain number
passed as `timeout=` sets every field; `Timeouts.from_env()` takes `GRADSERVER_<FIELD>_TIMEOUT`
(seconds; the Join deadline is GRADSERVER_WORKER_JOIN_TIMEOUT, since GRADSERVER_JOIN_TIMEOUT is
the coordinator's wait for the world) from the config layer (`TimeoutSettings` in
gradserver.common.config), so a deployment can tune a job without code changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from .config import TimeoutSettings, config_from_sources
from .errors import InvalidArgumentError

# Timeouts.`field` is TimeoutSettings.`field`_timeout (the join deadline: worker_join_timeout).
_SETTING_OF = {"join": "worker_join_timeout"}
_DEFAULTS = TimeoutSettings()


def _setting(field: str) -> str:
    return _SETTING_OF.get(field, f"{field}_timeout")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds allowed for each kind of wait on the worker side.

    connect: reaching the coordinator. join: Join, which waits for the whole world.
    receive: one receive or barrier call (covers the step's reduction). send: handing one chunk
    to the transport when the coordinator applies back-pressure. close: flushing on close().
    """

    connect: float = _DEFAULTS.connect_timeout
    join: float = _DEFAULTS.worker_join_timeout
    receive: float = _DEFAULTS.receive_timeout
    send: float = _DEFAULTS.send_timeout
    close: float = _DEFAULTS.close_timeout

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
        settings: TimeoutSettings = config_from_sources(TimeoutSettings, None, environ)
        return cls(**{f.name: getattr(settings, _setting(f.name)) for f in dataclasses.fields(cls)})
