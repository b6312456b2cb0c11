#!/usr/bin/env bash
# Install the Debian packages the real-Slurm tests need (slurmctld, slurmd, slurm-client, munge).
# Idempotent: does nothing when they are already installed, when not root, or without apt-get;
# the tests then skip with the reason. Never fails the caller's script.
set -u

PACKAGES=(slurmctld slurmd slurm-client munge)

missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-slurm: already installed: ${PACKAGES[*]}"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-slurm: not root, not installing: ${missing[*]} (the Slurm tests will skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm: no apt-get, not installing: ${missing[*]} (the Slurm tests will skip)"
    exit 0
fi

echo "install-slurm: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# The packages' post-install scripts try to start the daemons; the tests start their own,
# so keep the package scripts from starting anything (policy-rc.d exit 101 = "not allowed").
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
fi
apt-get update -q \
    && apt-get install -y -q --no-install-recommends "${missing[@]}" \
    || echo "install-slurm: apt-get failed (the Slurm tests will skip)"
[ "$created_policy" -eq 1 ] && rm -f "$policy"
exit 0
