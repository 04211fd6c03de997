// Package testkit holds the helpers kvflow's tests share (and the tools
// that start workers the way tests do: soak, `kvflow bench e2e
// --in-process`), so that a test helper is written once instead of copied
// between packages.
//
//   - testkit (this package, standard library only, so that any package's
//     tests can import it without a cycle, cgo or not): the seed's reference
//     vectors (testdata/seedref) and loopback port selection.
//   - testkit/fakes: recording fakes of the read stage's Transfer and the
//     notify stage's Sender, for tests of code that wraps them.
//   - testkit/fakes/leasefake: a recording fake of the lease keeper's
//     Renewer, standard library only, so that stages/lease's own tests can
//     use it too (fakes imports stages/read, which imports stages/lease).
//   - testkit/loopback: loopback worker configurations and in-process
//     clusters of node.Start workers, started on free ports.
//
// # Never
//
// Product code never imports testkit (see internal/tooling's doc); testkit
// never writes outside a test's temporary directories and never asserts on
// a test's behalf beyond failing it when a helper itself cannot work.
package testkit
