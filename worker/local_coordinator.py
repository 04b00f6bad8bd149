"""A `gradserver coordinator` child process on this machine, and the port it listens on.

One helper for everything that starts its own coordinator: `gradserver launch` and `gradserver
run` (gradserver.train) and the torch backend's embedded coordinator (gradserver.torch). The child
binds 127.0.0.1 (port 0: any free port) and writes the port it got to a file once it serves; that
file is the only readiness signal it gives (gradserver.worker.supervisor starts, watches and stops
the process and waits for that port). Afterwards: the coordinator's verdicts (its
--events-file: which worker it lost and why) and the removal of what a SIGKILLed one left (its
shared-memory socket directory), and the verdict that names the process that ended a job
(`verdict`, `coordinator_failure`). Torch-free, and it imports nothing of the server: the
coordinator is a separate process started by its command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from gradserver.common import shm
from gradserver.common.config import environment_value

from .supervisor import Child, error_line

_POLL_S = 0.05
# How long a failed child's verdict waits for the coordinator's (a survivor can exit a moment
# before the coordinator's line is read).
_VERDICT_WAIT_S = 1.0


def coordinator_command(
    world_size: int, port_file: Path, *options: str, port: int = 0, host: str = "127.0.0.1"
) -> list[str]:
    """The argv of a coordinator for `world_size` workers on `host`:`port` that reports its
    port in `port_file`; `options` are further `gradserver coordinator` flags. It chooses its
    chunk size itself (32 MiB when every worker joins over loopback and uses shared memory, as
    they do here by default, 8 MiB over loopback gRPC; 0.25 MiB when one joins from another host,
    as a torch backend group's ranks on several machines do) unless `options` or
    GRADSERVER_CHUNK_MIB set it."""
    return [
        sys.executable,
        "-m",
        "gradserver.cli",
        "coordinator",
        "--bind",
        f"{host}:{port}",
        "--world-size",
        str(world_size),
        "--port-file",
        str(port_file),
        *options,
    ]


@dataclasses.dataclass(frozen=True)
class LostWorker:
    """A coordinator's verdict on one worker (`--events-file`, see gradserver.server.events):
    `step` is the lowest step (the torch backend's operation number) in flight when it was lost,
    None when none was."""

    worker: int
    node: str
    reason: str
    step: int | None = None


def _events(events_file: Path) -> list[dict[str, Any]]:
    """The events file's objects; a missing file, or a line cut short, is skipped."""
    found = []
    with contextlib.suppress(OSError):
        for line in events_file.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    found.append(event)
    return found


def _lost(event: dict[str, Any]) -> LostWorker | None:
    try:
        step = event.get("step")
        return LostWorker(
            int(event["worker"]),
            str(event["node"]),
            str(event["reason"]),
            step if isinstance(step, int) else None,
        )
    except (KeyError, ValueError, TypeError):
        return None


def lost_workers(events_file: Path, wait_s: float = 0.0, answered: Collection[int] = ()) -> list[LostWorker]:
    """The workers the coordinator declared lost, in order, from its events file, but the
    losses at the positions `answered` (a supervisor restarted those workers: see `loss_of`);
    waits up to `wait_s` for a first one (a survivor may exit a moment before the line is read)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [w for i, w in enumerate(_all_lost(events_file)) if i not in answered]
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(_POLL_S)


def loss_of(
    events_file: Path, matches: Callable[[LostWorker], bool], answered: Collection[int], wait_s: float
) -> int | None:
    """The position in the events file of the first loss that `matches` (the worker a supervisor
    restarts) and is not among `answered` (waits up to `wait_s` for it); None when the coordinator
    declared none (it failed before it joined)."""
    deadline = time.monotonic() + wait_s
    while True:
        for i, lost in enumerate(_all_lost(events_file)):
            if matches(lost) and i not in answered:
                return i
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


def _all_lost(events_file: Path) -> list[LostWorker]:
    lost = [_lost(e) for e in _events(events_file) if e.get("event") == "worker_lost"]
    return [w for w in lost if w is not None]


def every_worker_left(events_file: Path) -> bool:
    """Whether the coordinator saw every worker leave with a goodbye (and none lost) since its
    job began."""
    return any(e.get("event") == "every_worker_left" for e in _events(events_file))


def _job_ended(events_file: Path, state: str) -> str | None:
    """Why the coordinator's job ended in `state`, from its events file; None when it did not."""
    for event in _events(events_file):
        if event.get("event") == "job_ended" and event.get("state") == state:
            return str(event.get("reason", ""))
    return None


def job_finished(events_file: Path) -> str | None:
    """Why the coordinator's job finished (every worker that took part left, or --max-steps was
    reached), from its events file; None while it has not said so."""
    return _job_ended(events_file, "finished")


def job_failure(events_file: Path) -> str:
    """Why the coordinator's job failed, from its events file; '' when it did not say."""
    return _job_ended(events_file, "failed") or ""


def remove_shm_dirs(pid: int, *parents: str) -> None:
    """After coordinator `pid` has exited: removes the shared-memory socket directories it left
    (SIGKILL) in its --shm-dir as this environment sets it, or the temp dir, and in `parents`."""
    places = {environment_value("shm_dir") or tempfile.gettempdir(), *parents}
    for parent in places:
        shm.remove_dirs_of(pid, parent)


def remove_leftovers(events_file: Path, pid: int | None = None) -> None:
    """After the coordinator `pid` with this events file has exited: removes its shared-memory
    socket directory if it could not (SIGKILL) and none of its workers did. The 'serving' event
    names it (any --shm-dir); the pid finds it even when that line was never written."""
    serving = [e for e in _events(events_file) if e.get("event") == "serving"]
    sockets = [str(e["shm_socket"]) for e in serving if e.get("shm_socket")]
    for path in sockets:
        shm.remove_if_abandoned(path)
    if pid is not None:
        remove_shm_dirs(pid, *(os.path.dirname(path) for path in sockets))


def verdict(
    child: Child,
    events: Path,
    name: Callable[[LostWorker], str],
    others: Iterable[Child] = (),
    unit: str = "step",
    answered: Collection[int] = (),
) -> tuple[Child, str]:
    """The process that ended the job and the last line, for a job that `child` ended by failing.
    When the coordinator had lost another worker first (`events`, its --events-file), that
    worker, named by `name` and found among `others`: if it has exited by itself (crashed, was
    killed), its own ending; else (stopped, hung, cut off) `NAME was lost at <unit> N (why);
    <child's failure>`. Without such a verdict, the child's failure alone. The losses at the
    positions `answered` (workers the supervisor restarted) are not the cause."""
    lost = lost_workers(events, wait_s=_VERDICT_WAIT_S, answered=answered)
    if not lost or name(lost[0]) == child.name:
        return child, child.failure()
    first = lost[0]
    culprit = next((c for c in others if c.name == name(first)), None)
    if culprit is not None and culprit.proc.poll() not in (None, 0):
        culprit.finish_output()
        return culprit, culprit.failure()
    at = f" at {unit} {first.step}" if first.step is not None else ""
    return child, f"{name(first)} was lost{at} ({first.reason}); {child.failure()}"


def coordinator_failure(coordinator: Child, events: Path) -> str:
    """How the coordinator ended, with its job's failure from `events` when its output has no
    error line of its own."""
    failure = coordinator.failure()
    why = job_failure(events)
    return f"{failure}: job failed: {why}" if why and not error_line(list(coordinator.tail)) else failure
