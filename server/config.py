"""The coordinator's configuration: one dataclass, filled from flags, environment and defaults.

Every field is a flag `--field-name` and an environment variable `GRADSERVER_FIELD_NAME`
(gradserver.common.config does the filling); a flag beats the environment, which beats the
default. Values are validated when the dataclass is built, so a bad value fails at start with one
line naming the flag, the variable and the value.
"""

from __future__ import annotations

import dataclasses
import math

from gradserver.common.config import (
    AUTH_TOKEN_HELP,
    LOG_FORMAT_HELP,
    LOG_LEVEL_HELP,
    MIB,
    parse_address,
    require_setting,
)
from gradserver.common.errors import InvalidArgumentError
from gradserver.common.partition_map import PartitionMap
from gradserver.common.security import is_loopback

# The automatic chunk sizes (--chunk-mib 0), docs/PERFORMANCE.md: each chunk costs a control
# message each way and a reduction call, so same-host jobs want large chunks, shared memory (no
# bytes in the messages, averages written in place) the largest; over real links smaller ones
# keep both directions of every link busy.
SHM_CHUNK_MIB = 32.0
LOCAL_CHUNK_MIB = 8.0
REMOTE_CHUNK_MIB = 0.25
# Jobs with members on other hosts whose links were measured (JoinRequest.link_bytes_per_s): a
# chunk is what the slowest link carries in RATE_CHUNK_S, rounded down to a power of two between
# these bounds (small enough to pipeline on a slow link, large enough on a fast one that the work
# per chunk does not cap it); REMOTE_CHUNK_MIB when a rate is unknown.
RATE_CHUNK_S = 0.010
MIN_RATE_CHUNK_MIB = 0.125
MAX_RATE_CHUNK_MIB = 4.0
# What a gRPC message holds besides a chunk's payload, at most.
MESSAGE_OVERHEAD_BYTES = 64 * 1024


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
        # A shared-memory job's chunk plus its message (a worker that falls back to gRPC sends them).
        default=SHM_CHUNK_MIB + 1,
        metadata={"help": "largest gRPC message accepted, MiB"},
    )
    chunk_mib: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "payload bytes per chunk, MiB (0: chosen when the world is complete: "
            f"{SHM_CHUNK_MIB:g} when every worker reached this coordinator over loopback and sends "
            f"through shared memory, {LOCAL_CHUNK_MIB:g} when every one is on this host, "
            f"{MIN_RATE_CHUNK_MIB:g}-{MAX_RATE_CHUNK_MIB:g} from the slowest measured link when any is "
            f"remote, else {REMOTE_CHUNK_MIB:g}; with --partition-map partition 0 chooses)"
        },
    )
    max_inflight_mib: float = dataclasses.field(
        default=64.0,
        metadata={
            "help": "per-worker MiB of unreduced contributions buffered before back-pressure (those "
            "in a worker's shared memory do not count)"
        },
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
    events_file: str = dataclasses.field(
        default="",
        metadata={
            "help": "append the job's verdicts (a worker lost and why, the job's end) to this file as "
            "JSON lines, for a supervising process"
        },
    )
    exit_with_parent: bool = dataclasses.field(
        default=False,
        metadata={"help": "stop (gracefully) when the process that started this one exits"},
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": LOG_LEVEL_HELP})
    log_format: str = dataclasses.field(default="text", metadata={"help": LOG_FORMAT_HELP})
    # The coordinator's own (server) certificate; a worker's client certificate is
    # --tls-client-cert / GRADSERVER_TLS_CLIENT_CERT, so one environment can hold both.
    tls_cert: str = dataclasses.field(
        default="", metadata={"help": "PEM server certificate of this coordinator: serve TLS"}
    )
    tls_key: str = dataclasses.field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str = dataclasses.field(
        default="", metadata={"help": "PEM CA: require client certificates signed by it (mutual TLS)"}
    )
    auth_token: str = dataclasses.field(
        default="", repr=False, metadata={"help": AUTH_TOKEN_HELP, "secret": True}
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
    # Coordinator partitions were called shards, a word that also meant data sample ranges.
    partition_map: str = dataclasses.field(
        default="",
        metadata={
            "help": "partitioned coordinators: ADDR0,ADDR1,... every partition's address as workers and "
            "the other partitions reach it, the same on every partition (empty: one coordinator)",
            "deprecated_flag": "--shard-map",
            "deprecated_env": "GRADSERVER_SHARD_MAP",
        },
    )
    partition_index: int = dataclasses.field(
        default=0,
        metadata={
            "help": "partitioned coordinators: this partition's index in --partition-map",
            "deprecated_flag": "--shard-index",
            "deprecated_env": "GRADSERVER_SHARD_INDEX",
        },
    )
    partition_tls_ca: str = dataclasses.field(
        default="",
        metadata={
            "help": "PEM CA that verifies the other partitions' certificates (default: --tls-client-ca)",
            "deprecated_flag": "--shard-tls-ca",
            "deprecated_env": "GRADSERVER_SHARD_TLS_CA",
        },
    )
    no_shm: bool = dataclasses.field(
        default=False,
        metadata={"help": "offer no shared-memory fast path to workers on this host (gRPC only)"},
    )
    no_lane: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "run one-shot collectives of same-host workers through the gRPC stream instead of "
            "the shared-memory collective lane"
        },
    )
    shm_dir: str = dataclasses.field(
        default="",
        metadata={"help": "where the 0700 directory of the shared-memory socket goes ('': the temp dir)"},
    )
    reduce_threads: int = dataclasses.field(
        default=0,
        metadata={
            "help": "threads that average one large chunk together (0: half the CPUs, 1 to 8; all "
            "of them for an average written over the workers' own shared memory)"
        },
    )
    shm_arena_mib: float = dataclasses.field(
        default=256.0,
        metadata={"help": "MiB of the shared output arena the averages go through (same-host workers)"},
    )

    def __post_init__(self) -> None:
        host, _ = parse_address(self.bind, what="--bind")
        require_setting(
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
        require_setting(self.world_size >= 1, "world_size", self.world_size, "at least 1")
        for name in ("join_timeout", "step_timeout", "heartbeat_timeout", "drain_timeout", "rejoin_timeout"):
            value = getattr(self, name)
            require_setting(math.isfinite(value) and value > 0, name, value, "a positive number of seconds")
        require_setting(
            self.chunk_mib == 0
            or (math.isfinite(self.chunk_mib) and self.chunk_mib > 0 and self.chunk_bytes >= 4),
            "chunk_mib",
            self.chunk_mib,
            "positive (or 0: chosen automatically)",
        )
        self._check_partitions()
        # Against the largest chunk this coordinator's jobs can have (with the automatic choice
        # too, so that a job never learns at run time that its chunks do not fit).
        chunk_mib = self.chunk_bytes / MIB
        require_setting(
            self.max_message_bytes >= self.chunk_bytes + MESSAGE_OVERHEAD_BYTES,
            "max_message_mib",
            self.max_message_mib,
            self._at_least_chunk(0.0625),
        )
        require_setting(
            self.max_inflight_mib >= chunk_mib,
            "max_inflight_mib",
            self.max_inflight_mib,
            self._at_least_chunk(0.0),
        )
        require_setting(
            self.max_tensor_elements >= 1, "max_tensor_elements", self.max_tensor_elements, ">= 1"
        )
        require_setting(self.max_steps >= 0, "max_steps", self.max_steps, ">= 0")
        require_setting(self.reduce_threads >= 0, "reduce_threads", self.reduce_threads, ">= 0 (0: auto)")
        require_setting(
            self.shm_arena_mib >= chunk_mib,
            "shm_arena_mib",
            self.shm_arena_mib,
            self._at_least_chunk(0.0),
        )
        require_setting(
            -1 <= self.metrics_port <= 65535, "metrics_port", self.metrics_port, "-1 (off) or a port 0..65535"
        )
        require_setting(self.log_format in ("text", "json"), "log_format", self.log_format, "text or json")
        require_setting(
            self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
            "log_level",
            self.log_level,
            "one of DEBUG, INFO, WARNING, ERROR",
        )

    def _check_partitions(self) -> None:
        partitions = self.partitions
        count = partitions.count if partitions is not None else 1
        require_setting(
            0 <= self.partition_index < count,
            "partition_index",
            self.partition_index,
            f"an index into --partition-map (0..{count - 1})",
        )
        if partitions is not None and partitions.count > 1 and self.on_worker_loss != "abort":
            # Each partition would carry on without the lost worker at its own moment, and one key's
            # chunks could then be averaged over different contributors on different partitions.
            raise InvalidArgumentError("--partition-map with several partitions needs --on-worker-loss abort")
        if partitions is not None and self.tls_cert and not (self.partition_tls_ca or self.tls_client_ca):
            raise InvalidArgumentError(
                "--partition-map with --tls-cert: the partitions reach each other over TLS and need "
                "--partition-tls-ca (or --tls-client-ca) to verify each other's certificates"
            )

    @property
    def partitions(self) -> PartitionMap | None:
        """The parsed --partition-map; None for one coordinator."""
        return PartitionMap.parse(self.partition_map) if self.partition_map.strip() else None

    @property
    def chunk_auto(self) -> bool:
        """Whether the chunk size is chosen per job (--chunk-mib 0, the default)."""
        return self.chunk_mib == 0

    @property
    def fixed_chunk_bytes(self) -> int | None:
        """The chunk size known before any worker joins: --chunk-mib when given; None when each
        job's is chosen as its world completes (`server/chunk_size.py`)."""
        if not self.chunk_auto:
            return int(self.chunk_mib * MIB) // 4 * 4
        return None

    @property
    def chunk_bytes(self) -> int:
        """The largest chunk this coordinator's jobs can have: --chunk-mib when given, else the
        largest automatic choice. What the limits are checked against and what buffers sized by
        a chunk (the output arena's slots, the collective lane's) hold; a job's own chunk size
        is the coordinator's `GradientServer.chunk_bytes`."""
        fixed = self.fixed_chunk_bytes
        if fixed is not None:
            return fixed
        if self.partitions is not None:  # partitioned jobs are sized for links
            return self.max_rate_chunk_bytes
        return int(LOCAL_CHUNK_MIB * MIB) if self.no_shm else self.shm_chunk_bytes

    @property
    def lane_chunk_bytes(self) -> int:
        """What the collective lane's slots are sized from (`common.lane.slot_bytes_for`): the
        chunk given, else the same-host gRPC size (measured for the lane; gradient jobs' larger
        shared-memory chunks do not concern it), or for partitioned coordinators, whose jobs are
        across links, the fixed remote size."""
        fixed = self.fixed_chunk_bytes
        if fixed is not None:
            return fixed
        return int((REMOTE_CHUNK_MIB if self.partitions is not None else LOCAL_CHUNK_MIB) * MIB)

    @property
    def max_rate_chunk_bytes(self) -> int:
        """The largest chunk chosen from a measured link: MAX_RATE_CHUNK_MIB, halved (down to
        REMOTE_CHUNK_MIB) while --max-message-mib or --max-inflight-mib leave less room."""
        room = min(self.max_message_bytes - MESSAGE_OVERHEAD_BYTES, self.max_inflight_bytes)
        size = int(MAX_RATE_CHUNK_MIB * MIB)
        while size > room and size > int(REMOTE_CHUNK_MIB * MIB):
            size //= 2
        return size

    @property
    def shm_chunk_bytes(self) -> int:
        """The automatic chunk size of a job whose every member sends through shared memory:
        SHM_CHUNK_MIB, or less (whole MiB, at least LOCAL_CHUNK_MIB) where --max-message-mib
        (a member that falls back to gRPC sends chunks whole), --max-inflight-mib or a quarter
        of --shm-arena-mib (slots of the output arena) leave less room."""
        room = min(
            self.max_message_bytes - MESSAGE_OVERHEAD_BYTES,
            self.max_inflight_bytes,
            self.shm_arena_bytes // 4,
        )
        return max(int(LOCAL_CHUNK_MIB * MIB), min(int(SHM_CHUNK_MIB * MIB), room // MIB * MIB))

    def setting_notes(self) -> dict[str, str]:
        """What --print-config adds to a value: where the chunk size comes from."""
        if not self.chunk_auto:
            return {}
        remote = (
            f"{MIN_RATE_CHUNK_MIB:g}-{MAX_RATE_CHUNK_MIB:g} MiB from the slowest link the workers "
            f"measured when any joins from another host ({REMOTE_CHUNK_MIB:g} when not measured)"
        )
        if self.partitions is not None:
            if self.partition_index:
                return {"chunk_mib": "-> automatic: partition 0's choice, brought by each worker's Join"}
            return {"chunk_mib": f"-> automatic, per job: {remote}, else {REMOTE_CHUNK_MIB:g} MiB"}
        shm = (
            ""
            if self.no_shm
            else f"{self.shm_chunk_bytes / MIB:g} MiB when every worker joins over loopback and sends "
            "through shared memory, "
        )
        return {
            "chunk_mib": f"-> automatic, per job: {shm}{LOCAL_CHUNK_MIB:g} MiB when every worker joins "
            f"over loopback, {remote}"
        }

    def _at_least_chunk(self, extra_mib: float) -> str:
        """'at least ...' the largest chunk plus `extra_mib`, saying where that chunk comes from."""
        chunk_mib = self.chunk_bytes / MIB
        plus = f" + {extra_mib:g}" if extra_mib else ""
        if not self.chunk_auto:
            return f"at least chunk_mib{plus} ({chunk_mib + extra_mib:g})"
        return (
            f"at least {chunk_mib + extra_mib:g} (the largest automatic chunk size, {chunk_mib:g} "
            f"MiB{plus}; a smaller --chunk-mib lowers it)"
        )

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mib * MIB)

    @property
    def shm_arena_bytes(self) -> int:
        return int(self.shm_arena_mib * MIB)

    @property
    def max_inflight_bytes(self) -> int:
        return int(self.max_inflight_mib * MIB)

    @property
    def heartbeat_interval(self) -> float:
        """How often workers are asked to send a heartbeat: four per timeout."""
        return self.heartbeat_timeout / 4
