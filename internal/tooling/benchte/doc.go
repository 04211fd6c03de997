// Package benchte is `kvflow bench te`: Mooncake's transfer_engine_bench
// (mooncake-transfer-engine/example/transfer_engine_bench.cpp) over
// kvflow's pure-Go TCP engine (hw/mooncake), with the same flags, the same
// request layout and the same result line, so the two can be run side by
// side and against each other.
//
// # Modes
//
//	kvflow bench te --mode target [--local_server_name 10.0.0.2:17000] [--buffer_size N]
//	kvflow bench te --mode initiator --segment_id 10.0.0.2:17000 [--operation read|write] \
//	    [--block_size 65536] [--batch_size 128] [--threads 12] [--duration 10] [--no-verify]
//	kvflow bench te --mode loopback --duration 1    # both in one process, on 127.0.0.1
//
// The target maps --buffer_size bytes (default 1 GiB, transfer_engine_bench's
// default; anonymous mmap), fills them with the pattern (byte i of word w =
// i/8 is byte i%8 of (w+1)·0x9E3779B97F4A7C15), registers them as buffer
// "cpu:0", prints its session id and buffer address and serves until ctx is
// done (SIGINT/SIGTERM in cmd/kvflow):
//
//	Target started: segment_id 10.0.0.2:17000, buffer_addr 0x7f1932000000, buffer_size 1073741824, data_port 40741, pattern kvflow-word-v1
//
// The initiator learns the target's buffers as Mooncake's does in
// P2PHANDSHAKE mode: it sends its segment descriptor in a Metadata frame to
// the target's RPC port and decodes the target's reply. Thread t uses buffer
// t % len(buffers) (transfer_engine_bench's choice); --remote_addr skips the
// lookup and uses one address for every thread. Thread t's request i moves
// --block_size bytes at offset block_size*(i*threads + t) of both buffers; the
// threads submit batches of --batch_size requests until --duration is over
// (each thread runs at least one batch), then print, exactly as
// transfer_engine_bench logs it:
//
//	Test completed: duration 10.00, batch count 4071, throughput 1.66 GB/s
//
// (throughput = batches × batch_size × block_size / duration, in
// --report_unit with --report_precision digits.) The initiator maps only the
// block_size*batch_size*threads bytes it uses; like transfer_engine_bench,
// a --buffer_size smaller than that is raised, with a warning.
//
// # Verification (unless --no-verify)
//
// Reads: before each batch the destination blocks are cleared, after it
// every byte is compared with the pattern at its offset in the target's
// buffer. The time this takes is inside the measured duration: use
// --no-verify for the engine's own throughput. Writes send the pattern (so a
// standalone target stays valid for later readers); after the run every
// written range is read back and checked. In loopback mode a write run
// starts from a zeroed target buffer, which is also checked directly, so it
// proves the writes landed. A target that is not kvflow's (Mooncake's own
// bench) holds no pattern: run against it with --no-verify.
//
// # Flags of transfer_engine_bench
//
// Kept, same names and defaults: mode (initiator), segment_id, operation
// (read), block_size (65536), batch_size (128), threads (12), duration (10 s;
// fractions and Go durations accepted too), buffer_size (1 GiB),
// local_server_name (host[:port]; empty: the hostname on all interfaces for a
// target, 127.0.0.1 for an initiator; port 0 = any free one), report_unit
// (GB), report_precision (2), metadata_server (only P2PHANDSHAKE), protocol
// (only tcp). Not kept: device_name, nic_priority_matrix, auto_discovery,
// backend, GPU flags (they are for RDMA and GPUs). Added: --mode loopback,
// --no-verify (alias --no_verify), --remote_addr, --zero_target, --te_lanes, --te_no_event_loop,
// --te_chunk_size.
//
// # Contract
//
// Run returns a *clierr.UsageError for bad flags (every problem at once),
// flag.ErrHelp for -h, and a plain error for a failed batch, a failed
// verification, an unreachable target or a target buffer too small for the
// threads. An initiator interrupted through ctx prints what it measured and
// returns an error wrapping ctx.Err(); a target returns nil when ctx is done.
//
// # Never
//
// Never unmaps a buffer before the engine that registered it is closed;
// never leaves a goroutine running after Run returns; never writes outside
// block_size*batch_size*threads bytes of the target's buffer.
package benchte
