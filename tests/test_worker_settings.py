"""The worker's settings: the job fingerprint, checks before connecting, the threads rule, one
meaning per environment variable across commands, `--print-config`, torch.distributed init."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradserver.cli import build_parser, main
from gradserver.common import codec
from gradserver.common.config import TimeoutSettings, config_from_sources, environment_of
from gradserver.common.errors import InvalidArgumentError
from gradserver.server.config import CoordinatorConfig
from gradserver.train import cli as worker_cli
from gradserver.train import corpus, trainer
from gradserver.train.cli import WorkerConfig, check_synthetic, check_training, choose_threads
from gradserver.train.fingerprint import differences, synthetic_fingerprint
from gradserver.train.launch import SHARED_WITH_WORKER
from gradserver.train.model import ModelConfig
from gradserver.train.synthetic import SHAPES

from .helpers.processes import ROOT


def worker_config(*argv: str, env: dict[str, str] | None = None) -> WorkerConfig:
    config: WorkerConfig = config_from_sources(
        WorkerConfig, worker_cli.worker_parser().parse_args(list(argv)), env or {}
    )
    return config


def fingerprint(*argv: str) -> dict[str, str]:
    return worker_cli.job_fingerprint(worker_config(*argv))


# --- the job fingerprint --------------------------------------------------------------------------


def test_the_training_fingerprint_names_every_setting_that_must_agree() -> None:
    got = fingerprint()
    model_fields = {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}
    expected = model_fields | {
        "job",
        "engine",
        "protocol_version",
        "wire_dtype",
        "seed",
        "steps",
        "batch_size",
        "accumulation_steps",
        "seq_len",
        "optimizer",
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "max_grad_norm",
        "data.name",
        "data.bytes",
        "data.sha256",
        "data.samples",
        "all_or_none_steps",
        "check_state_every",
    }
    assert set(got) == expected
    assert all(isinstance(v, str) and v for v in got.values())
    assert got["model.name"] == "tiny" and got["seed"] == "0" and got["lr"] == "0.003"


@pytest.mark.parametrize(
    ("flags", "changed"),
    [
        (["--seed", "1"], {"seed"}),
        (["--lr", "0.01"], {"lr"}),
        (["--max-grad-norm", "0.5"], {"max_grad_norm"}),
        (["--batch-size", "4"], {"batch_size"}),
        (["--accumulation-steps", "2"], {"accumulation_steps"}),
        (["--seq-len", "32"], {"seq_len", "data.samples"}),
        (["--steps", "7"], {"steps"}),
        (["--reconnect-timeout", "30"], {"all_or_none_steps"}),
        (["--engine", "gloo"], {"engine"}),
        (
            ["--model", "small"],
            {"model.name", "model.hidden", "model.num_heads", "model.intermediate", "model.num_layers"}
            | {"model.max_seq_len", "seq_len", "data.samples"},
        ),
    ],
)
def test_each_setting_changes_its_field(flags: list[str], changed: set[str]) -> None:
    base, other = fingerprint(), fingerprint(*flags)
    assert {k for k in base if base[k] != other[k]} == changed


@pytest.mark.parametrize(
    ("module", "name", "value", "field"),
    [
        (trainer, "ADAMW_BETAS", (0.8, 0.99), "betas"),
        (trainer, "ADAMW_EPS", 1e-6, "eps"),
        (trainer, "DEFAULT_WEIGHT_DECAY", 0.1, "weight_decay"),
        (corpus, "corpus_digest", lambda: "0" * 64, "data.sha256"),
        (codec, "PROTOCOL_VERSION", 99, "protocol_version"),
    ],
)
def test_fixed_settings_are_in_the_fingerprint(monkeypatch, module, name, value, field) -> None:
    base = fingerprint()
    monkeypatch.setattr(module, name, value)
    other = fingerprint()
    assert {k for k in base if base[k] != other[k]} == {field}


@pytest.mark.parametrize("field", ["num_blocks", "hidden", "kv_hidden", "intermediate", "vocab"])
def test_every_shape_field_is_in_the_synthetic_fingerprint(field: str) -> None:
    shape = SHAPES["tiny"]
    base = synthetic_fingerprint(shape, (), steps=3, seed=0)
    changed = dataclasses.replace(shape, **{field: getattr(shape, field) * 2})
    other = synthetic_fingerprint(changed, (), steps=3, seed=0)
    assert {k for k in base if base[k] != other[k]} == {f"shape.{field}"}
    assert synthetic_fingerprint(shape, (), steps=4, seed=0)["steps"] == "4"
    assert synthetic_fingerprint(shape, (), steps=3, seed=5)["seed"] == "5"


def test_differences_name_the_field_and_both_values() -> None:
    job = fingerprint()
    assert differences(job, fingerprint("--seed", "1")) == ["seed 1 != 0"]
    assert differences(job, fingerprint("--steps", "9"), ignore={"steps"}) == []


# --- checks before connecting ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "huge"], "--model 'huge' is not one of tiny, small, wide, 350m"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--steps", "-1"], "--steps must be >= 0"),
        (["--threads", "-2"], "--threads must be >= 0"),
        (["--device", "tpu"], "--device 'tpu' must be cpu, cuda, cuda:N or auto"),
        (["--device", "cuda:64"], "--device cuda:64"),
        (["--coordinator", "nowhere"], "--coordinator 'nowhere' is not HOST:PORT"),
        (
            ["--tls-ca", "/nonexistent/ca.pem"],
            "--tls-ca / --tls-client-ca '/nonexistent/ca.pem' cannot be read",
        ),
        (["--resume", "--node-id", "a"], "--resume needs --out"),
        (["--resume", "--out", "{tmp}"], "--resume with --engine remote needs --node-id"),
        (["--node-id", "a/b", "--out", "{tmp}"], "--node-id 'a/b' names checkpoint files"),
        (["--out", "{file}"], "is not a directory"),
        (["--engine", "gloo"], "--engine gloo needs --dist-world-size N, --dist-rank 0..N-1"),
        (
            ["--engine", "gloo", "--dist-world-size", "2", "--dist-rank", "2", "--dist-init", "file:///x"],
            "rank 2",
        ),
        (["--log-level", "LOUD"], "--log-level must be one of DEBUG, INFO, WARNING, ERROR"),
    ],
)
def test_training_arguments_are_checked_before_connecting(
    argv: list[str], message: str, tmp_path: Path
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    argv = [a.format(tmp=tmp_path, file=a_file) for a in argv]
    with pytest.raises(InvalidArgumentError) as caught:
        check_training(worker_config(*argv))
    assert message in caught.value.message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "huge"], "--model 'huge' is not one of"),
        (["--non-block", "lm_head,bogus"], "bogus"),
        (["--engine", "gloo"], "--job synthetic needs --engine remote"),
    ],
)
def test_synthetic_arguments_are_checked_before_connecting(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        check_synthetic(worker_config("--job", "synthetic", *argv))


def _run_cli(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    return result, time.monotonic() - started


@pytest.mark.processes
def test_worker_with_an_unknown_model_exits_2_without_connecting() -> None:
    """Nothing listens on the address, and the connect deadline (300 s) is far beyond the
    subprocess's timeout: only a worker that never tries to connect can answer in time."""
    result, _ = _run_cli(
        "worker", "--model", "huge", "--coordinator", "127.0.0.1:9", "--timeout", "300", timeout=150
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == ["gradserver worker: --model 'huge' is not one of tiny, small, wide, 350m"], result.stderr


@pytest.mark.processes
def test_launch_with_an_unknown_model_exits_2_before_starting_anything() -> None:
    result, _ = _run_cli("launch", "--model", "huge", "--workers", "2", "--run-timeout", "300", timeout=150)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "gradserver launch: --model 'huge' is not one of tiny, small, wide, 350m"
    ]
    assert "started" not in result.stdout


# --- threads --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("explicit", "env", "cores", "local", "expected"),
    [
        (0, {}, 16, 1, (16, "16 cores / 1 workers on this host")),
        (0, {}, 16, 4, (4, "16 cores / 4 workers on this host")),
        (0, {}, 2, 2, (1, "2 cores / 2 workers on this host")),
        (0, {}, 2, 5, (1, "2 cores / 5 workers on this host")),
        (0, {"OMP_NUM_THREADS": "3"}, 16, 4, (3, "OMP_NUM_THREADS")),
        (0, {"OMP_NUM_THREADS": ""}, 8, 2, (4, "8 cores / 2 workers on this host")),
        (0, {"OMP_NUM_THREADS": "0"}, 8, 2, (4, "8 cores / 2 workers on this host")),
        (2, {"OMP_NUM_THREADS": "3"}, 16, 4, (2, "--threads")),
    ],
)
def test_threads_rule(explicit, env, cores, local, expected) -> None:
    assert choose_threads(explicit, env, cores, local) == expected


def test_launch_and_a_worker_by_hand_share_cores_the_same_way() -> None:
    """launch exports OMP_NUM_THREADS = cores // workers, what a worker started by hand picks
    when the coordinator reports the same number of workers on its host."""
    cores, workers = worker_cli.available_cores(), 3
    by_hand, _ = choose_threads(0, {}, cores, workers)
    assert by_hand == max(1, cores // workers)
    assert choose_threads(0, {"OMP_NUM_THREADS": str(by_hand)}, cores, 1)[0] == by_hand


# --- one meaning per environment variable ---------------------------------------------------------

# Variables that more than one command reads, each with the one meaning it has for all of them.
SHARED_SETTINGS = {
    "GRADSERVER_LOG_LEVEL": "log level",
    "GRADSERVER_LOG_FORMAT": "log format",
    "GRADSERVER_AUTH_TOKEN": "the job's shared token",
    # launch takes the worker's own fields for what it shares with the worker.
    **{f"GRADSERVER_{name.upper()}": f"the worker's --{name}" for name in SHARED_WITH_WORKER},
    "GRADSERVER_WORKERS": "number of worker processes (launch, run)",
    "GRADSERVER_RUN_TIMEOUT": "seconds for the whole run (launch, run)",
    "GRADSERVER_RESTART_LOST": "restarts of lost workers or ranks in all (launch, run)",
    "GRADSERVER_HEARTBEAT_TIMEOUT": "the coordinator's, passed on to it by run",
    "GRADSERVER_NO_SLURM": "this machine alone, even in a SLURM step (launch, run)",
}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("gradserver has no subcommands")


def _env_settings() -> dict[str, dict[str, str]]:
    """variable -> {command: help} for every GRADSERVER_ variable any command reads: those its
    flags name, and the worker's Timeouts (read from the environment when --timeout is 0)."""
    found: dict[str, dict[str, str]] = {}
    for command, parser in _subcommands().items():
        for action in parser._actions:
            for name in re.findall(r"\benv (GRADSERVER_\w+)", action.help or ""):
                found.setdefault(name, {})[command] = action.help or ""
    for name, meaning in environment_of(TimeoutSettings).items():
        found.setdefault(name, {})["worker"] = meaning
    return found


def test_every_command_is_enumerated() -> None:
    assert {"coordinator", "worker", "launch", "health"} <= set(_subcommands())
    settings = _env_settings()
    assert "coordinator" in settings["GRADSERVER_WORLD_SIZE"]
    assert "worker" in settings["GRADSERVER_DIST_WORLD_SIZE"]


def test_no_environment_variable_has_two_meanings() -> None:
    shared = {name: commands for name, commands in _env_settings().items() if len(commands) > 1}
    unexplained = {name: sorted(commands) for name, commands in shared.items() if name not in SHARED_SETTINGS}
    assert not unexplained, f"read by several commands, meaning not agreed: {unexplained}"


def test_the_worker_does_not_read_the_coordinators_world_size() -> None:
    env = {"GRADSERVER_WORLD_SIZE": "7", "GRADSERVER_RANK": "3"}
    config = config_from_sources(WorkerConfig, None, env)
    assert (config.dist_world_size, config.dist_rank) == (0, -1)
    assert config_from_sources(CoordinatorConfig, None, env).world_size == 7
    moved = config_from_sources(WorkerConfig, None, {"GRADSERVER_DIST_WORLD_SIZE": "4"})
    assert moved.dist_world_size == 4


def test_worker_print_config_shows_sources_and_masks_secrets(capsys, monkeypatch) -> None:
    monkeypatch.setenv("GRADSERVER_SEED", "5")
    code = main(["worker", "--print-config", "--auth-token", "s3cret", "--model", "small"])
    out = capsys.readouterr().out
    assert code == 0
    assert "model = 'small'  (--model)" in out
    assert "seed = 5  (GRADSERVER_SEED)" in out
    assert "dist_world_size = 0  (default)" in out
    assert "auth_token = '***'  (--auth-token)" in out and "s3cret" not in out


# --- torch.distributed initialisation -------------------------------------------------------------


class _Initialised(Exception):
    pass


@pytest.mark.parametrize(("engine", "expected"), [("gloo", "gloo"), ("nccl", "cpu:gloo,cuda:nccl")])
def test_torch_distributed_backend_string(monkeypatch, tmp_path: Path, engine: str, expected: str) -> None:
    """NCCL reduces only CUDA tensors; the loss all-reduce is of CPU tensors, so gloo must serve
    the CPU ones in the same process group."""
    import torch.distributed as dist

    calls: list[tuple[str, dict[str, object]]] = []

    def init_process_group(backend: str, **kwargs: object) -> None:
        calls.append((backend, kwargs))
        raise _Initialised

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    argv = ["--engine", engine, "--dist-rank", "1", "--dist-world-size", "2"]
    argv += ["--dist-init", f"file://{tmp_path}/store", "--device", "cpu"]
    with pytest.raises(_Initialised):
        worker_cli._run_training(worker_config(*argv), {})
    assert calls == [(expected, {"init_method": f"file://{tmp_path}/store", "rank": 1, "world_size": 2})]
