"""scripts/gpu-check.sh and bench/gpu.py work without a GPU as far as a GPU is not needed: the
install from the tree, the launch check (its flags are the CLI's), the CUDA tests skipping with
their reason, and each benchmark's plumbing on the CPU. So a renamed flag or a broken part fails
here, not in the few minutes of a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .helpers.processes import ROOT

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU trial; on a GPU the script itself runs"),
]


def _run_parts(tmp_path: Path, parts: str) -> tuple[str, dict[str, Any], str]:
    """scripts/gpu-check.sh with ONLY=`parts` on the host, as a GPU machine runs it; its log,
    summary and output, after checking that it exited 0."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(
        os.environ,
        OUT=str(out),
        SITE=str(tmp_path / "site"),
        ONLY=parts,
        DEVICE="cpu",
        PYTHON=sys.executable,
    )
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        check=False,
    )
    log = (out / "gpu-check.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert result.returncode == 0, result.stdout + log[-3000:]
    return log, summary, result.stdout


@pytest.mark.timeout(300)
def test_the_gpu_check_installs_checks_a_launch_and_skips_the_cuda_tests(tmp_path: Path) -> None:
    log, summary, _ = _run_parts(tmp_path, "tests launch")
    assert {name: part["exit"] for name, part in summary["parts"].items()} == {"tests": "0", "launch": "0"}
    assert "tensors bit-identical on both workers at step 29" in log
    tests = summary["tests"]
    assert tests["tests"] == tests["skipped"] >= 6, tests
    assert "tests/test_cuda.py::test_a_step_synchronises_per_step_not_per_block_or_micro_batch" in {
        name.replace(".", "/", 1).replace("::", ".py::", 1) for name in tests["cases"]
    }


@pytest.mark.timeout(300)
def test_the_torch_backend_parts_run_their_checks_on_the_cpu(tmp_path: Path) -> None:
    """bench.torch_cuda under torchrun, as the script runs it, on the host: every collective
    exact, FSDP2 equal to gloo, DTensor, HSDP and DCP checked, DDP's three variants timed and
    compared."""
    _, summary, output = _run_parts(tmp_path, "torch-collectives torch-fsdp2 torch-sharded torch-ddp")
    parts = {name: part["exit"] for name, part in summary["parts"].items()}
    assert parts == {"torch-collectives": "0", "torch-fsdp2": "0", "torch-sharded": "0", "torch-ddp": "0"}, (
        parts
    )
    entries = summary["bench"]
    assert {(e["part"], e.get("variant")) for e in entries} == {
        ("torch-collectives", None),
        ("torch-fsdp2", "gradserver"),
        ("torch-fsdp2", None),
        ("torch-sharded", None),
        ("torch-ddp", "gloo"),
        ("torch-ddp", "gradserver"),
        ("torch-ddp", "alone"),
        ("torch-ddp", "compare"),
    }, entries
    assert all(e["ok"] for e in entries if "ok" in e), entries
    collectives = next(e for e in entries if e["part"] == "torch-collectives")
    assert not collectives["failed"] and len(collectives["passed"]) >= 30, collectives
    assert "_get_backend(cuda) is the group" in collectives["passed"]
    sharded = next(e for e in entries if e["part"] == "torch-sharded")
    assert not sharded["failed"] and len(sharded["passed"]) == 9, sharded
    # The verdicts close the output, one line each.
    assert "torch-fsdp2: ok: 3 AdamW steps: losses equal to gloo's (gloo on cpu)" in output
    assert "torch-ddp: ok: gradserver " in output


@pytest.mark.timeout(180)
@pytest.mark.parametrize("part", ["sync", "copies"])
def test_each_gpu_benchmark_runs_its_plumbing_on_the_cpu(part: str) -> None:
    argv = [sys.executable, "-m", "bench.gpu", "--part", part, "--device", "cpu", "--model", "tiny"]
    argv += ["--steps", "1", "--rounds", "1", "--warmup", "1", "--accumulation-steps", "2"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=170, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines and all(line["part"] == part and line["device"] == "cpu" for line in lines), lines
    if part == "sync":
        assert [line["variant"] for line in lines] == ["device", "sync_per_block", "pageable_inputs"]
        assert all(line["tokens_per_s"] > 0 for line in lines)


def test_the_gpu_benchmark_refuses_a_missing_gpu_naming_it() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--part", "sync"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 2
    assert "bench.gpu --part sync: needs a CUDA device" in result.stdout
