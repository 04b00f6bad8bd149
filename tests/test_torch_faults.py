"""The torch backend under faults, with real processes: 3 ranks of a plain DDP loop (or a loop of
plain `dist.all_reduce`, or of point-to-point sends and receives around a ring), started by hand
against one coordinator or by `gradserver run`.

Each row injects one fault keyed by rank and step (SIGKILL or SIGSTOP of a rank, SIGKILL or
SIGTERM of the coordinator, a SIGSTOP shorter than the heartbeat) and checks what a user sees:
every surviving rank ends with a Python traceback whose error names the lost rank (or the
coordinator), within the heartbeat timeout plus a margin; no rank dies by a signal it was not
sent (DDP ranks used to segfault: docs/RELIABILITY.md row T1); `run`'s last line names the
injected process; nothing is left in the temporary directory nor /dev/shm, and no process stays.
GRADSERVER_FAULT_REPEAT=N repeats every row N times (the check for flakes).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers.processes import ManagedProcess, ProcessGroup, descendants, pid_alive

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


WORLD = 3
HEARTBEAT_S = 2.0
FAULT_STEP = 8
STEPS = 40
# Survivors must end within this long after the fault: the heartbeat timeout (2.5 of them while
# a stopped rank's stream is held back, RELIABILITY row 16), plus exit and relay time.
DETECTION_BOUND_S = 2.5 * HEARTBEAT_S + 15.0
REPEAT = int(os.environ.get("GRADSERVER_FAULT_REPEAT", "1"))

RANK_SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist

mode = sys.argv[1]
dist.init_process_group("gradserver")
rank = dist.get_rank()
torch.manual_seed(0)
if mode == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(sys.argv[2])):
    print(f"STEP {step}", flush=True)
    if mode == "ddp":
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    elif mode == "p2p":
        world = dist.get_world_size()
        out, back = torch.full((1000,), float(rank + step)), torch.empty(1000)
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, back, prev)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert torch.all(back == float(prev + step)), (step, back[:3])
    else:
        t = torch.full((1000,), float(rank + step))
        dist.all_reduce(t)
        expected = float(sum(r + step for r in range(dist.get_world_size())))
        assert torch.all(t == expected), (step, t[:3])
    time.sleep(0.05)  # pacing, so that a fault lands mid-loop
print("DONE", flush=True)
dist.destroy_process_group()
"""

# (row, what is injected, into which process, whether the ranks must all finish)
ROWS = [
    ("rank-sigkill", "kill", "rank 1"),
    ("rank-sigstop", "stop", "rank 1"),
    ("rank-short-stop", "slow", "rank 1"),
    ("coordinator-sigkill", "kill", "coordinator"),
    ("coordinator-sigterm", "terminate", "coordinator"),
]
LOST_RANK = re.compile(r"worker 1 .*(disconnected|lost|no message|evicted|silent)|rank 1 ")
LOST_COORDINATOR = re.compile(r"coordinator", re.IGNORECASE)


def _snapshot(path: Path) -> set[str]:
    # torch's own compile cache is not ours to judge.
    names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    return {name for name in names if not name.startswith("torchinductor_")}


def _inject(fault: str, target: ManagedProcess | int) -> None:
    pid = target if isinstance(target, int) else target.proc.pid
    if fault == "slow":
        # Far shorter than the heartbeat timeout: the job must not notice.
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + HEARTBEAT_S / 4
        while time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGCONT)
        return
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "terminate": signal.SIGTERM}[fault]
    os.kill(pid, sig)


def _rank_env(tmp: Path, rank: int, coordinator: str, master_port: int) -> dict[str, str | None]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(WORLD),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "GRADSERVER_COORDINATOR": coordinator,
        "TMPDIR": str(tmp),
        "OMP_NUM_THREADS": "1",
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _assert_survivor_reported(proc: ManagedProcess, code: int, lost: re.Pattern[str]) -> None:
    output = proc.output
    assert code > 0, f"{proc.name} exited with {code} (a signal it was not sent?):\n{output}"
    assert "Traceback (most recent call last)" in output, output
    assert "Segmentation fault" not in output and "Fatal Python error" not in output, output
    tail = output[output.rindex("Traceback (most recent call last)") :]
    assert lost.search(tail), f"{proc.name}'s error does not name the lost process:\n{tail}"


def _check_row(
    fault: str,
    target: str,
    ranks: dict[int, ManagedProcess],
    wait_exit: Callable[[ManagedProcess, float], int],
) -> dict[int, int]:
    """Waits for every rank (except one killed or stopped on purpose) and checks its ending."""
    injected_rank = int(target.split()[1]) if target.startswith("rank") else None
    finishes = fault == "slow"
    codes: dict[int, int] = {}
    for rank, proc in ranks.items():
        if rank == injected_rank and fault in ("kill", "stop"):
            continue
        codes[rank] = code = wait_exit(proc, DETECTION_BOUND_S + (60.0 if finishes else 0.0))
        if finishes:
            assert code == 0 and "DONE" in proc.output, f"{proc.name} exited {code}:\n{proc.output}"
        else:
            _assert_survivor_reported(
                proc, code, LOST_RANK if injected_rank is not None else LOST_COORDINATOR
            )
    return codes


def _by_hand(processes: ProcessGroup, tmp: Path, mode: str, fault: str, target: str) -> None:
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    coordinator, address = processes.coordinator(
        "--world-size", str(WORLD), "--heartbeat-timeout", f"{HEARTBEAT_S:g}", env={"TMPDIR": str(tmp)}
    )
    port = _free_port()
    ranks = {
        r: processes.start(
            [sys.executable, str(script), mode, str(STEPS)], f"rank {r}", _rank_env(tmp, r, address, port)
        )
        for r in range(WORLD)
    }
    ranks[0].wait_for(f"^STEP {FAULT_STEP}$", timeout=120)
    victim = coordinator if target == "coordinator" else ranks[int(target.split()[1])]
    _inject(fault, victim)

    def wait_exit(proc: ManagedProcess, timeout: float) -> int:
        return proc.wait(timeout)

    _check_row(fault, target, ranks, wait_exit)
    if target != "coordinator":
        coordinator.terminate()
        coordinator.wait(30)
    for proc in processes.procs:
        proc.ensure_ended()


def _under_run(processes: ProcessGroup, tmp: Path, mode: str, fault: str, target: str) -> None:
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    run = processes.gradserver(
        "run",
        "--workers",
        str(WORLD),
        "--heartbeat-timeout",
        f"{HEARTBEAT_S:g}",
        "--",
        sys.executable,
        str(script),
        mode,
        str(STEPS),
        name="run",
        env={"TMPDIR": str(tmp)},
    )
    run.wait_for(rf"^\[rank 0\] STEP {FAULT_STEP}$", timeout=120)
    pids = {
        m.group(1): int(m.group(2))
        for m in map(re.compile(r"started (coordinator|rank \d+) \(pid (\d+)\)").search, run.lines)
        if m
    }
    try:
        _inject(fault, pids[target])
        code = run.wait(DETECTION_BOUND_S + (60.0 if fault == "slow" else 10.0))
        last = run.lines[-1]
        if fault == "slow":
            assert code == 0 and last.startswith("run: all 3 ranks finished"), run.output
            return
        assert code != 0, run.output
        assert last.startswith("run: ") and target in last, (
            f"run's last line does not name {target}:\n{run.output}"
        )
        output = run.output
        assert "Segmentation fault" not in output and "Fatal Python error" not in output, output
        if target.startswith("rank"):
            # Every survivor printed its traceback naming the lost rank before run stopped them.
            for rank in (r for r in range(WORLD) if f"rank {r}" != target):
                lines = [line for line in run.lines if line.startswith(f"[rank {rank}]")]
                assert any(LOST_RANK.search(line) for line in lines), output
    finally:
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        print(run.output)  # shown when the test fails


def _assert_nothing_left(tmp: Path, before_tmp: set[str], before_shm: set[str], pids: list[int]) -> None:
    deadline = time.monotonic() + 15
    while True:
        left = _snapshot(tmp) - before_tmp
        shm = _snapshot(Path("/dev/shm")) - before_shm
        alive = [pid for pid in pids if pid_alive(pid)]
        if not (left or shm or alive) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"left in the temporary directory: {sorted(left)}"
    assert not shm, f"left in /dev/shm: {sorted(shm)}"
    assert not alive, f"processes left: {alive}"


@pytest.mark.parametrize("repeat", range(REPEAT))
@pytest.mark.parametrize("mode", ["ddp", "plain", "p2p"])
@pytest.mark.parametrize(("row", "fault", "target"), ROWS, ids=[r[0] for r in ROWS])
@pytest.mark.parametrize("launcher", ["by-hand", "run"])
def test_a_fault_in_a_torch_job_ends_every_survivor_with_an_error_naming_it(
    tmp_path: Path, launcher: str, row: str, fault: str, target: str, mode: str, repeat: int
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp_path / "work").mkdir()
    before_shm = _snapshot(Path("/dev/shm"))
    processes = ProcessGroup(tmp_path / "work")
    pids: list[int] = []
    try:
        (_by_hand if launcher == "by-hand" else _under_run)(processes, tmp, mode, fault, target)
    finally:
        for proc in processes.procs:
            pids += [proc.proc.pid, *descendants(proc.proc.pid)]
        processes.close()
    (tmp / "rank.py").unlink()
    _assert_nothing_left(tmp, set(), before_shm, pids)
