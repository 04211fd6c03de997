// Package benche2e is `kvflow bench e2e`: end-to-end throughput and
// latency of kvflow's decode pipeline against a serial baseline, measured
// in the same invocation on the same workers.
//
// A run starts one prefill instance and one decode instance on loopback:
// by default each rank is a `kvflow serve` process (internal/tooling/workers, as
// the demo launches them: shm caches mapped here, ipc:// control sockets,
// /metrics scraped for the per-stage histograms), driven the way vLLM
// drives the connector — send on the prefill ranks, load on the decode
// ranks, finished polled on every decode rank (a request is done at the
// reply that shows it done on its last rank). --in-process (and Options
// without Process, as BenchmarkE2E uses it) runs the ranks as nodes in
// this process instead (node.Start; results from OnFinish). With --netem
// the processes run in two network namespaces joined by an emulated link
// (internal/tooling/netem). The driver fills a pool of prefill blocks with
// internal/tooling/verify's pattern and drives each workload twice: "kvflow" loads every request as it arrives (all at once, or on
// the mixed preset's schedule) and lets the pipeline overlap them;
// "serial" loads one request, waits until every decode rank reported it
// done (handshake, read, stitch, DONE/ACK), then the next — the seed's
// design, on the same engine and sockets. Latency is from a request's
// arrival to its last decode rank's done. A sample of requests (or all) is
// checked byte by byte after each run.
//
// Rounds (--rounds, default 3): the modes run once per round, each round
// after a 1-connection raw TCP stream, and one more stream closes the last
// round. Every ratio (kvflow/serial, kvflow/raw against the mean of the
// streams around the round) is formed within its round and the report
// keeps the median of the rounds': on a shared two-core machine absolute
// figures drift by a third from minute to minute, and a ratio of figures
// taken minutes apart with them. Tables show each mode's median run.
//
// Memory: decode needs one distinct block per block of the run; prefill
// blocks are read only, so requests share a pool of at least 64 blocks.
// When the caches of the model's 32 layers would exceed --max-mem-gib,
// fewer layers are allocated and moved (said in the report): ops keep the
// full model's sizes, requests carry fewer of them.
//
// It must never leave workers running: every cluster is closed on return,
// also when ctx is cancelled (processes get SIGTERM, then their process
// group SIGKILL). Every bad input is a usage error before any worker
// starts.
package benche2e
