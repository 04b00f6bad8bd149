"""examples/ft_ddp.py (or examples/ft_hsdp.py) with a fault: a rank kills itself at one point of
one step, or when it serves its state to a replacement, keyed by rank and step (fault injection
for tests/test_torch_ft.py).

    python -m tests.helpers.ft_rank --die RANK:STEP:PHASE --steps 600
    python -m tests.helpers.ft_rank --example ft_hsdp.py --die RANK:STEP:backward --steps 600
    python -m tests.helpers.ft_rank --die-serving RANK --steps 600
    python -m tests.helpers.ft_rank --lose-release RANK:STEP:FLAG --steps 600

RANK is the rank `gradserver run` started (LOCAL_RANK: the global rank, also under replica
groups). PHASE is where in step STEP it gets SIGKILL: `forward` (as the model runs), `backward`
(as the first gradient is computed), `averaging` (its gradients sent, their average not back:
mid-collective), `commit` (before the commit barrier) or `optimizer` (the step committed for
every rank, not yet applied here). `--die-serving` kills the rank as it begins to give its state
to a replacement (a donor lost mid-heal). Only the first incarnation dies: a restarted rank (it
healed) runs to the end. `--lose-release` plays a coordinator that dies as it releases step STEP's
commit barrier, the release reaching every rank but RANK: the other ranks print `rank R: applied
step STEP` once they applied it, and RANK, past the barrier, prints `rank RANK: lost the release
of step STEP`, waits (at most 120 s) for the file FLAG (the test creates it once it has killed the
coordinator) and fails the barrier as a lost connection does. The example itself runs, its
`ft.Replica` replaced by one that carries the fault; the other flags go to the example.

Two more let a test decide when things happen: `--hold RANKS:STEP:FLAG` stops each of RANKS
(comma-separated; every incarnation, a replacement too) at the start of step STEP until the file
FLAG exists, and
`--late-replacement FOLDER` makes a rank started again wait for FOLDER/go before it joins.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradserver.common.errors import ConnectionLost
from gradserver.torch import ft
from gradserver.worker import StateSnapshot

from .processes import ROOT

PHASES = ("forward", "backward", "averaging", "commit", "optimizer")
_FLAG_WAIT_S = 120.0


def _releasing_replica(lose_rank: int, step: int, flag: Path) -> type[ft.Replica]:
    rank = int(os.environ.get("LOCAL_RANK", "-1"))

    class ReleasingReplica(ft.Replica):
        def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
            super().__init__(model, optimizer, **options)
            if self.healed is not None:
                return
            barrier, apply = self.client.barrier, optimizer.step

            def commit_barrier(*a: Any, **k: Any) -> None:
                barrier(*a, **k)
                if rank == lose_rank and self.step == step:
                    print(f"rank {rank}: lost the release of step {step}", flush=True)
                    deadline = time.monotonic() + _FLAG_WAIT_S
                    while not flag.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    raise ConnectionLost(f"the release of step {step} was lost (injected)")

            def applied(*a: Any, **k: Any) -> Any:
                done = apply(*a, **k)
                if rank != lose_rank and self.step == step:
                    print(f"rank {rank}: applied step {step}", flush=True)
                return done

            self.client.barrier = commit_barrier  # type: ignore[method-assign]
            optimizer.step = applied  # type: ignore[method-assign]

    return ReleasingReplica


def _dying_replica(die_rank: int, die_step: int, phase: str, serving: bool) -> type[ft.Replica]:
    rank = int(os.environ.get("LOCAL_RANK", "-1"))

    class DyingReplica(ft.Replica):
        def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
            super().__init__(model, optimizer, **options)
            self._dies = self.healed is None and rank == die_rank
            if not self._dies or serving:
                return
            send, barrier, apply = self.client.send, self.client.barrier, optimizer.step

            def sent(*a: Any, **k: Any) -> None:
                send(*a, **k)
                self._at("averaging")

            def commit_barrier(*a: Any, **k: Any) -> None:
                self._at("commit")
                barrier(*a, **k)

            def applied(*a: Any, **k: Any) -> Any:
                self._at("optimizer")
                return apply(*a, **k)

            self.client.send = sent  # type: ignore[method-assign]
            self.client.barrier = commit_barrier  # type: ignore[method-assign]
            optimizer.step = applied  # type: ignore[method-assign]
            model.register_forward_pre_hook(lambda *_: self._at("forward"))
            # As the gradient of a layer's output arrives: in backward, before any averaging of
            # the step (with FSDP2, before its reduce-scatter too).
            for module in model.modules():
                if not list(module.children()):
                    module.register_full_backward_pre_hook(lambda *_: self._at("backward"))

        def _at(self, point: str) -> None:
            if self.step == die_step and point == phase:
                print(f"rank {die_rank}: dying in step {self.step} at {point}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def _snapshot(self) -> StateSnapshot:
            if serving and getattr(self, "_dies", False):
                print(f"rank {die_rank}: dying as it serves its state of step {self.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return super()._snapshot()

    return DyingReplica


def _holding_replica(base: type[ft.Replica], ranks: set[int], step: int, flag: Path) -> type[ft.Replica]:
    rank = int(os.environ.get("LOCAL_RANK", "-1"))

    class HoldingReplica(base):  # type: ignore[valid-type,misc]
        def steps(self, total: int) -> Iterator[int]:
            for current in super().steps(total):
                if current == step and rank in ranks:
                    print(f"rank {rank}: holding at step {step}", flush=True)
                    _wait_for(flag)
                yield current

    return HoldingReplica


def _wait_for(flag: Path) -> None:
    deadline = time.monotonic() + _FLAG_WAIT_S
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _late_replacement(folder: Path) -> None:
    """A rank started again (its first incarnation left a mark in `folder`) waits for the file
    `folder/go` before it joins, at most _FLAG_WAIT_S: the test decides when a replacement comes."""
    rank = os.environ.get("LOCAL_RANK", "-1")
    mark = folder / f"started-{rank}"
    if not mark.exists():
        mark.touch()
        return
    print(f"rank {rank}: a replacement, waiting to join", flush=True)
    _wait_for(folder / "go")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", default="ft_ddp.py", choices=("ft_ddp.py", "ft_hsdp.py"))
    parser.add_argument("--die", default="", help="RANK:STEP:PHASE")
    parser.add_argument("--die-serving", type=int, default=-1, help="RANK")
    parser.add_argument("--lose-release", default="", help="RANK:STEP:FLAG")
    parser.add_argument("--hold", default="", help="RANK[,RANK...]:STEP:FLAG")
    parser.add_argument("--late-replacement", default="", help="FOLDER")
    args, rest = parser.parse_known_args()
    if args.late_replacement:
        _late_replacement(Path(args.late_replacement))
    if args.lose_release:
        lose_rank, step, flag = args.lose_release.split(":", 2)
        ft.Replica = _releasing_replica(int(lose_rank), int(step), Path(flag))  # type: ignore[misc]
    elif args.die_serving >= 0:
        ft.Replica = _dying_replica(args.die_serving, -1, "", serving=True)  # type: ignore[misc]
    elif args.die:
        rank, step, phase = [*args.die.split(":"), "", "", ""][:3]
        if phase not in PHASES:
            parser.error(f"--die RANK:STEP:PHASE, PHASE one of {', '.join(PHASES)}")
        ft.Replica = _dying_replica(int(rank), int(step), phase, serving=False)  # type: ignore[misc]
    if args.hold:
        ranks, step, flag = args.hold.split(":", 2)
        held = {int(r) for r in ranks.split(",")}
        ft.Replica = _holding_replica(ft.Replica, held, int(step), Path(flag))  # type: ignore[misc]
    script = ROOT / "examples" / args.example
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
