#!/usr/bin/env bash
# Stock Mooncake's initiator (transfer_engine_bench, TCP, P2PHANDSHAKE, its
# default one-shot connection per request) reading from two targets in the
# same run: (a) Mooncake's own transfer_engine_bench target and (b) kvflow's
# (`kvflow bench te --mode target`). Both targets and every initiator run in
# one fresh network namespace (loopback only). For each block size, each
# round runs the initiator once against each target, in alternating order;
# the script prints every run, then per block size the median MB/s of each
# target and the median of the per-round ratios kvflow / Mooncake, and each
# target's CPU time per GB it served (median of rounds: steadier than MB/s
# on a shared machine, where the initiator and both targets share cores).
#
# Needs a Mooncake build (../shared/tools/mooncake-build.sh):
# MOONCAKE_BENCH, or ~/.config/kvflow/mooncake.env which sets it. Root (or
# unprivileged user namespaces) for `unshare -n`. Not part of make test.
#
#   bench/mooncake-target.sh                         # defaults below
#   BLOCKS="65536 262144" ROUNDS=7 DURATION=5 bench/mooncake-target.sh
#   THREADS=1 BATCH=128 KVFLOW_BIN=bin/kvflow bench/mooncake-target.sh
#   MC_TCP_ENABLE_CONNECTION_POOL=1 bench/mooncake-target.sh   # pooled initiator
#   NETNS=0 bench/mooncake-target.sh      # no namespace (an isolated machine)
#   FILL_MOONCAKE=1 bench/mooncake-target.sh  # Mooncake's target serves written memory too (fill() below)
#   KVFLOW_BASE_BIN=/tmp/kvflow-main bench/mooncake-target.sh  # and a second kvflow build
#                                                              # (before/after a change)
#   KVFLOW_VARIANTS="c64=/tmp/kv-c64.sh" bench/mooncake-target.sh  # and wrappers (other flags)
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
KVFLOW_BASE_BIN=${KVFLOW_BASE_BIN:-}
KVFLOW_REV=${KVFLOW_REV:-}

if [[ -z "${KVFLOW_IN_NETNS:-}" && "${NETNS:-1}" != 0 ]]; then
	export KVFLOW_IN_NETNS=1 MOONCAKE_BENCH KVFLOW_BIN KVFLOW_BASE_BIN KVFLOW_VARIANTS KVFLOW_REV BLOCKS ROUNDS DURATION THREADS BATCH BUFFER
	exec unshare -n "$0" "$@"
fi
if [[ "${NETNS:-1}" == 0 ]]; then
	# NETNS=0: no namespace of its own (a machine nothing else can reach);
	# the host's TIME_WAIT settings apply.
	echo "# NETNS=0: host network namespace" >&2
else
	if command -v ip >/dev/null; then
		ip link set lo up
	else # no iproute2: SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP
		python3 -c 'import socket, fcntl, struct
s = socket.socket()
f = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"")))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", f | 1, b""))'
	fi
	# No TIME_WAIT in this namespace: the initiator closes each of its
	# one-shot connections first, so without this every run leaves ~10^4
	# client ports in TIME_WAIT towards the target it read from, and later
	# runs against that target slow down in connect() looking for a free
	# port (a 64 KiB run alone opens ~15,000 connections). Both targets are
	# spared the same way.
	echo 0 >/proc/sys/net/ipv4/tcp_max_tw_buckets
fi

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
if [[ -n "${KVFLOW_BASE_BIN:-}" ]]; then
	"$KVFLOW_BASE_BIN" bench te --mode target --local_server_name 127.0.0.1:17250 \
		--buffer_size "$BUFFER" >base-target.log 2>&1 &
	pids+=($!)
fi

# Mooncake's P2P handshake picks its own RPC port: read it from the log.
mc=""
for _ in $(seq 300); do
	mc=$(sed -n 's/.*listening on \([0-9.]*:[0-9]*\).*/\1/p' mooncake-target.log | head -1)
	if [[ -n "$mc" ]] && grep -q "listen on port" mooncake-target.log && grep -q "Target started" kvflow-target.log &&
		{ [[ -z "${KVFLOW_BASE_BIN:-}" ]] || grep -q "Target started" base-target.log; }; then
		break
	fi
	mc=""
	sleep 0.1
done
if [[ -z "$mc" ]]; then
	echo "mooncake-target: a target did not start" >&2
	tail -n 5 ./*-target.log >&2
	exit 1
fi
names=(mooncake kvflow) addrs=("$mc" 127.0.0.1:17200)
if [[ -n "${KVFLOW_BASE_BIN:-}" ]]; then names+=(kvflow-base); addrs+=(127.0.0.1:17250); fi
# KVFLOW_VARIANTS="name=command ...": more kvflow targets (a command is a
# binary or a wrapper script that runs kvflow with other flags or env).
port=17260
for v in ${KVFLOW_VARIANTS:-}; do
	"${v#*=}" bench te --mode target --local_server_name 127.0.0.1:$port --buffer_size "$BUFFER" >"variant-$port.log" 2>&1 &
	pids+=($!)
	for _ in $(seq 300); do grep -q "Target started" "variant-$port.log" && break; sleep 0.1; done
	grep -q "Target started" "variant-$port.log" || { echo "mooncake-target: variant ${v%%=*} did not start" >&2; tail -n 5 "variant-$port.log" >&2; exit 1; }
	names+=("${v%%=*}"); addrs+=(127.0.0.1:$port)
	port=$((port + 10))
done

# cpu PID: the process's CPU time so far (user + system), in ms.
tck=$(getconf CLK_TCK)
cpu() { awk -v t="$tck" '{printf "%d\n", ($14 + $15) * 1000 / t}' "/proc/$1/stat"; }

# run TARGET BLOCK: one initiator run, prints MB/s.
run() {
	local out
	out=$("$MOONCAKE_BENCH" --mode initiator --metadata_server P2PHANDSHAKE --protocol tcp \
		--local_server_name 127.0.0.1:17300 --segment_id "$1" --operation read \
		--block_size "$2" --batch_size "$BATCH" --threads "$THREADS" --duration "$DURATION" \
		--buffer_size "$BUFFER" --report_unit MB --report_precision 0 2>&1) || { echo "initiator failed against $1:" >&2; tail -n 5 <<<"$out" >&2; echo 0; return; }
	sed -n 's/.*throughput \([0-9.]*\) MB\/s.*/\1/p' <<<"$out" | tail -1
}

median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "# transfer_engine_bench initiator (read, batch $BATCH, threads $THREADS, ${DURATION}s, pool ${MC_TCP_ENABLE_CONNECTION_POOL:-off}), $ROUNDS rounds; Mooncake's buffer $([[ "${FILL_MOONCAKE:-0}" == 0 ]] && echo "never written (zero page)" || echo "written first (FILL_MOONCAKE)")"
echo "# targets: ${names[*]} at ${addrs[*]}; kvflow at ${KVFLOW_REV:-$(git -C "$root" describe --always --dirty 2>/dev/null)}"
n=${#names[@]}
header="| block (B) |" sep="| ---: |"
for name in "${names[@]}"; do header+=" $name, median MB/s | runs |"; sep+=" ---: | --- |"; done
for name in "${names[@]:1}"; do header+=" $name / mooncake (median of rounds) |"; sep+=" ---: |"; done
for name in "${names[@]}"; do header+=" $name CPU ms/GB |"; sep+=" ---: |"; done
summary=()
# FILL_MOONCAKE=1: before each block size's rounds, one write run against
# Mooncake's target, so that the pages its reads touch are real memory.
# transfer_engine_bench's target never writes its buffer: every read of it
# copies from the kernel's zero page (one cached page), while kvflow's
# target serves a written pattern from DRAM, as a KV cache is.
fill() {
	"$MOONCAKE_BENCH" --mode initiator --metadata_server P2PHANDSHAKE --protocol tcp \
		--local_server_name 127.0.0.1:17300 --segment_id "$mc" --operation write \
		--block_size "$1" --batch_size "$BATCH" --threads "$THREADS" --duration 1 \
		--buffer_size "$BUFFER" --report_unit MB --report_precision 0 >/dev/null 2>&1 || echo "mooncake-target: fill run failed" >&2
}
for bs in $BLOCKS; do
	[[ "${FILL_MOONCAKE:-0}" == 0 ]] || fill "$bs"
	for name in "${names[@]}"; do : >"$name.$bs"; : >"ratio.$name.$bs"; : >"cpu.$name.$bs"; done
	for r in $(seq "$ROUNDS"); do
		# Rotate the order from round to round.
		line="block $(printf %7d "$bs") round $r:"
		declare -A got=() cpg=()
		for i in $(seq 0 $((n - 1))); do
			j=$(((i + r) % n))
			c0=$(cpu "${pids[$j]}")
			got[$j]=$(run "${addrs[$j]}" "$bs")
			c1=$(cpu "${pids[$j]}")
			# The target's CPU per GB it served (the initiator's run
			# includes its start-up, the same for every target).
			cpg[$j]=$(awk -v c=$((c1 - c0)) -v mb="${got[$j]}" -v d="$DURATION" 'BEGIN {printf "%.0f", (mb > 0 ? c * 1000 / (mb * d) : 0)}')
		done
		for j in $(seq 0 $((n - 1))); do
			echo "${got[$j]}" >>"${names[$j]}.$bs"
			echo "${cpg[$j]}" >>"cpu.${names[$j]}.$bs"
			line+=" ${names[$j]} ${got[$j]} MB/s (${cpg[$j]} CPU ms/GB)"
			((j == 0)) || awk -v k="${got[$j]}" -v m="${got[0]}" 'BEGIN {printf "%.3f\n", (m > 0 ? k / m : 0)}' >>"ratio.${names[$j]}.$bs"
		done
		unset got cpg
		echo "$line"
	done
	row="| $bs |"
	for name in "${names[@]}"; do row+=" $(median <"$name.$bs") | $(paste -sd/ "$name.$bs") |"; done
	for name in "${names[@]:1}"; do row+=" $(median <"ratio.$name.$bs") |"; done
	for name in "${names[@]}"; do row+=" $(median <"cpu.$name.$bs") |"; done
	summary+=("$row")
done
echo
echo "$header"
echo "$sep"
printf '%s\n' "${summary[@]}"
