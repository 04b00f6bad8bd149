#!/bin/sh
# Installs gradserver (not editable) and its pinned runtime dependencies into $PYTHON's
# environment, everything under SRC/constraints.txt:
#   install-runtime.sh SRC [PROJECT]     PROJECT: a wheel or a source folder (default SRC)
# Torch comes first, from the first of these that is set:
#   TORCH_WHEEL_DIR   a folder holding exactly one torch wheel (the container check puts this
#                     machine's CPU wheel there, since no torch index is reachable from it)
#   TORCH_INDEX_URL   a torch index (the Dockerfile passes the CPU or a CUDA index)
#   neither           pip's configured indexes
# TORCH_VARIANT (cpu, cu128, ...): fail unless the installed torch is that build, so that a pip
# that chose another torch (gigabytes of CUDA packages) stops the build instead of passing;
# with EXTRAS= (no torch), TORCH_VARIANT=none fails if a dependency pulled torch in anyway.
# One script for two callers: the Dockerfile's build stage, and tests/test_wheel.py, which runs
# it in a fresh virtual environment so a broken install step fails in CI, not in a user's build.
set -eu
PYTHON=${PYTHON:-python3}
SRC=${1:-.}
PROJECT=${2:-$SRC}
TORCH_WHEEL_DIR=${TORCH_WHEEL_DIR:-}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
TORCH_VARIANT=${TORCH_VARIANT:-}
# The training extra (torch, tqdm, matplotlib); EXTRAS= installs the coordinator and client only.
EXTRAS=${EXTRAS-train}
CONSTRAINTS="$SRC/constraints.txt"
pip_install() {
    "$PYTHON" -m pip install --no-cache-dir -c "$CONSTRAINTS" "$@"
}
check_torch() {
    if [ -n "$TORCH_VARIANT" ]; then
        PYTHON="$PYTHON" sh "$(dirname "$0")/check-torch.sh" "$TORCH_VARIANT"
    fi
}
if [ -z "$EXTRAS" ]; then
    pip_install "$PROJECT"
    check_torch
    exit 0
fi
if [ -n "$TORCH_WHEEL_DIR" ]; then
    set -- "$TORCH_WHEEL_DIR"/torch-*.whl
    if [ ! -f "$1" ] || [ $# -ne 1 ]; then
        echo "install-runtime: TORCH_WHEEL_DIR=$TORCH_WHEEL_DIR must hold exactly one torch-*.whl" >&2
        exit 1
    fi
    pip_install "$1"
elif [ -n "$TORCH_INDEX_URL" ]; then
    pip_install --index-url "$TORCH_INDEX_URL" torch
else
    pip_install torch
fi
pip_install "$PROJECT[$EXTRAS]"
check_torch
