// Package bench holds kvflow's stage and end-to-end benchmarks, each
// measured against a same-run baseline and reporting the ratio (see
// RESULTS.md for figures and the commands that produced them):
//
//   - BenchmarkPlan: PlanRequest + AppendOps for a 128-block request (GQA
//     P = 4 and MLA, 64 layers) vs a bare loop writing the same ops;
//   - BenchmarkHandshake: the metadata cache, hit and miss (GET_META over
//     real ZMQ) vs a bare zmq4 REQ/REP round trip;
//   - BenchmarkRead: TCPEngine.BatchRead of a 16-block Llama-3-8B-like
//     request on loopback vs a raw Go TCP copy loop of the same pieces;
//   - BenchmarkStitch: npu.Host.Stitch vs copy() of the same bytes;
//   - BenchmarkNotify: DONE_RECVING/ACK round trips vs bare REQ/REP;
//   - BenchmarkE2E: the `kvflow bench e2e` presets (internal/cli/benche2e),
//     kvflow's pipeline vs the serial baseline on the same workers;
//   - the pipeline's no-op chain is pipeline/bench_test.go's
//     BenchmarkChain.
//
// Nothing here runs without -bench: the package has no tests of its own
// beyond compiling, so `go test ./...` stays fast.
package bench
