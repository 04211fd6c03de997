// Package benche2e is `kvflow bench e2e`: end-to-end throughput and
// latency of kvflow's decode pipeline against a serial baseline, measured
// in the same invocation on the same workers.
//
// A run starts one prefill instance and one decode instance in this
// process (node.Start per rank: real TCP transfer engines and real ZMQ side
// channels on loopback; the demo starts processes instead), fills a pool of
// prefill blocks with internal/verify's pattern, and drives each workload
// twice: "kvflow" loads every request as it arrives (all at once, or on
// the mixed preset's schedule) and lets the pipeline overlap them;
// "serial" loads one request, waits until every decode rank reported it
// done (handshake, read, stitch, DONE/ACK), then the next — the seed's
// design, on the same engine and sockets. Latency is from a request's
// arrival to its last decode rank's done. A sample of requests (or all) is
// checked byte by byte after each run.
//
// Memory: decode needs one distinct block per block of the run; prefill
// blocks are read only, so requests share a pool of at least 64 blocks.
// When the caches of the model's 32 layers would exceed --max-mem-gib,
// fewer layers are allocated and moved (said in the report): ops keep the
// full model's sizes, requests carry fewer of them.
//
// It must never leave workers running: every cluster is closed on return,
// also when ctx is cancelled.
package benche2e
