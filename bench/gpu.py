"""Benchmark: the trainer on a CUDA GPU (scripts/gpu-check.sh runs it on a GPU machine).

    python -m bench.gpu --part sync     # one GPU: device-side accumulation vs a sync per block
    python -m bench.gpu --part copies   # torch profiler: device<->host copies vs compute per step
    python -m bench.gpu --part pair     # 2 workers sharing the GPU: coordinator vs gloo

`sync`: one process, the NCCL engine over one rank (so nothing leaves the GPU), the same model,
batches and steps for three trainers, alternated: the trainer as it is; a variant that waits for
the GPU after every block of every micro-batch, as the reference's original per-block host read
did; and one that uploads micro-batches from pageable memory (each upload a synchronisation), as
the trainer did before it used pinned memory. `copies`: one worker through a real coordinator
(gradients staged through pinned host buffers), two profiled steps after warm-up; the device
time of every host<->device copy against the device time of all kernels. `pair`: `gradserver
launch --workers 2 --device cuda` with the coordinator and with the gloo engine on CUDA tensors
(bench.training's median global tokens/s). Each part prints one JSON line per result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.training import run as run_launch
from gradserver.train.engines import AveragingEngine, CoordinatorEngine, TorchDistributedEngine
from gradserver.train.model import TransformerLM, model_config
from gradserver.train.trainer import DistributedTrainer


class _SyncPerBlock(DistributedTrainer):
    """The reference's original: the host waits for the GPU after each block's gradients."""

    def _on_grad(self, param: torch.Tensor) -> None:
        super()._on_grad(param)
        route = self._route[id(param)]
        if route[0] == "block" and self._remaining[route[1]] == 0 and self.device.type == "cuda":
            torch.cuda.synchronize()


class _PageableInputs(DistributedTrainer):
    """The trainer before it uploaded micro-batches through pinned memory: a plain `.to()` of
    pageable host memory, which synchronises once per micro-batch and tensor."""

    def _on_device(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.to(self.device)


def _batches(vocab: int, batch: int, seq: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, vocab, (batch, seq + 1), generator=generator) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _steps(
    trainer: DistributedTrainer, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int
) -> list[float]:
    """Seconds of each step (the trainer's own measure, which ends at a host read of its results)."""
    return [trainer.train_step(batches).seconds for _ in range(steps)]


@contextmanager
def _one_rank(tmp: str, device: str) -> Iterator[AveragingEngine]:
    """torch.distributed over one rank: NCCL on a GPU (nothing leaves it), gloo on the CPU."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
    engine = TorchDistributedEngine()
    try:
        yield engine
    finally:
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def part_sync(args: argparse.Namespace) -> list[dict[str, object]]:
    cfg = model_config(args.model)
    seq = args.seq_len or cfg.max_seq_len
    batches = _batches(cfg.vocab, args.batch_size, seq, args.accumulation_steps)
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp, _one_rank(tmp, args.device) as engine:
        variants = {
            "device": DistributedTrainer,
            "sync_per_block": _SyncPerBlock,
            "pageable_inputs": _PageableInputs,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        trainers = {
            name: cls(TransformerLM(cfg).to(args.device), engine, max_grad_norm=1.0)
            for name, cls in variants.items()
        }
        for trainer in trainers.values():
            _steps(trainer, batches, args.warmup)
        for _ in range(args.rounds):  # alternated, so drift hits both alike
            for name, trainer in trainers.items():
                times[name] += _steps(trainer, batches, args.steps)
        for trainer in trainers.values():
            trainer.close()
    tokens = args.batch_size * seq * args.accumulation_steps
    base = statistics.median(times["device"])
    for name, seconds in times.items():
        median = statistics.median(seconds)
        results.append(
            {
                "part": "sync",
                "variant": name,
                "model": args.model,
                "batch_size": args.batch_size,
                "seq_len": seq,
                "micro_batches": args.accumulation_steps,
                "tokens_per_step": tokens,
                "median_step_s": round(median, 4),
                "tokens_per_s": round(tokens / median),
                "slowdown": round(median / base, 3),
                "steps": len(seconds),
            }
        )
    return results


@contextmanager
def _coordinator(tmp: str) -> Iterator[str]:
    port_file = Path(tmp) / "port"
    argv = [sys.executable, "-m", "gradserver.cli", "coordinator", "--bind", "127.0.0.1:0"]
    argv += ["--port-file", str(port_file), "--world-size", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text().strip()}"
    finally:
        proc.terminate()
        proc.wait(30)


def part_copies(args: argparse.Namespace) -> list[dict[str, object]]:
    from torch.profiler import ProfilerActivity, profile

    from gradserver.worker import WorkerClient

    cfg = model_config(args.model)
    seq = args.seq_len or cfg.max_seq_len
    batches = _batches(cfg.vocab, args.batch_size, seq, args.accumulation_steps)
    with tempfile.TemporaryDirectory() as tmp, _coordinator(tmp) as address:
        client = WorkerClient.connect(address, device_type=args.device)
        model = TransformerLM(cfg).to(args.device)
        trainer = DistributedTrainer(model, CoordinatorEngine(client), max_grad_norm=1.0)
        try:
            _steps(trainer, batches, args.warmup)
            activities = [ProfilerActivity.CPU]
            if args.device == "cuda":
                torch.cuda.synchronize()
                activities.append(ProfilerActivity.CUDA)
            with profile(activities=activities) as prof:
                seconds = _steps(trainer, batches, 2)
                if args.device == "cuda":
                    torch.cuda.synchronize()
        finally:
            trainer.close()
            client.close()
    copies = {"DtoH": 0.0, "HtoD": 0.0}
    kernels = 0.0
    for event in prof.events():
        # A kernel or copy the GPU ran is an event of device type CUDA; its span is device time.
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        device_us = float(event.time_range.elapsed_us())
        name = event.name
        if "Memcpy DtoH" in name:
            copies["DtoH"] += device_us
        elif "Memcpy HtoD" in name:
            copies["HtoD"] += device_us
        elif "Memcpy" not in name and "Memset" not in name:
            kernels += device_us
    try:  # the profiler's own table, in the log, for reading where the time went
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12), file=sys.stderr)
    except Exception as exc:
        print(f"no profiler table: {exc}", file=sys.stderr)
    gradient_bytes = 4 * sum(p.numel() for p in TransformerLM(cfg).parameters())
    return [
        {
            "part": "copies",
            "model": args.model,
            "batch_size": args.batch_size,
            "seq_len": seq,
            "micro_batches": args.accumulation_steps,
            "steps": 2,
            "step_s": [round(s, 4) for s in seconds],
            "gradient_mb_per_step": round(gradient_bytes / 1e6, 1),
            "dtoh_ms_per_step": round(copies["DtoH"] / 2e3, 2),
            "htod_ms_per_step": round(copies["HtoD"] / 2e3, 2),
            "kernels_ms_per_step": round(kernels / 2e3, 2),
            "copies_over_kernels": round((copies["DtoH"] + copies["HtoD"]) / kernels, 3) if kernels else None,
        }
    ]


def part_pair(args: argparse.Namespace) -> list[dict[str, object]]:
    extra = ["--", "--device", args.device, "--accumulation-steps", str(args.accumulation_steps)]
    if args.seq_len:
        extra += ["--seq-len", str(args.seq_len)]
    results: list[dict[str, object]] = []
    rates: dict[str, float] = {}
    for engine in ("remote", "gloo"):
        rate, comm = run_launch(
            engine, 2, args.model, args.steps + args.warmup, args.batch_size, args.warmup, extra=extra
        )
        rates[engine] = rate
        results.append(
            {
                "part": "pair",
                "engine": engine,
                "model": args.model,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len or model_config(args.model).max_seq_len,
                "micro_batches": args.accumulation_steps,
                "workers": 2,
                "tokens_per_s": round(rate),
                "comm_fraction": round(comm, 3),
            }
        )
    for entry in results:
        entry["vs_gloo"] = round(rates[str(entry["engine"])] / rates["gloo"], 3)
    return results


PARTS = {"sync": part_sync, "copies": part_copies, "pair": part_pair}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=sorted(PARTS), required=True)
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=0)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a trial of the plumbing"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench.gpu --part {args.part}: needs a CUDA device (torch {torch.__version__} sees none)")
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    for result in PARTS[args.part](args):
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        print(json.dumps({"device": device, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
