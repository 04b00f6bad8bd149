#!/usr/bin/env bash
# Installs what tests/test_slurm.py's real cluster needs, from Debian's packages, when missing:
# slurm-wlm (slurmctld, slurmd, the client commands) and munge. Root and apt-get needed. The
# packages' own services are not used (the tests start their own daemons, with their own
# configuration and munge key), so none is started here. Never fails the caller: where the
# packages cannot be installed it says why, and the SLURM tests skip, naming what is missing.
set -uo pipefail

need=()
for tool in slurmctld slurmd sbatch scontrol; do command -v "$tool" >/dev/null || need+=(slurm-wlm); done
for tool in munged mungekey; do command -v "$tool" >/dev/null || need+=(munge); done
if [ ${#need[@]} -eq 0 ]; then
    echo "install-slurm: slurm-wlm and munge are installed"
    exit 0
fi
mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-slurm: ${need[*]} missing and not installable here (needs root and apt-get): the SLURM cluster tests skip"
    exit 0
fi
log=$(mktemp)
# policy-rc.d 101: no package starts its daemon while being installed.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1; fi
if timeout 300 apt-get update -qq >>"$log" 2>&1 &&
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >>"$log" 2>&1; then
    echo "install-slurm: installed ${need[*]}"
else
    echo "install-slurm: installing ${need[*]} failed, the SLURM cluster tests skip: $(tail -5 "$log")"
fi
[ "$made_policy" = 1 ] && rm -f "$policy"
rm -f "$log"
exit 0
