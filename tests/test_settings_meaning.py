"""Every setting means one thing: each GRADSERVER_ variable to every process that reads it, and each
flag `launch` shares with `worker` to both.

`gradserver run` hands the coordinator and the ranks one environment, and `launch` passes its
flags on to its workers, so a name with two meanings configures one process with the other's
value. The variables are enumerated from the config classes of the coordinator, the worker (and
its Timeouts), launch, run and a torch.distributed rank.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import trustme

from gradserver.cli import build_parser
from gradserver.common.config import (
    TimeoutSettings,
    config_from_sources,
    deprecated_names_of,
    env_name,
    environment_of,
)
from gradserver.common.timeouts import Timeouts
from gradserver.server.config import CoordinatorConfig
from gradserver.torch._settings import RankSettings
from gradserver.train.cli import WorkerConfig
from gradserver.train.launch import SHARED_WITH_WORKER, LaunchConfig
from gradserver.train.run import RunConfig

from .helpers.processes import ProcessGroup


def _worker_environment() -> dict[str, str]:
    """The worker CLI's settings and its library's deadlines (`Timeouts` when --timeout is 0)."""
    return {**environment_of(WorkerConfig), **environment_of(TimeoutSettings)}


def _launch_environment() -> dict[str, str]:
    shared = {env_name(name): environment_of(WorkerConfig)[env_name(name)] for name in SHARED_WITH_WORKER}
    return {**environment_of(LaunchConfig), **shared}


READERS = {
    "coordinator": lambda: environment_of(CoordinatorConfig),
    "worker": _worker_environment,
    "launch": _launch_environment,
    "run": lambda: environment_of(RunConfig),
    "torch rank": lambda: environment_of(RankSettings),
}


def _meanings() -> dict[str, dict[str, str]]:
    """variable -> {reader: its meaning there}."""
    meanings: dict[str, dict[str, str]] = {}
    for reader, variables in READERS.items():
        for name, meaning in variables().items():
            meanings.setdefault(name, {})[reader] = meaning
    return meanings


def test_the_enumeration_covers_every_process_and_the_renamed_settings() -> None:
    meanings = _meanings()
    assert set(meanings["GRADSERVER_TLS_CERT"]) == {"coordinator"}
    assert set(meanings["GRADSERVER_TLS_CLIENT_CERT"]) == {"worker", "torch rank"}
    assert set(meanings["GRADSERVER_JOIN_TIMEOUT"]) == {"coordinator"}
    assert set(meanings["GRADSERVER_WORKER_JOIN_TIMEOUT"]) == {"worker"}
    assert set(meanings["GRADSERVER_RUN_TIMEOUT"]) == {"launch", "run"}
    assert set(meanings["GRADSERVER_TIMEOUT"]) == {"worker", "launch"}


def test_no_environment_variable_is_read_with_two_meanings() -> None:
    """Where several processes read a variable, each reads it as the same field (the same help)."""
    two = {name: readers for name, readers in _meanings().items() if len(set(readers.values())) > 1}
    assert not two, f"read with different meanings: {two}"


def test_an_old_name_is_no_one_s_current_name_but_the_processes_it_belonged_to() -> None:
    """A renamed setting's old variable is the current name of the side that kept its meaning
    only: the worker's old GRADSERVER_TLS_CERT is the coordinator's certificate now, and no other
    process reads it as its own."""
    meanings = _meanings()
    renamed = {
        **deprecated_names_of(WorkerConfig),
        **deprecated_names_of(TimeoutSettings),
        **deprecated_names_of(RankSettings),
        **deprecated_names_of(RunConfig),
    }
    assert renamed["GRADSERVER_TLS_CERT"] == "GRADSERVER_TLS_CLIENT_CERT"
    assert renamed["GRADSERVER_TLS_KEY"] == "GRADSERVER_TLS_CLIENT_KEY"
    assert renamed["--timeout"] == "--run-timeout"
    assert renamed["--backend"] == "--engine"
    assert renamed["GRADSERVER_JOIN_TIMEOUT"] == "GRADSERVER_WORKER_JOIN_TIMEOUT"
    variables = [name for name in renamed if not name.startswith("--")]
    # Names that meant two things stay the coordinator's; a name renamed outright is no one's.
    split = {"GRADSERVER_TLS_CERT", "GRADSERVER_TLS_KEY", "GRADSERVER_JOIN_TIMEOUT"}
    for old in variables:
        owners = {"coordinator"} if old in split else set()
        assert set(meanings.get(old, {})) == owners, (old, meanings.get(old))


def test_an_old_variable_is_read_with_a_warning_only_when_the_new_one_is_not_set(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "gradserver.config")
    both = {"GRADSERVER_TLS_CERT": "server.crt", "GRADSERVER_TLS_CLIENT_CERT": "client.crt"}
    assert config_from_sources(WorkerConfig, None, both).tls_client_cert == "client.crt"
    assert not caplog.records
    old = config_from_sources(WorkerConfig, None, {"GRADSERVER_TLS_CERT": "mine.crt"})
    assert old.tls_client_cert == "mine.crt"
    assert [r.getMessage() for r in caplog.records] == [
        "GRADSERVER_TLS_CERT is deprecated and goes in the next release: use GRADSERVER_TLS_CLIENT_CERT "
        "(PEM client certificate of this worker (mutual TLS))"
    ]
    caplog.clear()
    assert Timeouts.from_env({"GRADSERVER_JOIN_TIMEOUT": "7"}).join == 7.0
    assert "use GRADSERVER_WORKER_JOIN_TIMEOUT" in caplog.records[0].getMessage()
    assert (
        Timeouts.from_env({"GRADSERVER_JOIN_TIMEOUT": "7", "GRADSERVER_WORKER_JOIN_TIMEOUT": "3"}).join == 3
    )


def test_an_old_flag_is_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "gradserver.config")
    args = _subcommands()["worker"].parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem"])
    config = config_from_sources(WorkerConfig, args, {})
    assert (config.tls_client_cert, config.tls_client_key) == ("c.pem", "k.pem")
    assert sorted(r.getMessage().split(" is deprecated")[0] for r in caplog.records) == [
        "--tls-cert",
        "--tls-key",
    ]


def test_the_coordinators_old_shard_flags_and_variables_set_its_partitions_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Coordinator partitions were "shards", a word that also named data sample ranges: the old
    names still work for one release, each with a warning naming its new one, and no process reads
    an old name as a current one of its own."""
    caplog.set_level(logging.WARNING, "gradserver.config")
    two = "127.0.0.1:1,127.0.0.1:2"
    old_env = {
        "GRADSERVER_SHARD_MAP": two,
        "GRADSERVER_SHARD_INDEX": "1",
        "GRADSERVER_SHARD_TLS_CA": "ca.pem",
    }
    config = config_from_sources(CoordinatorConfig, None, old_env)
    assert (config.partition_map, config.partition_index, config.partition_tls_ca) == (two, 1, "ca.pem")
    assert sorted(r.getMessage().split(" (")[0] for r in caplog.records) == [
        "GRADSERVER_SHARD_INDEX is deprecated and goes in the next release: use GRADSERVER_PARTITION_INDEX",
        "GRADSERVER_SHARD_MAP is deprecated and goes in the next release: use GRADSERVER_PARTITION_MAP",
        "GRADSERVER_SHARD_TLS_CA is deprecated and goes in the next release: use GRADSERVER_PARTITION_TLS_CA",
    ]
    caplog.clear()
    args = _subcommands()["coordinator"].parse_args(["--shard-map", two, "--shard-index", "1"])
    config = config_from_sources(CoordinatorConfig, args, {"GRADSERVER_PARTITION_INDEX": "0"})
    assert (config.partition_map, config.partition_index) == (two, 1)
    assert sorted(r.getMessage().split(" is deprecated")[0] for r in caplog.records) == [
        "--shard-index",
        "--shard-map",
    ]
    meanings = _meanings()
    assert not set(deprecated_names_of(CoordinatorConfig)) & set(meanings)


# --- launch and worker flags ----------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("gradserver has no subcommands")


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def _described(action: argparse.Action) -> tuple[Any, ...]:
    return (action.default, action.choices, action.help, action.nargs, action.const)


def test_launch_help_and_worker_help_agree_on_every_shared_flag() -> None:
    commands = _subcommands()
    launch, worker = _flags(commands["launch"]), _flags(commands["worker"])
    shared = (set(launch) & set(worker)) - {"-h", "--help"}
    assert {f"--{name.replace('_', '-')}" for name in SHARED_WITH_WORKER} <= shared
    assert {"--model", "--engine", "--backend", "--timeout", "--steps"} <= shared
    differing = {flag: (_described(launch[flag]), _described(worker[flag])) for flag in shared}
    differing = {flag: pair for flag, pair in differing.items() if pair[0] != pair[1]}
    assert not differing, f"launch and worker describe these flags differently: {differing}"


def test_launch_resolves_the_workers_settings_as_a_worker_does() -> None:
    """The coordinator's --max-steps and the progress bar follow what the workers will run, also
    when a flag after `--` overrides launch's own, and the default model is the worker's."""
    from gradserver.train.launch import _job

    parser = _subcommands()["launch"]
    job = _job(parser.parse_args(["--job", "synthetic", "--steps", "2", "--", "--steps", "5"]))
    assert (job.worker.steps, job.worker.model) == (5, WorkerConfig().model)
    assert job.argvs("127.0.0.1:1")[1][:4] == ["--node-id", "local-1", "--coordinator", "127.0.0.1:1"]


def test_the_old_backend_flag_and_variable_choose_the_averaging_engine_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--backend was the averaging engine; it is --engine now ("backend" is the torch.distributed
    backend only). launch passes an old flag on under the new name, so its workers do not warn."""
    from gradserver.train.launch import _job

    caplog.set_level(logging.WARNING)
    worker = config_from_sources(WorkerConfig, _subcommands()["worker"].parse_args(["--backend", "gloo"]), {})
    assert worker.engine == "gloo"
    assert config_from_sources(WorkerConfig, None, {"GRADSERVER_BACKEND": "nccl"}).engine == "nccl"
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "--backend is deprecated and goes in the next release: use --engine",
        "GRADSERVER_BACKEND is deprecated and goes in the next release: use GRADSERVER_ENGINE",
    ]
    caplog.clear()
    job = _job(_subcommands()["launch"].parse_args(["--backend", "gloo", "--steps", "2"]))
    assert job.worker.engine == "gloo"
    assert "--backend" not in job.worker_flags
    assert ("--engine", "gloo") in zip(job.worker_flags, job.worker_flags[1:], strict=False)
    assert [r.getMessage() for r in caplog.records] == [
        "--backend is deprecated and goes in the next release: use --engine"
    ]
    in_process = _job(_subcommands()["launch"].parse_args(["--backend", "local", "--steps", "2"]))
    assert in_process.launch.in_process and in_process.worker.engine == "remote"


# --- one environment under `gradserver run` -------------------------------------------------------


def _issue(ca: trustme.CA, tmp: Path, name: str, *identities: str) -> tuple[str, str]:
    cert = ca.issue_cert(*identities, common_name=name)
    crt, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    crt.write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
    key.write_bytes(cert.private_key_pem.bytes())
    return str(crt), str(key)


@pytest.mark.processes
def test_run_with_mutual_tls_and_a_token_gives_coordinator_and_ranks_their_own_variables(
    processes: ProcessGroup, tmp_path: Path
) -> None:
    """One environment holds the coordinator's server certificate and the ranks' client
    certificate, from two CAs: a rank that took the server certificate for its own would be
    refused (its CA is not the clients'), a coordinator that served the client certificate would
    not be trusted. The job completing, and each rank's resolved settings, show who read what."""
    server_ca, client_ca = trustme.CA(), trustme.CA()
    server_ca_file, client_ca_file = tmp_path / "server-ca.pem", tmp_path / "client-ca.pem"
    server_ca_file.write_bytes(server_ca.cert_pem.bytes())
    client_ca_file.write_bytes(client_ca.cert_pem.bytes())
    server_crt, server_key = _issue(server_ca, tmp_path, "server", "localhost", "127.0.0.1")
    client_crt, client_key = _issue(client_ca, tmp_path, "rank", "rank.workers.test")
    token = tmp_path / "token"
    token.write_text("s3cret-run-token\n")
    env: dict[str, str | None] = {
        "GRADSERVER_TLS_CERT": server_crt,
        "GRADSERVER_TLS_KEY": server_key,
        "GRADSERVER_TLS_CLIENT_CA": str(client_ca_file),
        "GRADSERVER_TLS_CA": str(server_ca_file),
        "GRADSERVER_TLS_CLIENT_CERT": client_crt,
        "GRADSERVER_TLS_CLIENT_KEY": client_key,
        "GRADSERVER_TLS_SERVER_NAME": "localhost",
    }
    worker = f"{sys.executable} -m gradserver.cli worker"
    script = (
        f"{worker} --print-config | grep -E '^(tls_|coordinator|auth_token)' && "
        f"exec {worker} --job synthetic --model tiny --steps 2 --node-id rank-$RANK"
    )
    run = processes.gradserver(
        "run", "--workers", "2", "--token-file", str(token), "--", "sh", "-c", script, name="run", env=env
    )
    assert run.wait(180) == 0, run.output
    assert run.lines[-1] == "run: all 2 ranks finished", run.output
    for rank in (0, 1):
        said = [line.split("] ", 1)[1] for line in run.lines if line.startswith(f"[rank {rank}] ")]
        assert f"tls_client_cert = '{client_crt}'  (GRADSERVER_TLS_CLIENT_CERT)" in said, run.output
        assert f"tls_ca = '{server_ca_file}'  (GRADSERVER_TLS_CA)" in said, run.output
        assert "auth_token = '***'  (GRADSERVER_AUTH_TOKEN)" in said, run.output
        assert any(line.startswith("coordinator = '127.0.0.1:") for line in said), run.output
    assert "deprecated" not in run.output
    # What the coordinator took from the same environment: its own certificate, not the ranks'.
    coordinator = config_from_sources(CoordinatorConfig, None, {k: v for k, v in env.items() if v})
    assert (coordinator.tls_cert, coordinator.tls_client_ca) == (server_crt, str(client_ca_file))
