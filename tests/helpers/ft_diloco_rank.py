"""examples/diloco_ft.py (or examples/ft_hsdp.py with --outer-steps) with a fault: a rank kills
itself at an inner step, keyed by rank and step (fault injection for tests/test_torch_ft_diloco.py).

    python -m tests.helpers.ft_diloco_rank --die RANK:STEP:PHASE --steps 200 --sync-every 20
    python -m tests.helpers.ft_diloco_rank --example ft_hsdp.py --die RANK:STEP:inner --outer-steps 10

RANK is the rank `gradserver run` started (LOCAL_RANK: the global rank, also under replica
groups). PHASE is where it gets SIGKILL: `inner`
(in the forward pass of inner step STEP: mid-inner-phase, its progress since its last exchange
lost) or `exchange` (its payload of the first exchange at or after inner step STEP queued, the
sum not back: a small payload has reached the coordinator by then, so the exchange completes
with it and the rank is lost before the commit barrier). Only the
first incarnation dies: a restarted rank (it healed) runs to the end. The other flags go to the
example, whose `ft.Replica` is replaced by one that carries the fault.

`--hold RANKS:STEP:FLAG` lets the test decide when things happen: each of RANKS (comma-separated,
first incarnations) stops at the start of inner step STEP until the file FLAG exists (at most
120 s), and a rank that joins the running job creates FLAG as it asks for a live rank's state.
So the others cannot finish the job before a replacement (slow to start on a loaded machine)
joins: a test of the heal, not of how fast a process starts. STEP `flush` holds them in
`DiLoCo.flush` instead, after the last inner step, so the replacement joins in the flush.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gradserver.torch import ft
from gradserver.torch.diloco import DiLoCo

from .processes import ROOT

PHASES = ("inner", "exchange")
FLUSH = -2  # `--hold RANKS:flush:FLAG`: the hold is at `DiLoCo.flush`, after the last inner step
_FLAG_WAIT_S = 120.0


def _hold(rank: int, where: str, flag: Path) -> None:
    """Waits for `flag` to exist (a replacement asking for a live rank's state), bounded."""
    print(f"rank {rank}: holding {where}", flush=True)
    deadline = time.monotonic() + _FLAG_WAIT_S
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _dying_replica(
    die_rank: int, die_step: int, phase: str, held: set[int], hold_step: int, flag: Path | None
) -> type[ft.Replica]:
    rank = int(os.environ.get("LOCAL_RANK", "-1"))

    class DyingReplica(ft.Replica):
        def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any) -> None:
            super().__init__(model, optimizer, **options)
            if self.healed is not None:
                return
            # The first incarnation starts at inner step 0: its forward passes count the steps.
            forwards = [0]

            def forward(*_: Any) -> None:
                if rank == die_rank and phase == "inner" and forwards[0] == die_step:
                    self._die(f"in inner step {die_step}")
                if rank in held and forwards[0] == hold_step and flag is not None:
                    _hold(rank, f"at inner step {hold_step}", flag)
                forwards[0] += 1

            model.register_forward_pre_hook(forward)
            if rank != die_rank:
                return

            send = self.client.send

            def sent(*a: Any, **k: Any) -> None:
                send(*a, **k)
                if phase == "exchange" and forwards[0] >= die_step:
                    self._die(f"in step {self.step} (an exchange), its payload sent")

            self.client.send = sent  # type: ignore[method-assign]

        def diloco(self, **options: Any) -> DiLoCo:
            outer = super().diloco(**options)
            if rank in held and hold_step == FLUSH and flag is not None:
                flush = outer.flush

                def held_flush() -> None:
                    _hold(rank, "before the flush", flag)
                    flush()

                outer.flush = held_flush  # type: ignore[method-assign]
            return outer

        def _heal(self, at: tuple[int, tuple[int, ...]] | None = None) -> None:
            if flag is not None:
                flag.touch()
            super()._heal(at)

        @staticmethod
        def _die(where: str) -> None:
            print(f"rank {die_rank}: dying {where}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    return DyingReplica


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--die", default="", help="RANK:STEP:PHASE")
    parser.add_argument("--hold", default="", help="RANK[,RANK...]:STEP:FLAG")
    parser.add_argument("--example", default="diloco_ft.py", choices=("diloco_ft.py", "ft_hsdp.py"))
    args, rest = parser.parse_known_args()
    held: set[int] = set()
    hold_step, flag = -1, None
    if args.hold:
        ranks, step, path = args.hold.split(":", 2)
        held, flag = {int(r) for r in ranks.split(",")}, Path(path)
        hold_step = FLUSH if step == "flush" else int(step)
    if args.die:
        rank, step, phase = [*args.die.split(":"), "", "", ""][:3]
        if phase not in PHASES:
            parser.error(f"--die RANK:STEP:PHASE, PHASE one of {', '.join(PHASES)}")
        ft.Replica = _dying_replica(int(rank), int(step), phase, held, hold_step, flag)  # type: ignore[misc]
    script = ROOT / "examples" / args.example
    sys.path.insert(0, str(script.parent))  # its `_result` import, as when it runs as a script
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
