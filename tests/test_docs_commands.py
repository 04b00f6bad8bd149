"""The commands a new user copies run as written: every `sh` and `bash` block of
docs/getting-started.md, of the README's quickstarts and of docs/torch.md, in order, as one shell
session per page, from a copy of the repository's root (links to its files, so `make venv` finds
the same `.venv`) with the environment of a fresh shell. A renamed flag or a moved example fails
here, not for a user.

The README's first block is the project's two entry points: `make test` is what runs this test,
and `make demo` is the launch of the quickstart with the small model for 150 steps; both are left
to CI and the demo."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from .helpers.processes import ROOT

pytestmark = pytest.mark.processes

_BLOCK = re.compile(r"^```(?:sh|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_ENTRY_POINTS = ("make demo", "make test")


def _left_out(line: str) -> bool:
    """The project's two entry points, and Ray Train's example where Ray is not installed (it is
    not in the `frameworks` extra; tests/test_torch_frameworks.py runs it where it is)."""
    if line.startswith(_ENTRY_POINTS):
        return True
    return "examples/ray_train.py" in line and importlib.util.find_spec("ray") is None


def command_blocks(page: Path) -> list[str]:
    """The page's shell blocks, without what `_left_out` names."""
    blocks = []
    for block in _BLOCK.findall(page.read_text()):
        lines = [line for line in block.splitlines() if not _left_out(line)]
        if any(line.strip() for line in lines):
            blocks.append("\n".join(lines))
    return blocks


def _fresh_shell_environment() -> dict[str, str]:
    """What a new user's shell has: none of the suite's GRADSERVER_ settings or its venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADSERVER_", "VIRTUAL_ENV"))}
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


def _run_page(page: Path, tmp_path: Path, after_install: bool = False) -> tuple[Path, str]:
    """`after_install`: in the shell Getting started left, its `.venv` activated."""
    up_to_date = subprocess.run(["make", "-q", "venv"], cwd=ROOT, capture_output=True, check=False)
    assert up_to_date.returncode == 0, "the .venv is out of date: run `make venv` first"
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git"):
            (checkout / entry.name).symlink_to(entry)
    blocks = command_blocks(page)
    prelude = ". .venv/bin/activate\n" if after_install else ""
    script = "set -euo pipefail\n" + prelude + "\n".join(blocks)
    result = subprocess.run(
        ["bash", "-c", script],
        cwd=checkout,
        env=_fresh_shell_environment(),
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert result.returncode == 0, (
        f"{page.name}:\n{script}\n--- output\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
    )
    return checkout, result.stdout + result.stderr


def _trained(run: Path, workers: int) -> None:
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {entry["worker_id"] for entry in steps} == set(range(workers)), run
    assert len(list(run.glob("checkpoint-*.pt"))) == workers, run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", ["docs/getting-started.md", "README.md"])
def test_every_command_a_quickstart_shows_runs_as_written(page: str, tmp_path: Path) -> None:
    checkout, output = _run_page(ROOT / page, tmp_path)
    assert "run: all 2 ranks finished" in output
    _trained(checkout / "runs" / "first", 2)
    _trained(checkout / "runs" / "tolerant", 3)


@pytest.mark.timeout(600)
def test_every_command_of_the_torch_page_runs_as_written(tmp_path: Path) -> None:
    """Each example under torchrun or run, as the page shows it: every one prints a RESULT line
    per rank (examples/_result.py), examples/ddp_cnn.py also its samples per second."""
    _, output = _run_page(ROOT / "docs" / "torch.md", tmp_path, after_install=True)
    commands = [line for block in command_blocks(ROOT / "docs" / "torch.md") for line in block.splitlines()]
    commands = [c for c in commands if c.strip()]
    frameworks = [c for c in commands if "ddp_cnn.py" not in c]
    ranks = sum(4 if "--nproc-per-node 4" in c else 2 for c in commands)
    assert len(frameworks) >= 6 and output.count("RESULT ") == ranks, output[-3000:]
    runs_of_ddp_cnn = sum("ddp_cnn.py" in c for c in commands)
    assert output.count("backend gradserver world 2:") == runs_of_ddp_cnn >= 2, output[-3000:]


def test_the_blocks_are_found_and_the_entry_points_left_out() -> None:
    readme = command_blocks(ROOT / "README.md")
    assert not any(line.startswith(_ENTRY_POINTS) for block in readme for line in block.splitlines())
    assert any("gradserver run --workers 2" in block for block in readme)
    guide = command_blocks(ROOT / "docs" / "getting-started.md")
    assert len(guide) >= 4 and any(block.startswith("make venv") for block in guide), guide
