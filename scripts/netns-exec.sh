#!/usr/bin/env bash
# go test -exec helper: runs a test binary (and its arguments) in a network
# namespace of its own with only loopback up, so listeners that bind every
# address (Mooncake's) are reachable from nowhere else. Root uses a plain
# network namespace; others an unprivileged user namespace.
set -euo pipefail
userns=()
[[ $(id -u) == 0 ]] || userns=(-r)
export KVFLOW_NETNS=1
exec unshare "${userns[@]}" -n bash -c 'ip link set lo up && exec "$@"' netns-exec "$@"
