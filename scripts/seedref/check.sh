#!/bin/sh
# Generate seedref vector sets with other salts from the seed's own code and run
# kvflow's seedref tests against each. Not part of `make test` (needs ../shared).
#   scripts/seedref/check.sh [salt ...]      (default salts: 1 2 3)
set -eu
cd "$(dirname "$0")/../.."
seed=${SEED_FILE:-../shared/seed/mooncake_connector.py}
py=${PYTHON:-/usr/bin/python3}
if [ ! -f "$seed" ]; then
	echo "check.sh: $seed not found; skipping (needs the seed checkout in ../shared)"
	exit 0
fi
pkgs="./stages/plan/ ./stages/plan/pyrandom/ ./stages/notify/tracker/ ./hw/npu/"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== public set reproduced from its inputs"
"$py" scripts/seedref/verify.py --seed-file "$seed" --dir testdata/seedref
for salt in ${*:-1 2 3}; do
	echo "== salt $salt"
	"$py" scripts/seedref/gen.py --seed-file "$seed" --out "$tmp/$salt" --salt "$salt"
	KVFLOW_SEEDREF_DIR="$tmp/$salt" go test -count=1 $pkgs
	echo "== salt $salt --vary (other block lengths, layer counts and topologies)"
	"$py" scripts/seedref/gen.py --seed-file "$seed" --out "$tmp/$salt-vary" --salt "$salt" --vary
	KVFLOW_SEEDREF_DIR="$tmp/$salt-vary" go test -count=1 $pkgs
done
