// Package verify fills prefill KV-cache blocks with a pattern only their
// (request, rank, layer, part, block) can produce and checks that a decode
// worker's blocks hold exactly what the seed's pull would have put there:
// the trimmed remote blocks, each task's heads in its head slot (the
// stitched layout when P > 1), the prefill PP stage's layers at their
// global layer index. The demo, the benchmarks and the integration tests
// use it; it never writes decode memory.
package verify
