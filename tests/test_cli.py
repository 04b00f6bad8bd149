"""The real CLIs as subprocesses on localhost: coordinator, workers, launch, configuration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .helpers.processes import ROOT

pytestmark = pytest.mark.processes


def _summary(proc) -> dict:
    return json.loads(proc.wait_for(r'^\{"worker_id"').string)


def test_coordinator_and_three_workers_with_a_128_mib_lm_head(processes) -> None:
    """The LM head of the 350M model (32768 x 1024 floats, 128 MiB) crosses as 32 chunks."""
    coord, address = processes.coordinator("--world-size", "3", "--max-steps", "1")
    shape = [
        "--num-blocks",
        "2",
        "--hidden",
        "1024",
        "--kv-hidden",
        "256",
        "--intermediate",
        "256",
        "--vocab",
        "32768",
        "--non-block",
        "lm_head,final_norm",
    ]
    workers = [
        processes.gradserver(
            "worker",
            "--job",
            "synthetic",
            "--coordinator",
            address,
            "--steps",
            "1",
            "--json",
            *shape,
            name=f"worker-{i}",
        )
        for i in range(3)
    ]
    summaries = [_summary(w) for w in workers]
    for w in workers:
        assert w.wait(120) == 0, w.output
    assert coord.wait(30) == 0, coord.output
    assert sorted(s["worker_id"] for s in summaries) == [0, 1, 2]
    checksums = {s["steps"][0]["checksum"] for s in summaries}
    assert len(checksums) == 1, "averages differ between workers"
    assert all(s["steps"][0]["max_rel_error"] <= 1e-6 for s in summaries)
    assert all(s["steps"][0]["bytes_sent"] >= 128 * 2**20 for s in summaries)
    assert "reached --max-steps 1" in coord.output


def test_launch_runs_the_demo_job(processes) -> None:
    launch = processes.gradserver(
        "launch", "--job", "synthetic", "--model", "tiny", "--workers", "2", "--steps", "2", name="launch"
    )
    assert launch.wait(120) == 0, launch.output
    assert launch.output.count("step 1: 5 tensors averaged") == 2
    assert "all processes finished" in launch.output


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--world-size", "0"], {}, "--world-size / GRADSERVER_WORLD_SIZE must be at least 1, got 0"),
        ([], {"GRADSERVER_WORLD_SIZE": "two"}, "GRADSERVER_WORLD_SIZE='two' is not a valid int"),
        (["--bind", "nowhere"], {}, "--bind 'nowhere' is not HOST:PORT"),
        (["--chunk-mib", "-1"], {}, "--chunk-mib / GRADSERVER_CHUNK_MIB must be positive"),
        (["--heartbeat-timeout", "0"], {}, "must be a positive number of seconds, got 0.0"),
    ],
)
def test_invalid_configuration_fails_at_start_with_one_line(args, env, message) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "coordinator", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**_clean_env(), **env},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_every_flag_names_its_environment_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "coordinator", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    for flag in (
        "--world-size",
        "--join-timeout",
        "--step-timeout",
        "--heartbeat-timeout",
        "--max-message-mib",
        "--log-level",
        "--max-steps",
        "--bind",
    ):
        assert flag in result.stdout
        assert "GRADSERVER_" + flag[2:].upper().replace("-", "_") in result.stdout


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("GRADSERVER_")}


def test_local_coordinators_choose_their_chunk_size_unless_told_otherwise(monkeypatch, tmp_path) -> None:
    """launch, run and the torch backend start their coordinator through coordinator_command:
    no --chunk-mib of its own (the coordinator picks 8 MiB for workers that join over loopback),
    never over the user's own choice."""
    from gradserver.worker.local_coordinator import coordinator_command

    monkeypatch.delenv("GRADSERVER_CHUNK_MIB", raising=False)
    port_file = tmp_path / "port"

    def chunk_flags(*options: str) -> list[str]:
        argv = coordinator_command(2, port_file, *options)
        return [argv[i + 1] for i, a in enumerate(argv) if a == "--chunk-mib"] + [
            a for a in argv if a.startswith("--chunk-mib=")
        ]

    assert chunk_flags() == []
    assert chunk_flags("--chunk-mib", "0.5") == ["0.5"]
    assert chunk_flags("--chunk-mib=2") == ["--chunk-mib=2"]
