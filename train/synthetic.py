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
from gradserver.common.logs import set_log_context
from gradserver.worker import WorkerClient


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
    """One step of one worker. compute: producing gradients (the stand-in for backward); send:
    inside send calls; wait: blocked in receive calls; check: comparing with the reference."""

    step: int
    worker_id: int
    tensors: int
    bytes_sent: int
    seconds: float
    compute_s: float
    send_s: float
    wait_s: float
    check_s: float
    max_rel_error: float
    checksum: int


class _PhaseClock:
    """Adds wall time to whichever phase is current."""

    def __init__(self) -> None:
        self.spent = {"compute": 0.0, "send": 0.0, "wait": 0.0, "check": 0.0}
        self._phase: str | None = None
        self._since = time.perf_counter()

    def switch(self, phase: str | None) -> None:
        now = time.perf_counter()
        if self._phase is not None:
            self.spent[self._phase] += now - self._since
        self._phase, self._since = phase, now


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


class _Step:
    """One synthetic step of one worker: contributes, receives, checks, and keeps the time."""

    def __init__(self, client: WorkerClient, step: int, seed: int, verify: bool, tolerance: float) -> None:
        self.client, self.step, self.seed = client, step, seed
        self.verify, self.tolerance = verify, tolerance
        self.clock = _PhaseClock()
        self.crc = 0
        self.worst = 0.0
        self.sent = 0

    def gradient(self, tag: int, size: int) -> np.ndarray:
        self.clock.switch("compute")
        grads = synthetic_gradient(self.seed, self.step, self.client.worker_id, tag, size)
        self.sent += grads.nbytes
        self.clock.switch("send")
        return grads

    def receive_block(self) -> None:
        self.clock.switch("wait")
        avg = self.client.receive_averaged_block()
        self.check(_block_tag(avg.block_idx), avg.gradients, f"block {avg.block_idx}")

    def receive_non_block(self) -> None:
        self.clock.switch("wait")
        got = self.client.receive_averaged_non_block()
        self.check(_non_block_tag(got.component), got.gradients, got.component.name)

    def check(self, tag: int, got: np.ndarray, what: str) -> None:
        self.clock.switch("check")
        self.crc = zlib.crc32(got.tobytes(), self.crc)
        if not self.verify:
            return
        want = _reference_mean(self.seed, self.step, self.client.total_workers, tag, got.size)
        error = _rel_error(got, want)
        self.worst = max(self.worst, error)
        if error > self.tolerance:
            raise InternalError(
                f"worker {self.client.worker_id} step {self.step} {what}: relative error "
                f"{error:.3g} exceeds {self.tolerance:g}"
            )


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
    sizes = shape.block_sizes
    blocks = list(reversed(range(shape.num_blocks)))
    for step in range(first_step, first_step + steps):
        set_log_context(step=step)
        started = time.perf_counter()
        s = _Step(client, step, seed, verify, tolerance)
        for block_idx in blocks:
            grads = s.gradient(_block_tag(block_idx), sum(sizes))
            client.send_block_gradient(step, block_idx, shape.num_blocks, grads, sizes)
            if not pipelined:
                s.receive_block()
        if pipelined:
            for _ in blocks:
                s.receive_block()
        for component in non_block:
            grads = s.gradient(_non_block_tag(component), shape.non_block_size(component))
            client.send_non_block_gradient(step, component, grads)
            del grads
            s.receive_non_block()
        s.clock.switch(None)
        report = StepReport(
            step=step,
            worker_id=client.worker_id,
            tensors=len(blocks) + len(non_block),
            bytes_sent=s.sent,
            seconds=time.perf_counter() - started,
            compute_s=s.clock.spent["compute"],
            send_s=s.clock.spent["send"],
            wait_s=s.clock.spent["wait"],
            check_s=s.clock.spent["check"],
            max_rel_error=s.worst,
            checksum=s.crc,
        )
        reports.append(report)
        if on_step is not None:
            on_step(report)
    return reports
