"""Workers that differ from the job are refused at Join, naming every differing field with both
values, without disturbing the members already joined."""

from __future__ import annotations

import re

import pytest

from .helpers.processes import ProcessGroup
from .helpers.training import train_worker


@pytest.mark.processes
@pytest.mark.parametrize(
    ("flags", "field", "ours", "job"),
    [
        (["--seed", "1"], "seed", "1", "0"),
        (["--lr", "0.01"], "lr", "0.01", "0.003"),
        (["--model", "small"], "model.name", "small", "tiny"),
    ],
)
def test_a_worker_with_different_settings_is_refused_at_join(
    coordinator, processes: ProcessGroup, flags: list[str], field: str, ours: str, job: str
) -> None:
    """Whichever joins second is refused, naming the field with both values (its own first)."""
    server = coordinator(world_size=2, join_timeout=60.0)
    same = train_worker(processes, server.address, "same")
    other = train_worker(processes, server.address, "other", *flags)
    refused = processes.wait_any([same, other], timeout=120)
    assert refused.proc.returncode not in (0, None), refused.output
    own, theirs = (ours, job) if refused is other else (job, ours)
    assert re.search(rf"{re.escape(field)} {re.escape(own)} != {re.escape(theirs)}", refused.output), (
        refused.output
    )
