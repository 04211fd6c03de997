#!/usr/bin/env bash
# Installs what kvflow needs to build and test, only when it is missing:
# libzmq (cgo, for pebbe/zmq4), pkg-config, Debian's python3 modules used by
# the interop tests and the Python client, and (as root) iptables for the
# network-namespace delay. Safe to run repeatedly.
set -euo pipefail

need=()
pkg-config --exists libzmq 2>/dev/null || need+=(libzmq3-dev)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
if [ -x /usr/bin/python3 ]; then
  /usr/bin/python3 -c 'import zmq' 2>/dev/null || need+=(python3-zmq)
  /usr/bin/python3 -c 'import msgpack' 2>/dev/null || need+=(python3-msgpack)
  /usr/bin/python3 -c 'import numpy' 2>/dev/null || need+=(python3-numpy)
  # The Python package's tiny engine and vLLM connector (clients/python).
  /usr/bin/python3 -c 'import torch' 2>/dev/null || need+=(python3-torch)
else
  need+=(python3 python3-zmq python3-msgpack python3-numpy python3-torch)
fi
command -v gcc >/dev/null 2>&1 || need+=(gcc)
# As root the --netem tests and bench delay packets in a netfilter queue,
# set up with iptables(8) inside their own network namespaces.
if [ "$(id -u)" = 0 ]; then
  command -v iptables >/dev/null 2>&1 || need+=(iptables)
fi

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
echo "deps: installing ${need[*]}" >&2
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
  $SUDO apt-get update >/dev/null 2>&1
  $SUDO apt-get install -y --no-install-recommends "${need[@]}"
}
