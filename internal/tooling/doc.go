// Package tooling is the parent of everything in kvflow that is not the
// product: the benchmarks (benche2e, benchresults, benchte), the soak
// driver (soak) and its fault injection (faults), network emulation
// (netem), the demo (demo) and the helpers these share (workers launches
// `kvflow serve` processes, verify fills and checks KV blocks, stagehist
// reads stage histograms), and testkit, the one package of helpers that
// tests share.
//
// The product is the rest of the module: pipeline/, stages/, hw/ and every
// package under internal/ but this one (config, control, decode, prefill,
// node, peers, sidechannel, pidlock, sched, cli/clierr, cli/plancmd, ...).
// cmd/kvflow is the only product package that may import tooling (it wires
// `kvflow demo` and `kvflow bench` as subcommands); tests of product
// packages may too.
//
// # Never
//
// Non-test code of a product package never imports a package under
// internal/tooling: TestProductDoesNotImportTooling (layout_test.go) fails
// the build's tests when one does.
package tooling
