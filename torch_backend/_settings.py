"""What a torch.distributed rank of the "gradserver" backend reads from its environment.

The same variables, with the same meanings, as the worker CLI's settings of the same names
(gradserver.common.config.client_setting): the coordinator to join (else rank 0 starts one), the
TLS files and token that reach it, and the backend's own checks. Read through the config layer,
never `os.environ` directly, so every name is enumerated and means one thing to every process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from gradserver.common.config import AUTH_TOKEN_HELP, LOG_LEVEL_HELP, client_setting, config_from_sources
from gradserver.common.errors import InvalidArgumentError
from gradserver.common.messages import QUANTIZED_DTYPES
from gradserver.common.wire_dtype import parse_wire_dtype


@dataclasses.dataclass(frozen=True)
class RankSettings:
    """A rank's settings; each is the variable GRADSERVER_<FIELD>."""

    # Empty: rank 0 starts an embedded coordinator (torch_backend/_coordinator.py).
    coordinator: str = client_setting("coordinator", "")
    tls_ca: str = client_setting("tls_ca", "")
    tls_client_cert: str = client_setting("tls_client_cert", "")
    tls_client_key: str = client_setting("tls_client_key", "")
    tls_server_name: str = client_setting("tls_server_name", "")
    auth_token: str = dataclasses.field(
        default="", repr=False, metadata={"help": AUTH_TOKEN_HELP, "secret": True}
    )
    # Only the embedded coordinator's: a rank's own logging is its script's business.
    log_level: str = dataclasses.field(default="WARNING", metadata={"help": LOG_LEVEL_HELP})
    torch_check_finite: bool = dataclasses.field(
        default=False,
        metadata={"help": "torch backend: a collective with NaN or Inf fails, naming the rank and element"},
    )
    # What it covers for a rank: SUM/AVG all_reduce and reduce_scatter of floating tensors; a
    # 16-bit wire turns shared memory off (docs/torch.md, "A 16-bit wire").
    wire_dtype: str = client_setting("wire_dtype", "float32")
    ft_reconnect_timeout: float = dataclasses.field(
        default=60.0,
        metadata={
            "help": "gradserver.torch.ft: seconds a rank that lost its coordinator tries to rejoin it at "
            "the same address (restarted, as `gradserver run --restart-lost` does) before it fails (0: "
            "it fails at once); the ft.Replica argument reconnect_timeout wins over it"
        },
    )


def rank_settings(environ: Mapping[str, str] | None = None) -> RankSettings:
    """This rank's settings from `environ` (default: the process environment)."""
    settings: RankSettings = config_from_sources(RankSettings, None, environ)
    try:
        dtype = parse_wire_dtype(settings.wire_dtype)
    except ValueError as exc:
        raise InvalidArgumentError(f"GRADSERVER_WIRE_DTYPE: {exc}") from None
    if dtype in QUANTIZED_DTYPES:
        raise InvalidArgumentError(
            f"GRADSERVER_WIRE_DTYPE={settings.wire_dtype}: a process group's collectives travel as "
            "float32, bfloat16 or float16 (its REDUCE_SCATTERs and NaN-propagating reductions cannot "
            "be int8 or int4 records); DiLoCo's quantize= sends its own payloads quantized"
        )
    return settings


def replica_group_index(environ: Mapping[str, str] | None = None) -> int | None:
    """The replica group a launcher put this process in (GRADSERVER_REPLICA_GROUP: `gradserver
    run --replica-group-size`), or None."""
    value = (os.environ if environ is None else environ).get("GRADSERVER_REPLICA_GROUP", "")
    return int(value) if value.isdigit() else None


def launcher_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """The rank a launcher gave this process (torch's RANK: torchrun, `gradserver run`), or None."""
    value = (os.environ if environ is None else environ).get("RANK", "")
    return int(value) if value.isdigit() else None
