"""The synthetic exchange: random per-block and non-block gradients of a model's shape, averaged
through the coordinator and checked against a float64 reference mean.

Every worker draws its gradient for (step, key) from a generator seeded by (seed, step, worker,
key), so each worker can also draw every other worker's gradient and compute the exact expected
average itself. Each step reports the largest relative error against that reference and a CRC32
of everything received, which must be equal on every worker (bit-identical averages).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable

import numpy as np

from gradserver.common.components import NonBlockComponent, compute_block_sizes
from gradserver.common.errors import InternalError

from .client import WorkerClient


@dataclasses.dataclass(frozen=True)
class ModelShape:
    num_blocks: int
    hidden: int
    kv_hidden: int
    intermediate: int
    vocab: int

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return compute_block_sizes(self.hidden, self.kv_hidden, self.intermediate)

    def non_block_size(self, component: NonBlockComponent) -> int:
        if component is NonBlockComponent.FINAL_NORM:
            return self.hidden
        return self.vocab * self.hidden

    def total_bytes(self, non_block: tuple[NonBlockComponent, ...]) -> int:
        elements = self.num_blocks * sum(self.block_sizes)
        elements += sum(self.non_block_size(c) for c in non_block)
        return 4 * elements


SHAPES = {
    "tiny": ModelShape(num_blocks=2, hidden=64, kv_hidden=16, intermediate=128, vocab=256),
    "small": ModelShape(num_blocks=4, hidden=256, kv_hidden=64, intermediate=1024, vocab=4096),
    "350m-slice": ModelShape(num_blocks=4, hidden=1024, kv_hidden=256, intermediate=4096, vocab=32768),
    "350m": ModelShape(num_blocks=24, hidden=1024, kv_hidden=256, intermediate=4096, vocab=32768),
}


def synthetic_gradient(seed: int, step: int, worker_id: int, tag: int, size: int) -> np.ndarray:
    """The gradient worker `worker_id` contributes at `step` for the key identified by `tag`."""
    rng = np.random.default_rng([seed, step, worker_id, tag])
    return rng.standard_normal(size, dtype=np.float32)


def _block_tag(block_idx: int) -> int:
    return 1000 + block_idx


def _non_block_tag(component: NonBlockComponent) -> int:
    return int(component)


@dataclasses.dataclass
class StepReport:
    step: int
    tensors: int
    bytes_sent: int
    seconds: float
    max_rel_error: float
    checksum: int


def _reference_mean(seed: int, step: int, world: int, tag: int, size: int) -> np.ndarray:
    total = np.zeros(size, dtype=np.float64)
    for w in range(world):
        total += synthetic_gradient(seed, step, w, tag, size)
    return total / world


def _rel_error(got: np.ndarray, want: np.ndarray) -> float:
    if got.size == 0:
        return 0.0
    scale = np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    return float(np.max(np.abs(got.astype(np.float64) - want) / scale))


def run_exchange(
    client: WorkerClient,
    shape: ModelShape,
    steps: int,
    *,
    seed: int = 0,
    first_step: int = 0,
    pipelined: bool = True,
    non_block: tuple[NonBlockComponent, ...] = tuple(NonBlockComponent),
    verify: bool = True,
    tolerance: float = 1e-6,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """Runs `steps` synthetic steps; raises InternalError if an average is wrong."""
    reports = []
    world, me = client.total_workers, client.worker_id
    sizes = shape.block_sizes
    block_total = sum(sizes)
    for step in range(first_step, first_step + steps):
        started = time.perf_counter()
        crc = 0
        worst = 0.0
        sent = 0
        blocks = list(reversed(range(shape.num_blocks)))

        def check(tag: int, got: np.ndarray, what: str, step: int = step) -> None:
            nonlocal crc, worst
            crc = zlib.crc32(got.tobytes(), crc)
            if verify:
                want = _reference_mean(seed, step, world, tag, got.size)
                error = _rel_error(got, want)
                worst = max(worst, error)
                if error > tolerance:
                    raise InternalError(
                        f"worker {me} step {step} {what}: relative error {error:.3g} exceeds {tolerance:g}"
                    )

        for block_idx in blocks:
            grads = synthetic_gradient(seed, step, me, _block_tag(block_idx), block_total)
            client.send_block_gradient(step, block_idx, shape.num_blocks, grads, sizes)
            sent += grads.nbytes
            if not pipelined:
                avg = client.receive_averaged_block()
                check(_block_tag(avg.block_idx), avg.gradients, f"block {avg.block_idx}")
        if pipelined:
            for _ in blocks:
                avg = client.receive_averaged_block()
                check(_block_tag(avg.block_idx), avg.gradients, f"block {avg.block_idx}")
        for component in non_block:
            grads = synthetic_gradient(
                seed, step, me, _non_block_tag(component), shape.non_block_size(component)
            )
            client.send_non_block_gradient(step, component, grads)
            sent += grads.nbytes
            del grads
            got = client.receive_averaged_non_block()
            check(_non_block_tag(got.component), got.gradients, got.component.name)
        report = StepReport(
            step=step,
            tensors=len(blocks) + len(non_block),
            bytes_sent=sent,
            seconds=time.perf_counter() - started,
            max_rel_error=worst,
            checksum=crc,
        )
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports
