#!/usr/bin/env bash
# make test-mooncake: the cgo Mooncake binding (hw/mooncake/mooncakec,
# -tags mooncake) built, vetted and tested against a real Mooncake build,
# Mooncake's own engine reading kvflow's target (hw/mooncake), each test
# binary in a loopback-only network namespace (scripts/netns-exec.sh); then
# the node's Mooncake tests (internal/node, which enter a namespace
# themselves). Opt-in, never part of make test or CI.
#
# Needs MOONCAKE_PREFIX (the install prefix of a Mooncake build: include/
# and lib/), taken from the environment or from ~/.config/kvflow/mooncake.env
# (MOONCAKE_ENV overrides the path), which ../shared/tools/mooncake-build.sh
# writes; MOONCAKE_LDFLAGS there gives the link line, MOONCAKE_PY the
# directory of Mooncake's Python module (TestStockMooncakeInitiator),
# MOONCAKE_BENCH its transfer_engine_bench (TestStockMooncakeBench). Without
# MOONCAKE_PREFIX it prints why and exits 0 (skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
env_file=${MOONCAKE_ENV:-$HOME/.config/kvflow/mooncake.env}
if [[ -z "${MOONCAKE_PREFIX:-}" && -f "$env_file" ]]; then
	set -a
	# shellcheck disable=SC1090
	source "$env_file"
	set +a
fi
if [[ -z "${MOONCAKE_PREFIX:-}" ]]; then
	echo "test-mooncake: SKIPPED: MOONCAKE_PREFIX is unset and $env_file does not set it" \
		"(build Mooncake with ../shared/tools/mooncake-build.sh, or export MOONCAKE_PREFIX and MOONCAKE_LDFLAGS)"
	exit 0
fi
if [[ ! -f "$MOONCAKE_PREFIX/include/transfer_engine_c.h" ]]; then
	echo "test-mooncake: $MOONCAKE_PREFIX/include/transfer_engine_c.h not found (MOONCAKE_PREFIX=$MOONCAKE_PREFIX)" >&2
	exit 2
fi
: "${MOONCAKE_LDFLAGS:=-L$MOONCAKE_PREFIX/lib -Wl,-rpath,$MOONCAKE_PREFIX/lib -Wl,--start-group -ltransfer_engine -lbase -lmooncake_common -Wl,--end-group -lasio -lstdc++ -libverbs -lnuma -lglog -lgflags -ljsoncpp -lyaml-cpp -lpthread -lm}"
export CGO_ENABLED=1 CGO_CFLAGS="-I$MOONCAKE_PREFIX/include" CGO_LDFLAGS="$MOONCAKE_LDFLAGS"
export MOONCAKE_PY="${MOONCAKE_PY:-}" SEED_PYTHON="${SEED_PYTHON:-python3}"
echo "test-mooncake: against $MOONCAKE_PREFIX"
set -x
"$GO" vet -tags mooncake ./hw/mooncake/...
"$GO" test -tags mooncake -race -count=1 -timeout 10m -exec "$PWD/scripts/netns-exec.sh" ./hw/mooncake/mooncakec/
# Mooncake's own engine (its Python module, MOONCAKE_PY) reading from
# kvflow's target, connection pool off and on, and a decode-sized load (8
# threads × 2048-request batches, one connection per request); then
# transfer_engine_bench (MOONCAKE_BENCH) as initiator with its default 12
# threads. Each is skipped without its variable.
export MOONCAKE_BENCH="${MOONCAKE_BENCH:-}"
"$GO" test -race -count=1 -timeout 5m -exec "$PWD/scripts/netns-exec.sh" -run 'TestStockMooncakeInitiator|TestStockMooncakeBench' -v ./hw/mooncake/ | grep -E '^(=== RUN|--- |\s+---|PASS|FAIL|ok)|skip|throughput'
# The node on Mooncake's engine (its tests enter a namespace themselves).
export MOONCAKE_PREFIX
# shellcheck disable=SC2086
"$GO" test -tags mooncake ${TESTFLAGS:--race -count=1 -timeout 8m} -run 'Mooncake' ./internal/node/

