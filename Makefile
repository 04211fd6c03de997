# kvflow — build, test, demo.
GO        ?= go
PKGS      ?= ./...
TESTFLAGS ?= -race -count=1 -timeout 8m
BIN       := bin/kvflow

.PHONY: all deps build test test-nocgo vet demo bench soak fmt clean

all: build

deps:
	@bash scripts/deps.sh

build: deps
	$(GO) build -o $(BIN) ./cmd/kvflow

vet: deps
	$(GO) vet $(PKGS)

# The pure packages must build and test without cgo.
test-nocgo:
	CGO_ENABLED=0 $(GO) test -count=1 ./pipeline/... ./stages/plan/...

test: deps vet test-nocgo
	$(GO) test $(TESTFLAGS) $(PKGS)

demo: build
	./$(BIN) demo

bench: deps
	$(GO) test -run '^$$' -bench . -benchmem -count 1 ./bench/...

fmt:
	gofmt -w $$(git ls-files '*.go')

clean:
	rm -rf bin
