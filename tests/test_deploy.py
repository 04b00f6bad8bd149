"""What can be checked of the container setup without a Docker engine: the compose file against
the real CLI and configuration, and the Dockerfile against our rules. The Dockerfile's install
script runs in tests/test_wheel.py; the real engine runs in `make docker-check`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
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


def test_compose_file_works_with_compose_v1_and_an_image_per_service() -> None:
    compose = _compose()
    # Compose v1 (1.29, Debian's docker-compose) refuses a top-level `name:`; the project name
    # comes from COMPOSE_PROJECT_NAME (docker/run-job.sh sets it).
    assert set(compose) == {"services", "volumes"}
    targets = _targets((ROOT / "Dockerfile").read_text())
    images = set()
    for name, service in compose["services"].items():
        # Each service builds the Dockerfile's target of its own name: the coordinator's without torch.
        assert service["build"] == {"context": ".", "target": name}, name
        assert name in targets, f"no Dockerfile target {name}"
        images.add(service["image"])
        assert _interpolate(service["image"]).startswith(f"gradserver-{name}:"), service["image"]
    assert images == {
        "${GRADSERVER_COORDINATOR_IMAGE:-gradserver-coordinator:latest}",
        "${GRADSERVER_WORKER_IMAGE:-gradserver-worker:latest}",
    }
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
    override = _compose("docker-compose.gpu.yml")["services"]
    assert set(override) == {"worker"}, "the coordinator needs no GPU and keeps its image"
    worker = override["worker"]
    assert worker["build"]["target"] == "worker"
    assert _interpolate(worker["image"]) != _interpolate(_compose()["services"]["worker"]["image"])
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


def _targets(dockerfile: str) -> dict[str, list[str]]:
    """Each named stage's instructions, with those of the stages it is built FROM before them
    (what the image of that target holds or inherits)."""
    targets: dict[str, list[str]] = {}
    for stage in _stages(dockerfile):
        words = stage[0].split()
        assert len(words) == 4 and words[2].upper() == "AS", f"unnamed stage: {stage[0]}"
        targets[words[3]] = targets.get(words[1], []) + stage
    return targets


def _copies_from(instructions: list[str]) -> list[str]:
    return [m.group(1) for i in instructions if (m := re.match(r"COPY --from=(\S+) ", i))]


def test_dockerfile_builds_two_images_by_our_rules() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = _stages(text)
    targets = _targets(text)
    # The classic builder builds every stage before its target: the coordinator's come first so
    # that its build never installs torch, and a build without --target gives the worker image.
    names = [stage[0].split()[3] for stage in stages]
    assert names[-1] == "worker" and names.index("coordinator") < names.index("build-worker")
    for name in ("coordinator", "worker"):
        final = targets[name]
        users = [i.split()[1] for i in final if i.upper().startswith("USER ")]
        assert users and users[-1] not in ("root", "0"), f"{name} runs as root"
        assert 'ENTRYPOINT ["gradserver"]' in final and f'CMD ["{name}"]' in final, name
        own = stages[names.index(name)]
        for tool in ("gcc", "g++", "build-essential", "make ", "git"):
            assert tool not in "\n".join(final), f"{tool} in the {name} image"
        assert not any(i.upper().startswith("COPY ") and "--from=" not in i for i in own), (
            f"sources in the {name} image"
        )
        assert _copies_from(own) == [f"build-{name}"], f"{name} copies the environment of build-{name}"
    healthchecks = {
        name: any(re.match(r'HEALTHCHECK .*CMD \["gradserver", "health"', i) for i in targets[name])
        for name in ("coordinator", "worker")
    }
    assert healthchecks == {"coordinator": True, "worker": False}, "only the coordinator serves health"

    coordinator_build = "\n".join(targets["build-coordinator"])
    assert "EXTRAS= TORCH_VARIANT=none sh .ci/install-runtime.sh" in coordinator_build, "no torch"
    assert "docker/wheels" not in coordinator_build and "TORCH_WHEEL_DIR" not in coordinator_build
    worker_build = "\n".join(targets["build-worker"])
    assert "install-runtime.sh" in worker_build and "TORCH_INDEX_URL" in worker_build
    assert "EXTRAS" not in worker_build, "the worker installs the default extra, train"
    for arg in ("TORCH_INDEX_URL", "TORCH_VARIANT", "TORCH_WHEEL_DIR"):
        assert f"ARG {arg}" in worker_build, f"{arg} reaches the worker's build stage"
        assert f'{arg}="${{{arg}}}"' in worker_build, f"{arg} reaches the install script"
    assert "ARG TORCH_VARIANT=cpu" in text, "the default build checks for +cpu"
    assert "check-torch.sh" in worker_build and "COPY docker/wheels" in worker_build
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "build"} <= set(ignored)
    assert not any(p in ("docker", "docker/wheels", "*.whl", "**/*.whl") for p in ignored)


def _check_torch(python: Path | str, variant: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run(
        ["sh", str(ROOT / ".ci" / "check-torch.sh"), variant],
        env={**env, "PYTHON": str(python)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_torch_check_for_the_coordinator_build_refuses_any_torch(tmp_path: Path) -> None:
    """`check-torch.sh none`, which the coordinator's build runs: it passes in an environment
    without torch and fails, naming the version, in one with torch (this one)."""
    venv.EnvBuilder(with_pip=False).create(tmp_path / "venv")
    bare = _check_torch(tmp_path / "venv" / "bin" / "python", "none")
    assert bare.returncode == 0 and "no torch is installed, as asked" in bare.stdout, bare.stderr
    with_torch = _check_torch(sys.executable, "none")
    assert with_torch.returncode == 1
    assert "torch 2.13.0+cpu is installed, but no torch was asked for" in with_torch.stderr


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


def test_the_build_stage_copies_every_package_folder() -> None:
    """pip installs the package-dir mapping of pyproject.toml: a folder the Dockerfile does not
    copy (torch_backend/ once did not) fails the image build, not a test."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {folder.split("/")[0] for folder in setuptools["package-dir"].values()}
    build = "\n".join(_targets((ROOT / "Dockerfile").read_text())["sources"])
    copied = {m.group(1) for m in re.finditer(r"^COPY (\S+) \./\1$", build, re.M)}
    assert folders <= copied, f"not copied into the build stage: {sorted(folders - copied)}"
