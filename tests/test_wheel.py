"""The package as a user installs it, not the editable development install: the wheel built from
the repository's files holds every file the code reads at run time, and, installed by the
Dockerfile's install script into a fresh virtual environment, trains from a directory outside the
source tree."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers.processes import ROOT

# Each package folder and the name it is installed as, gradserver.<name>.
PACKAGES = {
    "common": "common",
    "server": "server",
    "worker": "worker",
    "train": "train",
    "cli": "cli",
    "torch_backend": "torch",
}
INSTALL_SCRIPT = ROOT / ".ci" / "install-runtime.sh"
CHECK_TORCH = ROOT / ".ci" / "check-torch.sh"

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]


def _repository_files() -> list[str]:
    """What a commit of the working tree holds: tracked files plus new ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return sorted({name for name in out.split("\0") if name and (ROOT / name).is_file()})


def _package_files() -> list[str]:
    return [name for name in _repository_files() if name.split("/", 1)[0] in PACKAGES]


def _installed(name: str) -> str:
    """Where a file of a package folder is in the wheel."""
    folder, rest = name.split("/", 1)
    return f"gradserver/{PACKAGES[folder]}/{rest}"


def _clean_env(bin_dir: Path | None = None) -> dict[str, str]:
    """The caller's environment (pip's configuration included) without anything that could put
    the source tree or the development environment on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = (f"{bin_dir}:" if bin_dir else "") + "/usr/local/bin:/usr/bin:/bin"
    return env


@dataclass
class Installed:
    wheel: Path
    python: Path
    bin_dir: Path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel . --no-deps` of a copy of the repository's files, so that nothing generated or
    untracked in this checkout can end up in the wheel."""
    src = tmp_path_factory.mktemp("src")
    for name in _repository_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (built,) = dist.glob("gradserver-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh virtual environment (no system site-packages, so the editable install is out of
    sight) with CPU torch and the wheel, installed by the Dockerfile's install script."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    result = subprocess.run(
        ["sh", str(INSTALL_SCRIPT), str(ROOT), str(wheel)],
        env={**_clean_env(), "PYTHON": str(python), "TORCH_VARIANT": "cpu"},
        cwd=env_dir,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "torch 2.13.0+cpu is the cpu build" in result.stdout
    return Installed(wheel=wheel, python=python, bin_dir=env_dir / "bin")


def _strings_in(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def _names_a_data_file(package: Path, text: str) -> bool:
    if not text or len(text) > 200 or any(c in text for c in "\0\n ") or text.endswith(".py"):
        return False
    if text.startswith("/"):  # an absolute path (e.g. /proc/...) names no file of the package
        return False
    return (package / text).is_file()


def test_wheel_ships_every_file_of_the_packages(wheel: Path) -> None:
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {_installed(name) for name in _package_files()}
    assert "gradserver/torch/backend.py" in expected
    assert {name for name in expected if name.endswith("/kjv.txt.gz")}, "the corpus is tracked"
    missing = sorted(expected - shipped)
    assert not missing, f"files of the packages missing from {wheel.name}: {missing}"
    # Every path the code names as a string (resources.files(...).joinpath("data/..."), open(...))
    # that is a file of its package: the scan must find the corpus, or it proves nothing.
    opened = set()
    for name in _package_files():
        if name.endswith(".py"):
            package = ROOT / name.split("/", 1)[0]
            opened |= {
                f"gradserver/{PACKAGES[package.name]}/{s}"
                for s in _strings_in(ROOT / name)
                if _names_a_data_file(package, s)
            }
    assert "gradserver/train/data/kjv.txt.gz" in opened
    assert opened <= shipped, f"data files the code opens, missing from the wheel: {opened - shipped}"


def test_install_script_gives_cpu_torch_and_no_bare_modules(installed: Installed, tmp_path: Path) -> None:
    check = (
        "import importlib.util, sys, torch, gradserver.worker; "
        "print(torch.__version__); print(gradserver.worker.__file__); "
        "print([m for m in ('common', 'server', 'worker', 'torch_backend') if importlib.util.find_spec(m)]); "
        # The entry point registered the backend at `import torch`, from the installed package.
        "import torch.distributed as dist; print('gradserver' in dist.Backend.backend_list, "
        "sys.modules['gradserver.torch'].__file__)"
    )
    out = subprocess.run(
        [str(installed.python), "-c", check],
        env=_clean_env(installed.bin_dir),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    version, location, bare, registered = out.stdout.splitlines()
    assert version == "2.13.0+cpu"
    assert Path(location).is_relative_to(installed.python.parent.parent), location
    backend, backend_location = registered.split(" ", 1)
    assert backend == "True" and backend_location.endswith("gradserver/torch/__init__.py")
    assert Path(backend_location).is_relative_to(installed.python.parent.parent), backend_location
    assert bare == "[]", "the source folders must not be importable as top-level modules"
    cli = subprocess.run(
        [str(installed.bin_dir / "gradserver"), "health", "--help"],
        env=_clean_env(installed.bin_dir),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "HOST:PORT" in cli.stdout


def _succeeds(
    installed: Installed, cwd: Path, argv: list[str], *, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Runs `argv` with the installed environment's PATH in `cwd` (outside the source tree) and
    asserts it exits 0, showing the end of its output if not."""
    result = subprocess.run(
        argv,
        env=_clean_env(installed.bin_dir),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_installed_wheel_trains_outside_the_source_tree(installed: Installed, tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = [str(installed.bin_dir / "gradserver"), "launch", "--workers", "2", "--steps", "2"]
    argv += ["--out", str(out), "--no-progress", "--timeout", "300"]
    _succeeds(installed, tmp_path, argv, timeout=420)
    assert (out / "metrics.jsonl").read_text().count("\n") == 4  # 2 steps x 2 workers
    assert (out / "checkpoint-local-0.pt").is_file() and (out / "checkpoint-local-1.pt").is_file()


@pytest.mark.parametrize(("variant", "passes"), [("cpu", True), ("cu128", False)])
def test_torch_build_check_refuses_another_build(variant: str, passes: bool) -> None:
    """The check the image build runs after installing torch, against this environment's torch
    (the CPU build): asking for a CUDA build must fail and say what is installed instead."""
    result = subprocess.run(
        ["sh", str(CHECK_TORCH), variant],
        env={**_clean_env(), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode == 0) is passes, result.stdout + result.stderr
    if not passes:
        assert "torch 2.13.0+cpu is installed, but the cu128 build" in result.stderr


P2P_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gradserver")
rank, world = dist.get_rank(), dist.get_world_size()
out, back = torch.arange(5000.0) + rank, torch.empty(5000)
ops = [dist.P2POp(dist.isend, out, (rank + 1) % world), dist.P2POp(dist.irecv, back, (rank - 1) % world)]
for work in dist.batch_isend_irecv(ops):
    work.wait()
assert torch.equal(back, torch.arange(5000.0) + (rank - 1) % world), back[:3]
print("P2P OK", rank, flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def test_installed_wheel_sends_and_receives_between_ranks(installed: Installed, tmp_path: Path) -> None:
    """Point-to-point (shared memory between the ranks of one host) from the installed package."""
    script = tmp_path / "p2p.py"
    script.write_text(P2P_SCRIPT)
    argv = [str(installed.bin_dir / "gradserver"), "run", "--workers", "2", "--run-timeout", "240"]
    result = _succeeds(installed, tmp_path, [*argv, "--", str(installed.python), str(script)], timeout=300)
    assert result.stdout.count("P2P OK") == 2, result.stdout[-4000:]


def test_installed_wheel_runs_the_live_recovery_example(installed: Installed, tmp_path: Path) -> None:
    """examples/live_recovery.py's calls (offer_state, updating_state, check_state) from the
    installed package: two workers under `gradserver run`, outside the source tree, end with one
    state digest."""
    script = tmp_path / "live_recovery.py"
    script.write_text((ROOT / "examples" / "live_recovery.py").read_text())
    argv = [str(installed.bin_dir / "gradserver"), "run", "--workers", "2", "--run-timeout", "240"]
    command = [*argv, "--", str(installed.python), str(script), "--steps", "60"]
    result = _succeeds(installed, tmp_path, command, timeout=300)
    digests = re.findall(r"60 steps, loss \S+, digest (0x[0-9a-f]+)", result.stdout)
    assert len(digests) == 2 and digests[0] == digests[1], result.stdout[-4000:]
