"""The one line each framework example prints per rank, so that a test can compare two runs.

    RESULT {"rank": 0, "backend": "gradserver", "group_backend": "gradserver", "losses": [...],
            "param_sum": ..., "param_sha256": "..."}   (on one line)

`losses` and `param_sum` are floats printed exactly (JSON keeps every bit of a Python float);
`param_sha256` hashes the bytes of every parameter in name order, so two runs whose parameters are
bit-identical print the same digest; `group_backend` is what the default process group really
runs on (a framework that fell back to another backend would show it).

`end_process_group` is how every torchrun example ends (see its docstring for why).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from typing import NoReturn

import torch
import torch.distributed as dist

PREFIX = "RESULT "


def parameter_digest(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[float, str]:
    """The float64 sum of every parameter element, and the sha256 of their bytes in name order."""
    digest = hashlib.sha256()
    total = 0.0
    for name, tensor in sorted(named, key=lambda item: item[0]):
        values = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        # A copy, so the hash never marks the caller's storage non-resizable (Tensor.numpy does).
        digest.update(values.clone().view(torch.uint8).numpy().tobytes())
        total += float(values.double().sum())
    return total, digest.hexdigest()


def print_result(
    rank: int, backend: str, losses: list[float], named_params: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Prints this rank's RESULT line, flushed at once (ranks share torchrun's stdout)."""
    param_sum, param_sha256 = parameter_digest(named_params)
    # What the default group really ran on, so a test sees that the framework did not fall back.
    group_backend = dist.get_backend() if dist.is_initialized() else None
    line = {
        "rank": rank,
        "backend": backend,
        "group_backend": group_backend,
        "losses": losses,
        "param_sum": param_sum,
        "param_sha256": param_sha256,
    }
    # One write of the whole line: print() writes the text and the newline apart, and the ranks'
    # lines then interleave in torchrun's shared stdout.
    sys.stdout.write(PREFIX + json.dumps(line) + "\n")
    sys.stdout.flush()


def end_process_group() -> NoReturn:
    """Ends the run: every rank leaves the process group together, then the process exits at once
    (exit code 0), without the interpreter's shutdown. Call it last.

    gloo (torch 2.13, Python 3.11) runs each collective on a worker thread, which drops its
    references to the collective's tensors only after the rank was told the collective is done.
    Dropping one of a tensor that Python knows takes the GIL, and if the interpreter has begun
    shutting down by then, Python ends that thread inside a C++ destructor and the process aborts
    ("terminate called without an active exception") after it printed everything. Neither
    `destroy_process_group` nor a barrier waits for those threads: with a barrier before
    `destroy_process_group`, as torch's own examples end, 3 runs in 82 still aborted under load
    (bench/examples_repeat.py). Leaving without the interpreter's shutdown leaves nothing for
    those threads to trip over. The barrier stays: no rank tears its group down (or, rank 0,
    its embedded coordinator) while a peer still talks to it.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
