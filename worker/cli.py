"""`gradserver worker`: join a coordinator and run the synthetic gradient exchange.

Each step sends every block's gradient (in reverse order, as backward produces them) and the
non-block tensors, checks the averages against a float64 reference and prints one line per step
with a checksum that must be the same on every worker. `--json` prints a machine-readable
summary last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import IO, Any

from gradserver.common.components import parse_non_block_component
from gradserver.common.config import add_config_arguments, config_from_sources
from gradserver.common.errors import InvalidArgumentError
from gradserver.common.logs import LOG_FORMATS, configure_logging, set_log_context
from gradserver.common.timeouts import Timeouts

from .client import WorkerClient
from .synthetic import SHAPES, ModelShape, StepReport, run_exchange


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    coordinator: str = dataclasses.field(
        default="127.0.0.1:50051", metadata={"help": "coordinator HOST:PORT"}
    )
    node_id: str = dataclasses.field(default="", metadata={"help": "name of this node (default: hostname)"})
    backend: str = dataclasses.field(default="cpu", metadata={"help": "compute backend reported at join"})
    gpu_count: int = dataclasses.field(default=0, metadata={"help": "GPUs reported at join"})
    steps: int = dataclasses.field(default=3, metadata={"help": "steps to run"})
    model: str = dataclasses.field(
        default="tiny", metadata={"help": f"gradient shape preset: {', '.join(SHAPES)}"}
    )
    num_blocks: int = dataclasses.field(default=0, metadata={"help": "override the preset's blocks"})
    hidden: int = dataclasses.field(default=0, metadata={"help": "override the preset's hidden size"})
    kv_hidden: int = dataclasses.field(default=0, metadata={"help": "override the preset's KV size"})
    intermediate: int = dataclasses.field(default=0, metadata={"help": "override the MLP size"})
    vocab: int = dataclasses.field(default=0, metadata={"help": "override the vocabulary size"})
    non_block: str = dataclasses.field(
        default="lm_head,final_norm,embedding", metadata={"help": "non-block tensors to send"}
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the synthetic gradients"})
    lockstep: bool = dataclasses.field(
        default=False, metadata={"help": "receive each block before sending the next"}
    )
    no_verify: bool = dataclasses.field(
        default=False, metadata={"help": "skip the float64 reference check (benchmarks)"}
    )
    timeout: float = dataclasses.field(default=0.0, metadata={"help": "seconds for every wait (0: defaults)"})
    json: bool = dataclasses.field(default=False, metadata={"help": "print a JSON summary line last"})
    out: str = dataclasses.field(
        default="", metadata={"help": "directory for metrics.jsonl (one line per step and worker)"}
    )
    log_level: str = dataclasses.field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING, ERROR"})
    log_format: str = dataclasses.field(default="text", metadata={"help": "text or json"})

    def shape(self) -> ModelShape:
        if self.model not in SHAPES:
            raise InvalidArgumentError(f"--model {self.model!r} is not one of {', '.join(SHAPES)}")
        base = SHAPES[self.model]
        overrides = {
            name: getattr(self, name)
            for name in ("num_blocks", "hidden", "kv_hidden", "intermediate", "vocab")
            if getattr(self, name)
        }
        return dataclasses.replace(base, **overrides)


def _open_metrics(out: str) -> IO[str] | None:
    """DIR/metrics.jsonl opened for appending. Several workers may share DIR: each line is one
    small append, which the OS keeps whole."""
    if not out:
        return None
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    return (directory / "metrics.jsonl").open("a", encoding="utf-8", buffering=1)


def register(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "worker",
        help="join a coordinator and exchange synthetic gradients",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, WorkerConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config: WorkerConfig = config_from_sources(WorkerConfig, args)
    if config.log_format not in LOG_FORMATS:
        raise InvalidArgumentError(
            f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {config.log_format!r}"
        )
    configure_logging(config.log_level, "worker", config.log_format)
    shape = config.shape()
    non_block = tuple(parse_non_block_component(name) for name in config.non_block.split(",") if name.strip())
    if config.steps < 0:
        raise InvalidArgumentError(f"--steps must be >= 0, got {config.steps}")
    timeouts = Timeouts.of(config.timeout or None)
    log = logging.getLogger("gradserver.worker")
    with WorkerClient.connect(
        config.coordinator,
        node_id=config.node_id,
        gpu_count=config.gpu_count,
        backend=config.backend,
        timeout=timeouts,
    ) as client:
        me = client.worker_id
        mib = shape.total_bytes(non_block) / 2**20
        print(
            f"worker {me}/{client.total_workers}: joined {config.coordinator}; "
            f"{shape.num_blocks} blocks + {len(non_block)} non-block tensors, {mib:.1f} MiB per step",
            flush=True,
        )

        set_log_context(worker_id=me)
        metrics_file = _open_metrics(config.out)

        def report(r: StepReport) -> None:
            print(
                f"worker {me} step {r.step}: {r.tensors} tensors averaged, "
                f"{r.bytes_sent / 2**20:.1f} MiB in {r.seconds:.3f} s "
                f"(compute {r.compute_s:.3f}, send {r.send_s:.3f}, wait {r.wait_s:.3f}), "
                f"max rel err {r.max_rel_error:.2e}, checksum {r.checksum:08x}",
                flush=True,
            )
            if metrics_file is not None:
                metrics_file.write(json.dumps({"time": time.time(), **dataclasses.asdict(r)}) + "\n")
                metrics_file.flush()

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
        log.debug("worker %d done", me)
    if config.json:
        summary = {
            "worker_id": me,
            "steps": [dataclasses.asdict(r) for r in reports],
        }
        print(json.dumps(summary), flush=True)
    return 0
