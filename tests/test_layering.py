"""The layering of the packages, enforced: what each may import, and a coordinator without torch.

    cli -> server, worker, train;  train -> worker, common;  server -> common;  worker -> common
    torch_backend (gradserver.torch) -> worker, common

`common` imports nothing above it, `server` and `worker` never import each other or `train`, the
client library imports torch only inside functions, and the torch.distributed backend
`torch_backend/` imports torch freely but nothing of server or train; no other package but cli
imports it. Of common and server only the gRPC edge (GRPC_EDGE) imports grpc. The static part
reads every module's imports (AST, so nothing is executed); the dynamic part runs in a subprocess
where torch, matplotlib and tqdm cannot be imported, as in a `pip install gradserver` without the
`train` extra.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers.processes import ROOT

PACKAGES = ("common", "server", "worker", "train", "cli", "torch_backend")
TRAINING_MODULES = ("torch", "matplotlib", "tqdm")
# For each package folder, the gradserver packages (installed names) it must not import.
FORBIDDEN = {
    "common": {"server", "worker", "train", "cli", "torch"},
    "server": {"worker", "train", "cli", "torch"},
    "worker": {"server", "train", "cli", "torch"},
    "train": {"server", "cli", "torch"},
    "cli": set(),
    "torch_backend": {"server", "train", "cli"},
}


def _imports(tree: ast.AST) -> list[tuple[str, ast.stmt]]:
    """(absolute module name, statement) for every import; relative ones stay in their package."""
    found: list[tuple[str, ast.stmt]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend((f"{node.module}.{alias.name}", node) for alias in node.names)
    return found


def _module_level(tree: ast.Module) -> set[int]:
    """ids of the import statements that run at import time (TYPE_CHECKING blocks excluded)."""
    top: set[int] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            top.add(id(node))
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                pending.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            pending.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                pending.extend(handler.body)
    return top


def _violations(package: str) -> list[str]:
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if "_pb" in path.parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        top = _module_level(tree)
        where = path.relative_to(ROOT)
        for name, node in _imports(tree):
            parts = name.split(".")
            if parts[0] == "gradserver" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                problems.append(f"{where}:{node.lineno} imports {name}")
            if parts[0] in TRAINING_MODULES:
                if package in ("common", "server"):
                    problems.append(f"{where}:{node.lineno} imports {name}")
                elif package == "worker" and id(node) in top:
                    problems.append(f"{where}:{node.lineno} imports {name} at import time")
    return problems


@pytest.mark.parametrize("package", PACKAGES)
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    assert _violations(package) == []


def test_the_scan_sees_a_forbidden_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "worker").mkdir()
    (tmp_path / "common" / "bad.py").write_text("def f():\n    from gradserver.server import cli\n")
    (tmp_path / "worker" / "eager.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "import numpy\ntry:\n    import torch.nn\nexcept ImportError:\n    pass\n"
        "def lazy():\n    import torch\n"
        "def backend():\n    import gradserver.torch\n"
    )
    (tmp_path / "torch_backend").mkdir()
    (tmp_path / "torch_backend" / "app.py").write_text(
        "import torch\nfrom gradserver.worker import client\nfrom gradserver.train import model\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations("common") == ["common/bad.py:2 imports gradserver.server.cli"]
    assert _violations("worker") == [
        "worker/eager.py:6 imports torch.nn at import time",
        "worker/eager.py:12 imports gradserver.torch",
    ]
    assert _violations("torch_backend") == ["torch_backend/app.py:3 imports gradserver.train.model"]


# The gRPC edge: the only modules of common and server that may import grpc (the servicer and its
# streams, auth and binding, the peers' RPCs, the CLI's health probe, and the one conversion
# between `Status` and `grpc.StatusCode` in common/rpc.py). Everything else, the pure cores first
# among them, passes `gradserver.common.errors.Status` around.
GRPC_EDGE = {
    "common/rpc.py",
    "server/auth.py",
    "server/binding.py",
    "server/cli.py",
    "server/coordinator.py",
    "server/peers.py",
    "server/streams.py",
}
PURE_MODULES = (
    "common/errors.py",
    "common/collective_rules.py",
    "common/futex.py",
    "common/cores.py",
    "server/reduction.py",
    "server/step_ledger.py",
    "server/step_actions.py",
    "server/pending_keys.py",
    "server/slots.py",
    "server/barriers.py",
    "server/placement.py",
    "server/chunk_ownership.py",
    "server/inflight.py",
    "server/chunk_rules.py",
    "server/chunk_averages.py",
    "server/job.py",
    "server/outgoing.py",
    "server/outbox.py",
    "server/sample_ranges.py",
)


def _grpc_imports(packages: tuple[str, ...]) -> list[str]:
    """Every grpc import (any scope, TYPE_CHECKING included) of a module outside GRPC_EDGE."""
    problems = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if "_pb" in path.parts or where in GRPC_EDGE:
                continue
            for name, node in _imports(ast.parse(path.read_text(), str(path))):
                if name.partition(".")[0] in ("grpc", "grpc_health"):
                    problems.append(f"{where}:{node.lineno} imports {name}")
    return problems


def test_only_the_grpc_edge_of_common_and_server_imports_grpc() -> None:
    assert all((ROOT / module).is_file() and module not in GRPC_EDGE for module in PURE_MODULES)
    assert _grpc_imports(("common", "server")) == []


def test_the_grpc_scan_sees_an_import_outside_the_edge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "job.py").write_text("def f():\n    from grpc import StatusCode\n")
    (tmp_path / "server" / "streams.py").write_text("import grpc\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _grpc_imports(("server",)) == ["server/job.py:2 imports grpc.StatusCode"]


# The config layer: the only modules that read the process environment (each setting is a field
# of a config class: flag, variable, default, one meaning). Besides them, the process supervisor
# copies the environment into the children it starts and leaves OMP_NUM_THREADS to a caller that
# set it, the worker CLI reads OMP_NUM_THREADS (OpenMP's variable, not a gradserver setting)
# to size torch's thread pool, and the torch backend reads torch's MASTER_ADDR (where torch's
# env:// rendezvous points) to know where its embedded coordinator must be reachable, and
# train/slurm.py reads the SLURM_ variables srun sets for a step's task.
CONFIG_LAYER = {"common/config.py", "server/config.py", "torch_backend/_settings.py"}
READS_ONLY_OTHERS_VARIABLES = {
    "worker/supervisor.py",
    "train/cli.py",
    "torch_backend/_reach.py",
    "train/slurm.py",
}


def _environment_reads(packages: tuple[str, ...]) -> list[str]:
    """Every use of os.environ / os.getenv (or an import of either) outside the config layer."""
    problems = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            if "_pb" in path.parts or where in CONFIG_LAYER | READS_ONLY_OTHERS_VARIABLES:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr in ("environ", "environb", "getenv")
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "os"
                ):
                    problems.append(f"{where}:{node.lineno} reads os.{node.attr}")
                elif isinstance(node, ast.ImportFrom) and node.module == "os":
                    for alias in node.names:
                        if alias.name in ("environ", "environb", "getenv"):
                            problems.append(f"{where}:{node.lineno} imports os.{alias.name}")
    return problems


def test_only_the_config_layer_reads_the_environment() -> None:
    assert all((ROOT / module).is_file() for module in CONFIG_LAYER | READS_ONLY_OTHERS_VARIABLES)
    assert _environment_reads(PACKAGES) == []


def test_the_environment_scan_sees_a_read_outside_the_config_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "client.py").write_text(
        "import os\nfrom os import getenv\nMODE = os.environ.get('GRADSERVER_TRANSPORT')\n"
    )
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "config.py").write_text("import os\nENV = os.environ\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _environment_reads(("worker", "common")) == [
        "worker/client.py:2 imports os.getenv",
        "worker/client.py:3 reads os.environ",
    ]


# Installed first in every subprocess below: the training extra's modules cannot be imported.
BLOCKER = textwrap.dedent(
    """
    import sys

    class _BlockTrainingExtra:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("torch", "matplotlib", "tqdm"):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
            return None

    sys.meta_path.insert(0, _BlockTrainingExtra())
    """
)

COORDINATOR_AND_CLIENT = textwrap.dedent(
    """
    import asyncio, importlib, pkgutil, sys
    import gradserver.common, gradserver.server, gradserver.worker

    for package in (gradserver.common, gradserver.server, gradserver.worker):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)

    from gradserver.server import CoordinatorConfig, GradientServer
    from gradserver.worker import WorkerClient

    def join(address):
        with WorkerClient.connect(address, node_id="n0", device_type="cpu") as client:
            return client.total_workers

    async def main():
        server = GradientServer(CoordinatorConfig(bind="127.0.0.1:0", world_size=1))
        await server.start()
        try:
            workers = await asyncio.wait_for(asyncio.to_thread(join, server.address), 60)
        finally:
            await server.stop()
        print("joined", workers, "torch loaded:", "torch" in sys.modules)

    asyncio.run(main())
    """
)


def _run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_blocker_blocks_torch() -> None:
    result = _run_blocked("import torch")
    assert result.returncode != 0 and "blocked by the test" in result.stderr


def test_coordinator_and_client_library_run_without_the_training_extra() -> None:
    result = _run_blocked(COORDINATOR_AND_CLIENT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "joined 1 torch loaded: False"


def test_coordinator_help_runs_without_the_training_extra() -> None:
    result = _run_blocked("from gradserver.cli import main; sys.exit(main(['coordinator', '--help']))")
    assert result.returncode == 0, result.stderr
    assert "--world-size" in result.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--job", "train", "--coordinator", "127.0.0.1:1"],
        ["launch", "--workers", "2", "--steps", "1"],
    ],
)
def test_a_command_needing_the_training_extra_exits_2_with_one_line(argv: list[str]) -> None:
    result = _run_blocked(f"from gradserver.cli import main; sys.exit(main({argv!r}))")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"gradserver {argv[0]} needs the training extra")
    assert "pip install 'gradserver[train]'" in lines[0]
