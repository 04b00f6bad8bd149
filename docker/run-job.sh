#!/usr/bin/env bash
# Runs the compose job (docker-compose.yml, or the files in COMPOSE_FILE) to its end and exits
# with its outcome. Works with compose v2 (`docker compose`) and v1 (`docker-compose`).
#
#   export GRADSERVER_AUTH_TOKEN=$(openssl rand -hex 16)
#   GRADSERVER_WORLD_SIZE=4 docker/run-job.sh --build        # extra arguments go to `up`
#
# Why not `docker compose up` alone: it waits for every container (a coordinator still up after
# its workers crashed keeps it waiting), and its --abort-on-container-exit / --exit-code-from stop
# every container as soon as the FIRST one exits, even with 0: a worker that finishes first
# kills the others while they write their checkpoints, and a killed worker stops the coordinator
# before it has logged the worker as lost.
# So this starts the job detached (`up -d --scale worker=N`), follows the logs, and watches the
# containers:
#   - every container exited 0 (the coordinator exits after its last step once every worker has
#     left, and workers leave after writing their outputs): exit 0;
#   - a container exited non-zero: the job is dead (a lost worker fails the step of every other
#     one, naming it). The others get GRADSERVER_HEARTBEAT_TIMEOUT + GRADSERVER_END_MARGIN seconds
#     to end on their own, so that the coordinator logs the loss and the survivors their errors;
#     then whatever still runs is stopped: exit 1;
#   - every worker exited 0 but the coordinator is still up GRADSERVER_END_MARGIN seconds later,
#     or the job runs past GRADSERVER_JOB_TIMEOUT seconds, or Ctrl-C: stop it, exit 1 (124 for
#     the job timeout, 130 for Ctrl-C).
# Containers and the runs volume stay for inspection; `docker compose down -v` removes them.
# COMPOSE_PROJECT_NAME defaults to "gradserver"; COMPOSE overrides the compose command.
set -euo pipefail
cd "$(dirname "$0")/.."

export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-gradserver}
WORKERS=${GRADSERVER_WORLD_SIZE:-2}
HEARTBEAT_TIMEOUT=${GRADSERVER_HEARTBEAT_TIMEOUT:-10}
END_MARGIN=${GRADSERVER_END_MARGIN:-30}
JOB_TIMEOUT=${GRADSERVER_JOB_TIMEOUT:-86400}
STOP_TIMEOUT=10

say() { echo "run-job: $*" >&2; }

if [ -n "${COMPOSE:-}" ]; then
    read -r -a compose <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose)
else
    say "neither 'docker compose' (v2) nor 'docker-compose' (v1) is installed"
    exit 1
fi

logs_pid=""
stop_job() {
    say "stopping the containers still running"
    timeout $((STOP_TIMEOUT + 60)) "${compose[@]}" stop -t "$STOP_TIMEOUT" >&2 || say "compose stop failed"
}
finish() {
    local code=$1
    if [ -n "$logs_pid" ]; then
        kill "$logs_pid" 2>/dev/null || true
        wait "$logs_pid" 2>/dev/null || true
    fi
    summary
    exit "$code"
}
trap 'say "interrupted"; stop_job; finish 130' INT TERM

containers() {
    docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
        --filter "label=com.docker.compose.oneoff=False"
}

# One line per container: service status exit-code name
states() {
    local ids
    ids=$(containers)
    [ -n "$ids" ] || return 0
    # shellcheck disable=SC2086
    docker inspect -f '{{index .Config.Labels "com.docker.compose.service"}} {{.State.Status}} {{.State.ExitCode}} {{.Name}}' $ids
}

summary() {
    say "containers of project $COMPOSE_PROJECT_NAME (service status exit-code name):"
    states | sed 's/^/    /' >&2 || true
}

say "starting $WORKERS worker(s) and the coordinator (project $COMPOSE_PROJECT_NAME)"
if ! timeout "$JOB_TIMEOUT" "${compose[@]}" up -d --scale "worker=$WORKERS" "$@"; then
    say "'up' failed (an unhealthy coordinator, a failed build, a port in use?)"
    stop_job
    finish 1
fi
"${compose[@]}" logs -f --no-color &
logs_pid=$!

started=$SECONDS
failed_at=""
workers_done_at=""
while :; do
    now=$SECONDS
    mapfile -t lines < <(states)
    running=0 workers_running=0 workers=0 failures=()
    for line in "${lines[@]}"; do
        read -r service status code name <<<"$line"
        [ "$service" = worker ] && workers=$((workers + 1))
        case "$status" in
        exited | dead)
            [ "$code" = 0 ] || failures+=("$name ($service) exited with $code")
            ;;
        *)
            running=$((running + 1))
            [ "$service" = worker ] && workers_running=$((workers_running + 1))
            ;;
        esac
    done
    if [ "${#failures[@]}" -gt 0 ] && [ -z "$failed_at" ]; then
        failed_at=$now
        say "job failed: ${failures[*]}; waiting up to $((HEARTBEAT_TIMEOUT + END_MARGIN)) s for the rest to end"
    fi
    if [ "$running" -eq 0 ]; then
        if [ -n "$failed_at" ] || [ "$workers" -eq 0 ]; then
            say "job failed${failures:+: ${failures[*]}}"
            finish 1
        fi
        say "job done: every container exited 0"
        finish 0
    fi
    if [ -n "$failed_at" ]; then
        if [ "$workers_running" -eq 0 ] || [ $((now - failed_at)) -ge $((HEARTBEAT_TIMEOUT + END_MARGIN)) ]; then
            say "job failed: ${failures[*]}"
            stop_job
            finish 1
        fi
    elif [ "$workers_running" -eq 0 ]; then
        workers_done_at=${workers_done_at:-$now}
        if [ $((now - workers_done_at)) -ge "$END_MARGIN" ]; then
            say "every worker exited 0, but the coordinator still runs $END_MARGIN s later" \
                "(do GRADSERVER_STEPS and the workers' steps agree?)"
            stop_job
            finish 1
        fi
    fi
    if [ $((now - started)) -ge "$JOB_TIMEOUT" ]; then
        say "job still running after GRADSERVER_JOB_TIMEOUT=$JOB_TIMEOUT s"
        stop_job
        finish 124
    fi
    sleep 1
done
