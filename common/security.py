"""Transport security and authentication shared by both sides.

TLS files are read once into a `TlsFiles` value; the coordinator serves TLS (mutual when it has a
client CA), a worker verifies the coordinator against its CA and presents its own certificate
when it has one. A shared token travels as `authorization: Bearer <token>` metadata on every
call and is compared in constant time; it is never logged or printed. With mutual TLS a worker's
identity is its certificate's common name (or first subject alternative name).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import InvalidArgumentError

AUTH_METADATA = "authorization"
_BEARER = "Bearer "


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM contents: `ca` verifies the peer; `cert` and `key` are this side's own."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def load(cls, ca: str = "", cert: str = "", key: str = "", *, what: str = "TLS") -> TlsFiles | None:
        """Reads the files named (None when none is); raises naming a missing or unpaired file."""
        if bool(cert) != bool(key):
            raise InvalidArgumentError(f"{what}: --tls-cert and --tls-key go together")
        if not (ca or cert):
            return None
        return cls(
            ca=_read(ca, "--tls-ca / --tls-client-ca"),
            cert=_read(cert, "--tls-cert"),
            key=_read(key, "--tls-key"),
        )


def _read(path: str, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"{flag} {path!r} cannot be read: {exc.strerror}") from None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA, _BEARER + token),) if token else ()


def token_matches(metadata: Iterable[tuple[str, Any]] | None, expected: str) -> bool:
    """Constant-time check of the call's bearer token."""
    for key, value in metadata or ():
        if key == AUTH_METADATA and isinstance(value, str) and value.startswith(_BEARER):
            return hmac.compare_digest(value[len(_BEARER) :].encode(), expected.encode())
    return False


def peer_identity(auth_context: dict[str, list[bytes]] | None) -> str | None:
    """The client certificate's common name, else its first subject alternative name."""
    if not auth_context:
        return None
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        values = auth_context.get(key)
        if values:
            return values[0].decode(errors="replace")
    return None


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
