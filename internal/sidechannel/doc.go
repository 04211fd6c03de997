// Package sidechannel is kvflow's side channel: the ZMQ request/reply link
// between a decode worker and the prefill workers it pulls from, wire
// compatible with vllm-ascend's Mooncake connector (the seed). It owns every
// ZMQ socket of the side channel; no other package touches zmq for it. The
// pure encoding lives in package wire (no cgo), re-exported here.
//
// # Roles
//
// The prefill side runs a Server: a ROUTER bound on tcp://host:port (the
// seed's KVCacheSendingThread; handshake port = side_channel_port +
// pp_rank·tp + tp_rank + pcp_rank·prefill_tp). The decode side uses a Client
// (the seed's _get_remote_metadata / _send_done_recv_signal) with REQ
// sockets, pooled per peer "host:port".
//
// # Wire format (see package wire for the bytes)
//
//	D → P  [identity] "" msgpack [bin "get_meta_msg", ""]
//	P → D  [identity] "" msgpack {engine_id, te_rpc_port, kv_caches_base_addr, num_blocks}
//	D → P  [identity] "" msgpack [bin "done_recving_msg", request_id]
//	P → D  [identity] "" raw "ACK"
//
// The server, like the seed, accepts the payload with or without the empty
// delimiter frame (it ignores empty frames after the identity and requires
// exactly one non-empty one) and always replies [identity, "", reply].
// Metadata bytes equal msgspec's; kvflow's optional "kvflow" map field
// (Ext, e.g. boot_epoch) is sent only when set, and the seed's decoder
// ignores it.
//
// # Where kvflow deliberately differs from the seed
//
//   - Bad requests (wrong envelope, undecodable or wrongly typed msgpack,
//     unknown message type): the seed logs and drops them, so a REQ peer
//     waits for its timeout and its socket is stuck. kvflow logs them
//     (rate-limited), counts them in kvflow_sidechannel_bad_messages_total
//     {reason}, keeps serving, and by default answers "ERR <reason>" so the
//     peer fails at once; ServerOptions.DropBadMessages restores the seed's
//     silence. No well-formed request is ever answered with ERR except when
//     the Handler panics.
//   - DONE_RECVING is ACKed even when Handler.Done returns an error (as the
//     seed, which ACKs after updating its tracker); the error is logged and
//     counted (outcome "handler_error").
//   - ACKs are queued without blocking (a ROUTER drops replies to departed
//     peers); the seed's unbounded ACK busy-retry loop is gone.
//   - A client socket that timed out, failed, was cancelled or got an
//     unacceptable reply is closed and replaced, never returned to the pool
//     (the seed reuses stuck REQ sockets); each wait polls only its own
//     socket (the seed shares one Poller across all); one ZMQ context per
//     process (the seed makes one per socket).
//   - Retries are bounded (ClientOptions.Attempts, default 3 × 1 s as the
//     seed) and only for timeouts and socket errors; malformed replies, "ERR"
//     and non-ACK replies fail at once.
//
// # Socket ownership rules
//
//   - One Context (NewContext) per process, passed to every NewClient and
//     NewServer. Context.Close closes every client and server on it, waits
//     for all their sockets to close, then terminates libzmq's context.
//   - A Server's ROUTER and its wake-up PAIR belong to the server's one
//     goroutine; Close wakes it through the inproc PAIR (no timed polling)
//     and waits for it to close them. Handler methods run on that
//     goroutine, one request at a time: they must return promptly.
//   - A Client socket (REQ + its inproc wake-up PAIR) is owned by exactly one
//     call at a time: checked out of the peer's pool under a mutex (the
//     memory barrier libzmq requires to move a socket between threads), used
//     by that call only, then returned or closed. A cancelled context wakes
//     the call's poll through the PAIR, from a context.AfterFunc the call
//     waits for before it lets go of the socket.
//   - Every socket gets linger 0 at creation and again before Close.
//   - Peers are independent: MaxConnsPerPeer bounds the sockets (and
//     concurrent requests) per peer, so a slow peer only delays its callers.
//
// # Never
//
//   - never use a socket from two goroutines at once, or share a Poller;
//   - never reuse a REQ socket after a timeout, error or cancellation;
//   - never create a ZMQ context per socket or per call;
//   - never terminate the context with sockets open (Term would hang);
//   - never block the server goroutine on a send, or retry a send forever;
//   - never spin: waits are zmq_poll with a deadline, or on a wake socket;
//   - never put a request id in a metric label.
//
// # Metrics
//
// Registered once per Context on ContextOptions.Registerer:
// kvflow_sidechannel_requests_total{role,op,outcome},
// kvflow_sidechannel_request_duration_seconds{role,op},
// kvflow_sidechannel_bad_messages_total{reason},
// kvflow_sidechannel_socket_resets_total{reason} and
// kvflow_sidechannel_open_sockets. role is "client" or "server" (one process
// may be both), op "get_meta" or "done".
package sidechannel
