"""torch.distributed ranks as spawned processes, for tests that compare backends.

Each rank runs `target(*args)` in a fresh interpreter (the "spawn" start method: no state is
inherited from the test process) and writes its results (or `rankN.error`) to a directory the
test reads afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RANK_TIMEOUT_S = 240.0


def spawn_and_join(
    target: Callable[..., None], argss: list[tuple[Any, ...]], timeout_s: float = RANK_TIMEOUT_S
) -> list[mp.process.BaseProcess]:
    """One spawned process per argument tuple, joined within `timeout_s` each; any still alive
    then is killed, and the test fails."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in argss]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    assert not any(p.is_alive() for p in procs)
    return procs


def rank_errors(out: Path) -> dict[str, str]:
    """rankN.error -> its text, for every rank that wrote one."""
    return {p.name: p.read_text() for p in out.glob("*.error")}


def rank_results(out: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's saved results (rankN.pt); fails with the ranks' errors if any wrote one."""
    errors = rank_errors(out)
    assert not errors, errors
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]
