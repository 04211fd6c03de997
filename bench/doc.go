// Package bench holds kvflow's stage and end-to-end benchmarks, each
// measured against a same-run baseline and reporting the ratio (see
// RESULTS.md for figures and the commands that produced them):
//
//   - BenchmarkPlan: a 128-block request (GQA P = 4 and MLA, 64 layers):
//     planning (PlanRequest + every task's compact plan.Reads, the hand-off
//     to the read stage; kvflow_ns/request, target < 50 µs) and, timed
//     apart, expanding all ops into a []plan.Op (expand_ns/request; on the
//     request path the transfer adapter does this once, into the engine's
//     op list) vs a bare loop writing the same ops (base_ns/request);
//   - BenchmarkHandshake: the metadata cache, hit and miss (GET_META over
//     real ZMQ) vs a bare zmq4 REQ/REP round trip;
//   - BenchmarkRead: TCPEngine.BatchRead of a 16-block Llama-3-8B-like
//     request on loopback vs a raw Go TCP copy loop of the same pieces;
//   - BenchmarkStitch: npu.Host.Stitch vs copy() of the same bytes;
//   - BenchmarkSameHost: node.te_backend shm's read (hw/shm.Reader) vs a
//     plain copy() of the same bytes between the same two mappings and vs
//     TCPEngine.BatchRead on loopback;
//   - BenchmarkNotify: DONE_RECVING/ACK round trips vs bare REQ/REP;
//   - BenchmarkE2E: the `kvflow bench e2e` presets (internal/cli/benche2e),
//     kvflow's pipeline vs the serial baseline on the same workers;
//   - the pipeline's no-op chain is pipeline/bench_test.go's
//     BenchmarkChain.
//
// Nothing here runs without -bench: the package has no tests of its own
// beyond compiling, so `go test ./...` stays fast.
package bench
