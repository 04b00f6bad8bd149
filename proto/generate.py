"""Regenerates the committed protobuf modules in common/_pb from proto/gradserver/v1.

Run `python proto/generate.py` after editing the .proto (needs grpcio-tools); `--check` regenerates
into a temporary folder and exits 1 if the committed files differ. Only message modules and their
.pyi stubs are generated: the service is bound by method name in gradserver.common.rpc, so no
generated import path ties the package layout to the proto path.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = PROTO_ROOT / "gradserver" / "v1" / "gradient_server.proto"
TARGET = ROOT / "common" / "_pb"
OUTPUTS = ("gradient_server_pb2.py", "gradient_server_pb2.pyi")


def generate(into: Path) -> None:
    """Runs protoc (from grpcio-tools) and copies the two outputs into `into`."""
    from grpc_tools import protoc  # dev dependency, imported only when generating

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            str(PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO_FILE}")
        into.mkdir(parents=True, exist_ok=True)
        for name in OUTPUTS:
            shutil.copyfile(Path(tmp) / "gradserver" / "v1" / name, into / name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    options = parser.parse_args()
    if not options.check:
        generate(TARGET)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [n for n in OUTPUTS if not filecmp.cmp(Path(tmp) / n, TARGET / n, shallow=False)]
    if stale:
        print(f"stale generated code: {', '.join(stale)}; run: python proto/generate.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
