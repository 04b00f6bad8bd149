"""examples/ft_ddp.py with a fault: the rank kills itself at one point of one step, keyed by rank
and step (fault injection for tests/test_torch_ft.py).

    python -m tests.helpers.ft_rank --die RANK:STEP:PHASE --steps 600

PHASE is where in step STEP rank RANK gets SIGKILL: `forward` (as the model runs), `averaging`
(its gradients sent, their average not back: mid-collective), `commit` (before the commit
barrier) or `optimizer` (the step committed for every rank, not yet applied here). Only the first
incarnation dies: a restarted rank (it healed) runs to the end. The example itself runs, its
`ft.Replica` replaced by one that carries the fault; the other flags go to the example.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
from typing import Any

import torch

from gradserver.torch import ft

from .processes import ROOT

PHASES = ("forward", "averaging", "commit", "optimizer")


def _dying_replica(die_rank: int, die_step: int, phase: str) -> type[ft.Replica]:
    class DyingReplica(ft.Replica):
        def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
            super().__init__(model, optimizer, **options)
            if self.healed is not None or self.client.worker_id != die_rank:
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

        def _at(self, point: str) -> None:
            if self.step == die_step and point == phase:
                print(f"rank {die_rank}: dying in step {self.step} at {point}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    return DyingReplica


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--die", required=True, help="RANK:STEP:PHASE")
    args, rest = parser.parse_known_args()
    rank, step, phase = [*args.die.split(":"), "", "", ""][:3]
    if phase not in PHASES:
        parser.error(f"PHASE is one of {', '.join(PHASES)}")
    ft.Replica = _dying_replica(int(rank), int(step), phase)  # type: ignore[misc]
    script = ROOT / "examples" / "ft_ddp.py"
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
