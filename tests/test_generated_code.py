"""The committed protobuf modules are exactly what proto/generate.py produces from the .proto."""

from __future__ import annotations

import subprocess
import sys

from .helpers.processes import ROOT


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, "proto/generate.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_installed_package_has_no_bare_top_level_modules() -> None:
    import gradserver.common
    import gradserver.server
    import gradserver.worker

    assert gradserver.server.GradientServer and gradserver.worker.WorkerClient
    for bare in ("common", "server", "worker", "train", "cli"):
        spec = __import__("importlib.util").util.find_spec(bare)
        assert spec is None or "site-packages" not in (spec.origin or ""), bare


def test_server_does_not_import_torch() -> None:
    code = (
        "import sys, gradserver.server, gradserver.cli as cli; cli.build_parser(); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False"
