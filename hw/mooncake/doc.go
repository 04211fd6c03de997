// Package mooncake is kvflow's transfer engine: it moves KV-cache blocks
// between the memory of prefill (P) and decode (D) workers with the
// semantics of Mooncake's TransferEngine. A process registers memory
// regions by virtual address; a peer names the engine by its session id
// "host:rpc_port" and submits batches of (local address, remote address,
// length) reads or writes. Addresses are always the registering process's
// virtual addresses, as in Mooncake.
//
// # Backends
//
// [TCPEngine] is a pure-Go engine (the embedded default) that speaks
// Mooncake TransferEngine's own TCP transport, so a kvflow worker can read
// from, and serve, a C++ or Python Mooncake engine running with the
// "P2PHANDSHAKE" metadata mode and the "tcp" protocol. A cgo binding to
// Mooncake's C API (transfer_engine_c.h), for RDMA and Ascend deployments,
// is the subpackage mooncakec, built with the build tag "mooncake" (see
// README.md); default builds never need it. kvflow's node runs on it with
// node.te_backend "mooncake" in a binary built with that tag.
//
// # One interface, optional capabilities
//
// Engine is what every backend implements. What only some can do is an
// optional interface a caller resolves once, when it wires the engine
// (stages/read.Engine, internal/node), never per call: StridedReader
// (local strided rows: the fused head transpose), GatherReader (strided
// remote rows: head slices), LedgerReader (per-op landed bytes: the cgo
// engine), SegmentReader (a peer's registered buffers), Granter (read
// grants) and PeerAuthenticator (data-plane credentials). The TCP engine
// has all but LedgerReader; the cgo engine has LedgerReader only.
//
// # Contract
//
//   - Register refuses zero-length, wrapping, overlapping and duplicate
//     regions. Unregister waits until no transfer uses the region.
//   - BatchRead/BatchWrite are all-or-nothing in their result: nil only if
//     every op completed; otherwise a *BatchError with one error per op
//     (ErrNotAttempted for ops skipped after the first failure). The
//     contents of a failed op's destination are unspecified. Local ranges
//     must lie inside one registered region each; they are validated
//     before any I/O. A batch never returns while the engine still
//     touches its local memory, whether it succeeded, failed, was
//     cancelled through its context, or the engine was closed.
//   - A dead peer fails the batch: at once when its sockets close, after
//     IOTimeout of no progress when it is silent.
//   - The server serves only ranges fully inside one registered region
//     (and, with ReadGrants on, covered by granted ranges); anything else
//     is refused and counted in kvflow_transfer_rejected_total.
//
// # Wire protocol (Mooncake TCP transport)
//
// Handshake, on the RPC port, one exchange per connection: frames of
// uint64 little-endian length (counting the type byte), a uint8 type
// (Connection 0, Metadata 1, Notify 2, Probe 3; a first byte above 3
// means a legacy frame with no type byte) and a JSON payload, at most
// 1 MiB. The initiator sends its segment descriptor in a Metadata frame;
// the target answers with its own:
//
//	{"buffers":[{"addr":140245520400384,"length":1048576,"name":"10.0.0.2:17000"}],
//	 "name":"10.0.0.2:17000","protocol":"tcp","tcp_data_port":15432,
//	 "tcp_proto_version":2,"timestamp":"2025-06-01 12:00:00.123456"}
//
// (keys sorted, no whitespace, trailing newline, as jsoncpp's FastWriter
// writes it; addresses are uint64 and decoded as integers). The target
// then half-closes and waits for the initiator to close.
//
// Data, on tcp_data_port, persistent connections carrying requests one
// after another: a 24-byte header {uint64 size; uint64 addr; uint8 opcode;
// 7 bytes padding} little-endian, opcode READ 0 or WRITE 1, with bit 0x80
// set for protocol v2 (used when the target advertises
// tcp_proto_version >= 2). A READ is answered by size bytes from addr; a
// WRITE is followed by size bytes for addr. Under v2 the target sends an
// 8-byte status frame 0x4D435456_00000000 ("MCTV") before a READ's data
// and after a WRITE's data has been applied; 0x4D435456_00000001 means the
// range was refused, after which the target closes the connection (v1
// peers only see the close). Under v1 a WRITE is not acknowledged at all:
// its completion only means the payload left this engine.
//
// # Inside TCPEngine (ours, not Mooncake's)
//
// Per peer, Lanes persistent connections, each owned by one goroutine
// that takes requests from the peer's bounded queue, so the ops of a batch
// spread over the lanes; ops longer than ChunkSize are split, and READ ops
// whose remote ranges follow one another inside one of the peer's
// registered buffers (its segment descriptor lists them) are merged into
// one request of up to ChunkSize whose answer is scattered over their
// local ranges (with tp_num_need_pulls > 1 the planner reads each block
// of a rank's contiguous cache into its own strided place). The queue
// keeps requests per batch and lanes take from the batch with the fewest
// bytes not yet taken (shortest remaining first, ties to the older), so a
// small batch is not stuck behind the requests of large ones queued before
// it and, of several large batches, one finishes early instead of all
// late; the oldest batch is served at least once per eight of its
// requests' worth of bytes taken by others, so a stream of small batches
// keeps 7/8 of the link but cannot starve a large one. The per-peer depth bound (QueueDepth)
// holds back a new batch, except one shorter than every queued batch,
// which would be served first anyway. READs are pipelined: a lane keeps up
// to Pipeline (512) requests outstanding, or fewer once they add up to
// PipelineBytes (4 MiB) beyond the first two, sending the next headers
// while earlier responses stream (once the window is full it refills it
// only after half of it, by requests or by bytes, has been answered, and
// consumes the responses already buffered first, so one header write
// refills many slots instead of one per response), and consumes the
// responses in order
// (the target serves a connection's requests one after another,
// Mooncake's too). kvflow's target reads headers through a buffer and,
// while more pipelined READ headers are already buffered, gathers the
// answers of small READs (≤ 256 KiB each, ≤ 1 MiB or 64 together) into
// one writev; the lane reads answers through a 64 KiB buffer, so small
// ones cost a fraction of a syscall each and large ones are still read
// straight into place. When the connection breaks on one request (a refusal, a peer
// close, a cancelled batch's abort), the requests behind it were never
// served and are sent again on a fresh connection, a bounded number of
// times; a silent peer fails them all. WRITEs run one at a time, once no
// READ is outstanding on the lane. Reads of more than 64 KiB land
// straight in the destination memory and writes leave straight from the
// source (no staging copies), in socket I/O of up to ChunkSize (4 MiB).
// BatchReadGather (GatherReader) reads each op's bytes from strided remote
// rows into contiguous local memory: to a peer that negotiated kvflow's
// strided READ (below), as requests of whole rows up to ChunkSize, each
// answered with its rows back to back and read straight into place; to
// any other peer, as one READ per row.
// BatchReadStrided (StridedReader) sends the same requests but copies
// each answer out of the lane's buffer row by row to strided places
// (Stride): the decode side's head transpose, fused into the copy the
// receive makes anyway. Rows of 256 bytes or more are written with
// non-temporal stores (amd64 assembly, SSE2; a plain copy elsewhere),
// fenced before the request is reported done: into cold cache memory
// they run at about 3.5x an ordinary copy of 512-byte rows
// (BenchmarkScatterRows), since no line is read before it is overwritten. Completion is a channel close: nothing spins or polls. Every goroutine
// is owned by the engine and waited for in Close.
//
// # kvflow's strided READ (kvflow ↔ kvflow, negotiated)
//
// A decode rank whose TP is above the prefill's needs one slice of every
// token row of the prefill's blocks (a head slice): with Mooncake's READ,
// one request per row (1 KiB at TP 1 → 2 on Llama-8B-like shapes). kvflow
// adds one data-port op, never sent to a peer that did not advertise it:
//
//   - Negotiation, in the RPC handshake's segment descriptors: a kvflow
//     initiator's descriptor carries "kvflow_ops":1 (KvflowOpStridedRead;
//     the key sorts between "buffers" and "name", and is absent when 0).
//     A kvflow target puts the field in its reply only when the request
//     carried it, so a Mooncake initiator gets Mooncake's descriptor byte
//     for byte (TestGatherNegotiation); a Mooncake target ignores the
//     unknown key (its decoder reads the keys it knows) and its reply has
//     none, so the initiator reads it row by row. TCPConfig.NoKvflowOps
//     neither advertises, nor serves, nor sends the op.
//   - Request: the 24-byte header {size = rows × row, addr = first row,
//     opcode 0x82 (2 with the v2 bit; v2 only)} then {uint64 row; uint64
//     pitch}: StridedHeaderSize bytes. Answer: a READ's, v2 status then
//     size bytes, the rows back to back.
//   - The target checks the whole span, from addr to the last row's end
//     ((rows-1) × pitch + row), exactly as a READ of that span: inside one
//     registered region, and (ReadGrants) covered by grants, held while it
//     answers. A row of 0 bytes, a size that is not whole rows, rows that
//     overlap (pitch < row), or a span that overflows or wraps is refused
//     (reason bad_strided) before any lookup (ParseStrided, fuzzed); so is
//     the opcode without v2, and any strided request to a target with
//     NoKvflowOps (bad_opcode, as Mooncake would). The answer goes out by
//     writev straight from registered memory, at most 1024 rows or
//     ChunkSize bytes per write.
//
// # Connections an outsider can open
//
// Anyone who reaches the data or RPC port can connect, so nothing a
// connection holds is unbounded (TCPConfig, kvflow's node.limits):
//   - A data connection must start a request header within
//     FirstByteTimeout (10 s) of the accept and, between requests, within
//     IdleTimeout (5 min); a started header must complete within
//     IOTimeout. An RPC connection has HandshakeTimeout (5 s) for its whole
//     exchange. Cuts are counted in
//     kvflow_transfer_connections_timed_out_total{port,reason}.
//   - Each port holds at most MaxConns (32768) connections. Once it is
//     under pressure (it holds as many as it has room left for, under
//     MaxConns or the descriptor reserve), one address (IPv6: one /64)
//     may hold at most MaxConnsPerPeer (256) connections that have not
//     yet sent a valid request; a data connection whose first request
//     was valid counts only against MaxConns.
//   - A new connection to either port is refused when the process holds
//     more descriptors than the soft RLIMIT_NOFILE minus FDReserve (256):
//     the control socket, the side channel and HTTP keep room to accept
//     (libzmq aborts the process when an ipc:// accept finds no
//     descriptor). The count is read from /proc/self/fd at most every
//     10 ms and estimated from the engine's own connections in between.
//   - Refusals (a reset at accept) are counted in
//     kvflow_transfer_connections_refused_total{port,reason} (peer_cap,
//     total_cap, fd_reserve) and logged at most every 10 s.
//
// All of this runs once per connection, at accept or when it goes idle;
// the request path is unchanged. A new connection is cheap, since
// Mooncake's initiator opens one per request unless its connection pool is
// on. On Linux (without RequireAuth, and unless NoEventLoop) the data port
// is served by an event loop (loop_linux.go): one goroutine, its own epoll
// instance, non-blocking raw syscalls, no goroutine, netpoll registration
// or finalizer per connection; per one-shot connection accept4, read,
// writev, epoll_ctl, read of the end of stream, close. It serves a
// connection while each read brings exactly one whole plain READ header of
// registered (and granted) memory, writing the answer as the socket takes
// it (an answer of up to 256 KiB in one turn, a larger one 128 KiB per
// turn of the loop, so answers to
// many peers advance side by side and a peer that
// reads a huge answer as fast as it is written does not keep others
// waiting; the rest of a started header within one IOTimeout, as on the
// goroutine path), and hands the connection, between two requests and
// with the bytes read so far, to a goroutine of its own (serveData) for
// anything else: pipelined headers (kvflow's lanes, whose small answers
// serveData gathers into one writev), strided reads, WRITEs and requests
// to refuse (refused, counted and logged there, as without the loop).
// Handoffs are counted in
// kvflow_transfer_event_loop_handoffs_total. The caps, the descriptor
// reserve and the timeouts above apply on both paths; a grant cut resets a
// loop connection at the loop's next turn. On the goroutine path
// TCP_NODELAY and keep-alive are set once on each listener and inherited
// by what it accepts (one setsockopt per connection, the one Go always
// makes, instead of six), and a data connection's 64 KiB header buffer and
// pending-response list come from a pool (allocated per connection, the
// buffer was 96% of the bytes BenchmarkAuthConnect allocated, and zeroing
// and collecting it ~15% of that benchmark's CPU).
// An initiator with the pool off opens up to threads × batch size
// connections at once from one address (transfer_engine_bench's
// defaults: 12 × 128; the seed's decode: 32 threads × 61 × 2 × block
// groups), connecting for a whole batch before it writes the first
// header, so most of them are briefly pending: the per-address cap
// therefore waits for pressure, and counts only pending connections,
// and such a burst meets only MaxConns and the descriptor reserve. An
// initiator drops a lane idle for
// IdleTimeout/2 and dials afresh, so it never sends on a connection a
// kvflow target with the same setting is closing. A lane also redials
// when the peer was handshaken again since it connected (the peer may be
// a new process on the same RPC port). Under a flood, lanes
// already open keep working; a new lane may be refused, which fails the
// op it carried. What remains open to an outsider: silent connections
// from one address can take half of a port's room (then the per-address
// cap applies), several addresses the rest, refusing new legitimate
// connections until FirstByteTimeout cuts the outsiders'; under that
// pressure a legitimate one-shot burst is refused past MaxConnsPerPeer
// pending connections. A peer that sends valid requests keeps its
// connections (IdleTimeout between requests), up to MaxConns. With RequireAuth
// (below) only a peer holding a credential can send a request: others are
// cut at their first 8 bytes, or within the lesser of FirstByteTimeout
// and HandshakeTimeout.
//
// # Data-plane authentication (kvflow ↔ kvflow, optional)
//
// Mooncake's TCP transport authenticates nothing: whoever reaches the RPC
// port gets the segment descriptor (every registered buffer's address and
// length), and whoever reaches the data port reads any registered range
// (with ReadGrants, any granted one). TCPConfig.RequireAuth (kvflow's node
// sets it with auth.mode curve) closes both ports to anyone who cannot
// prove they hold a credential this engine issued, before a single byte of
// Mooncake's protocol is read or answered:
//
//   - At start the engine draws a 32-byte secret (crypto/rand) that never
//     leaves the process. AuthToken(key) = HMAC-SHA256(secret, label |
//     key) is the credential of a client's CURVE public key; the side
//     channel hands it out in the GET_META reply (the metadata extension's
//     "te_auth") only over CURVE, to the key the ZAP handler admitted, so
//     only clients the side channel admits ever hold one.
//   - Every new connection to either port starts with a challenge-response
//     (auth.go has the bytes): the initiator sends a hello with its key,
//     the target a fresh 32-byte nonce, the initiator HMAC-SHA256(token,
//     label | port | nonce | key), the target an 8-byte status (MCTV OK, or
//     rejected and close). The proof is compared in constant time. A token
//     never crosses the data plane; a proof is good for one nonce, one port
//     and one key, so one seen on the wire cannot be replayed.
//   - The hello's magic, read as a Mooncake frame length or header size,
//     is a value no Mooncake peer sends: a plain handshake or READ is
//     refused at its first 8 bytes, with no reply. Outcomes are counted in
//     kvflow_transfer_auth_total{port,outcome} (ok, no_hello, bad_proof,
//     incomplete) and refusals logged at most every 10 s.
//   - An initiator authenticates only to sessions given a Credential
//     (SetPeerCredential; kvflow's decode sets or clears it from each
//     GET_META reply), so it speaks Mooncake's plain protocol to Mooncake
//     engines and to kvflow targets that did not ask. Authentication runs
//     once per connection (the RPC exchange, each lane's dial); the request
//     path is unchanged.
//   - After the exchange the connection is Mooncake's protocol in the
//     clear: no encryption, no integrity. A passive observer of the path
//     sees segment descriptors and every byte read; an active one (able to
//     inject into or take over a TCP connection) can, after the exchange,
//     read through an authenticated connection or alter the bytes a decode
//     receives. The token is a bearer secret for its key until the engine
//     restarts: a decode whose memory leaks it lets the holder read as that
//     decode. Authorization is per peer, not per request: an authenticated
//     peer reads any registered range (with ReadGrants, any granted one).
//
// # Never
//
// The engine must never read or write memory outside a registered region,
// for a peer or for the local side of a batch; never serve a range that
// straddles regions or (with grants on) is not granted; never take a
// peer's write unless AcceptWrites is on; with RequireAuth, never read a
// request or answer a handshake before the peer proved its credential,
// and never send a token on the wire; never allocate a
// frame larger than the cap before validating its length; never send
// kvflow's strided READ to a peer whose handshake did not advertise it, or
// advertise it to an initiator that did not advertise its own; never decode
// addresses through float64; never spin a core waiting; never leave a
// goroutine running after Close; never return from a batch while a lane
// may still touch its memory; never panic on peer input.
package mooncake
