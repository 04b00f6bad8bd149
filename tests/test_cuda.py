"""The trainer's CUDA paths on a real GPU (each test skips, saying so, where there is none):
device-side accumulation and clipping synchronise with the host a fixed number of times per
step, never per block or micro-batch; gradients staged through pinned host buffers for the
coordinator come back into `param.grad`; two workers sharing a GPU end bit-identical and agree
with an engine that averages on the device. `scripts/gpu-check.sh` runs these on a GPU machine."""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from gradserver.train.checkpoint import load_checkpoint
from gradserver.train.engines import CoordinatorEngine, LocalEngine, LocalHub
from gradserver.train.model import TransformerLM, model_config
from gradserver.train.trainer import DistributedTrainer
from gradserver.train.training import TrainConfig, train

from .helpers.server import connect_all, run_each

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _host_batches(vocab: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches on the host, as a data loader hands them over."""
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (2, 17), generator=generator) for _ in range(count)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _synchronisations(coordinator, layers: int, micro_batches: int, clip: bool) -> list[str]:
    """Where the third training step synchronised the host with the GPU (torch's sync debug mode
    names each synchronising call); the first two make the one-time allocations and imports (the
    first run on an H200 saw one such synchronisation in a process's second step)."""
    config = dataclasses.replace(model_config("tiny"), num_layers=layers)
    server = coordinator(world_size=1)
    [client] = connect_all(server.address, 1)
    model = TransformerLM(config).to("cuda")
    trainer = DistributedTrainer(model, CoordinatorEngine(client), max_grad_norm=1.0 if clip else None)
    batches = _host_batches(config.vocab, micro_batches, seed=layers)
    seen: list[str] = []

    def record(message: Warning | str, *args: object, **kwargs: object) -> None:
        # Only the warning of a synchronising call: torch also warns, once, that the debug mode
        # is a prototype that "does not yet detect all synchronizing operations".
        if "called a synchronizing" in str(message):  # where: the calling frames, innermost first
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            seen.append(" <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames[-5:])))

    try:
        trainer.train_step(batches)
        trainer.train_step(batches)
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(batches)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        staged = list(trainer.accumulator._pinned.values())
        assert staged, "nothing was staged on the host for the coordinator"
        assert all(buffer.is_pinned() for buffer in staged)
    finally:
        trainer.close()
        client.close()
    return seen


def test_a_step_synchronises_per_step_not_per_block_or_micro_batch(coordinator) -> None:
    many = _synchronisations(coordinator, layers=4, micro_batches=3, clip=True)
    few = _synchronisations(coordinator, layers=2, micro_batches=1, clip=True)
    unclipped = _synchronisations(coordinator, layers=4, micro_batches=3, clip=False)
    for name, where in (("4 blocks, 3 micro-batches", many), ("2, 1", few), ("4, 3, unclipped", unclipped)):
        print(f"synchronisations in a step ({name}):", *where, sep="\n  ")
    # The loss read after backward, and nothing else: the clipped gradients' norm, reported with
    # the step, is read through an event that waits for the clipping, not for the stream.
    calls = [[where.split(" <- ")[0] for where in seen] for seen in (many, few, unclipped)]
    assert calls[0] == calls[1] == calls[2] and len(calls[0]) == 1, (many, few, unclipped)
    assert Path(calls[0][0].rsplit(":", 1)[0]).name == "trainer.py", many


def _train_pair(coordinator, tmp: Path, remote: bool) -> list[dict[str, torch.Tensor]]:
    config = TrainConfig(
        model="tiny",
        steps=4,
        batch_size=4,
        accumulation_steps=2,
        lr=1e-2,
        max_grad_norm=0.5,
        device="cuda",
        out=str(tmp),
    )
    if remote:
        server = coordinator(world_size=2)
        clients = connect_all(server.address, 2)
        try:
            run_each(clients, lambda c: train(CoordinatorEngine(c), config), timeout=300)
        finally:
            for c in clients:
                c.close()
    else:
        hub = LocalHub(2)
        run_each([0, 1], lambda rank: train(LocalEngine(hub, rank), config), timeout=300)
    return [load_checkpoint(tmp / f"checkpoint-rank{r}.pt").model_state for r in range(2)]


def test_two_workers_on_one_gpu_end_bit_identical_through_pinned_staging(coordinator, tmp_path: Path) -> None:
    staged = _train_pair(coordinator, tmp_path / "remote", remote=True)
    local = _train_pair(coordinator, tmp_path / "local", remote=False)
    for name, weight in staged[0].items():
        assert weight.device.type == "cpu"  # checkpoints hold host copies
        assert torch.equal(weight, staged[1][name]), name
        # The same arithmetic (a float64 sum in rank order) on the same GPU: equal up to the
        # order in which the GPU's kernels summed each worker's own gradient.
        torch.testing.assert_close(weight, local[0][name], msg=lambda m, n=name: f"{n}: {m}")
    initial = TransformerLM(model_config("tiny")).state_dict()
    assert any(not torch.equal(initial[name], w) for name, w in staged[0].items())
