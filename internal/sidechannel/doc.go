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
// # Connections from the network (ServerOptions.Limits)
//
// libzmq accepts on a tcp endpoint without any bound: a connection that
// never completes the ZMTP handshake lives ZMQ_HANDSHAKE_IVL (30 s), one
// that completes it forever. An outsider could so use up the process's
// descriptors, and libzmq aborts the process when an ipc:// listener (the
// control socket) then fails to accept. A Server with Limits (the node
// always sets them, from its config's node.limits) therefore owns its
// public port with a Go listener (front.go) that admits at most
// Limits.MaxConns connections,
// MaxConnsPerPeer per IP (IPv6: per /64), none while fewer than FDReserve
// descriptors are left (a relay costs three; bytes are copied through a
// buffer, not spliced, which would cost four more), and cuts one that sends
// nothing within FirstByteTimeout. Each admitted connection's bytes are
// relayed unchanged to the ROUTER, bound on a loopback tcp port (a tcp
// listener survives EMFILE). CURVE runs end to end through the relay; the
// ZAP handler sees 127.0.0.1 as every peer's address (keys are checked as
// before). Refusals: kvflow_sidechannel_connections_refused_total{reason}.
// Established connections may idle (REQ peers pool them): an outsider can
// still occupy the caps, as on the transfer engine's ports.
//
// # Wire format (see package wire for the bytes)
//
//	D → P  [identity] "" msgpack [bin "get_meta_msg", ""]
//	P → D  [identity] "" msgpack {engine_id, te_rpc_port, kv_caches_base_addr, num_blocks}
//	D → P  [identity] "" msgpack [bin "done_recving_msg", request_id]
//	P → D  [identity] "" raw "ACK"
//	D → P  [identity] "" msgpack [bin "renew_msg", [request_id, ...]]   (kvflow only)
//	P → D  [identity] "" raw "ACK"
//	D → P  [identity] "" msgpack [bin "done_batch_msg", [request_id, ...], msg_id]   (kvflow only; msg_id optional)
//	P → D  [identity] "" raw "ACK"
//
// The server, like the seed, accepts the payload with or without the empty
// delimiter frame (it ignores empty frames after the identity and requires
// exactly one non-empty one) and always replies [identity, "", reply].
// Metadata bytes equal msgspec's; kvflow's optional "kvflow" map field
// (Ext: boot_epoch, lease_ttl_ms, batch_done) is sent only when set, and
// the seed's decoder ignores it.
//
// RENEW (leases) is negotiated: a prefill Handler that implements Renewer
// advertises Ext.LeaseTTL, and a decode worker sends Client.Renew only to
// peers that advertised it, so a seed ROUTER never receives it. A Handler
// without Renewer (or HandlerFuncs without RenewFunc) answers it "ERR".
//
// # Batched DONE (kvflow only, negotiated)
//
// done_batch_msg carries 1 to wire.MaxDoneBatchIDs request ids and means
// exactly one DONE_RECVING per id, in order: the server calls Handler.Done
// for each (an id listed twice is counted twice, as two DONEs would be),
// then replies once, "ACK" — also when Done returned errors (logged once
// per message, outcome "handler_error"), as for DONE_RECVING — or
// "ERR internal error" when a Done call panicked (the other ids are still
// handed over). An empty list, non-str ids, too many ids or a msg_id that
// is not a uint are bad messages ("ERR decode: ..."). The client gives
// every message a random msg_id, the same on each retry of it; a server
// that has handed over a msg_id (of its last 65,536) answers a repeat
// "ACK" without calling Done again (outcome "duplicate"), so a batch whose
// ACK was late is not counted twice. Servers from before msg_id skip it.
//
// Every Server takes it, but a decode worker sends it only to a peer whose
// metadata advertised Ext.BatchDone (the prefill worker does, unless
// prefill.Options.NoBatchDone); seed peers and older kvflow servers never
// receive it and get SendDone's plain messages.
//
// Client.SendDoneBatched is a group commit per peer endpoint, without a
// timer: a caller that finds no DONE queued and fewer than
// ClientOptions.MaxDoneBatchesPerPeer messages in flight sends its own id
// at once on its own goroutine (SendDone's latency); otherwise its id
// queues and a batcher goroutine of that peer sends everything queued in
// the next message as soon as one in flight is answered, and exits when
// nothing is queued. Each caller returns the result of the message that
// carried its id. One caller's ctx never cancels a shared message (it is
// bounded by the attempts and Close); a cancelled caller returns at once,
// and its id is dropped if still queued or may still arrive if already
// sent. Close fails queued callers with ErrClosed; batchers are counted
// with the calls Close waits for, so none outlives the Client.
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
// # Authentication (optional, off by default)
//
// With ServerOptions.Curve and ClientOptions.Curve nil (the default) the
// side channel speaks the seed's plain protocol, which seed peers require.
// Setting them turns on ZMQ CURVE (RFC 26) for that socket; NewRouter (the
// control socket, tcp:// or ipc://) takes ServerOptions.Curve too.
//
//   - A client must know the server's public key (Curve.ServerPublicKey);
//     traffic is encrypted and the server proves it holds the secret key.
//   - With Curve.AuthorizedClients the server also admits only the listed
//     client public keys; without it, any client that knows the server key.
//     A client with no key pair of its own uses an ephemeral one (good only
//     for servers that admit any client).
//   - A peer that fails (no keys, wrong server key, unlisted key, or a seed
//     peer) never completes the handshake: libzmq drops it before any
//     message, so the Handler is never called, the peer gets no reply and
//     its call times out, and the server keeps serving everyone else. A
//     CURVE client never falls back to plaintext. Turn auth on for every
//     worker of a deployment at once.
//   - Client keys are checked by a ZAP handler (RFC 27) that each Context
//     runs itself: a ROUTER at inproc://zeromq.zap.01 on the Context's own
//     ZMQ context, owned by one goroutine, started by the first CURVE
//     server and stopped by Context.Close before libzmq is terminated.
//     pebbe/zmq4's AuthStart is not used: it binds on zmq4's default
//     context, which a Context's sockets never consult, so it would admit
//     every key. Each CURVE server has its own ZAP domain ("kvflow-N") and
//     key list; requests for unknown domains are denied (fail closed).
//     Servers without Curve use no ZAP domain and are not affected.
//   - ZAP denials are counted in kvflow_sidechannel_auth_denied_total
//     {reason} and logged (rate-limited) with the peer address and key.
//     Handshake failures (no keys, wrong server key) are not reported by
//     libzmq to the server: they show only as client timeouts.
//   - Keys are Z85 text (40 characters). LoadCurveKeys reads the files the
//     configuration names (auth.*_file): one key per file, the authorized
//     file one per line ("KEY [comment]", '#' comment lines); the pair
//     must match, and an authorized file without keys is an error rather
//     than "admit anyone". GenerateKeyPair, WriteKeyFile (never
//     overwrites; secret files 0600) and WriteKeyPair make them. A Curve
//     prints (String, LogValue) without its secret key.
//   - A client has one ServerPublicKey: every prefill worker a decode
//     worker dials shares one server key pair.
//   - ServerOptions.AuthToken (CURVE servers only) binds a data-plane
//     credential to each client: for every GET_META the server reads the
//     client's public key from the message (the ZAP handler's User-Id,
//     which libzmq attaches to the peer's frames, not to the ROUTER's
//     routing-id frame) and sends AuthToken(key) as Ext.TEAuth. Only a
//     client the ZAP handler admitted gets one, and only over CURVE;
//     Client.PublicKey is the key a client's credential is bound to (see
//     package mooncake, "Data-plane authentication").
//
// # Metrics
//
// Registered once per Context on ContextOptions.Registerer:
// kvflow_sidechannel_requests_total{role,op,outcome},
// kvflow_sidechannel_request_duration_seconds{role,op},
// kvflow_sidechannel_bad_messages_total{reason},
// kvflow_sidechannel_socket_resets_total{reason},
// kvflow_sidechannel_auth_denied_total{reason},
// kvflow_sidechannel_done_batch_ids{role} (ids per done_batch_msg) and
// kvflow_sidechannel_open_sockets. role is "client" or "server" (one process
// may be both), op "get_meta", "done", "renew" or "done_batch" (one per
// message, whatever its id count).
package sidechannel
