"""torch.distributed ranks as spawned processes, for tests that compare backends.

Each rank runs `target(*args)` in a fresh interpreter (the "spawn" start method: no state is
inherited from the test process) and writes its results (or `rankN.error`) to a directory the
test reads afterwards. A rank that returned ends at once, without the interpreter's shutdown:
gloo's worker threads may still be releasing the tensors of its last collectives, and one that
does so while Python shuts down aborts the process (examples/_result.py, `end_process_group`).
Every rank must exit 0; one that crashed fails the test even if it wrote its results first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RANK_TIMEOUT_S = 240.0


def _rank_main(target: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Runs one rank; once it returned, flushes its output and exits without interpreter shutdown
    (an exception still ends the process through multiprocessing, with exit code 1)."""
    target(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_and_join(
    target: Callable[..., None],
    argss: list[tuple[Any, ...]],
    timeout_s: float = RANK_TIMEOUT_S,
    *,
    check_exits: bool = True,
) -> list[mp.process.BaseProcess]:
    """One spawned process per argument tuple, joined within `timeout_s` each; any still alive
    then is killed, and the test fails, as it does when any exits non-zero (unless `check_exits`
    is False: a test that kills a rank looks at the exit codes itself)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(target, args)) for args in argss]
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
    codes = [p.exitcode for p in procs]
    if check_exits:
        assert all(code == 0 for code in codes), f"rank exit codes {codes} (negative: killed by that signal)"
    return procs


def rank_errors(out: Path) -> dict[str, str]:
    """rankN.error -> its text, for every rank that wrote one."""
    return {p.name: p.read_text() for p in out.glob("*.error")}


def rank_results(out: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's saved results (rankN.pt); fails with the ranks' errors if any wrote one."""
    errors = rank_errors(out)
    assert not errors, errors
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def gradserver_rank(
    rank: int, world: int, store_path: str, out_dir: str, body: Callable[[int], dict[str, Any]]
) -> None:
    """One rank of the "gradserver" backend (one torch thread, a file store): saves what
    `body(rank)` returns as rankN.pt, or what it raised as rankN.error (`rank_results` fails the
    test with it); the process group is destroyed either way."""
    import torch.distributed as dist

    import gradserver.torch  # noqa: F401 - registers "gradserver"

    torch.set_num_threads(1)
    dist.init_process_group("gradserver", init_method=f"file://{store_path}", rank=rank, world_size=world)
    out = Path(out_dir)
    try:
        torch.save(body(rank), out / f"rank{rank}.pt")
    except Exception as exc:
        (out / f"rank{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
