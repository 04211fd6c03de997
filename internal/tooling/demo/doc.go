// Package demo is kvflow's embedded default, run by `make demo`: it starts
// a prefill instance and a decode instance on loopback as separate
// `kvflow serve` processes (shared-memory caches, the pure-Go TCP transfer
// engine, real ZMQ side channels and control sockets), fills the prefill
// caches with a pattern only each (request, rank, layer, part, block) can
// produce, drives requests through the control sockets the way vLLM's
// scheduler drives the seed's connector (the scheduler rules are
// internal/sched's), verifies every byte on the decode
// side (stitched when one decode rank pulls from several prefill ranks) and
// prints a summary. It fails unless every request is done and every byte
// matches.
//
// Its tests also run the Python package's suite (clients/python/tests:
// the vLLM connector and the tiny engine whose disaggregated tokens must
// equal its monolithic ones) against a freshly built kvflow.
package demo
