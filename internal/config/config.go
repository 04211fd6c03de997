package config

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// Config is everything one kvflow worker (one prefill or decode rank) needs.
// Its JSON form is the configuration file; see the package documentation for
// precedence and the rules of the decoder.
type Config struct {
	// KVTransfer is vLLM's own kv_transfer_config object, verbatim (the value
	// of vllm serve --kv-transfer-config).
	KVTransfer KVTransferConfig `json:"kv_transfer_config"`
	// Model is the model and cache shape (the whole model, not this rank's
	// share: the per-rank share is computed by Shape).
	Model Model `json:"model"`
	// Rank is this worker's position in its instance.
	Rank Rank `json:"rank"`
	// Cache says where the KV cache memory lives.
	Cache Cache `json:"cache"`
	// Node holds the listen addresses of this worker.
	Node Node `json:"node"`
	// Pipeline sizes the decode pipeline's stages.
	Pipeline Pipeline `json:"pipeline"`
	// Handshake configures fetching remote agent metadata (GET_META).
	Handshake Handshake `json:"handshake"`
	// Read configures the transfer reads.
	Read Read `json:"read"`
	// Notify configures DONE_RECVING messages and their ACKs.
	Notify Notify `json:"notify"`
	// Peers isolates prefill peers on a decode worker (per-peer queues in
	// the read and notify stages) and tracks their health.
	Peers Peers `json:"peers"`
	// Tracker configures the prefill side's delayed frees.
	Tracker Tracker `json:"tracker"`
	// Shutdown configures the two-phase shutdown.
	Shutdown Shutdown `json:"shutdown"`
	// Log configures logging.
	Log Log `json:"log"`
	// Auth configures side-channel authentication (off by default).
	Auth Auth `json:"auth"`
}

// KVTransferConfig is vLLM's KVTransferConfig as JSON. Every field vLLM
// defines is accepted; the ones kvflow does not use (kv_buffer_*, kv_rank,
// kv_parallel_size, kv_ip, kv_connector_module_path, ...) are kept as given
// (nil when absent) so that --print-config shows the object unchanged.
type KVTransferConfig struct {
	KVConnector string `json:"kv_connector"`
	// EngineID is this instance's engine id; it must equal vLLM's, because
	// the scheduler hands it to peers as remote_engine_id.
	EngineID string `json:"engine_id"`
	// KVRole is "kv_producer" (prefill) or "kv_consumer" (decode).
	KVRole string `json:"kv_role"`
	// KVPort is the base of the instance's handshake ports (the seed's
	// side_channel_port = kv_port + dp_rank*tp*pp*pcp). vLLM passes it as a
	// number or a string; both are accepted.
	KVPort Port `json:"kv_port"`
	// KVConnectorExtraConfig carries the prefill and decode layouts; other
	// keys are preserved and ignored.
	KVConnectorExtraConfig ExtraConfig `json:"kv_connector_extra_config"`

	// Accepted for vLLM compatibility, unused by kvflow.
	KVRank                *int     `json:"kv_rank,omitempty"`
	KVParallelSize        *int     `json:"kv_parallel_size,omitempty"`
	KVIP                  *string  `json:"kv_ip,omitempty"`
	KVBufferDevice        *string  `json:"kv_buffer_device,omitempty"`
	KVBufferSize          *float64 `json:"kv_buffer_size,omitempty"`
	KVConnectorModulePath *string  `json:"kv_connector_module_path,omitempty"`
	EnablePermuteLocalKV  *bool    `json:"enable_permute_local_kv,omitempty"`
	KVLoadFailurePolicy   *string  `json:"kv_load_failure_policy,omitempty"`
}

// ExtraConfig is kv_connector_extra_config. Keys other than prefill and
// decode belong to other plugins (use_ascend_direct, ...): they are
// preserved in Extra (and printed) but never interpreted, and serve logs
// them once at warn (UnknownExtraKeys). A key one or two edits from
// prefill or decode ("prefil") is an error instead.
type ExtraConfig struct {
	Prefill Parallel                   `json:"prefill"`
	Decode  Parallel                   `json:"decode"`
	Extra   map[string]json.RawMessage `json:"-" kvflow:"extra"`
}

// Parallel is one instance's layout in kv_connector_extra_config. As in the
// seed, tp_size and dp_size are required and pp_size defaults to 1; pcp_size
// and dcp_size (kvflow additions, 0 or absent meaning 1) give the instance's
// context-parallel sizes. An unknown key is an error (with a did-you-mean):
// a misspelt size would silently keep its default.
type Parallel struct {
	TPSize  int `json:"tp_size"`
	DPSize  int `json:"dp_size"`
	PPSize  int `json:"pp_size"`
	PCPSize int `json:"pcp_size,omitempty"`
	DCPSize int `json:"dcp_size,omitempty"`
}

// Model is the model and KV-cache shape, for the whole model.
type Model struct {
	NumLayers  int `json:"num_layers"`   // hf_config.num_hidden_layers
	NumKVHeads int `json:"num_kv_heads"` // hf_config.num_key_value_heads (all ranks)
	HeadDim    int `json:"head_dim"`     // GQA head dimension; ignored with mla
	BlockSize  int `json:"block_size"`   // tokens per block (cache_config.block_size)
	// DType is the cache element type: bf16, fp16, fp32, int8, fp8 or a
	// torch/vLLM spelling of one (npu.ParseDType).
	DType     string `json:"dtype"`
	NumBlocks int    `json:"num_blocks"` // blocks per cache tensor (this rank)
	MLA       bool   `json:"mla"`        // model_config.is_deepseek_mla
	// KVLoraRank and QKRopeHeadDim are the MLA parts' widths (mla only).
	KVLoraRank    int `json:"kv_lora_rank"`
	QKRopeHeadDim int `json:"qk_rope_head_dim"`
	// Sparse adds the third (indexer) cache part; it requires mla.
	Sparse     bool `json:"sparse"`
	IndexerDim int  `json:"indexer_dim"`
	// PPLayerPartition is the prefill instance's VLLM_PP_LAYER_PARTITION
	// ("" = unset): comma-separated layers per prefill PP stage. kvflow never
	// reads the environment variable itself.
	PPLayerPartition string `json:"pp_layer_partition"`
	// DecodePPLayerPartition is the decode instance's
	// VLLM_PP_LAYER_PARTITION ("" = unset), for decode pp_size > 1
	// (kvflow ↔ kvflow only: the seed has no decode PP).
	DecodePPLayerPartition string `json:"decode_pp_layer_partition"`
}

// Rank is this worker's position in its instance (vLLM's tp/pp/dp/pcp/dcp
// ranks; dp is data_parallel_rank, as the seed's side_channel_port uses).
type Rank struct {
	TP  int `json:"tp"`
	PP  int `json:"pp"`
	DP  int `json:"dp"`
	PCP int `json:"pcp"`
	DCP int `json:"dcp"`
}

// Cache modes.
const (
	CacheAnonymous = "anonymous"  // private anonymous memory (npu.NewHost)
	CacheShm       = "shm"        // kvflow creates the shared-memory file (npu.CreateShm)
	CacheShmAttach = "shm_attach" // attach to a file the engine created (npu.OpenShm)
)

// Cache says where the KV cache memory lives. Its size follows from Model.
type Cache struct {
	// Mode is anonymous, shm or shm_attach.
	Mode string `json:"mode"`
	// Path is the shared-memory file (shm modes only). Empty: derived from
	// the engine id, role and ranks under /dev/shm (see CachePath).
	Path string `json:"path"`
	// RemoveOnClose removes the file at exit (shm only).
	RemoveOnClose bool `json:"remove_on_close"`
	// NoHugePages skips the huge-page attempts.
	NoHugePages bool `json:"no_huge_pages"`
	// NoLock leaves the caches pageable instead of locking them in memory
	// (mlock, as an RDMA registration pins them). Locked, no transfer
	// faults a page in, and reclaim never takes one; an unprivileged
	// worker whose RLIMIT_MEMLOCK is too small logs a warning and runs
	// unlocked.
	NoLock bool `json:"no_lock"`
}

// Transfer-engine backends.
const (
	// BackendTCP is hw/mooncake's pure-Go engine, which speaks Mooncake
	// TransferEngine's TCP transport: the default, in every build.
	BackendTCP = "tcp"
	// BackendMooncake is Mooncake's own transfer engine through its C API
	// (hw/mooncake/mooncakec.CgoEngine, RDMA or Ascend deployments): only
	// in a binary built with -tags mooncake (MooncakeBuilt); elsewhere
	// Validate rejects it (ErrMooncakeNotBuilt). What it lacks next to
	// the tcp engine the node does without, visibly (BackendFallbacks).
	BackendMooncake = "mooncake"
	// BackendShm is the TCP engine plus same-host reads without the
	// network (hw/shm), negotiated per peer: a prefill worker publishes
	// its cache file and a grant table in its metadata ("same_host"); a
	// decode worker maps the file of a peer on its host and copies from
	// it, and reads every other peer, or one whose claim does not hold,
	// over TCP (kvflow_shm_fallbacks_total, a warning).
	BackendShm = "shm"
)

// MooncakeTE configures Mooncake's transfer engine (node.te_backend
// mooncake). It always exchanges segment descriptors peer to peer on the
// RPC port (metadata P2PHANDSHAKE, as the seed's connector does), so a
// peer's session is the side channel's host and te_rpc_port.
type MooncakeTE struct {
	// Protocol is the transport Mooncake installs: rdma, tcp, ascend, ...
	Protocol string `json:"protocol"`
	// Location tags the registered cache memory ("cpu:0", "npu:0", ...).
	Location string `json:"location"`
	// NICPriorityMatrix is the rdma transport's JSON topology matrix; ""
	// lets Mooncake discover the NICs.
	NICPriorityMatrix string `json:"nic_priority_matrix"`
}

// Node holds this worker's listen addresses.
type Node struct {
	// SideChannelHost is the address the side channel binds (the seed binds
	// the worker's IP, get_ip()); prefill peers are dialed at the host the
	// scheduler advertises, so in a deployment set the worker's IP.
	SideChannelHost string `json:"side_channel_host"`
	// TEBackend is the transfer engine: tcp (kvflow's own, default), shm
	// (tcp plus same-host reads by mapping the peer's cache file,
	// BackendShm) or mooncake (Mooncake's engine through its C API; a
	// binary built with -tags mooncake, see BackendMooncake).
	TEBackend string `json:"te_backend"`
	// Mooncake configures the mooncake backend (ignored with tcp).
	Mooncake MooncakeTE `json:"mooncake"`
	// TEHost is the transfer engine's listen host; "" means SideChannelHost
	// (the seed starts its engine on the same IP).
	TEHost string `json:"te_host"`
	// TEPort is the transfer engine's RPC port; 0 picks a free one (it is
	// advertised in the metadata as te_rpc_port, so peers need not know it).
	TEPort int `json:"te_port"`
	// TEDataPort is the transfer engine's data port (the tcp engine's
	// tcp_data_port, which its segment descriptor advertises to peers
	// after the handshake on TEPort); 0 picks a free one at each start.
	// Fix it, with TEPort, to open a firewall for exactly two ports. The
	// tcp and shm backends apply it; mooncake refuses a fixed one (its
	// engine picks its data port itself).
	TEDataPort int `json:"te_data_port"`
	// Control is the control socket endpoint (ipc:// or tcp://); "" derives
	// ipc:///tmp/kvflow-<engine_id>-<role>-dp<d>-pp<p>-tp<t>.sock
	// (see ControlEndpoint).
	Control string `json:"control"`
	// MetricsAddr is host:port of /metrics, /healthz and /readyz; "" turns
	// the HTTP endpoint off.
	MetricsAddr string `json:"metrics_addr"`
	// Pprof also serves Go's profiler under /debug/pprof/ on MetricsAddr
	// (CPU and heap profiles of a live worker). Off by default: profiles
	// reveal internals and a CPU profile costs a few percent while it
	// runs.
	Pprof bool `json:"pprof"`
	// Limits bound what a peer that reaches this worker's ports can hold.
	Limits Limits `json:"limits"`
}

// Limits bound the connections a peer that reaches this worker's
// transfer-engine ports (data and handshake) and HTTP endpoint can open
// and keep, so that no one can pin the process's file descriptors. The
// transfer engine's defaults are hw/mooncake.DefaultTCPConfig's, where
// each number is justified.
type Limits struct {
	// TEFirstByteTimeout closes a data connection that sends no request
	// header this long after connecting.
	TEFirstByteTimeout Duration `json:"te_first_byte_timeout"`
	// TEIdleTimeout closes a data connection with no request for this
	// long; kvflow's own lanes are dropped and redialed after half of it.
	// Raise it if Mooncake initiators with a connection pool, idle
	// longer, read from this worker.
	TEIdleTimeout Duration `json:"te_idle_timeout"`
	// TEMaxConns caps the open connections of each transfer-engine port;
	// TEMaxConnsPerPeer those from one remote address (IPv6: one /64) that
	// have sent no valid request yet, once the port is half full
	// (mooncake.TCPConfig.MaxConnsPerPeer).
	TEMaxConns        int `json:"te_max_conns"`
	TEMaxConnsPerPeer int `json:"te_max_conns_per_peer"`
	// FDReserve keeps this many file descriptors free under the soft
	// RLIMIT_NOFILE: beyond, new transfer-engine connections are refused
	// so the control socket, the side channel and HTTP always have room;
	// new side-channel connections are refused below half of it (a flood
	// of either port leaves the control socket and HTTP room). 0 turns the
	// check off.
	FDReserve int `json:"fd_reserve"`
	// SideChannelMaxConns caps the open connections of a prefill worker's
	// side-channel port, SideChannelMaxConnsPerPeer those from one remote
	// address (IPv6: one /64); a connection beyond either is closed at
	// accept (sidechannel.Limits; libzmq itself accepts without bound).
	// They apply with every te_backend.
	SideChannelMaxConns        int `json:"side_channel_max_conns"`
	SideChannelMaxConnsPerPeer int `json:"side_channel_max_conns_per_peer"`
	// HTTPMaxConns caps the open connections of the metrics endpoint;
	// further ones are closed at once.
	HTTPMaxConns int `json:"http_max_conns"`
}

// Handshake is the handshake stage's configuration (stages/handshake
// owns its fields, defaults and checks): GET_META's timeout, attempts and
// backoff, and the metadata cache's size.
type Handshake = handshake.Config

// Read is the read stage's configuration (stages/read): the read timeout,
// the per-peer limit, fused stitching and the prefill side's read grants.
type Read = read.Config

// Notify is the notify stage's configuration (stages/notify): the DONE and
// RENEW client's timeout, attempts and backoff.
type Notify = notify.Config

// Peers is a decode worker's prefill-peer isolation and health
// (internal/peers owns its fields, defaults and checks).
type Peers = peers.Config

// Tracker configures the prefill side's delayed frees.
type Tracker struct {
	// AbortRequestTimeout force-frees a request not DONE within it (vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT; kvflow does not read the variable).
	// On a decode worker it is the prefill side's timeout assumed for
	// peers that advertise no lease (seed peers; the metadata does not
	// carry it): a read that would start later than this after the
	// request's admission is refused, since the blocks may have been freed
	// (kvflow_decode_stale_reads_refused_total). Keep it equal to the
	// prefill's.
	AbortRequestTimeout Duration `json:"abort_request_timeout"`
	// LeaseTTL turns leases on (prefill; 0 = off): the side channel's
	// metadata advertises it and kvflow decode workers renew the requests
	// they are still pulling every LeaseTTL/3. A renewed request is
	// force-freed LeaseTTL after its last renewal, whatever its abort
	// timeout: a short abort_request_timeout no longer frees blocks a live
	// kvflow decode still reads, and a dead decode's blocks are freed
	// LeaseTTL after its last renewal. Requests never renewed (seed decode
	// workers never renew) keep abort_request_timeout, as in the seed.
	LeaseTTL Duration `json:"lease_ttl"`
	// BatchDone (prefill) advertises batched DONEs in the metadata, so
	// kvflow decode workers send their DONEs to this worker several per
	// message (done_batch_msg); seed decode workers never do. False makes
	// every decode worker send plain DONE_RECVING, one per request.
	BatchDone bool `json:"batch_done"`
	// HeldAgeAlert (prefill): a request held (awaiting DONEs) longer than
	// this counts in kvflow_tracker_requests_held_past_age and is flagged
	// in /debug/kv: stranded blocks, freed only at the abort timeout.
	HeldAgeAlert Duration `json:"held_age_alert"`
}

// Shutdown configures the two-phase shutdown.
type Shutdown struct {
	// DrainTimeout is how long accepted requests may take to finish after
	// SIGTERM: on a decode worker, before the rest are canceled; on a
	// prefill worker (which refuses new sends at once), how long it keeps
	// serving GET_META, reads and DONEs for the requests it holds before it
	// stops. 0 stops at once.
	DrainTimeout Duration `json:"drain_timeout"`
}

// Log configures logging.
type Log struct {
	Level  string `json:"level"`  // debug, info, warn or error
	Format string `json:"format"` // auto (text on a TTY, else json), text or json
}

// Auth modes.
const (
	AuthOff   = "off"
	AuthCurve = "curve"
)

// Data-plane settings (auth.data_plane).
const (
	// DataPlaneAuthenticated: with auth.mode curve, the transfer engine's
	// RPC and data ports serve only peers holding a credential the side
	// channel handed them (the default with curve).
	DataPlaneAuthenticated = "authenticated"
	// DataPlaneOpen: the transfer engine's ports speak Mooncake's plain
	// protocol to anyone who reaches them, as with auth.mode off (for a
	// rolling upgrade from kvflow decode workers that cannot
	// authenticate).
	DataPlaneOpen = "open"
)

// Auth configures ZMQ CURVE authentication of the side channel. Key files
// hold one Z85 key each; they are read by the server, never by Validate.
type Auth struct {
	Mode string `json:"mode"` // off or curve
	// SecretKeyFile and PublicKeyFile are this worker's key pair.
	SecretKeyFile string `json:"secret_key_file"`
	PublicKeyFile string `json:"public_key_file"`
	// ServerPublicKeyFile (decode) is the prefill servers' public key.
	ServerPublicKeyFile string `json:"server_public_key_file"`
	// AuthorizedKeysFile (prefill, optional) lists the client public keys
	// allowed, one per line; empty admits any client holding the server key.
	AuthorizedKeysFile string `json:"authorized_keys_file"`
	// DataPlane (curve only) is "authenticated" (default when empty) or
	// "open"; see DataPlaneAuthenticated.
	DataPlane string `json:"data_plane"`
}

// DataPlaneAuth reports whether the transfer engine's ports require
// authentication: auth.mode curve, unless auth.data_plane is open.
func (a Auth) DataPlaneAuth() bool {
	return a.Mode == AuthCurve && a.DataPlane != DataPlaneOpen
}

// Default returns the defaults. Fields that describe the deployment
// (role, engine id, parallel sizes, model shape, number of blocks) have no
// safe default and are left zero, so Validate reports them as missing.
func Default() Config {
	te := mooncake.DefaultTCPConfig()
	return Config{
		KVTransfer: KVTransferConfig{
			// vllm-ascend's name for the seed's connector.
			KVConnector: "MooncakeConnectorV1",
			// vLLM's KVTransferConfig default, so a config that leaves
			// kv_port out gets the ports vLLM's own connector would use.
			KVPort: 14579,
			KVConnectorExtraConfig: ExtraConfig{
				// tp_size and dp_size stay 0: the seed asserts they are
				// given. pp_size is optional in the seed, default 1.
				Prefill: Parallel{PPSize: 1},
				Decode:  Parallel{PPSize: 1},
			},
		},
		Cache: Cache{
			// Private memory needs no file and no cleanup; the engine
			// attaching to the cache is an explicit choice.
			Mode: CacheAnonymous,
		},
		Node: Node{
			// Loopback: nothing is exposed until the operator says so; the
			// embedded demo runs P and D on one host.
			SideChannelHost: "127.0.0.1",
			TEBackend:       BackendTCP,
			Mooncake: MooncakeTE{
				// The reason to pick Mooncake's engine over kvflow's own
				// (which is faster over TCP) is its RDMA transport.
				Protocol: "rdma",
				// Host memory: the cache is an mmap'd region (hw/npu).
				Location: "cpu:0",
			},
			// 0: the OS picks a free RPC port, which the metadata
			// advertises (the seed's get_rpc_port does the same).
			TEPort: 0,
			// 0: the OS picks the data port too; the segment descriptor
			// advertises it, so only a firewall needs it fixed.
			TEDataPort: 0,
			// Loopback so /metrics is not exposed by default, port 0 so the
			// eight or sixteen workers of one host never collide; the bound
			// address is logged and reported by the status op. Set a fixed
			// port per worker for Prometheus scraping.
			MetricsAddr: "127.0.0.1:0",
			Limits: Limits{
				TEFirstByteTimeout: Duration(te.FirstByteTimeout),
				TEIdleTimeout:      Duration(te.IdleTimeout),
				TEMaxConns:         te.MaxConns,
				TEMaxConnsPerPeer:  te.MaxConnsPerPeer,
				FDReserve:          te.FDReserve,
				// A kvflow decode worker keeps up to 16 side-channel
				// connections to one prefill rank for its DONEs (the
				// side-channel client's MaxConnsPerPeer) and a few for
				// GET_META, shed after 2 min idle: 256 from one address is
				// a decode host of 8 to 16 ranks at full concurrency, 4096
				// sixteen such hosts (a seed decode worker holds fewer).
				// Each relayed connection costs three descriptors, which
				// fd_reserve bounds as well. internal/sidechannel's
				// DefaultLimits carry the same numbers (a node test pins
				// them: config cannot import that cgo package).
				SideChannelMaxConns:        4096,
				SideChannelMaxConnsPerPeer: 256,
				// A Prometheus server or two, a health checker and an
				// operator's curl need a handful; 64 leaves room for
				// several scrapers while an outsider cannot hold more.
				HTTPMaxConns: 64,
			},
		},
		// Each stage's pool and settings are its package's defaults.
		Pipeline:  DefaultPipeline(),
		Handshake: handshake.DefaultConfig(),
		Read:      read.DefaultConfig(),
		Notify:    notify.DefaultConfig(),
		Peers:     peers.DefaultConfig(),
		Tracker: Tracker{
			// vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default, which the
			// seed uses.
			AbortRequestTimeout: Duration(480 * time.Second),
			// 10 s: renewals every 3.3 s, one message per (decode worker,
			// prefill rank) however many requests, so the cost is nil;
			// a lease survives two lost renewals (each a side-channel call
			// of at most 3 × 1 s), and a dead decode's blocks come back
			// 10 s after its last renewal, whatever the abort timeout
			// (which still applies to requests never renewed).
			LeaseTTL: Duration(10 * time.Second),
			// Fewer side-channel round trips under load (16 concurrent
			// DONEs to one peer: 0.43 messages per DONE), no added
			// latency when idle; negotiated, so seed peers are unaffected.
			BatchDone: true,
			// A request's blocks are read within seconds of its send: two
			// minutes held is a decode that never came, long before the
			// 480 s abort timeout frees the blocks.
			HeldAgeAlert: Duration(120 * time.Second),
		},
		Shutdown: Shutdown{
			// Inside Kubernetes' default 30 s termination grace period,
			// leaving 5 s to report and close. On a prefill worker it is
			// the time a decode has to finish reading what the worker
			// holds: a request's reads take milliseconds to seconds, so
			// 25 s lets a rolling restart fail none but the stuck ones.
			DrainTimeout: Duration(25 * time.Second),
		},
		Log: Log{
			Level: "info",
			// Human-readable on a terminal, JSON for log collectors.
			Format: "auto",
		},
		Auth: Auth{
			// Off: the seed's plain protocol, which seed peers speak.
			Mode: AuthOff,
		},
	}
}

// Example returns a complete, valid configuration of the embedded demo's
// shape for one role: a Llama-3-8B-like model (32 layers, 8 KV heads, head
// dim 128, block size 128, bf16, 1024 blocks) with prefill TP 4 and decode
// TP 2 (so the stitch runs), engine ids "prefill-0" and "decode-0", kv_port
// 20001 (prefill) and 20101 (decode), rank 0.
func Example(r Role) Config {
	c := Default()
	kv := &c.KVTransfer
	kv.KVConnectorExtraConfig.Prefill = Parallel{TPSize: 4, DPSize: 1, PPSize: 1}
	kv.KVConnectorExtraConfig.Decode = Parallel{TPSize: 2, DPSize: 1, PPSize: 1}
	switch r {
	case Prefill:
		kv.KVRole, kv.EngineID, kv.KVPort = KVProducer, "prefill-0", 20001
	default:
		kv.KVRole, kv.EngineID, kv.KVPort = KVConsumer, "decode-0", 20101
	}
	c.Model = Model{
		NumLayers: 32, NumKVHeads: 8, HeadDim: 128, BlockSize: 128,
		DType: "bf16", NumBlocks: 1024,
	}
	return c
}

// Role is the worker's role.
type Role int

// Roles. The zero Role is invalid (a missing kv_role).
const (
	Prefill Role = iota + 1 // kv_producer
	Decode                  // kv_consumer
)

// vLLM's kv_role values.
const (
	KVProducer = "kv_producer"
	KVConsumer = "kv_consumer"
	KVBoth     = "kv_both"
)

func (r Role) String() string {
	switch r {
	case Prefill:
		return "prefill"
	case Decode:
		return "decode"
	}
	return fmt.Sprintf("Role(%d)", int(r))
}

// KVRole is the role's vLLM kv_role ("" for an invalid Role).
func (r Role) KVRole() string {
	switch r {
	case Prefill:
		return KVProducer
	case Decode:
		return KVConsumer
	}
	return ""
}

// ParseRole accepts vLLM's kv_producer / kv_consumer and kvflow's prefill /
// decode. kv_both is rejected: a kvflow worker runs one role.
func ParseRole(s string) (Role, error) {
	switch s {
	case KVProducer, "prefill":
		return Prefill, nil
	case KVConsumer, "decode":
		return Decode, nil
	case KVBoth:
		return 0, fmt.Errorf("%q is not supported: a kvflow worker is either prefill (kv_producer) or decode (kv_consumer); run one worker per role", s)
	case "":
		return 0, fmt.Errorf("missing: want %s (prefill) or %s (decode)", KVProducer, KVConsumer)
	}
	return 0, fmt.Errorf("unknown role %q: want %s (prefill) or %s (decode)", s, KVProducer, KVConsumer)
}

// Role is the worker's role from kv_role; 0 when kv_role is not valid.
func (c Config) Role() Role {
	r, _ := ParseRole(c.KVTransfer.KVRole)
	return r
}

func (p Parallel) plan(kvPort int) plan.Parallel {
	return plan.Parallel{TP: p.TPSize, PP: p.PPSize, DP: p.DPSize, PCP: p.PCPSize, DCP: p.DCPSize, KVPort: kvPort}
}

// own is this worker's instance layout (prefill for a producer, else decode).
func (c Config) own() Parallel {
	if c.Role() == Prefill {
		return c.KVTransfer.KVConnectorExtraConfig.Prefill
	}
	return c.KVTransfer.KVConnectorExtraConfig.Decode
}

// Topology is the P/D configuration for package plan. This worker's own
// instance carries kv_port; the other's KVPort is 0 (its base port arrives
// with each request as remote_port).
func (c Config) Topology() plan.Topology {
	ex := c.KVTransfer.KVConnectorExtraConfig
	var pPort, dPort int
	switch c.Role() {
	case Prefill:
		pPort = int(c.KVTransfer.KVPort)
	case Decode:
		dPort = int(c.KVTransfer.KVPort)
	}
	m := c.Model
	return plan.Topology{
		Prefill:                ex.Prefill.plan(pPort),
		Decode:                 ex.Decode.plan(dPort),
		Model:                  plan.Model{NumLayers: m.NumLayers, NumKVHeads: m.NumKVHeads, MLA: m.MLA, Sparse: m.Sparse},
		PPLayerPartition:       m.PPLayerPartition,
		DecodePPLayerPartition: m.DecodePPLayerPartition,
	}
}

// Self is this worker's rank.
func (c Config) Self() plan.Rank {
	r := c.Rank
	return plan.Rank{TP: r.TP, PP: r.PP, DP: r.DP, PCP: r.PCP, DCP: r.DCP}
}

// Shape is this worker's cache shape: the layers of its PP stage and, for
// GQA, its share of the KV heads (max(1, num_kv_heads / tp_size), as the
// seed computes it). The error names the bad fields.
func (c Config) Shape() (npu.Shape, error) {
	m := c.Model
	dt, err := npu.ParseDType(m.DType)
	if err != nil {
		return npu.Shape{}, &FieldError{Path: "model.dtype", Msg: err.Error(), Err: err}
	}
	own := c.own()
	layers := m.NumLayers
	if own.PPSize > 1 {
		part := m.PPLayerPartition
		if c.Role() == Decode {
			part = m.DecodePPLayerPartition
		}
		start, end, err := plan.PPIndices(m.NumLayers, c.Rank.PP, own.PPSize, part)
		if err != nil {
			return npu.Shape{}, rewrite(err)
		}
		layers = end - start
	}
	s := npu.Shape{
		NumLayers: layers,
		NumBlocks: m.NumBlocks,
		BlockSize: m.BlockSize,
		DType:     dt,
	}
	switch {
	case m.MLA:
		s.MLA, s.KVLoraRank, s.QKRopeHeadDim = true, m.KVLoraRank, m.QKRopeHeadDim
		s.Sparse, s.IndexerDim = m.Sparse, m.IndexerDim
	default:
		s.NumKVHeads, s.HeadDim = m.NumKVHeads, m.HeadDim
		if own.TPSize > 0 {
			s.NumKVHeads = max(1, m.NumKVHeads/own.TPSize)
		}
		s.Sparse, s.IndexerDim = m.Sparse, m.IndexerDim
		s.KVLoraRank, s.QKRopeHeadDim = m.KVLoraRank, m.QKRopeHeadDim
	}
	if err := s.Validate(); err != nil {
		return npu.Shape{}, &FieldError{Path: "model", Msg: err.Error(), Err: err}
	}
	return s, nil
}

// The accessors below assume a configuration that passed Validate; with an
// invalid kv_role they use the decode instance.

// HandshakePort is the port this worker's side channel listens on (the
// seed's handshake_port): kv_port + dp*tp*pp*pcp + (pp + pcp)*tp + tp_rank of
// its own instance.
func (c Config) HandshakePort() int {
	return plan.HandshakePort(int(c.KVTransfer.KVPort), c.own().plan(0), c.Self())
}

// SideChannelPort is the base port of this worker's DP replica (the seed's
// side_channel_port, which the prefill scheduler advertises as remote_port).
func (c Config) SideChannelPort() int {
	return plan.SideChannelPort(int(c.KVTransfer.KVPort), c.own().plan(0), c.Rank.DP)
}

// TEHost is the transfer engine's listen host: Node.TEHost, or the side
// channel host when that is empty.
func (c Config) TEHost() string {
	if c.Node.TEHost != "" {
		return c.Node.TEHost
	}
	return c.Node.SideChannelHost
}

// workerName is "<engine_id>-<role>-dp<d>-pp<p>[-pcp<c>]-tp<t>" with the
// engine id reduced to file-name-safe characters: unique per worker of a
// host, since each has its own handshake port.
func (c Config) workerName() string {
	id := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.', r == '_', r == '-':
			return r
		}
		return '_'
	}, c.KVTransfer.EngineID)
	if id == "" {
		id = "engine"
	}
	role := c.Role().String()
	if c.Role() == 0 {
		role = "worker"
	}
	pcp := ""
	if c.own().PCPSize > 1 {
		pcp = fmt.Sprintf("-pcp%d", c.Rank.PCP)
	}
	return fmt.Sprintf("%s-%s-dp%d-pp%d%s-tp%d", id, role, c.Rank.DP, c.Rank.PP, pcp, c.Rank.TP)
}

// ControlEndpoint is the control socket's endpoint: Node.Control, or
// ipc:///tmp/kvflow-<engine_id>-<role>-dp<d>-pp<p>-tp<t>.sock.
func (c Config) ControlEndpoint() string {
	if c.Node.Control != "" {
		return c.Node.Control
	}
	return "ipc:///tmp/kvflow-" + c.workerName() + ".sock"
}

// CachePath is the shared-memory file of the shm modes: Cache.Path, or
// /dev/shm/kvflow-<engine_id>-<role>-dp<d>-pp<p>-tp<t>. It is "" in
// anonymous mode.
func (c Config) CachePath() string {
	if c.Cache.Mode == CacheAnonymous {
		return ""
	}
	if c.Cache.Path != "" {
		return c.Cache.Path
	}
	return "/dev/shm/kvflow-" + c.workerName()
}

// Print writes the effective configuration as indented JSON (kvflow serve
// --print-config): c with the derived values filled in (node.control,
// node.te_host and, in the shm modes, cache.path; the names are derived only
// once kv_role and engine_id are set). kv_transfer_config is
// printed as given, with the vLLM fields kvflow ignores and the unknown keys
// of kv_connector_extra_config. The output loads back to the same
// configuration; comment keys ("//...") are not kept. When the transfer
// backend cannot do all the configuration asks (BackendFallbacks), a first
// comment key, "//node.te_backend <name> falls back", lists what it does
// instead.
func (c Config) Print(w io.Writer) error {
	fallbacks := c.BackendFallbacks()
	c.Node.TEHost = c.TEHost()
	if c.Role() != 0 && c.KVTransfer.EngineID != "" { // else the names would be placeholders
		c.Node.Control = c.ControlEndpoint()
		c.Cache.Path = c.CachePath()
	}
	b, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return fmt.Errorf("config: print: %w", err)
	}
	if len(fallbacks) > 0 {
		notes := make([]string, len(fallbacks))
		for i, f := range fallbacks {
			notes[i] = f.String()
		}
		var head bytes.Buffer
		enc := json.NewEncoder(&head)
		enc.SetEscapeHTML(false) // "→", "> 1" read as written
		enc.SetIndent("  ", "  ")
		head.WriteString("{\n  ")
		if err := enc.Encode("//node.te_backend " + c.Node.TEBackend + " falls back"); err != nil {
			return fmt.Errorf("config: print: %w", err)
		}
		head.Truncate(head.Len() - 1) // Encode's newline
		head.WriteString(": ")
		if err := enc.Encode(notes); err != nil {
			return fmt.Errorf("config: print: %w", err)
		}
		head.Truncate(head.Len() - 1)
		head.WriteString(",\n")
		b = append(head.Bytes(), b[2:]...) // b starts with "{\n"
	}
	b = append(b, '\n')
	_, err = w.Write(b)
	return err
}
