"""deploy/kubernetes/ as Kubernetes and gradserver see it (no cluster runs here): every manifest is
valid against the Kubernetes schemas (kubernetes-validate, pinned in constraints.txt, for the
version below, strict: an unknown field fails), every GRADSERVER_ variable a manifest sets is one
that gradserver reads, and what each gradserver container is given (its arguments and its
settings, the Secret's value stood in) is accepted by the command it starts."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gradserver.cli import build_parser
from gradserver.common.config import config_from_sources
from gradserver.server.config import CoordinatorConfig
from gradserver.train.cli import WorkerConfig

from .helpers.processes import ROOT
from .test_settings_meaning import READERS

KUBERNETES = "1.33.0"
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
_VARIABLE = re.compile(r"\$\((\w+)\)")


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for name, doc in _documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        found += [(f"{name} {doc['kind']} {c['name']}", c) for c in spec.get("containers", [])]
    return found


def _environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables; one from a Secret or the pod is given a stand-in value."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = "1"  # the pod index
        else:
            env[item["name"]] = "secret-value"
    return env


def test_the_manifests_are_there() -> None:
    names = [path.name for path in MANIFESTS]
    assert names == ["coordinator.yaml", "partitioned.yaml", "torch-ranks.yaml", "workers.yaml"], names
    kinds = sorted(doc["kind"] for _, doc in _documents())
    assert kinds == ["Job", "Job", "Job", "Service", "Service", "Service", "StatefulSet"], kinds


@pytest.mark.parametrize(("name", "document"), _documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_manifest_is_valid_kubernetes(name: str, document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, KUBERNETES, strict=True)


def test_a_wrong_field_is_caught() -> None:
    """The validation can fail: a misspelt field of a container."""
    _, job = next((n, d) for n, d in _documents() if d["kind"] == "Job")
    broken = yaml.safe_load(yaml.safe_dump(job))
    broken["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_every_gradserver_variable_a_manifest_sets_is_read_by_gradserver() -> None:
    known = {variable for environment in READERS.values() for variable in environment()}
    named = {item["name"] for _, c in _containers() for item in c.get("env", [])}
    text = "\n".join(path.read_text() for path in MANIFESTS)
    named |= set(re.findall(r"\b(GRADSERVER_[A-Z_]+)\b", text))  # in comments too
    ours = {n for n in named if n.startswith("GRADSERVER_")}
    assert ours and ours <= known, sorted(ours - known)


@pytest.mark.parametrize(
    ("where", "container"),
    [(w, c) for w, c in _containers() if str(c["image"]).startswith("gradserver-")],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_each_gradserver_container_is_given_what_its_command_accepts(
    where: str, container: dict[str, Any]
) -> None:
    env = _environment(container)
    args = [
        _VARIABLE.sub(lambda m: "0" if m[1] == "JOB_COMPLETION_INDEX" else m[0], a) for a in container["args"]
    ]
    namespace = build_parser().parse_args(args)
    config_class = {"coordinator": CoordinatorConfig, "worker": WorkerConfig}[namespace.command]
    config = config_from_sources(config_class, namespace, env)
    if namespace.command == "coordinator":
        assert config.world_size > 1 and config.auth_token == "secret-value", where
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in container:
                health = build_parser().parse_args(container[probe]["exec"]["command"][1:])
                assert health.command == "health", where
    else:
        assert config.coordinator and config.auth_token == "secret-value", where


def test_the_workers_are_as_many_as_the_coordinator_waits_for() -> None:
    by_name = {(name, doc["kind"], doc["metadata"]["name"]): doc for name, doc in _documents()}
    workers = by_name[("workers.yaml", "Job", "gradserver-workers")]["spec"]
    coordinator = by_name[("coordinator.yaml", "Job", "gradserver-coordinator")]["spec"]["template"]["spec"]
    env = _environment(coordinator["containers"][0])
    assert workers["completions"] == workers["parallelism"] == int(env["GRADSERVER_WORLD_SIZE"])
    worker_env = _environment(workers["template"]["spec"]["containers"][0])
    assert worker_env["GRADSERVER_STEPS"] == env["GRADSERVER_MAX_STEPS"]
    assert worker_env["GRADSERVER_COORDINATOR"].split(":")[0] == "gradserver-coordinator"
