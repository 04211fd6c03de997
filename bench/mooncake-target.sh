#!/usr/bin/env bash
# Stock Mooncake's initiator (transfer_engine_bench, TCP, P2PHANDSHAKE, its
# default one-shot connection per request) reading from two targets in the
# same run: (a) Mooncake's own transfer_engine_bench target and (b) kvflow's
# (`kvflow bench te --mode target`). Both targets and every initiator run in
# one fresh network namespace (loopback only). For each block size, each
# round runs the initiator once against each target, in alternating order;
# the script prints every run, then per block size the median GB/s of each
# target and the median of the per-round ratios kvflow / Mooncake.
#
# Needs a Mooncake build (../shared/tools/mooncake-build.sh):
# MOONCAKE_BENCH, or ~/.config/kvflow/mooncake.env which sets it. Root (or
# unprivileged user namespaces) for `unshare -n`. Not part of make test.
#
#   bench/mooncake-target.sh                         # defaults below
#   BLOCKS="65536 262144" ROUNDS=7 DURATION=5 bench/mooncake-target.sh
#   THREADS=1 BATCH=128 KVFLOW_BIN=bin/kvflow bench/mooncake-target.sh
#   MC_TCP_ENABLE_CONNECTION_POOL=1 bench/mooncake-target.sh   # pooled initiator
set -euo pipefail

BLOCKS=${BLOCKS:-"4096 16384 65536 262144 1048576"}
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-3}
THREADS=${THREADS:-1}
BATCH=${BATCH:-128}
BUFFER=${BUFFER:-268435456}

if [[ -z "${MOONCAKE_BENCH:-}" && -f "$HOME/.config/kvflow/mooncake.env" ]]; then
	# shellcheck disable=SC1091
	source "$HOME/.config/kvflow/mooncake.env"
fi
if [[ -z "${MOONCAKE_BENCH:-}" || ! -x "${MOONCAKE_BENCH}" ]]; then
	echo "mooncake-target: MOONCAKE_BENCH unset or not executable (run ../shared/tools/mooncake-build.sh)" >&2
	exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
KVFLOW_BIN=${KVFLOW_BIN:-$root/bin/kvflow}
if [[ ! -x "$KVFLOW_BIN" ]]; then
	(cd "$root" && go build -o "$KVFLOW_BIN" ./cmd/kvflow)
fi
KVFLOW_BIN=$(cd "$(dirname "$KVFLOW_BIN")" && pwd)/$(basename "$KVFLOW_BIN")

if [[ -z "${KVFLOW_IN_NETNS:-}" ]]; then
	export KVFLOW_IN_NETNS=1 MOONCAKE_BENCH KVFLOW_BIN BLOCKS ROUNDS DURATION THREADS BATCH BUFFER
	exec unshare -n "$0" "$@"
fi
ip link set lo up
# No TIME_WAIT in this namespace: the initiator closes each of its
# one-shot connections first, so without this every run leaves ~10^4
# client ports in TIME_WAIT towards the target it read from, and later
# runs against that target slow down in connect() looking for a free
# port (a 64 KiB run alone opens ~15,000 connections). Both targets are
# spared the same way.
sysctl -qw net.ipv4.tcp_max_tw_buckets=0

work=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT
cd "$work" # glog and Mooncake write next to the working directory

"$MOONCAKE_BENCH" --mode target --metadata_server P2PHANDSHAKE --protocol tcp \
	--local_server_name 127.0.0.1:17100 --buffer_size "$BUFFER" >mooncake-target.log 2>&1 &
pids+=($!)
"$KVFLOW_BIN" bench te --mode target --local_server_name 127.0.0.1:17200 \
	--buffer_size "$BUFFER" >kvflow-target.log 2>&1 &
pids+=($!)

# Mooncake's P2P handshake picks its own RPC port: read it from the log.
mc="" kv=""
for _ in $(seq 300); do
	mc=$(sed -n 's/.*listening on \([0-9.]*:[0-9]*\).*/\1/p' mooncake-target.log | head -1)
	grep -q "Target started" kvflow-target.log && grep -q "listen on port" mooncake-target.log && [[ -n "$mc" ]] && kv=127.0.0.1:17200 && break
	sleep 0.1
done
if [[ -z "$mc" || -z "$kv" ]]; then
	echo "mooncake-target: a target did not start" >&2
	tail -n 5 mooncake-target.log kvflow-target.log >&2
	exit 1
fi

# run TARGET BLOCK: one initiator run, prints GB/s.
run() {
	local out
	out=$("$MOONCAKE_BENCH" --mode initiator --metadata_server P2PHANDSHAKE --protocol tcp \
		--local_server_name 127.0.0.1:17300 --segment_id "$1" --operation read \
		--block_size "$2" --batch_size "$BATCH" --threads "$THREADS" --duration "$DURATION" \
		--buffer_size "$BUFFER" 2>&1) || { echo "initiator failed against $1:" >&2; tail -n 5 <<<"$out" >&2; echo 0; return; }
	sed -n 's/.*throughput \([0-9.]*\) GB\/s.*/\1/p' <<<"$out" | tail -1
}

median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "# transfer_engine_bench initiator (read, batch $BATCH, threads $THREADS, ${DURATION}s, pool ${MC_TCP_ENABLE_CONNECTION_POOL:-off}), $ROUNDS rounds"
echo "# mooncake target $mc, kvflow target $kv ($("$KVFLOW_BIN" version | head -1))"
summary=()
for bs in $BLOCKS; do
	: >"m.$bs" ; : >"k.$bs" ; : >"r.$bs"
	for r in $(seq "$ROUNDS"); do
		if ((r % 2)); then m=$(run "$mc" "$bs"); k=$(run "$kv" "$bs")
		else k=$(run "$kv" "$bs"); m=$(run "$mc" "$bs"); fi
		echo "$m" >>"m.$bs"; echo "$k" >>"k.$bs"
		awk -v k="$k" -v m="$m" 'BEGIN {printf "%.3f\n", (m > 0 ? k / m : 0)}' >>"r.$bs"
		printf 'block %7d round %d: mooncake %s GB/s, kvflow %s GB/s\n' "$bs" "$r" "$m" "$k"
	done
	summary+=("$(printf '| %d | %s | %s | %s | %s | %s |' "$bs" "$(median <"m.$bs")" "$(paste -sd/ "m.$bs")" \
		"$(median <"k.$bs")" "$(paste -sd/ "k.$bs")" "$(median <"r.$bs")")")
done
echo
echo "| block (B) | Mooncake target, median GB/s | runs | kvflow target, median GB/s | runs | kvflow / Mooncake (median of rounds) |"
echo "| ---: | ---: | --- | ---: | --- | ---: |"
printf '%s\n' "${summary[@]}"
