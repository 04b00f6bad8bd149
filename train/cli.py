"""`gradserver worker`: one worker process, training or running the synthetic exchange.

`--job train` (the default) trains a model on the shipped corpus, averaging gradients through the
coordinator (`--engine remote`) or through torch.distributed (`--engine gloo|nccl`, with
`--dist-rank`, `--dist-world-size` and `--dist-init`). `--job synthetic` sends random per-block
and non-block gradients of a model's shape and checks each average against a float64 reference;
every step line ends with a checksum that must be the same on every worker.

Every local argument (model, sizes, device, paths, TLS files, the checkpoint to resume) is checked
before any network call, so a typo exits at once with code 2 and one line. At Join the worker
sends the job fingerprint (train/fingerprint.py): a worker whose settings differ from the job's
is refused. Checkpoints belong to `--node-id` (stable across restarts, unlike the join order);
`--resume` with the remote engine needs one.

Threads: after Join the worker sets torch's intra-op threads to `cores // workers on this host`
(the coordinator counts the job's workers per host), unless `--threads` or `OMP_NUM_THREADS` says
otherwise; the choice is logged at INFO.

Each step logs one line; with `--progress-fd N` (how `gradserver launch` follows its workers) it
also writes one JSON object per step (not for the final flush's steps, which train nothing) to
that inherited file descriptor, never to stdout; with `--out DIR`, one JSON line per step goes to
DIR/metrics.jsonl. `--print-config` prints the
resolved configuration (secrets masked) and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from gradserver.common.components import NonBlockComponent, parse_non_block_component
from gradserver.common.config import (
    AUTH_TOKEN_HELP,
    LOG_FORMAT_HELP,
    LOG_LEVEL_HELP,
    add_config_arguments,
    client_setting,
    config_from_sources,
    describe_config,
    parse_address,
)
from gradserver.common.cores import available_cores
from gradserver.common.errors import InvalidArgumentError
from gradserver.common.logs import LOG_FORMATS, configure_logging, set_log_context
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts
from gradserver.common.wire_dtype import WIRE_DTYPES
from gradserver.worker import WorkerClient
from gradserver.worker.client import TRANSPORTS

from .extra import require_training_extra
from .fingerprint import synthetic_fingerprint
from .metrics_log import open_metrics_log
from .synthetic import SHAPES, ModelShape, StepReport, run_exchange

if TYPE_CHECKING:
    import torch

    from .trainer import StepResult
    from .training import TrainConfig

# Training modules import torch; they are imported when a training job starts, so that the
# `gradserver` command (and with it the coordinator) never loads torch.

log = logging.getLogger("gradserver.worker")

JOBS = ("train", "synthetic")
ENGINES = ("remote", "gloo", "nccl")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# torch.distributed backend per engine: NCCL reduces CUDA tensors only, and the loss all-reduce
# is of CPU tensors, so the NCCL engine runs gloo beside it for the CPU ones.
DIST_BACKENDS = {"gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}


_NON_NEGATIVE = (
    "steps",
    "gpu_count",
    "threads",
    "checkpoint_every",
    "num_blocks",
    "hidden",
    "kv_hidden",
    "intermediate",
    "vocab",
    "timeout",
    "reconnect_timeout",
    "check_state_every",
    "outer_steps",
)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    job: str = dataclasses.field(default="train", metadata={"help": f"one of {', '.join(JOBS)}"})
    coordinator: str = client_setting("coordinator", "127.0.0.1:50051")
    node_id: str = dataclasses.field(
        default="",
        metadata={
            "help": "stable name of this worker: names its checkpoint; needed by --resume (default: hostname)"
        },
    )
    # The averaging engine was --backend, a word kept for the torch.distributed backend.
    engine: str = dataclasses.field(
        default="remote",
        metadata={
            "help": f"gradient averaging engine: {', '.join(ENGINES)}",
            "deprecated_flag": "--backend",
            "deprecated_env": "GRADSERVER_BACKEND",
        },
    )
    gpu_count: int = dataclasses.field(default=0, metadata={"help": "GPUs reported at join"})
    dist_rank: int = dataclasses.field(default=-1, metadata={"help": "gloo and nccl engines: this rank"})
    dist_world_size: int = dataclasses.field(
        default=0, metadata={"help": "gloo and nccl engines: number of ranks"}
    )
    dist_init: str = dataclasses.field(
        default="", metadata={"help": "gloo and nccl engines: init_method (tcp://... or file://...)"}
    )
    steps: int = dataclasses.field(default=3, metadata={"help": "steps to run"})
    model: str = dataclasses.field(
        default="tiny", metadata={"help": "model (train: tiny, small, wide, 350m) or shape (synthetic)"}
    )
    batch_size: int = dataclasses.field(default=8, metadata={"help": "train: sequences per micro-batch"})
    seq_len: int = dataclasses.field(default=0, metadata={"help": "train: tokens per sequence (0: model's)"})
    accumulation_steps: int = dataclasses.field(default=1, metadata={"help": "train: micro-batches per step"})
    lr: float = dataclasses.field(default=3e-3, metadata={"help": "train: AdamW learning rate"})
    max_grad_norm: float = dataclasses.field(default=1.0, metadata={"help": "train: clip norm (0: off)"})
    checkpoint_every: int = dataclasses.field(
        default=0, metadata={"help": "train: steps between checkpoints"}
    )
    resume: bool = dataclasses.field(
        default=False, metadata={"help": "train: continue from --out's checkpoint"}
    )
    device: str = dataclasses.field(default="auto", metadata={"help": "train: cpu, cuda, cuda:N or auto"})
    threads: int = dataclasses.field(
        default=0,
        metadata={"help": "torch threads (0: OMP_NUM_THREADS if set, else cores // workers on this host)"},
    )
    check_state_every: int = dataclasses.field(
        default=50,
        metadata={
            "help": (
                "train: steps between state-digest checks across workers (0: only after a worker "
                "joins a running job); a diverged worker is evicted"
            )
        },
    )
    outer_steps: int = dataclasses.field(
        default=0,
        metadata={
            "help": (
                "train: DiLoCo outer steps: H inner steps without averaging, then the weights' change "
                "is averaged and an outer optimizer steps (0: off, average every step); --steps then "
                "counts inner steps"
            )
        },
    )
    fragments: int = dataclasses.field(
        default=1,
        metadata={"help": "train, --outer-steps: model parts exchanged in turn, one every H/F inner steps"},
    )
    outer_lr: float = dataclasses.field(
        default=0.7, metadata={"help": "train, --outer-steps: learning rate of the outer Nesterov SGD"}
    )
    outer_momentum: float = dataclasses.field(
        default=0.9,
        metadata={"help": "train, --outer-steps: momentum of the outer Nesterov SGD (0: plain SGD)"},
    )
    outer_delay: int = dataclasses.field(
        default=0,
        metadata={
            "help": "train, --outer-steps: inner steps that run while each exchange travels (Streaming "
            "DiLoCo's tau; below H/F)"
        },
    )
    outer_keep_local: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "train, --outer-steps: share of its local weights a fragment keeps when its average "
            "lands (alpha; 0: they become the global ones)"
        },
    )
    outer_flush: str = dataclasses.field(
        default="mean",
        metadata={
            "help": "train, --outer-steps with --fragments above 1: how each final flush step applies its "
            "average (mean: the workers' mean weights, the outer optimizer left alone; outer: an outer "
            "optimizer step)"
        },
    )
    reconnect_timeout: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "train: seconds to keep rejoining a lost coordinator (0: off); steps become all-or-none"
        },
    )
    transport: str = dataclasses.field(
        default="auto",
        metadata={
            "help": "remote: how gradients move; auto: shared memory when the coordinator is on this host, "
            "else gRPC; grpc; shm (fail if unavailable)"
        },
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of weights or synthetic gradients"})
    num_blocks: int = dataclasses.field(
        default=0, metadata={"help": "synthetic: override the preset's blocks"}
    )
    hidden: int = dataclasses.field(default=0, metadata={"help": "synthetic: override the hidden size"})
    kv_hidden: int = dataclasses.field(default=0, metadata={"help": "synthetic: override the KV size"})
    intermediate: int = dataclasses.field(default=0, metadata={"help": "synthetic: override the MLP size"})
    vocab: int = dataclasses.field(default=0, metadata={"help": "synthetic: override the vocabulary"})
    non_block: str = dataclasses.field(
        default="lm_head,final_norm,embedding", metadata={"help": "synthetic: non-block tensors to send"}
    )
    lockstep: bool = dataclasses.field(
        default=False, metadata={"help": "synthetic: receive each block before sending the next"}
    )
    no_verify: bool = dataclasses.field(
        default=False, metadata={"help": "synthetic: skip the reference check"}
    )
    wire_dtype: str = client_setting("wire_dtype", "float32")
    error_feedback: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "remote, 16-bit or int8/int4 wire: add each tensor's rounding error to its next gradient"
        },
    )
    timeout: float = dataclasses.field(default=0.0, metadata={"help": "seconds for every wait (0: defaults)"})
    json: bool = dataclasses.field(default=False, metadata={"help": "print a JSON summary line last"})
    progress_fd: int = dataclasses.field(
        default=-1,
        metadata={
            "help": "train: write one JSON line per step (worker_id, step, loss, tokens_per_s, "
            "allreduce_ms) to this inherited file descriptor, for a supervising process (-1: off)"
        },
    )
    out: str = dataclasses.field(default="", metadata={"help": "directory for metrics.jsonl and checkpoints"})
    tls_ca: str = client_setting("tls_ca", "")
    tls_client_cert: str = client_setting("tls_client_cert", "")
    tls_client_key: str = client_setting("tls_client_key", "")
    tls_server_name: str = client_setting("tls_server_name", "")
    auth_token: str = dataclasses.field(
        default="", repr=False, metadata={"help": AUTH_TOKEN_HELP, "secret": True}
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": LOG_LEVEL_HELP})
    log_format: str = dataclasses.field(default="text", metadata={"help": LOG_FORMAT_HELP})

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("job", self.job, JOBS),
            ("engine", self.engine, ENGINES),
            ("transport", self.transport, TRANSPORTS),
            ("log_format", self.log_format, LOG_FORMATS),
            ("log_level", self.log_level.upper(), LOG_LEVELS),
        ):
            if value not in allowed:
                raise InvalidArgumentError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}"
                )
        if self.wire_dtype not in WIRE_DTYPES:
            raise InvalidArgumentError(
                f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}"
            )
        if self.error_feedback and self.wire_dtype == "float32":
            raise InvalidArgumentError("--error-feedback needs --wire-dtype bfloat16, float16, int8 or int4")
        if self.wire_dtype != "float32" and self.engine != "remote":
            raise InvalidArgumentError(
                f"--wire-dtype {self.wire_dtype} is for --engine remote; {self.engine} sends float32"
            )
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if value < 0:
                raise InvalidArgumentError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.progress_fd < -1:
            raise InvalidArgumentError(
                f"--progress-fd must be a file descriptor or -1, got {self.progress_fd}"
            )

    def shape(self) -> ModelShape:
        if self.model not in SHAPES:
            raise InvalidArgumentError(f"--model {self.model!r} is not one of {', '.join(SHAPES)}")
        overrides = {
            name: getattr(self, name)
            for name in ("num_blocks", "hidden", "kv_hidden", "intermediate", "vocab")
            if getattr(self, name)
        }
        return dataclasses.replace(SHAPES[self.model], **overrides)

    def train_config(self) -> TrainConfig:
        from .training import TrainConfig

        return TrainConfig(
            model=self.model,
            steps=self.steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            accumulation_steps=self.accumulation_steps,
            lr=self.lr,
            max_grad_norm=self.max_grad_norm,
            seed=self.seed,
            out=self.out,
            resume=self.resume,
            checkpoint_every=self.checkpoint_every,
            device=self.device,
            reconnect_timeout=self.reconnect_timeout,
            node_id=self.node_id,
            check_state_every=self.check_state_every,
            outer_steps=self.outer_steps,
            fragments=self.fragments,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            outer_delay=self.outer_delay,
            outer_keep_local=self.outer_keep_local,
            outer_flush=self.outer_flush,
        )

    def non_block_components(self) -> tuple[NonBlockComponent, ...]:
        return tuple(parse_non_block_component(name) for name in self.non_block.split(",") if name.strip())


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "worker",
        help="one worker: train a model or run the synthetic exchange",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(run=run)


def worker_parser() -> argparse.ArgumentParser:
    """A parser of `gradserver worker`'s flags alone (for `launch` to check what it will pass)."""
    parser = argparse.ArgumentParser(prog="gradserver worker")
    _add_arguments(parser)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, WorkerConfig)
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration and exit"
    )


def run(args: argparse.Namespace) -> int:
    config: WorkerConfig = config_from_sources(WorkerConfig, args)
    if getattr(args, "print_config", False):
        print(describe_config(config, args))
        return 0
    configure_logging(config.log_level, "worker", config.log_format)
    if config.job == "synthetic":
        fingerprint = check_synthetic(config)
        return _run_synthetic(config, fingerprint)
    require_training_extra()
    return _run_training(config, check_training(config))


# --- checks before any network call -------------------------------------------------------------


def _check_common(config: WorkerConfig) -> None:
    if config.engine == "remote":
        parse_address(config.coordinator, what="--coordinator")
        tls = TlsFiles.load(config.tls_ca, config.tls_client_cert, config.tls_client_key, what="worker TLS")
        if tls is not None and tls.ca is None:
            raise InvalidArgumentError("--tls-client-cert needs --tls-ca to verify the coordinator")
    if config.out:
        out = Path(config.out)
        if out.exists() and not out.is_dir():
            raise InvalidArgumentError(f"--out {config.out!r} is not a directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidArgumentError(f"--out {config.out!r} cannot be created: {exc.strerror}") from None
        if not os.access(out, os.W_OK):
            raise InvalidArgumentError(f"--out {config.out!r} is not writable")


def check_synthetic(config: WorkerConfig) -> dict[str, str]:
    """Checks a synthetic job's arguments; returns its fingerprint."""
    if config.engine != "remote":
        raise InvalidArgumentError("--job synthetic needs --engine remote (it exercises the coordinator)")
    shape = config.shape()
    non_block = config.non_block_components()
    _check_common(config)
    fingerprint = synthetic_fingerprint(shape, non_block, steps=config.steps, seed=config.seed)
    return _with_wire(fingerprint, config)


def _with_wire(fingerprint: dict[str, str], config: WorkerConfig) -> dict[str, str]:
    """The fingerprint's wire settings as this worker uses them: workers that round differently
    must not form one job."""
    fingerprint["wire_dtype"] = config.wire_dtype
    if config.error_feedback:
        fingerprint["error_feedback"] = "True"
    return fingerprint


def check_training(config: WorkerConfig, *, checkpoint: bool = True) -> dict[str, str]:
    """Checks a training job's arguments, device and (with `checkpoint`) the checkpoint that
    --resume continues from; returns the job's fingerprint."""
    from .model import model_config
    from .training import checkpoint_identity, find_resume_checkpoint, resolve_device

    train_config = config.train_config()
    model_config(config.model)
    check_device(resolve_device(train_config.device))
    _check_common(config)
    if config.engine != "remote":
        if not 0 <= config.dist_rank < config.dist_world_size or not config.dist_init:
            raise InvalidArgumentError(
                f"--engine {config.engine} needs --dist-world-size N, --dist-rank 0..N-1 and "
                f"--dist-init, got rank {config.dist_rank}, world size {config.dist_world_size}, "
                f"init {config.dist_init!r}"
            )
    elif config.resume and not config.node_id:
        raise InvalidArgumentError(
            "--resume with --engine remote needs --node-id: worker ids follow the join order, so "
            "only a node id finds this worker's checkpoint"
        )
    fingerprint = job_fingerprint(config)
    if config.resume and checkpoint:
        identity = checkpoint_identity(train_config, config.dist_rank)
        find_resume_checkpoint(train_config, identity, fingerprint)
    return fingerprint


def job_fingerprint(config: WorkerConfig) -> dict[str, str]:
    """The training fingerprint, with the engine named as its AveragingEngine names itself."""
    from .engines import CoordinatorEngine, TorchDistributedEngine
    from .fingerprint import training_fingerprint

    engine = CoordinatorEngine.name if config.engine == "remote" else TorchDistributedEngine.name
    return _with_wire(training_fingerprint(config.train_config(), engine=engine), config)


def check_device(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidArgumentError(f"--device {device}: CUDA is not available on this machine")
        if device.index is not None and device.index >= count:
            raise InvalidArgumentError(f"--device {device}: this machine has cuda:0..cuda:{count - 1}")


# --- threads ------------------------------------------------------------------------------------


def choose_threads(
    explicit: int, environ: Mapping[str, str], cores: int, local_workers: int
) -> tuple[int, str]:
    """torch intra-op threads for a worker, and why: `--threads`, else `OMP_NUM_THREADS`, else the
    host's cores shared out between the job's workers on it (at least one each)."""
    if explicit > 0:
        return explicit, "--threads"
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    workers = max(1, local_workers)
    return max(1, cores // workers), f"{cores} cores / {workers} workers on this host"


def _set_threads(config: WorkerConfig, local_workers: int) -> None:
    import torch

    threads, why = choose_threads(config.threads, os.environ, available_cores(), local_workers)
    torch.set_num_threads(threads)
    log.info("using %d torch threads (%s)", threads, why)


# --- running ------------------------------------------------------------------------------------


def _connect(
    config: WorkerConfig,
    device_type: str,
    fingerprint: Mapping[str, str],
    committed_step: int | None = None,
) -> WorkerClient:
    tls = TlsFiles.load(config.tls_ca, config.tls_client_cert, config.tls_client_key, what="worker TLS")
    return WorkerClient.connect(
        config.coordinator,
        node_id=config.node_id,
        gpu_count=config.gpu_count,
        device_type=device_type,
        timeout=Timeouts.of(config.timeout or None),
        tls=tls,
        auth_token=config.auth_token,
        server_name=config.tls_server_name,
        committed_step=committed_step,
        fingerprint=fingerprint,
        wire_dtype=config.wire_dtype,
        error_feedback=config.error_feedback,
        transport=config.transport,
    )


def _run_training(config: WorkerConfig, fingerprint: Mapping[str, str]) -> int:
    from .engines import AveragingEngine, CoordinatorEngine, TorchDistributedEngine
    from .training import prepare_training, resolve_device, train

    train_config = config.train_config()
    device = resolve_device(train_config.device)
    engine: AveragingEngine
    if config.engine == "remote":
        # Before Join: a worker that joins a running job holds the others up from its Join to
        # its first contribution, so nothing slow may come between.
        prepare_training()
        engine = CoordinatorEngine(
            _connect(config, device.type, fingerprint),
            lambda committed: _connect(config, device.type, fingerprint, committed),
            config.reconnect_timeout,
        )
        local_workers = engine.client.local_workers
    else:
        import torch.distributed as dist

        dist.init_process_group(
            DIST_BACKENDS[config.engine],
            init_method=config.dist_init,
            rank=config.dist_rank,
            world_size=config.dist_world_size,
        )
        engine = TorchDistributedEngine()
        # torch.distributed does not say how many ranks share this host: --threads or
        # OMP_NUM_THREADS (which `gradserver launch` sets) decide, else every core.
        local_workers = 1
    me = engine.rank
    set_log_context(worker_id=me)
    _set_threads(config, local_workers)
    log.info(
        "worker %d/%d: training %s (%s engine, %s)",
        me,
        engine.world_size,
        config.model,
        engine.name,
        device,
    )

    def report(r: StepResult) -> None:
        rate = r.tokens / r.seconds
        outer = "" if r.inner_steps is None else f" ({r.inner_steps} inner, {r.outer_steps} outer steps done)"
        if r.flush:
            # It trained nothing: no loss or rate to show, and the bar keeps the last step's.
            log.info(
                "worker %d step %d: final flush of fragment %s, all-reduce %.0f ms%s",
                me,
                r.step,
                r.fragment,
                r.comm_s * 1000,
                outer,
            )
            return
        log.info(
            "worker %d step %d: loss %.4f, global loss %.4f, %.0f tokens/s, compute %.0f ms, "
            "all-reduce %.0f ms%s",
            me,
            r.step,
            r.loss,
            r.global_loss,
            rate,
            r.compute_s * 1000,
            r.comm_s * 1000,
            outer,
        )
        if progress is not None:
            entry: dict[str, object] = {
                "worker_id": me,
                "step": r.step,
                "loss": r.global_loss,
                "tokens_per_s": rate,
                "allreduce_ms": r.comm_s * 1000,
            }
            if r.inner_steps is not None:
                entry |= {"inner_steps": r.inner_steps, "outer_steps": r.outer_steps}
            progress.write(json.dumps(entry) + "\n")

    progress = _open_progress(config.progress_fd)
    try:
        results = train(engine, train_config, report)
    finally:
        if progress is not None:
            progress.close()
        if isinstance(engine, CoordinatorEngine):
            engine.client.close()
        else:
            engine.close()
    if config.json:
        print(json.dumps({"worker_id": me, "steps": [dataclasses.asdict(r) for r in results]}), flush=True)
    return 0


def _open_progress(fd: int) -> TextIO | None:
    """The line-buffered progress channel of --progress-fd, or None when it is off."""
    if fd < 0:
        return None
    try:
        return os.fdopen(fd, "w", buffering=1, encoding="utf-8")
    except OSError as exc:
        raise InvalidArgumentError(
            f"--progress-fd {fd} is not an open file descriptor: {exc.strerror}"
        ) from None


def _run_synthetic(config: WorkerConfig, fingerprint: Mapping[str, str]) -> int:
    shape = config.shape()
    non_block = config.non_block_components()
    with _connect(config, "cpu", fingerprint) as client:
        me = client.worker_id
        set_log_context(worker_id=me)
        mib = shape.total_bytes(non_block) / 2**20
        print(
            f"worker {me}/{client.total_workers}: joined {config.coordinator}; "
            f"{shape.num_blocks} blocks + {len(non_block)} non-block tensors, {mib:.1f} MiB per step",
            flush=True,
        )
        metrics_file = open_metrics_log(config.out)

        def report(r: StepReport) -> None:
            log.info(
                "worker %d step %d: %d tensors averaged, %.1f MiB in %.3f s (compute %.3f, send %.3f, "
                "wait %.3f), max rel err %.2e, checksum %08x",
                me,
                r.step,
                r.tensors,
                r.bytes_sent / 2**20,
                r.seconds,
                r.compute_s,
                r.send_s,
                r.wait_s,
                r.max_rel_error,
                r.checksum,
            )
            if metrics_file is not None:
                metrics_file.write(json.dumps({"time": time.time(), **dataclasses.asdict(r)}) + "\n")

        try:
            reports = run_exchange(
                client,
                shape,
                config.steps,
                seed=config.seed,
                pipelined=not config.lockstep,
                non_block=non_block,
                # Per-element relative error is unbounded under 16-bit rounding (cancellation);
                # the checksum still shows every worker got the same bytes.
                verify=not config.no_verify and config.wire_dtype == "float32",
                on_step=report,
            )
        finally:
            if metrics_file is not None:
                metrics_file.close()
    if config.json:
        print(json.dumps({"worker_id": me, "steps": [dataclasses.asdict(r) for r in reports]}), flush=True)
    return 0
