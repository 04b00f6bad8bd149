"""What can be checked of the container setup without a Docker engine: the compose file against
the real CLI and configuration, and the Dockerfile against our rules. The Dockerfile's install
script runs in tests/test_wheel.py; the real engine runs in `make docker-check`."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import yaml

from gradserver.cli import build_parser
from gradserver.common.config import config_from_sources, env_name
from gradserver.server.config import CoordinatorConfig
from gradserver.train.cli import WorkerConfig

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


def test_compose_file_works_with_compose_v1_and_one_image() -> None:
    compose = _compose()
    # Compose v1 (1.29, Debian's docker-compose) refuses a top-level `name:`; the project name
    # comes from COMPOSE_PROJECT_NAME (docker/run-job.sh sets it).
    assert set(compose) == {"services", "volumes"}
    images = {service["image"] for service in compose["services"].values()}
    assert images == {"${GRADSERVER_IMAGE:-gradserver:latest}"}, "coordinator and workers share one image"
    for port in compose["services"]["coordinator"]["ports"]:
        host, _, container = port.rpartition(":")
        assert container in ("50051", "9090") and _interpolate(host) in ("50051", "9090")


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
    args = worker["build"]["args"]
    variant = args["TORCH_INDEX_URL"].rstrip("/").rsplit("/", 1)[-1]
    assert variant.startswith("cu") and args["TORCH_VARIANT"] == variant, "the build checks the CUDA torch"
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
    for arg in ("TORCH_VARIANT", "TORCH_WHEEL_DIR"):
        assert f'{arg}="${{{arg}}}"' in build_text, f"{arg} reaches the install script"
    assert "ARG TORCH_VARIANT=cpu" in (ROOT / "Dockerfile").read_text(), "the default build checks for +cpu"
    assert "check-torch.sh" in build_text and "COPY docker/wheels" in build_text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "build"} <= set(ignored)
    assert not any(p in ("docker", "docker/wheels", "*.whl", "**/*.whl") for p in ignored)


def test_container_scripts_parse_and_ci_runs_the_check_after_the_tests() -> None:
    for script in ("docker/check.sh", "docker/run-job.sh"):
        path = ROOT / script
        assert os.access(path, os.X_OK), f"{script} is not executable"
        result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{script}: {result.stderr}"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert ci.index("make test") < ci.index("make docker-check")
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^docker-check:.*\n\tbash docker/check\.sh$", makefile, re.MULTILINE)
