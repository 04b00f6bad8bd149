#!/bin/sh
# Installs gradserver (not editable) and its pinned runtime dependencies into $PYTHON's
# environment: torch first, from $TORCH_INDEX_URL when set (the Dockerfile sets the CPU or a CUDA
# index), then the project, everything under constraints.txt.
# One script for two callers: the Dockerfile's build stage, and tests/test_deploy.py, which runs
# it in a fresh virtual environment so a broken install step fails in CI, not in a user's build.
set -eu
PYTHON=${PYTHON:-python3}
SRC=${1:-.}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
if [ -n "$TORCH_INDEX_URL" ]; then
    "$PYTHON" -m pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" -c "$SRC/constraints.txt" torch
else
    "$PYTHON" -m pip install --no-cache-dir -c "$SRC/constraints.txt" torch
fi
"$PYTHON" -m pip install --no-cache-dir -c "$SRC/constraints.txt" "$SRC"
