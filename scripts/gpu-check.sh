#!/usr/bin/env bash
# The CUDA checks, in one run of at most 8 minutes on a GPU machine that has no network.
#
#   scripts/gpu-check.sh wheels   # here, with network: downloads into .whl/ the wheels the GPU
#                                 # machine's Python 3.12 lacks (our pins of grpcio, protobuf,
#                                 # pytest and plugins); .whl/ is carried with the working tree
#   scripts/gpu-check.sh          # there: installs them and gradserver (from this tree) under
#                                 # /tmp/site, then runs, each under its own time limit:
#     tests    the CUDA tests (tests/test_cuda.py, the CUDA/NCCL tests of the other files, the quantizer,
#              DiLoCo's int8 sum on the coordinator with a CUDA model)
#     torch-collectives, torch-fsdp2, torch-sharded, torch-ddp
#              bench.torch_cuda under torchrun, 2 ranks sharing the GPU (issue 52): every
#              collective of the "gradserver" backend exact on CUDA tensors, and the group's
#              cuda registration; FSDP2 against gloo; DTensor redistribution, HSDP on 2-D meshes
#              and DCP save/load of a CUDA FSDP2 model; DDP on a 27M-parameter encoder, step
#              time against gloo's and the profiler's device<->host copies (pinned or pageable)
#     launch   gradserver launch --workers 2 --device cuda (accumulation and clipping on), and
#              a check that both workers' weights are bit-identical
#     sync     bench.gpu --part sync: tokens/s, device-side accumulation vs a sync per block
#     pair     bench.gpu --part pair: 2 workers on the GPU, coordinator vs gloo
#     copies   bench.gpu --part copies: host<->device copy time per step vs kernel time
#   and writes $OUT/gpu-check.log, $OUT/tests.xml, $OUT/bench.jsonl and $OUT/summary.json.
#
# Without a GPU every part runs and the CUDA ones fail or skip saying so (exit 1), which is how
# the script is tried before a GPU machine is spent on it. A part is skipped when less time is
# left than it may take, so the whole stays within BUDGET seconds (default 450). ONLY="tests
# launch" runs those parts alone; SITE is where the install goes (default /tmp/gradserver-site).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = wheels ]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo /.whl/ >>.git/info/exclude; }
    platform="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform any"
    pins=$(grep -E '^(grpcio|grpcio-health-checking|protobuf|pytest|pytest-asyncio|pytest-timeout|prometheus-client)==' constraints.txt)
    # shellcheck disable=SC2086
    exec $PY -m pip download -q --no-deps $platform -d .whl $pins pluggy==1.7.0 iniconfig==2.3.1
fi

OUT=${OUT:-$(mktemp -d)}
BUDGET=${BUDGET:-450}
LOG=$OUT/gpu-check.log
PARTS=$OUT/.parts
: >"$LOG"
: >"$PARTS"
: >"$OUT/bench.jsonl"
started=$SECONDS

# part NAME LIMIT COMMAND...: runs COMMAND under LIMIT seconds unless less than that is left.
part() {
    local name=$1 limit=$2 t0 rc
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    if [ $((started + BUDGET - SECONDS)) -lt "$limit" ]; then
        echo "== $name: skipped, less than ${limit}s left" | tee -a "$LOG"
        printf '%s\tskipped\t0\n' "$name" >>"$PARTS"
        return
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$LOG"
    t0=$SECONDS
    # A function of this script runs in a child bash (timeout runs programs, not functions).
    if declare -F "$1" >/dev/null; then
        timeout -k 10 "$limit" bash -c '"$@"' part "$@" >>"$LOG" 2>&1
    else
        timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    fi
    rc=$?
    echo "== $name: exit $rc in $((SECONDS - t0))s" | tee -a "$LOG"
    printf '%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t0)) >>"$PARTS"
}

install() {
    local wheels=() site=${SITE:-/tmp/gradserver-site}
    rm -rf "$site"
    shopt -s nullglob
    wheels=(.whl/*.whl)
    # The wheels are for the GPU machine's Python 3.12; another Python (a trial run here) is
    # expected to have the project's dependencies already.
    if [ ${#wheels[@]} -gt 0 ] && [ "$($PY -c 'import sys; print(sys.version_info[:2] == (3, 12))')" = True ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" || return 1
    fi
    # From this tree, with the machine's own torch: no index, no dependencies, no isolation.
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . || return 1
    echo "$site"
}

site=$(install 2>>"$LOG" | tail -1)
if [ -z "$site" ]; then
    echo "install failed: see $LOG" | tee -a "$LOG"
    exit 1
fi
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu: a trial of the launch and bench plumbing without a GPU
export PY OUT DEVICE PYTHONPATH=$site PYTHONUNBUFFERED=1 PATH=$site/bin:$PATH

part info 30 bash -c "nvidia-smi -L; $PY -c 'import torch, grpc, google.protobuf as pb; \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"-\"); print(\"grpc\", grpc.__version__, \"protobuf\", pb.__version__)'"

part tests 150 $PY -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" -rA \
    tests/test_cuda.py tests/test_gradients.py tests/test_training_torch_distributed.py \
    tests/test_torch_backend.py tests/test_quantize.py tests/test_torch_diloco_devices.py -k "cuda or nccl"

# The torch backend on CUDA tensors (issue 52): two ranks under torchrun sharing the GPU; rank 0
# prints the JSON lines.
torch_check() {
    $PY -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.torch_cuda --device "$DEVICE" "$@" |
        tee -a "$OUT/bench.jsonl"
    return "${PIPESTATUS[0]}"
}
export -f torch_check
part torch-collectives 90 torch_check --part collectives
part torch-fsdp2 90 torch_check --part fsdp2
part torch-sharded 60 torch_check --part sharded
part torch-ddp 150 torch_check --part ddp

launch_check() {
    local dir
    dir=$(mktemp -d)
    $PY -m gradserver.cli launch --workers 2 --model tiny --steps 30 --batch-size 8 --out "$dir" \
        --no-progress -- --accumulation-steps 2 --max-grad-norm 0.5 --device "$DEVICE" || return 1
    $PY - "$dir" <<'EOF'
import sys
from pathlib import Path

import torch

from gradserver.train.checkpoint import load_checkpoint

paths = sorted(Path(sys.argv[1]).glob("checkpoint-*.pt"))
states = [load_checkpoint(p) for p in paths]
assert len(states) == 2, paths
differ = [n for n, t in states[0].model_state.items() if not torch.equal(t, states[1].model_state[n])]
assert not differ, f"weights differ between the workers: {differ}"
print(f"launch: {len(states[0].model_state)} tensors bit-identical on both workers at step {states[0].step}")
EOF
}
export -f launch_check
part launch 90 launch_check

bench() {
    $PY -m bench.gpu --device "$DEVICE" "$@" | tee -a "$OUT/bench.jsonl"
    return "${PIPESTATUS[0]}"
}
export -f bench
# The per-block sync costs most where each block's work is short against the host's launches:
# a large micro-batch, then a small one, of the same 350M-parameter model.
part sync 100 bench --part sync --model 350m --batch-size 4 --seq-len 512 --accumulation-steps 4 --steps 3
part sync-small 80 bench --part sync --model 350m --batch-size 1 --seq-len 128 --accumulation-steps 8 --steps 3
part pair 110 bench --part pair --model wide --accumulation-steps 2 --steps 6
part pair-350m 150 bench --part pair --model 350m --batch-size 4 --seq-len 512 --accumulation-steps 2 --steps 4
part copies 50 bench --part copies --model wide --accumulation-steps 2
part copies-350m 60 bench --part copies --model 350m --batch-size 4 --seq-len 512 --accumulation-steps 2

$PY - "$OUT" <<'EOF'
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
parts = {}
for line in (out / ".parts").read_text().splitlines():
    name, rc, seconds = line.split("\t")
    parts[name] = {"exit": rc, "seconds": int(seconds)}
tests = {}
if (out / "tests.xml").exists():
    root = ET.parse(out / "tests.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    tests["passed"] = tests["tests"] - tests["failures"] - tests["errors"] - tests["skipped"]
    tests["cases"] = {
        f"{case.get('classname')}::{case.get('name')}": (
            "failed" if case.find("failure") is not None or case.find("error") is not None
            else "skipped" if case.find("skipped") is not None else "passed"
        )
        for case in suite.iter("testcase")
    }
bench = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines() if line.startswith("{")]
summary = {"parts": parts, "tests": tests, "bench": bench}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({"parts": parts, "tests": {k: v for k, v in tests.items() if k != "cases"}}))
for entry in bench:
    print(json.dumps(entry))
# The checks' own one-line verdicts, last: what to read first.
for entry in bench:
    if "summary" in entry:
        verdict = "" if "ok" not in entry else "ok: " if entry["ok"] else "FAILED: "
        print(f"{entry['part']}: {verdict}{entry['summary']}")
sys.exit(0 if all(p["exit"] == "0" for p in parts.values()) else 1)
EOF
status=$?
rm -f "$PARTS"
echo "total ${SECONDS}s, exit $status"
exit $status
