// Command kvflow moves KV-cache blocks from prefill workers to decode
// workers in disaggregated LLM serving; one process per worker.
//
//	kvflow serve    one prefill or decode worker (config file + flags)
//	kvflow demo     prefill and decode workers on loopback, every byte verified
//	kvflow plan     validate a topology and print a request's plan
//	kvflow probe    fetch a side channel's metadata and cache fingerprint, compare it with a decode config, optionally send a DONE
//	                (--auth curve and serve's auth-*-key-file flags for CURVE)
//	kvflow bench    te (transfer engine, transfer_engine_bench flags), e2e
//	kvflow keygen   a CURVE key pair for auth.mode curve
//	kvflow version
//
// Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error.
// The command is thin: flags and config, wiring (internal/node), run. It
// must never hold behaviour a library package could test on its own.
package main
