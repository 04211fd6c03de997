// Package config is the configuration of one kvflow worker (one prefill or
// decode rank): vLLM's own kv_transfer_config object, the model and cache
// shape, this worker's ranks, where its KV cache lives, and kvflow's own
// settings (listen addresses, pool and queue sizes, timeouts, retries, log,
// authentication). It is a pure package: structs, a decoder, flag binding
// and validation, with no I/O beyond reading the file Load is given.
//
// # Sources and precedence
//
// defaults < file < flags. Default holds kvflow's settings, each number
// justified in its comment; the deployment's facts (kv_role, engine_id,
// tp_size/dp_size of both instances, the model shape, num_blocks) have no
// safe default and are reported missing by Validate. Example returns a
// complete configuration of the embedded demo's shape.
//
//	cfg, err := config.Parse(os.Args[2:], fs) // --config FILE, then the other flags
//	if err == nil { err = cfg.Validate() }    // every problem at once
//
// Parse finds --config wherever it is among the arguments, loads that file
// (Load) on top of Default, binds the flags of RegisterFlags to the loaded
// values and parses the arguments, so a flag always wins over the file.
// --kv-transfer-config takes vLLM's --kv-transfer-config JSON verbatim and
// merges it into kv_transfer_config in command-line order. Two command-line
// sources of one kv_transfer_config setting that disagree (--role decode and
// a --kv-transfer-config whose kv_role is kv_producer) are an error naming
// both, whatever their order; one flag given twice keeps its last value.
//
// # The file
//
// JSON, one object: kv_transfer_config (vLLM's object as is: kv_port may be a
// number or a string, every field vLLM defines is accepted and the unused
// ones kept; unknown keys at the top of kv_connector_extra_config belong to
// other plugins and are preserved and ignored (UnknownExtraKeys lists them
// for a warning), except a near miss of prefill or decode ("prefil"), which
// is an error, as is any unknown key inside prefill and decode), model, rank, cache, node,
// pipeline, handshake, read, notify, tracker, shutdown, log, auth. Absent
// fields keep their defaults. Durations are Go duration strings ("30s").
// Keys starting with "//" are comments and are dropped anywhere.
// deploy/examples/ holds annotated examples that run as written on one
// machine; testdata/example-*.json are the decoder's fixtures (vLLM-style
// spellings, multi-host values).
//
// Load and FromJSON report every problem of the document at once
// (errors.Join of *FieldError), each with "file:line:col" and the JSON path:
// invalid JSON, unknown fields (with a "did you mean" hint), duplicate
// fields and ill-typed values ("model.num_layers: want an integer, got
// string \"32\""). Keys match exactly (case-sensitive, as in vLLM).
//
// # Validation
//
// Validate reports every problem at once, each a *FieldError naming the
// field by JSON path, e.g.
// "kv_transfer_config.kv_connector_extra_config.decode.tp_size: must be >= 1,
// got 0 (missing?)". It runs plan.Topology.Validate (its field names mapped
// to this file's paths) and npu.Shape.Validate on this worker's shape, and
// checks kv_role (kv_both is rejected: a kvflow worker runs one role), the
// ranks against this role's sizes, ports, addresses, the control endpoint
// (including the unix socket path limit), pool and queue sizes, durations,
// log and auth settings.
//
// # Derived values
//
// Role, Topology, Self, Shape (this rank's layers and KV heads),
// HandshakePort and SideChannelPort (the seed's formulas via package plan),
// TEHost, ControlEndpoint (default
// ipc:///tmp/kvflow-<engine_id>-<role>-dp<d>-pp<p>-tp<t>.sock) and CachePath
// (default /dev/shm/kvflow-<engine_id>-<role>-dp<d>-pp<p>-tp<t> in the shm
// modes). Print writes the effective configuration with the derived values
// filled in; its output loads back to the same configuration.
//
// # Never
//
//   - never reads the environment: VLLM_NIXL_ABORT_REQUEST_TIMEOUT and
//     VLLM_PP_LAYER_PARTITION are tracker.abort_request_timeout and
//     model.pp_layer_partition (the prefill instance's;
//     model.decode_pp_layer_partition is the decode instance's, for
//     decode pp_size > 1, kvflow ↔ kvflow only), set explicitly;
//   - never reads a file other than the one passed to Load or named by
//     --config (key files and the cache file are opened by their users);
//   - never panics on bad input (FuzzFromJSON); never silently ignores an
//     unknown field outside the top level of kv_connector_extra_config;
//   - never stops at the first problem: the decoder and Validate report all.
package config
