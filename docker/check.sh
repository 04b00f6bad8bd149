#!/usr/bin/env bash
# The container check (`make docker-check`, run by .ci/run after `make test`): both images build
# and the compose job trains under a real Docker engine, and a killed worker ends the job.
#
#   1. engine:  installs Debian's docker.io and docker-compose when missing (root and apt needed),
#               starts dockerd when none answers (and stops it at the end)
#   2. base:    BASE_IMAGE if given; otherwise a Debian bookworm image made with debootstrap
#               (python3, venv, pip, ca-certificates, this machine's CA bundle and pip index
#               settings), because no registry image can be pulled here. The root file system
#               is cached as a tarball in $GRADSERVER_CHECK_CACHE (empty: no cache).
#   3. build-coordinator: the Dockerfile's `coordinator` target (no wheel in the context yet);
#               asserts `import torch` fails in it and neither torch, matplotlib, tqdm nor a CUDA
#               package is installed, and that its user is not root
#   4. build-worker: the `worker` target, with this machine's CPU torch wheel (TORCH_WHEEL, or
#               `pip download torch==X+cpu`) copied into docker/wheels; the build itself fails
#               unless torch is the +cpu build, and the check asserts torch is X+cpu with no CUDA
#               package, and that its user is not root
#   5. job:     docker/run-job.sh (the README's command) with 2 workers for a few steps; asserts
#               every container exited 0 and ran from its service's image as non-root, the
#               coordinator's health check passed, a /metrics scrape has
#               gradserver_steps_completed_total, metrics.jsonl and checkpoints are in the runs volume
#   6. kill:    the same job with many steps; one worker container is killed mid-run; asserts the
#               job ends non-zero within the heartbeat timeout plus a margin, the coordinator logs
#               the killed container's worker as gone, and the surviving worker names it
#   7. hang:    the same with a frozen (docker pause) worker container, which only the heartbeat
#               timeout detects: the coordinator logs it as lost, and the job ends non-zero
# It prints both images' sizes (and the base's it made) and the time of each phase, and removes what it made (containers,
# networks, volumes, images, the wheel copy, the daemon it started) on every exit.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

RUN_ID=gradcheck$$
COORDINATOR_IMAGE=gradserver-check-coordinator:$$
WORKER_IMAGE=gradserver-check-worker:$$
BASE_TAG=gradserver-check-base:$$
HEARTBEAT_TIMEOUT=5
END_MARGIN=${GRADSERVER_CHECK_END_MARGIN:-45} # slack for a slow machine in every time limit below
RUN_JOB_MARGIN=20                              # run-job.sh's GRADSERVER_END_MARGIN
CACHE=${GRADSERVER_CHECK_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/gradserver-docker-check}
MIRROR=${DEBIAN_MIRROR:-}
WORK=$(mktemp -d /tmp/gradserver-docker-check.XXXXXX)
WHEEL_DIR=docker/wheels

started_dockerd=""
job_pid=""
base_id=""
compose=()
made_images=()
projects=()
phase_names=()
phase_times=()
image_sizes=()

say() { echo "docker-check: $*" >&2; }
fail() {
    say "FAILED: $*"
    exit 1
}

phase_start=0
begin() {
    phase_start=$SECONDS
    say "== $1"
    phase_names+=("$1")
}
end() { phase_times+=($((SECONDS - phase_start))); }

report() {
    say "-- phase times (s):"
    local i
    for i in "${!phase_names[@]}"; do
        if [ "$i" -lt "${#phase_times[@]}" ]; then
            printf 'docker-check:    %-18s %4d\n' "${phase_names[$i]}" "${phase_times[$i]}" >&2
        else
            printf 'docker-check:    %-18s %4d (did not finish)\n' "${phase_names[$i]}" $((SECONDS - phase_start)) >&2
        fi
    done
    printf 'docker-check:    %-18s %4d (cleanup included)\n' total "$SECONDS" >&2
    local size
    for size in "${image_sizes[@]}"; do say "-- image size: $size"; done
}

# Leaves first: every image built on this run's base image (the classic builder keeps the build
# stage and, after a failed build, every step's layer as untagged images), then the tagged ones.
remove_images() {
    local id left=0 made=()
    [ -z "$base_id" ] || mapfile -t made < <(docker image ls -aq --no-trunc | sort -u |
        xargs -r docker image inspect -f '{{.Id}} {{.Parent}} {{.Created}}' | python3 -c '
import sys
rows = [line.split() for line in sys.stdin if line.strip()]
parent = {r[0]: (r[1] if len(r) == 3 else "") for r in rows}
created = {r[0]: r[-1] for r in rows}
def built_on(i, base, seen=0):
    while i and seen < 1000:
        if i == base:
            return True
        i, seen = parent.get(i, ""), seen + 1
    return False
ours = [i for i in parent if i != sys.argv[1] and built_on(i, sys.argv[1])]
print("\n".join(sorted(ours, key=created.get, reverse=True)))
' "$base_id")
    for id in "${made[@]}" "${made_images[@]}"; do
        docker image inspect "$id" >/dev/null 2>&1 || continue
        timeout 300 docker rmi -f "$id" >>"$WORK/rmi.log" 2>&1
    done
    for id in "${made_images[@]}" "${made[@]}"; do
        if docker image inspect "$id" >/dev/null 2>&1; then
            say "could not remove image $id: $(tail -2 "$WORK/rmi.log" 2>/dev/null)"
            left=1
        fi
    done
    return $left
}

cleanup() {
    local code=$?
    set +e
    trap - EXIT INT TERM
    say "== cleanup"
    if [ -n "$job_pid" ] && kill -0 "$job_pid" 2>/dev/null; then
        kill "$job_pid" # run-job.sh stops its containers on SIGTERM
        wait "$job_pid"
    fi
    local project
    for project in "${projects[@]}"; do
        COMPOSE_PROJECT_NAME=$project timeout 120 "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 ||
            say "could not remove compose project $project"
    done
    remove_images || code=1
    rm -f "$ROOT/$WHEEL_DIR"/torch-*.whl
    if [ -d "$WORK/rootfs" ]; then
        local m
        for m in dev/pts dev proc sys; do
            mountpoint -q "$WORK/rootfs/$m" && umount -l "$WORK/rootfs/$m"
        done
    fi
    rm -rf --one-file-system "$WORK"
    if [ -n "$started_dockerd" ]; then
        say "stopping the dockerd this check started (pid $started_dockerd)"
        kill "$started_dockerd" 2>/dev/null
        local waited=0
        while kill -0 "$started_dockerd" 2>/dev/null && [ $waited -lt 60 ]; do
            sleep 1
            waited=$((waited + 1))
        done
        kill -0 "$started_dockerd" 2>/dev/null && say "dockerd $started_dockerd did not stop within 60 s"
    fi
    report
    if [ "$code" -eq 0 ]; then say "PASSED"; else say "FAILED (exit $code)"; fi
    exit "$code"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- 1. engine
apt_install() {
    [ "$(id -u)" = 0 ] || fail "$* missing, and installing it needs root"
    command -v apt-get >/dev/null || fail "$* missing, and there is no apt-get to install it"
    say "installing $* (log: $WORK/apt.log)"
    timeout 300 apt-get update -qq >>"$WORK/apt.log" 2>&1 || fail "apt-get update failed: $(tail -5 "$WORK/apt.log")"
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "$@" \
        >>"$WORK/apt.log" 2>&1 || fail "apt-get install $* failed: $(tail -10 "$WORK/apt.log")"
}

ensure_engine() {
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io iptables)
    command -v docker >/dev/null || missing+=(docker.io)
    if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
        missing+=(docker-compose)
    fi
    [ "${#missing[@]}" -eq 0 ] || apt_install "${missing[@]}"
    if ! timeout 20 docker info >/dev/null 2>&1; then
        command -v dockerd >/dev/null || fail "no dockerd to start"
        [ "$(id -u)" = 0 ] || fail "no Docker daemon answers, and starting one needs root"
        say "starting dockerd (log: $WORK/dockerd.log)"
        dockerd --storage-driver=overlay2 >"$WORK/dockerd.log" 2>&1 &
        started_dockerd=$!
        local waited=0
        until timeout 10 docker info >/dev/null 2>&1; do
            if ! kill -0 "$started_dockerd" 2>/dev/null; then
                tail -20 "$WORK/dockerd.log" >&2
                started_dockerd=""
                fail "dockerd exited at start (log above)"
            fi
            [ $waited -lt 60 ] || fail "dockerd did not answer within 60 s; log: $(tail -5 "$WORK/dockerd.log")"
            sleep 1
            waited=$((waited + 1))
        done
    fi
    if docker compose version >/dev/null 2>&1; then
        compose=(docker compose)
    else
        compose=(docker-compose)
    fi
    say "engine: $(docker version -f 'server {{.Server.Version}}, client {{.Client.Version}}'), compose: $("${compose[@]}" version --short 2>/dev/null || "${compose[@]}" version | head -1)"
}

# ---------------------------------------------------------------- 2. base image
debian_mirror() {
    [ -z "$MIRROR" ] || {
        echo "$MIRROR"
        return
    }
    local uri
    uri=$({ grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}'
        grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'; } |
        grep -E '/debian/?$' | head -1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

# pip settings that reach an index from inside a container: http(s) indexes only (file:// and
# find-links paths are this machine's folders), and the CA bundle copied into the image.
write_pip_conf() {
    {
        echo "[global]"
        echo "cert = /etc/ssl/certs/ca-certificates.crt"
        local key value
        for key in index-url extra-index-url trusted-host; do
            value=$(python3 -m pip config get "global.$key" 2>/dev/null || true)
            local env_name
            env_name=PIP_$(echo "$key" | tr 'a-z-' 'A-Z_')
            value=${!env_name:-$value}
            value=$(echo "$value" | tr ' ' '\n' | grep -E '^https?://|^[a-z0-9.-]+$' | tr '\n' ' ' || true)
            if [ -n "${value// /}" ]; then echo "$key = $value"; fi
        done
    } >"$1"
}

make_rootfs_tar() {
    local tar=$1 rootfs=$WORK/rootfs mirror
    command -v debootstrap >/dev/null || apt_install debootstrap
    mirror=$(debian_mirror)
    say "debootstrap bookworm from $mirror (minbase + python3, python3-venv, python3-pip, ca-certificates)"
    timeout 900 debootstrap --variant=minbase \
        --include=python3,python3-venv,python3-pip,ca-certificates,passwd \
        bookworm "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 ||
        fail "debootstrap failed: $(tail -5 "$WORK/debootstrap.log")"
    [ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
    write_pip_conf "$rootfs/etc/pip.conf"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
    mkdir -p "$(dirname "$tar")"
    tar --numeric-owner -C "$rootfs" -cf "$tar.part" . || fail "cannot write $tar.part"
    mv "$tar.part" "$tar"
    rm -rf --one-file-system "$rootfs"
}

ensure_base() {
    if [ -n "${BASE_IMAGE:-}" ]; then
        say "base image: $BASE_IMAGE (given)"
        base=$BASE_IMAGE
        return
    fi
    local tar
    if [ -n "$CACHE" ]; then tar=$CACHE/bookworm-python3.tar; else tar=$WORK/bookworm-python3.tar; fi
    if [ -f "$tar" ]; then
        say "base root file system from the cache: $tar"
    else
        make_rootfs_tar "$tar"
    fi
    made_images+=("$BASE_TAG")
    docker import "$tar" "$BASE_TAG" >/dev/null || fail "docker import $tar failed"
    base_id=$(docker image inspect -f '{{.Id}}' "$BASE_TAG")
    base=$BASE_TAG
    image_sizes+=("base $(($(docker image inspect -f '{{.Size}}' "$base") / 1000000)) MB ($base)")
    docker run --rm "$base" python3 -c 'import sys, venv; assert sys.version_info[:2] == (3, 11), sys.version' ||
        fail "the base image has no Python 3.11 with venv"
}

# ---------------------------------------------------------------- 3. build
torch_pin() {
    sed -n 's/^torch==\([^ ;#]*\).*/\1/p' constraints.txt | head -1
}

ensure_torch_wheel() {
    rm -f "$WHEEL_DIR"/torch-*.whl
    if [ -n "${TORCH_WHEEL:-}" ]; then
        cp "$TORCH_WHEEL" "$WHEEL_DIR/"
    else
        local spec
        spec="torch==$(torch_pin)+cpu" # a local version: only CPU builds match, never CUDA ones
        say "pip download $spec"
        local python=python3
        python3 -m pip --version >/dev/null 2>&1 || python=.venv/bin/python # made by `make test`
        timeout 600 "$python" -m pip download -q --no-deps --only-binary :all: -d "$WHEEL_DIR" "$spec" >&2 ||
            fail "no CPU torch wheel ($spec) reachable by pip; set TORCH_WHEEL=/path/to/torch-...+cpu-...whl"
    fi
    local wheels=("$WHEEL_DIR"/torch-*.whl)
    [ -f "${wheels[0]}" ] && [ "${#wheels[@]}" -eq 1 ] || fail "expected one torch wheel in $WHEEL_DIR"
    case "$(basename "${wheels[0]}")" in
    *+cpu-*) say "torch wheel: $(basename "${wheels[0]}")" ;;
    *) fail "$(basename "${wheels[0]}") is not a CPU build of torch" ;;
    esac
}

build_target() { # target image [docker build arguments]
    local target=$1 image=$2 log=$WORK/build-$1.log
    shift 2
    made_images+=("$image")
    timeout 1200 docker build --force-rm --network host --target "$target" -t "$image" \
        --build-arg BASE_IMAGE="$base" "$@" . >"$log" 2>&1 ||
        fail "docker build --target $target failed: $(tail -30 "$log")"
    grep -h "check-torch:" "$log" | sed 's/^/    /' >&2 || true
    local bytes
    bytes=$(docker image inspect -f '{{.Size}}' "$image")
    image_sizes+=("$target $((bytes / 1000000)) MB ($image)")
    say "image size: ${image_sizes[-1]}"
}

# What an image holds, as "torch-version-or-none [names of torch, matplotlib, tqdm, nvidia-*]".
image_packages() {
    docker run --rm --entrypoint python "$1" -c '
import importlib.metadata as m
names = sorted({d.metadata["Name"].lower() for d in m.distributions()})
try:
    torch = m.version("torch")
except m.PackageNotFoundError:
    torch = "none"
print(torch, [n for n in names if n in ("torch", "matplotlib", "tqdm") or n.startswith("nvidia")])'
}

assert_non_root() { # image
    local uid
    uid=$(docker run --rm --entrypoint id "$1" -u) || fail "cannot run id in $1"
    [ "$uid" != 0 ] || fail "the user of $1 is root"
    say "$1 runs as uid $uid"
}

# Before the wheel is copied in: the coordinator's build must not need it.
build_coordinator() {
    rm -f "$WHEEL_DIR"/torch-*.whl
    build_target coordinator "$COORDINATOR_IMAGE"
    local out packages
    if out=$(docker run --rm --entrypoint python "$COORDINATOR_IMAGE" -c 'import torch' 2>&1); then
        fail "import torch works in the coordinator image"
    fi
    grep -q "No module named 'torch'" <<<"$out" || fail "import torch failed in the coordinator image, but not for want of torch: $out"
    packages=$(image_packages "$COORDINATOR_IMAGE")
    say "coordinator image: import torch fails (No module named 'torch'); torch and friends: $packages"
    [ "$packages" = "none []" ] || fail "the coordinator image holds training packages: $packages"
    docker run --rm "$COORDINATOR_IMAGE" health --help >/dev/null || fail "gradserver health does not run in the coordinator image"
    assert_non_root "$COORDINATOR_IMAGE"
}

build_worker() {
    ensure_torch_wheel
    build_target worker "$WORKER_IMAGE" --build-arg TORCH_WHEEL_DIR="$WHEEL_DIR" --build-arg TORCH_VARIANT=cpu
    rm -f "$WHEEL_DIR"/torch-*.whl
    local packages
    packages=$(image_packages "$WORKER_IMAGE")
    say "worker image: torch and friends: $packages"
    case "$packages" in
    "$(torch_pin)+cpu ['matplotlib', 'torch', 'tqdm']") ;;
    *) fail "the worker image's torch is not the CPU build $(torch_pin)+cpu with matplotlib and tqdm, or CUDA packages came in: $packages" ;;
    esac
    assert_non_root "$WORKER_IMAGE"
}

# ---------------------------------------------------------------- 5.-7. the compose job
job_env() {
    export COMPOSE_PROJECT_NAME=$1
    export GRADSERVER_COORDINATOR_IMAGE=$COORDINATOR_IMAGE
    export GRADSERVER_WORKER_IMAGE=$WORKER_IMAGE
    export GRADSERVER_AUTH_TOKEN
    GRADSERVER_AUTH_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    export GRADSERVER_WORLD_SIZE=2
    export GRADSERVER_STEPS=$2
    export GRADSERVER_MODEL=tiny
    export GRADSERVER_HEARTBEAT_TIMEOUT=$HEARTBEAT_TIMEOUT
    export GRADSERVER_END_MARGIN=$RUN_JOB_MARGIN
    export GRADSERVER_JOB_TIMEOUT=600
    export GRADSERVER_LOG_FORMAT=text
    # Loopback only, and ports the engine picks: nothing else on this machine can collide.
    export GRADSERVER_PUBLISH_GRPC=127.0.0.1:0
    export GRADSERVER_PUBLISH_METRICS=127.0.0.1:0
    export COMPOSE="${compose[*]}"
}

container_of() { # project service -> container ids, oldest first
    docker ps -aq --filter "label=com.docker.compose.project=$1" --filter "label=com.docker.compose.service=$2" |
        tac
}

start_job() { # log file; the job runs in the background, its pid in $job_pid
    projects+=("$COMPOSE_PROJECT_NAME")
    docker/run-job.sh --no-build >"$1" 2>&1 &
    job_pid=$!
}

wait_job() { # seconds -> the job's exit code in $job_code
    local limit=$1 waited=0
    while kill -0 "$job_pid" 2>/dev/null; do
        if [ $waited -ge "$limit" ]; then
            kill "$job_pid"
            wait "$job_pid" || true
            fail "run-job.sh still running after $limit s"
        fi
        sleep 1
        waited=$((waited + 1))
    done
    job_code=0
    wait "$job_pid" || job_code=$?
}

# The coordinator's /metrics (host port the engine chose), or nothing while it is not up.
scrape() {
    local cid=$1 port
    port=$(docker port "$cid" 9090/tcp 2>/dev/null | head -1 | sed 's/.*://') || return 0
    [ -n "$port" ] || return 0
    python3 - "$port" <<'EOF' 2>/dev/null || true
import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode())
EOF
}

steps_completed() { # metrics text -> the counter's value (0 when absent)
    awk '/^gradserver_steps_completed_total /{print int($2); found=1} END{if(!found) print 0}'
}

wait_for_coordinator() { # project -> container id in $coordinator (bounded)
    local waited=0
    coordinator=""
    while [ -z "$coordinator" ]; do
        coordinator=$(container_of "$1" coordinator | head -1)
        [ -n "$coordinator" ] || {
            kill -0 "$job_pid" 2>/dev/null || fail "the job ended before its coordinator was created: $(tail -20 "$WORK/$1.log")"
            [ $waited -lt 300 ] || fail "no coordinator container after 300 s"
            sleep 1
            waited=$((waited + 1))
        }
    done
}

success_run() {
    local project=${RUN_ID}ok steps=3 log=$WORK/${RUN_ID}ok.log
    job_env "$project" "$steps"
    start_job "$log"
    wait_for_coordinator "$project"
    local healthy="" metrics="" text waited=0
    while kill -0 "$job_pid" 2>/dev/null && [ $waited -lt 600 ]; do
        [ "$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$coordinator" 2>/dev/null)" = healthy ] &&
            healthy=yes
        text=$(scrape "$coordinator")
        if grep -q '^gradserver_steps_completed_total ' <<<"$text"; then
            metrics=$text
            [ "$(steps_completed <<<"$text")" -ge 1 ] && break
        fi
        sleep 0.5
        waited=$((waited + 1))
    done
    wait_job 600
    sed 's/^/    | /' "$log" | tail -40 >&2
    [ "$job_code" -eq 0 ] || fail "run-job.sh exited with $job_code (log above)"

    local states
    states=$(docker ps -aq --filter "label=com.docker.compose.project=$project" |
        xargs docker inspect -f '{{index .Config.Labels "com.docker.compose.service"}} {{.State.Status}} {{.State.ExitCode}} {{.Config.User}} {{.Config.Image}}')
    say "containers (service status exit-code user image):"
    sed 's/^/    /' <<<"$states" >&2
    [ "$(grep -c '^coordinator ' <<<"$states")" -eq 1 ] && [ "$(grep -c '^worker ' <<<"$states")" -eq 2 ] ||
        fail "expected 1 coordinator and 2 workers"
    ! grep -qv ' exited 0 ' <<<"$states" || fail "not every container exited 0"
    ! awk '$4 == "" || $4 == "root" || $4 == "0" {bad=1} END{exit !bad}' <<<"$states" ||
        fail "a container runs as root"
    ! awk -v c="$COORDINATOR_IMAGE" -v w="$WORKER_IMAGE" \
        '($1 == "coordinator" && $5 != c) || ($1 == "worker" && $5 != w) {bad=1} END{exit !bad}' <<<"$states" ||
        fail "the coordinator must run from $COORDINATOR_IMAGE and the workers from $WORKER_IMAGE"

    local health_codes
    health_codes=$(docker inspect -f '{{if .State.Health}}{{range .State.Health.Log}}{{.ExitCode}} {{end}}{{end}}' "$coordinator")
    [ -n "$healthy" ] || grep -qw 0 <<<"$health_codes" || fail "the coordinator's health check never passed ($health_codes)"
    say "coordinator health check passed (seen healthy: ${healthy:-no}; probe exit codes: $health_codes)"

    [ -n "$metrics" ] || fail "no /metrics scrape with gradserver_steps_completed_total while the job ran"
    say "/metrics: $(grep -E '^gradserver_(steps_completed_total|workers_joined|world_size) ' <<<"$metrics" | tr '\n' ' ')"

    local volume listing
    volume=$(docker volume ls -q --filter "label=com.docker.compose.project=$project" | head -1)
    [ -n "$volume" ] || fail "no runs volume for $project"
    listing=$(docker run --rm -v "$volume:/runs:ro" --entrypoint sh "$WORKER_IMAGE" -c \
        'cd /runs && ls -l && echo "metrics-lines $(wc -l < metrics.jsonl)"') || fail "cannot read the runs volume"
    sed 's/^/    /' <<<"$listing" >&2
    grep -q "metrics-lines $((steps * 2))\$" <<<"$listing" || fail "metrics.jsonl should hold $((steps * 2)) lines"
    grep -q 'checkpoint-rank0.pt' <<<"$listing" && grep -q 'checkpoint-rank1.pt' <<<"$listing" ||
        fail "checkpoints missing from the runs volume"

    COMPOSE_PROJECT_NAME=$project timeout 120 "${compose[@]}" down -v >/dev/null 2>&1 || true
}

# A fault in one worker container once the job has completed 2 steps: `kill` (SIGKILL: its
# connections close, the coordinator sees the stream break) or `pause` (frozen, connections open:
# only the heartbeat timeout finds it). The job must end non-zero within `limit` seconds of the
# fault, the coordinator must log the worker of that container (its hostname is the node id) as
# gone in the words given, and the surviving worker must name the same worker.
fault_run() {
    local kind=$1 limit=$2 words=$3
    local project=${RUN_ID}$kind log=$WORK/${RUN_ID}$kind.log
    job_env "$project" 1000
    start_job "$log"
    wait_for_coordinator "$project"
    local waited=0 done_steps=0
    while [ "$done_steps" -lt 2 ]; do
        kill -0 "$job_pid" 2>/dev/null || fail "the job ended before the fault: $(tail -30 "$log")"
        [ $waited -lt 600 ] || fail "fewer than 2 steps after 300 s"
        done_steps=$(scrape "$coordinator" | steps_completed)
        sleep 0.5
        waited=$((waited + 1))
    done
    local workers victim survivor host fault_at elapsed
    workers=$(container_of "$project" worker)
    victim=$(head -1 <<<"$workers")
    survivor=$(tail -1 <<<"$workers")
    host=$(docker inspect -f '{{.Config.Hostname}}' "$victim")
    say "after $done_steps steps: docker $kind worker container $victim (hostname $host)"
    fault_at=$SECONDS
    docker "$kind" "$victim" >/dev/null
    wait_job $((limit + 60))
    elapsed=$((SECONDS - fault_at))
    docker unpause "$victim" >/dev/null 2>&1 || true
    sed 's/^/    | /' "$log" | grep -Ei 'lost|disconnected|exited|run-job' | tail -20 >&2
    say "job ended $elapsed s after the $kind with exit code $job_code"
    [ "$job_code" -ne 0 ] || fail "the job exited 0 after a worker container was hit by docker $kind"
    [ "$elapsed" -le "$limit" ] || fail "the job took $elapsed s to end after the $kind, more than $limit s"
    local gone="worker ([0-9]+) \\(node '$host'\\) ($words)" logs line worker_id
    logs=$(docker logs "$coordinator" 2>&1)
    line=$(grep -m1 -E "$gone" <<<"$logs") ||
        fail "the coordinator's log names no worker of node $host as gone ($words): $(tail -15 <<<"$logs")"
    worker_id=$(sed -E "s/.*$gone.*/\\1/" <<<"$line")
    say "coordinator: $line"
    logs=$(docker logs "$survivor" 2>&1)
    line=$(grep -E "worker $worker_id ($words)" <<<"$logs" | tail -1) ||
        fail "the surviving worker's log does not name worker $worker_id: $(tail -15 <<<"$logs")"
    say "surviving worker: $line"
    COMPOSE_PROJECT_NAME=$project timeout 120 "${compose[@]}" down -v >/dev/null 2>&1 || true
}

begin engine
ensure_engine
end
begin base
ensure_base
end
begin build-coordinator
build_coordinator
end
begin build-worker
build_worker
end
begin job
success_run
end
begin kill
# Killed, a worker's stream breaks at once ("disconnected"); the heartbeat timeout bounds it anyway.
fault_run kill $((HEARTBEAT_TIMEOUT + END_MARGIN)) "lost|disconnected"
end
begin hang
# Frozen, a worker is found by the heartbeat timeout ("lost"); the survivor fails then, and
# run-job.sh waits up to heartbeat timeout + its margin for the frozen one before stopping it
# (10 s grace, then SIGKILL).
fault_run pause $((2 * HEARTBEAT_TIMEOUT + RUN_JOB_MARGIN + 10 + END_MARGIN)) "lost"
end
