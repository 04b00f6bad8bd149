"""`gradserver worker`: one worker process, training or running the synthetic exchange.

`--job train` (the default) trains a model on the shipped corpus, averaging gradients through the
coordinator (`--backend remote`) or through torch.distributed (`--backend gloo|nccl`, with
`--rank`, `--world-size` and `--dist-init`). `--job synthetic` sends random per-block and
non-block gradients of a model's shape and checks each average against a float64 reference;
every step line ends with a checksum that must be the same on every worker.

Each step prints one line, and a `PROGRESS {json}` line that `gradserver launch` reads; with
`--out DIR`, one JSON line per step goes to DIR/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from gradserver.common.components import parse_non_block_component
from gradserver.common.config import add_config_arguments, config_from_sources
from gradserver.common.errors import InvalidArgumentError
from gradserver.common.logs import LOG_FORMATS, configure_logging, set_log_context
from gradserver.common.security import TlsFiles
from gradserver.common.timeouts import Timeouts

from .client import WorkerClient
from .metrics_log import open_metrics_log
from .synthetic import SHAPES, ModelShape, StepReport, run_exchange

if TYPE_CHECKING:
    from .trainer import StepResult
    from .training import TrainConfig

# Training modules import torch; they are imported when a training job starts, so that the
# `gradserver` command (and with it the coordinator) never loads torch.

log = logging.getLogger("gradserver.worker")

JOBS = ("train", "synthetic")
BACKENDS = ("remote", "gloo", "nccl")


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    job: str = dataclasses.field(default="train", metadata={"help": f"one of {', '.join(JOBS)}"})
    coordinator: str = dataclasses.field(
        default="127.0.0.1:50051", metadata={"help": "coordinator HOST:PORT"}
    )
    node_id: str = dataclasses.field(default="", metadata={"help": "name of this node (default: hostname)"})
    backend: str = dataclasses.field(
        default="remote", metadata={"help": f"gradient averaging: {', '.join(BACKENDS)}"}
    )
    gpu_count: int = dataclasses.field(default=0, metadata={"help": "GPUs reported at join"})
    rank: int = dataclasses.field(default=-1, metadata={"help": "torch.distributed backends: this rank"})
    world_size: int = dataclasses.field(
        default=0, metadata={"help": "torch.distributed backends: world size"}
    )
    dist_init: str = dataclasses.field(
        default="", metadata={"help": "torch.distributed backends: init_method (tcp://... or file://...)"}
    )
    steps: int = dataclasses.field(default=3, metadata={"help": "steps to run"})
    model: str = dataclasses.field(
        default="tiny", metadata={"help": "model (train: tiny, small, 350m) or shape preset (synthetic)"}
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
    reconnect_timeout: float = dataclasses.field(
        default=0.0,
        metadata={
            "help": "train: seconds to keep rejoining a lost coordinator (0: off); steps become all-or-none"
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
    timeout: float = dataclasses.field(default=0.0, metadata={"help": "seconds for every wait (0: defaults)"})
    json: bool = dataclasses.field(default=False, metadata={"help": "print a JSON summary line last"})
    out: str = dataclasses.field(default="", metadata={"help": "directory for metrics.jsonl and checkpoints"})
    tls_ca: str = dataclasses.field(
        default="", metadata={"help": "PEM CA that signed the coordinator's certificate"}
    )
    tls_cert: str = dataclasses.field(
        default="", metadata={"help": "PEM certificate of this worker (mutual TLS)"}
    )
    tls_key: str = dataclasses.field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_server_name: str = dataclasses.field(
        default="", metadata={"help": "name to check the coordinator's certificate against"}
    )
    auth_token: str = dataclasses.field(
        default="", repr=False, metadata={"help": "shared token of the coordinator", "secret": True}
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING, ERROR"})
    log_format: str = dataclasses.field(default="text", metadata={"help": "text or json"})

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("job", self.job, JOBS),
            ("backend", self.backend, BACKENDS),
            ("log_format", self.log_format, LOG_FORMATS),
        ):
            if value not in allowed:
                raise InvalidArgumentError(
                    f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}, got {value!r}"
                )
        if self.steps < 0:
            raise InvalidArgumentError(f"--steps must be >= 0, got {self.steps}")

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
        )


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "worker",
        help="one worker: train a model or run the synthetic exchange",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, WorkerConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config: WorkerConfig = config_from_sources(WorkerConfig, args)
    configure_logging(config.log_level, "worker", config.log_format)
    if config.job == "synthetic":
        return _run_synthetic(config)
    return _run_training(config)


def _connect(config: WorkerConfig, backend_name: str, committed_step: int | None = None) -> WorkerClient:
    tls = TlsFiles.load(config.tls_ca, config.tls_cert, config.tls_key, what="worker TLS")
    if tls is not None and tls.ca is None:
        raise InvalidArgumentError("--tls-cert needs --tls-ca to verify the coordinator")
    return WorkerClient.connect(
        config.coordinator,
        node_id=config.node_id,
        gpu_count=config.gpu_count,
        backend=backend_name,
        timeout=Timeouts.of(config.timeout or None),
        tls=tls,
        auth_token=config.auth_token,
        server_name=config.tls_server_name,
        committed_step=committed_step,
    )


def _run_training(config: WorkerConfig) -> int:
    from .backends import GradientBackend, RemoteBackend, TorchDistributedBackend
    from .training import resolve_device, train

    train_config = config.train_config()
    device = resolve_device(train_config.device)
    backend: GradientBackend
    if config.backend == "remote":
        backend = RemoteBackend(
            _connect(config, device.type),
            lambda committed: _connect(config, device.type, committed),
            config.reconnect_timeout,
        )
    else:
        import torch.distributed as dist

        if config.rank < 0 or config.world_size < 1 or not config.dist_init:
            raise InvalidArgumentError("--backend gloo/nccl needs --rank, --world-size and --dist-init")
        dist.init_process_group(
            config.backend, init_method=config.dist_init, rank=config.rank, world_size=config.world_size
        )
        backend = TorchDistributedBackend()
    me = backend.rank
    set_log_context(worker_id=me)
    log.info(
        "worker %d/%d: training %s (%s backend, %s)",
        me,
        backend.world_size,
        config.model,
        backend.name,
        device,
    )

    def report(r: StepResult) -> None:
        rate = r.tokens / r.seconds
        log.info(
            "worker %d step %d: loss %.4f, global loss %.4f, %.0f tokens/s, compute %.0f ms, "
            "all-reduce %.0f ms",
            me,
            r.step,
            r.loss,
            r.global_loss,
            rate,
            r.compute_s * 1000,
            r.comm_s * 1000,
        )
        progress = {
            "worker_id": me,
            "step": r.step,
            "loss": r.global_loss,
            "tokens_per_s": rate,
            "allreduce_ms": r.comm_s * 1000,
        }
        print("PROGRESS " + json.dumps(progress), flush=True)

    try:
        results = train(backend, train_config, report)
    finally:
        if isinstance(backend, RemoteBackend):
            backend.client.close()
        else:
            backend.close()
    if config.json:
        print(json.dumps({"worker_id": me, "steps": [dataclasses.asdict(r) for r in results]}), flush=True)
    return 0


def _run_synthetic(config: WorkerConfig) -> int:
    shape = config.shape()
    non_block = tuple(parse_non_block_component(name) for name in config.non_block.split(",") if name.strip())
    with _connect(config, "cpu") as client:
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
                verify=not config.no_verify,
                on_step=report,
            )
        finally:
            if metrics_file is not None:
                metrics_file.close()
    if config.json:
        print(json.dumps({"worker_id": me, "steps": [dataclasses.asdict(r) for r in reports]}), flush=True)
    return 0
