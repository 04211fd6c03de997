#!/usr/bin/env bash
# e2e-prometheus.sh — start Debian's prometheus on loopback against running
# kvflow workers and check that the dashboard's per-stage latency query
# returns data. Opt-in (make e2e-prometheus); needs the `prometheus`
# package (prometheus + promtool).
#
#   deploy/e2e-prometheus.sh HOST:PORT [HOST:PORT ...]
#
# The arguments are the workers' metrics addresses (node.metrics_addr; the
# demo logs them). At least one must be a decode worker (the pipeline stage
# metrics live there), and requests must flow while this runs: the query is
# a rate over 1m, so it needs two scrapes that see new observations.
#
# Environment:
#   E2E_TIMEOUT   seconds to wait for data (default 90)
#   E2E_IDLE_OK=1 also accept the lifetime quantile (no rate()) when the
#                 workers are idle, e.g. scraping a demo that has finished
#   E2E_KEEP=1    keep the temporary directory (config, data, log)
#
# Exit status: 0 data returned; 1 no data in time or prometheus failed;
# 2 usage error or missing tools.
set -euo pipefail

usage() { echo "usage: $0 HOST:PORT [HOST:PORT ...]  (kvflow metrics addresses)" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
for a in "$@"; do
	[[ $a =~ ^[^[:space:]/]+:[0-9]+$ ]] || { echo "$0: bad address '$a', want HOST:PORT" >&2; usage; }
done
for tool in prometheus promtool; do
	command -v "$tool" >/dev/null || { echo "$0: $tool not found (apt-get install prometheus)" >&2; exit 2; }
done

timeout_s=${E2E_TIMEOUT:-90}
query='histogram_quantile(0.99, sum by (le, stage) (rate(kvflow_stage_duration_seconds_bucket[1m])))'
lifetime='histogram_quantile(0.99, sum by (le, stage) (kvflow_stage_duration_seconds_bucket))'

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvflow-e2e-prometheus.XXXXXX")
pid=
cleanup() {
	if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
		kill "$pid" 2>/dev/null || true
		for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		kill -9 "$pid" 2>/dev/null || true
	fi
	if [[ ${E2E_KEEP:-} == 1 ]]; then echo "kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

{
	echo "global:"
	echo "  scrape_interval: 2s"
	echo "  scrape_timeout: 1s"
	echo "  evaluation_interval: 2s"
	echo "scrape_configs:"
	echo "  - job_name: kvflow"
	echo "    static_configs:"
	echo "      - targets:"
	for a in "$@"; do echo "          - '$a'"; done
} >"$tmp/prometheus.yml"
promtool check config "$tmp/prometheus.yml" >/dev/null

# Pick a free loopback port; retry if another process takes it first.
url=
for attempt in 1 2 3 4 5; do
	port=$((20000 + RANDOM % 40000))
	if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then continue; fi # in use
	prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/data" \
		--web.listen-address="127.0.0.1:$port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
	pid=$!
	for _ in $(seq 100); do
		kill -0 "$pid" 2>/dev/null || break
		if promtool query instant "http://127.0.0.1:$port" 'vector(1)' >/dev/null 2>&1; then
			url="http://127.0.0.1:$port"
			break 2
		fi
		sleep 0.1
	done
	echo "prometheus did not come up on port $port (attempt $attempt):" >&2
	tail -5 "$tmp/prometheus.log" >&2 || true
	kill "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
	pid=
	rm -rf "$tmp/data"
done
[[ -n $url ]] || { echo "FAIL: could not start prometheus" >&2; exit 1; }
echo "prometheus on $url scraping: $*"

# A result line looks like: {stage="read"} => 0.0012 @[1712345678.901]
finite() { grep -E '=> ' | grep -viE '=> (NaN|[+-]?Inf)( |$)' || true; }

start=$SECONDS
last=
while ((SECONDS - start < timeout_s)); do
	if ! kill -0 "$pid" 2>/dev/null; then
		echo "FAIL: prometheus exited:" >&2
		tail -20 "$tmp/prometheus.log" >&2
		exit 1
	fi
	last=$(promtool query instant "$url" "$query" 2>&1 || true)
	got=$(finite <<<"$last")
	if [[ -n $got ]]; then
		echo "OK after $((SECONDS - start))s: p99 per stage (rate over 1m):"
		echo "$got"
		exit 0
	fi
	if [[ ${E2E_IDLE_OK:-} == 1 ]]; then
		got=$(promtool query instant "$url" "$lifetime" 2>&1 | finite)
		if [[ -n $got ]]; then
			echo "OK after $((SECONDS - start))s (idle workers): lifetime p99 per stage:"
			echo "$got"
			exit 0
		fi
	fi
	sleep 1
done

echo "FAIL: no per-stage latency data after ${timeout_s}s" >&2
echo "query: $query" >&2
echo "last result: ${last:-<empty>}" >&2
echo "scrape health (up):" >&2
promtool query instant "$url" 'up' >&2 || true
echo "stage duration series scraped:" >&2
promtool query instant "$url" 'count by (instance) (kvflow_stage_duration_seconds_count)' >&2 || true
exit 1
