"""What can be checked of the container setup without a Docker engine: the compose file against
the real CLI and configuration, and the Dockerfile against our rules. The Dockerfile's install
script runs in tests/test_wheel.py; the real engine runs in `make docker-check`."""

from __future__ import annotations

import re
from typing import Any

import yaml

from gradserver.common.cli import build_parser
from gradserver.common.config import CoordinatorConfig, config_from_sources, env_name
from gradserver.worker.cli import WorkerConfig

from .helpers.processes import ROOT

CONFIG_FOR = {"coordinator": CoordinatorConfig, "worker": WorkerConfig}
_DEFAULT = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def _compose(name: str = "docker-compose.yml") -> dict[str, Any]:
    return yaml.safe_load((ROOT / name).read_text())


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} as a user who sets nothing gets it; ${VAR:?error} as a user who
    set the required variable does."""
    return _DEFAULT.sub(lambda m: "set-by-user" if m.group(2) == "?" else (m.group(3) or ""), value)


def test_compose_services_use_real_commands_and_variables() -> None:
    services = _compose()["services"]
    assert set(services) == {"coordinator", "worker"}
    parser = build_parser()
    for name, service in services.items():
        command = service["command"]
        assert command[0] == name
        parser.parse_args(command)  # the subcommand exists
        env = {k: _interpolate(str(v)) for k, v in service["environment"].items()}
        cls = CONFIG_FOR[name]
        known = {env_name(f) for f in cls.__dataclass_fields__}
        unknown = set(env) - known
        assert not unknown, f"{name} sets variables its CLI does not read: {unknown}"
        config_from_sources(cls, None, env)  # every value parses and validates


def test_compose_dependencies_volume_and_healthcheck() -> None:
    compose = _compose()
    worker, coordinator = compose["services"]["worker"], compose["services"]["coordinator"]
    assert worker["depends_on"]["coordinator"]["condition"] == "service_healthy"
    assert any(v.startswith("runs:") for v in worker["volumes"]) and "runs" in compose["volumes"]
    assert worker["environment"]["GRADSERVER_OUT"] == "/runs"
    assert worker["environment"]["GRADSERVER_COORDINATOR"] == "coordinator:50051"
    assert "replicas" not in worker.get("deploy", {}), "workers are scaled with --scale"
    test = coordinator["healthcheck"]["test"]
    assert test[0] == "CMD"
    build_parser().parse_args(test[1:][1:])  # gradserver health HOST:PORT
    assert test[1:3] == ["gradserver", "health"]


def test_gpu_override_reserves_gpus_and_a_cuda_build() -> None:
    worker = _compose("docker-compose.gpu.yml")["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert "cu" in worker["build"]["args"]["TORCH_INDEX_URL"]
    config_from_sources(WorkerConfig, None, {k: str(v) for k, v in worker["environment"].items()})


def _stages(dockerfile: str) -> list[list[str]]:
    lines = dockerfile.replace("\\\n", " ").splitlines()
    instructions = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    stages: list[list[str]] = []
    for instruction in instructions:
        if instruction.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def test_dockerfile_follows_the_rules() -> None:
    stages = _stages((ROOT / "Dockerfile").read_text())
    assert len(stages) >= 2, "multi-stage build"
    final = stages[-1]
    users = [i.split()[1] for i in final if i.upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert any(re.match(r'HEALTHCHECK .*CMD \["gradserver", "health"', i) for i in final)
    assert 'ENTRYPOINT ["gradserver"]' in final
    final_text = "\n".join(final)
    for tool in ("gcc", "g++", "build-essential", "make ", "git"):
        assert tool not in final_text, f"{tool} in the final stage"
    assert not any(i.upper().startswith("COPY ") and "--from=" not in i for i in final), (
        "sources in the final stage"
    )
    build_text = "\n".join(stages[0])
    assert "install-runtime.sh" in build_text and "TORCH_INDEX_URL" in build_text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "build"} <= set(ignored)
