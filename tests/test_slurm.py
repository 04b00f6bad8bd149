"""SLURM: `gradserver run` as one task of an srun step, and examples/slurm/ddp.sbatch on a real
SLURM cluster.

- How a task reads its step (gradserver.train.slurm): host lists expanded as `scontrol show
  hostnames` does (checked against it where the SLURM client is installed), tasks per node, the
  variables and the errors that name a missing or malformed one, the ports every task derives.
- Two tasks of one step on this machine (their SLURM variables set by the test): two `gradserver
  run` processes make one job of 4 ranks that trains bit-identically, and two `gradserver launch`
  processes one trainer job. Runs wherever torch does.
- The examples/slurm/ scripts on a real cluster (tests/helpers/slurm_cluster.py: Debian's
  slurmctld and two slurmd, each node its own network namespace), submitted with sbatch as a user
  would: ddp.sbatch trains with the same parameter digest on every rank; the job's token is on no
  command line; a node lost mid-job (its slurmd and every process on it killed) fails the job with
  the lost rank named, and a node's slurmd killed alone ends it once SLURM gives the node up, its
  ranks named; ft_ddp.sbatch restarts a killed rank on its node, which heals; launch.sbatch
  (both engines) leaves one checkpoint per worker, all with the same weights. Skipped, naming what
  is missing, without root or the packages slurm-wlm and munge.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradserver.common.errors import InvalidArgumentError
from gradserver.train.run import _Layout
from gradserver.train.slurm import SlurmStep, expand_hostlist, expand_tasks_per_node, slurm_step

from .helpers import slurm_cluster
from .helpers.processes import ROOT, ProcessGroup
from .helpers.slurm_cluster import SlurmCluster

EXAMPLE = ROOT / "examples" / "slurm" / "ddp.sbatch"
FT_EXAMPLE = ROOT / "examples" / "slurm" / "ft_ddp.sbatch"
LAUNCH_EXAMPLE = ROOT / "examples" / "slurm" / "launch.sbatch"
DIGEST = re.compile(r"rank (\d+): (\d+) steps \((\d+) applied here\), digest (0x[0-9a-f]+)")
RESULT = re.compile(r"RESULT (\{.*\})")


def _step_env(**overrides: str) -> dict[str, str]:
    """Task 1 of a 2-node step, one task per node, as srun sets it."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "node[1-2]",
    }
    return env | overrides


# --- reading the step ----------------------------------------------------------------------------

HOSTLISTS = [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-03,7],gpu-a", ["node01", "node02", "node03", "node7", "gpu-a"]),
    ("rack[1-2]-n[8-9]", ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]),
    ("x[009-011]", ["x009", "x010", "x011"]),
    ("a,b[2,4]", ["a", "b2", "b4"]),
]


@pytest.mark.parametrize(("text", "hosts"), HOSTLISTS)
def test_host_lists_expand_as_scontrol_does(text: str, hosts: list[str]) -> None:
    assert list(expand_hostlist(text)) == hosts


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="the SLURM client (scontrol) is not installed")
def test_the_expansion_agrees_with_scontrol(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=check\nSlurmctldHost=localhost\n")  # scontrol reads one, offline
    for text, _ in HOSTLISTS:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", text],
            capture_output=True,
            text=True,
            env={**os.environ, "SLURM_CONF": str(conf)},
            timeout=30,
            check=True,
        ).stdout
        assert list(expand_hostlist(text)) == out.split(), text


@pytest.mark.parametrize("text", ["", "node[1-", "node]1", "node[3-1]", "node[a-b]", "n[1-2]x]"])
def test_a_bad_host_list_is_refused_naming_it(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(repr(text))):
        expand_hostlist(text)


def test_tasks_per_node_expand() -> None:
    assert expand_tasks_per_node("2(x3),1") == (2, 2, 2, 1)
    assert expand_tasks_per_node("4") == (4,)
    with pytest.raises(InvalidArgumentError, match="SLURM_TASKS_PER_NODE='2x'"):
        expand_tasks_per_node("2x")


def test_a_task_reads_its_step() -> None:
    step = slurm_step(_step_env())
    assert step == SlurmStep(
        job_id=4242, tasks=2, task=1, node=1, local_task=0, tasks_per_node=(1, 1), hosts=("node1", "node2")
    )
    assert step.first_host == "node1"
    assert step.local_tasks == 1


def test_the_jobs_variables_serve_when_the_steps_are_missing() -> None:
    env = _step_env()
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST"):
        del env[name]
    env |= {"SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODELIST": "gpu[07-08]"}
    step = slurm_step(env)
    assert step is not None
    assert (step.tasks, step.tasks_per_node, step.hosts) == (4, (2, 2), ("gpu07", "gpu08"))


def test_outside_a_step_there_is_none() -> None:
    # An sbatch script itself has the job's variables but is no task of a step.
    env = _step_env()
    del env["SLURM_STEP_ID"]
    assert slurm_step(env) is None
    assert slurm_step({}) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"SLURM_PROCID": ""}, "SLURM_PROCID is not set"),
        ({"SLURM_JOB_ID": "x"}, "SLURM_JOB_ID='x' is not a whole number"),
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID 2 is not a task of 2"),
        ({"SLURM_STEP_NODELIST": "node[1-3]"}, "disagree"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2,1"}, "add up to 3, not its 2 tasks"),
        ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID 1 is not a task of the 1 on node2"),
        ({"SLURM_PROCID": "0"}, "task 0 runs on node2, not the step's first node node1"),
    ],
)
def test_a_broken_step_is_refused_naming_the_variable(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        slurm_step(_step_env(**overrides))


def test_every_task_derives_the_same_ports_from_the_job_id() -> None:
    tasks = [slurm_step(_step_env(SLURM_PROCID=str(t), SLURM_NODEID=str(t))) for t in range(2)]
    ports = {step.ports() for step in tasks if step is not None}
    assert len(ports) == 1
    coordinator, store = ports.pop()
    assert store == coordinator + 1 and 10000 <= coordinator < 32768  # below Linux's ephemeral ports
    other = slurm_step(_step_env(SLURM_JOB_ID="4243"))
    assert other is not None and other.ports()[0] != coordinator
    assert tasks[0] is not None and tasks[0].ports(23456) == (23456, 23457)
    with pytest.raises(InvalidArgumentError, match="--port 65535"):
        tasks[0].ports(65535)


def test_a_tasks_ranks_get_the_jobs_ranks_and_the_first_nodes_addresses() -> None:
    # Task 1 of 2, the second of two tasks on node 1 (cyclic: SLURM_LOCALID 1 of 2).
    place = SlurmStep(
        job_id=1, tasks=4, task=3, node=1, local_task=1, tasks_per_node=(2, 2), hosts=("node1", "node2")
    )
    env = _Layout(2, 0, place).env(1, 10001, ["node1:10000"], "tok", 1)
    assert env["RANK"] == "7" and env["WORLD_SIZE"] == "8"
    assert env["LOCAL_RANK"] == "3" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["GROUP_RANK"] == "1"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("node1", "10001")
    assert env["GRADSERVER_COORDINATOR"] == "node1:10000"


# --- two tasks of one step on this machine -------------------------------------------------------


def _free_pair() -> int:
    """A port p with p + 1 free too (coordinator, torch Store), in the range the job ids use."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 65535:
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two free consecutive ports")


def _results(text: str) -> list[dict[str, object]]:
    return [json.loads(m[1]) for m in RESULT.finditer(text)]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_two_tasks_of_a_step_make_one_job_that_trains_identically(processes: ProcessGroup) -> None:
    port = _free_pair()
    # The coordinator accepts other machines, so it requires a token (the sbatch example draws one).
    step = _step_env(SLURM_STEP_NODELIST="localhost,localhost", GRADSERVER_AUTH_TOKEN="t" * 32)
    example = ["examples/ddp_cnn.py", "--steps", "8"]
    argv = ["run", "--workers", "2", "--port", str(port), "--", sys.executable, *example]
    runs = [
        processes.gradserver(
            *argv, name=f"task {t}", env={**step, "SLURM_PROCID": str(t), "SLURM_NODEID": str(t)}
        )
        for t in range(2)
    ]
    for run in runs:
        assert run.wait(150) == 0, run.output
    results = _results(runs[0].output + runs[1].output)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert len({r["param_sha256"] for r in results}) == 1
    assert "run: all 2 ranks of SLURM task 0 finished" in runs[0].output
    assert "run: all 2 ranks of SLURM task 1 finished" in runs[1].output
    # Task 0 started the one coordinator; task 1 none.
    assert "started coordinator" in runs[0].output and "started coordinator" not in runs[1].output


def _free_job_id() -> str:
    """A job id whose two derived ports are free here now."""
    for job_id in range(20000, 29000, 7):
        step = slurm_step(_step_env(SLURM_JOB_ID=str(job_id)))
        assert step is not None
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", step.ports()[0]))
                b.bind(("127.0.0.1", step.ports()[1]))
        except OSError:
            continue
        return str(job_id)
    raise AssertionError("no job id with two free ports")


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_two_launch_tasks_of_a_step_train_one_job(processes: ProcessGroup, tmp_path: Path) -> None:
    import torch

    from gradserver.train.checkpoint import load_checkpoint

    step = _step_env(
        SLURM_JOB_ID=_free_job_id(), SLURM_STEP_NODELIST="localhost,localhost", GRADSERVER_AUTH_TOKEN="t" * 32
    )
    argv = ["launch", "--workers", "1", "--steps", "4", "--out", str(tmp_path)]
    tasks = [
        processes.gradserver(
            *argv, name=f"task {t}", env={**step, "SLURM_PROCID": str(t), "SLURM_NODEID": str(t)}
        )
        for t in range(2)
    ]
    for task in tasks:
        assert task.wait(150) == 0, task.output
    zero, one = (load_checkpoint(tmp_path / f"checkpoint-worker-{r}.pt").model_state for r in range(2))
    assert all(torch.equal(zero[name], one[name]) for name in zero)
    assert "launch: 4 steps in" in tasks[0].output and "launch: 4 steps in" not in tasks[1].output


@pytest.mark.processes
def test_in_process_launch_is_refused_across_tasks(processes: ProcessGroup) -> None:
    run = processes.gradserver("launch", "--in-process", name="launch", env=_step_env())
    assert run.wait(60) == 2
    assert "--in-process runs every worker in one process, and this SLURM step has 2 tasks" in run.output


@pytest.mark.processes
def test_task_0_without_a_token_is_refused_saying_so(processes: ProcessGroup) -> None:
    env: dict[str, str | None] = {
        **_step_env(SLURM_PROCID="0", SLURM_NODEID="0"),
        "GRADSERVER_AUTH_TOKEN": None,
    }
    run = processes.gradserver(
        "run", "--workers", "1", "--", sys.executable, "-c", "pass", name="run", env=env
    )
    assert run.wait(60) == 1
    assert "accepts connections from other machines" in run.output
    assert "--auth-token" in run.output


@pytest.mark.processes
def test_replica_groups_are_refused_across_tasks(processes: ProcessGroup) -> None:
    run = processes.gradserver(
        "run", "--workers", "2", "--replica-group-size", "2", "--", sys.executable, "-c", "pass",
        name="run", env=_step_env(),
    )  # fmt: skip
    assert run.wait(60) == 2
    assert (
        "--replica-group-size runs replica groups on one machine, and this SLURM step has 2 tasks"
        in run.output
    )


# --- a real SLURM cluster ------------------------------------------------------------------------

CLUSTER_OK, CLUSTER_WHY = slurm_cluster.available()
needs_cluster = pytest.mark.skipif(not CLUSTER_OK, reason=f"no SLURM cluster here: {CLUSTER_WHY}")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SlurmCluster]:
    with SlurmCluster(tmp_path / "slurm", nodes=2) as built:
        yield built


def _job_env(**extra: str) -> dict[str, str]:
    """The submitting shell's environment: gradserver and python from this venv on PATH."""
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "PYTHON": "python"} | extra


def _submit(cluster: SlurmCluster, script: Path, out: Path, **env: str) -> int:
    """Submits `script` from the repository, as a user would, its output to `out`; its job id."""
    return cluster.sbatch(script, f"--output={out}", env=_job_env(**env), cwd=ROOT)


def _wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text(errors="replace") if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} not in {path} within {timeout:g} s"
        time.sleep(0.2)


@needs_cluster
@pytest.mark.processes
@pytest.mark.timeout(240)
def test_the_sbatch_example_trains_identically_on_every_rank(cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job = _submit(cluster, EXAMPLE, out, STEPS="20")
    state = cluster.wait(job, timeout=180)
    text = out.read_text(errors="replace")
    assert state == "COMPLETED", text
    results = _results(text)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3], text
    assert len({r["param_sha256"] for r in results}) == 1, text
    assert all(r["group_backend"] == "gradserver" for r in results)
    assert "run: all 2 ranks of SLURM task 0 finished" in text
    assert "run: all 2 ranks of SLURM task 1 finished" in text


def _processes_under(root_pid: int) -> list[tuple[int, str, dict[str, str]]]:
    """(pid, command line, environment) of `root_pid` and every process under it."""
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
        found.append((pid, line, env))
    return found


@needs_cluster
@pytest.mark.processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["remote", "gloo"])
def test_the_trainers_launch_example_trains_identically_on_every_worker(
    cluster: SlurmCluster, tmp_path: Path, engine: str
) -> None:
    import torch

    from gradserver.train.checkpoint import load_checkpoint

    out, run_dir = tmp_path / "job.out", tmp_path / "run"
    job = _submit(cluster, LAUNCH_EXAMPLE, out, STEPS="12", OUT=str(run_dir), GRADSERVER_ENGINE=engine)
    state = cluster.wait(job, timeout=180)
    text = out.read_text(errors="replace")
    assert state == "COMPLETED", text
    # One checkpoint per worker of the job, named by its rank, all with the same weights.
    paths = sorted(run_dir.glob("checkpoint-*.pt"))
    assert [p.name for p in paths] == [f"checkpoint-worker-{r}.pt" for r in range(4)], text
    first, *others = (load_checkpoint(p).model_state for p in paths)
    for other in others:
        assert first.keys() == other.keys()
        for name, tensor in first.items():
            assert torch.equal(tensor, other[name]), name
    # Task 0 plotted the whole job's metrics once every task's workers were done.
    assert (run_dir / "loss.png").exists()
    assert text.count("launch: 12 steps in") == 1
    assert text.count("launch: all processes finished") == 2


def _token_of_a_rank(root_pid: int) -> tuple[str, list[str]]:
    """GRADSERVER_AUTH_TOKEN from the environment of a process under `root_pid`, and the command
    lines of every process under it."""
    under = _processes_under(root_pid)
    tokens = [env["GRADSERVER_AUTH_TOKEN"] for _, _, env in under if "GRADSERVER_AUTH_TOKEN" in env]
    return (tokens[0] if tokens else ""), [line for _, line, _ in under]


@needs_cluster
@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_lost_node_fails_the_job_naming_the_lost_rank(cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    job = _submit(cluster, EXAMPLE, out, STEPS="5000")
    _wait_for_text(out, "step 20 ", timeout=120)
    # The job's own token, drawn inside it: in every rank's environment, on no command line.
    token, lines = _token_of_a_rank(cluster.daemon_pid("node2"))
    assert re.fullmatch(r"[0-9a-f]{64}", token), "no rank on node2 has the job's token"
    assert any("gradserver run" in line or "gradserver.cli" in line for line in lines), lines
    assert not [line for line in lines if token in line]
    cluster.kill_node("node2")
    state = cluster.wait(job, timeout=150)
    text = out.read_text(errors="replace")
    assert state in ("NODE_FAIL", "FAILED"), text
    # Ranks 2 and 3 ran on node2; task 0's run names the one the coordinator lost first, with the
    # operation it was lost at when one was in flight (none is between two of DDP's all_reduces).
    assert re.search(r"^run: rank [23] was lost( at operation \d+)? \(", text, re.MULTILINE), text
    assert "RESULT" not in text


@needs_cluster
@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_nodes_slurmd_killed_alone_ends_the_job_when_slurm_gives_the_node_up_naming_its_ranks(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """slurmd alone dies: slurmstepd and the ranks on node2 go on, and the job trains on until
    SLURM holds the node down (SlurmdTimeout, 10 s here) and cancels the job. Then srun stops
    every task; task 0's run says SLURM stopped it and names the node and the ranks that ran
    there (the coordinator never lost them)."""
    out = tmp_path / "job.out"
    job = _submit(cluster, EXAMPLE, out, STEPS="20000")
    _wait_for_text(out, "step 20 ", timeout=120)
    cluster.kill_slurmd("node2")
    state = cluster.wait(job, timeout=180)
    text = out.read_text(errors="replace")
    assert state == "NODE_FAIL", text
    assert re.search(
        r"^run: stopped by SIGTERM; SLURM reports node node2 \(ranks 2-3 ran there\) down or not responding$",
        text,
        re.MULTILINE,
    ), text


@needs_cluster
@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_rank_killed_inside_the_allocation_is_restarted_on_its_node_and_heals(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    out = tmp_path / "job.out"
    job = _submit(cluster, FT_EXAMPLE, out, STEPS="3000")
    _wait_for_text(out, "step 100:", timeout=120)
    [rank2] = [
        pid
        for pid, line, env in _processes_under(cluster.daemon_pid("node2"))
        if env.get("RANK") == "2" and "ft_ddp.py" in line and "gradserver" not in line
    ]
    os.kill(rank2, signal.SIGKILL)
    state = cluster.wait(job, timeout=240)
    text = out.read_text(errors="replace")
    assert state == "COMPLETED", text
    # node2's run restarted it; it healed from a live rank and finished with the others.
    assert "run: rank 2 was killed by SIGKILL; starting it again" in text
    finals = {int(m[1]): (int(m[3]), m[4]) for m in DIGEST.finditer(text)}
    assert sorted(finals) == [0, 1, 2, 3], text
    assert len({digest for _, digest in finals.values()}) == 1, text
    assert finals[2][0] < 3000 <= min(applied for rank, (applied, _) in finals.items() if rank != 2)
