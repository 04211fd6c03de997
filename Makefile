# kvflow — build, test, demo.
GO        ?= go
PKGS      ?= ./...
TESTFLAGS ?= -race -count=1 -timeout 8m
BIN       := bin/kvflow

.PHONY: all deps build test test-nocgo vet vet-mooncake test-mooncake demo bench soak e2e-prometheus fmt clean

all: build

deps:
	@bash scripts/deps.sh

build: deps
	$(GO) build -o $(BIN) ./cmd/kvflow

vet: deps
	$(GO) vet $(PKGS)

# The cgo Mooncake binding (hw/mooncake/mooncakec, -tags mooncake) and the
# node's use of it are type-checked against a stub of Mooncake's
# transfer_engine_c.h, so they cannot silently stop compiling on machines
# without Mooncake. Vet and build of library packages compile the cgo code
# without linking; main packages (which link the node, so Mooncake's
# libraries, under the tag) are vetted, not built.
MOONCAKE_STUB := $(CURDIR)/hw/mooncake/mooncakec/testdata/include
vet-mooncake: deps
	CGO_CFLAGS="-I$(MOONCAKE_STUB)" $(GO) vet -tags mooncake $(PKGS)
	CGO_CFLAGS="-I$(MOONCAKE_STUB)" $(GO) build -tags mooncake \
		$$($(GO) list -tags mooncake -f '{{if ne .Name "main"}}{{.ImportPath}}{{end}}' $(PKGS))

# Opt-in: the tests with a real Mooncake (TCP transport), built by
# ../shared/tools/mooncake-build.sh, which writes MOONCAKE_PREFIX,
# MOONCAKE_LDFLAGS, MOONCAKE_PY and SEED_PYTHON to MOONCAKE_ENV (read when
# MOONCAKE_PREFIX is not in the environment). Skipped with a message when
# MOONCAKE_PREFIX is unset. Mooncake's listeners bind every address, so each
# test runs in a private network namespace with only loopback up
# (scripts/netns-exec.sh for hw/mooncake/...; the node's tests re-run
# themselves in one). scripts/test-mooncake.sh: vet with the real header,
# the cgo binding's tests, Mooncake's own engine reading kvflow's target,
# the node's Mooncake tests. Not part of make test.
MOONCAKE_ENV ?= $(HOME)/.config/kvflow/mooncake.env
test-mooncake: deps
	GO="$(GO)" TESTFLAGS="$(TESTFLAGS)" MOONCAKE_ENV="$(MOONCAKE_ENV)" bash scripts/test-mooncake.sh

# The pure packages (the pipeline and every stage) must build and test
# without cgo.
test-nocgo:
	CGO_ENABLED=0 $(GO) test -count=1 ./pipeline/... ./stages/... ./internal/sched/...

test: deps vet vet-mooncake test-nocgo
	$(GO) test $(TESTFLAGS) $(PKGS)

demo: build
	./$(BIN) demo

# The tiny paged-attention engine (clients/python/kvflow/tiny) monolithic and
# disaggregated through kvflow serve sidecars (prefill TP 4 -> decode TP 2):
# tokens/s, transfer share of time to first token, tokens identical.
.PHONY: demo-engine
demo-engine: build
	PYTHONPATH=clients/python KVFLOW_BIN=$(BIN) /usr/bin/python3 -m kvflow.tiny.run

# Benchmarks, each against a baseline measured in the same run: the stage
# benchmarks and `kvflow bench e2e` (all workloads; small with --netem
# "delay 1ms" when root), then rewrites bench/RESULTS.md and bench/e2e.svg
# (about 4 minutes on 2 cores; not part of make test). BENCHTIME sets the
# stage benchmarks' -benchtime.
BENCHTIME ?= 1s
bench: deps
	GO=$(GO) $(GO) run ./internal/tooling/benchresults/gen -out bench/RESULTS.md -plot bench/e2e.svg -benchtime $(BENCHTIME)

# 10 minutes of mixed load with random faults on loopback (not part of make test).
soak: deps
	KVFLOW_SOAK_DURATION=$${KVFLOW_SOAK_DURATION:-10m} $(GO) test -race -run TestSoak -timeout 20m -v ./internal/tooling/soak/

# Opt-in: Debian's Prometheus scrapes live workers and answers a per-stage latency query.
e2e-prometheus: deps
	@command -v prometheus >/dev/null 2>&1 || apt-get install -y --no-install-recommends prometheus
	KVFLOW_E2E_PROMETHEUS=1 $(GO) test -count=1 -run E2E -v ./deploy/

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	rm -rf bin
