package benchte

import (
	"errors"
	"flag"
	"fmt"
	"math/bits"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/kvflow/kvflow/hw/mooncake"
)

// Modes.
const (
	ModeTarget    = "target"
	ModeInitiator = "initiator"
	ModeLoopback  = "loopback"
)

// p2pHandshake is Mooncake's metadata_server value for the P2P handshake
// (segment descriptors exchanged on the RPC port), the only metadata mode
// the TCP engine speaks.
const p2pHandshake = "P2PHANDSHAKE"

// Bounds that keep a typo from spawning a million goroutines or ops.
const (
	maxThreads   = 1024
	maxBatchSize = 1 << 16
)

// rateUnits are transfer_engine_bench's --report_unit values.
var rateUnits = map[string]float64{
	"GB": 1e9, "GiB": 1 << 30, "Gb": 1e9 / 8,
	"MB": 1e6, "MiB": 1 << 20, "Mb": 1e6 / 8,
	"KB": 1e3, "KiB": 1 << 10, "Kb": 1e3 / 8,
}

// options are the flags of transfer_engine_bench that apply to the TCP
// engine, with its defaults, plus kvflow's --no-verify, --remote_addr and
// --mode loopback.
type options struct {
	mode            string
	segmentID       string
	operation       string
	blockSize       uint64
	batchSize       int
	threads         int
	duration        seconds
	bufferSize      uint64
	localServerName string
	metadataServer  string
	protocol        string
	reportUnit      string
	reportPrecision int
	noVerify        bool
	remoteAddr      uint64
	lanes           int
	chunkSize       int
	noEventLoop     bool
	zeroTarget      bool
}

func (o *options) register(fs *flag.FlagSet) {
	te := mooncake.DefaultTCPConfig()
	o.duration = seconds(10 * time.Second)
	fs.StringVar(&o.mode, "mode", ModeInitiator, "target (serve a patterned buffer until SIGINT), initiator (read/write a target's buffer), or loopback (both in this process)")
	fs.StringVar(&o.segmentID, "segment_id", "", "initiator: the target's session id host:rpc_port (printed by the target)")
	fs.StringVar(&o.operation, "operation", "read", "read or write")
	fs.Uint64Var(&o.blockSize, "block_size", 65536, "bytes of each transfer request")
	fs.IntVar(&o.batchSize, "batch_size", 128, "requests per batch")
	fs.IntVar(&o.threads, "threads", 12, "batch submission goroutines (1.."+strconv.Itoa(maxThreads)+")")
	fs.Var(&o.duration, "duration", "test duration in seconds (or a Go duration, e.g. 500ms)")
	fs.Uint64Var(&o.bufferSize, "buffer_size", 1<<30, "bytes of the target's buffer (raised to block_size*batch_size*threads if smaller); the initiator maps only block_size*batch_size*threads")
	fs.StringVar(&o.localServerName, "local_server_name", "", "host[:rpc_port] of this engine; empty: the hostname on all interfaces (target) or 127.0.0.1 (initiator, loopback), any free port")
	fs.StringVar(&o.metadataServer, "metadata_server", p2pHandshake, "metadata mode; only "+p2pHandshake+" (segment descriptors over the RPC port)")
	fs.StringVar(&o.protocol, "protocol", "tcp", "transport; only tcp")
	fs.StringVar(&o.reportUnit, "report_unit", "GB", "throughput unit: GB|GiB|Gb|MB|MiB|Mb|KB|KiB|Kb")
	fs.IntVar(&o.reportPrecision, "report_precision", 2, "digits after the point in the throughput")
	fs.BoolVar(&o.noVerify, "no-verify", false, "do not check the data against the target's pattern (needed against a target that is not kvflow's)")
	fs.BoolVar(&o.noVerify, "no_verify", false, "alias of --no-verify")
	fs.Uint64Var(&o.remoteAddr, "remote_addr", 0, "initiator: the target buffer's address (buffer_addr in its banner); 0 learns it from the target's segment descriptor")
	fs.IntVar(&o.lanes, "te_lanes", te.Lanes, "transfer engine: persistent connections per peer")
	fs.IntVar(&o.chunkSize, "te_chunk_size", te.ChunkSize, "transfer engine: largest request and socket I/O in bytes")
	fs.BoolVar(&o.zeroTarget, "zero_target", false, "target: serve a buffer never written (the kernel's zero page behind every read, as transfer_engine_bench's target does) instead of the pattern; initiators then need --no-verify")
	fs.BoolVar(&o.noEventLoop, "te_no_event_loop", false, "transfer engine: serve every data connection on a goroutine of its own, not on the data port's event loop (A/B runs)")
}

// validate checks the options and returns every problem; it also raises
// bufferSize to the bytes the threads touch, as transfer_engine_bench does
// (the returned note says so).
func (o *options) validate() (note string, err error) {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	switch o.mode {
	case ModeTarget, ModeInitiator, ModeLoopback:
	default:
		bad("--mode: %q, want target, initiator or loopback", o.mode)
	}
	if o.operation != "read" && o.operation != "write" {
		bad("--operation: %q, want read or write", o.operation)
	}
	if o.blockSize == 0 {
		bad("--block_size: must be >= 1")
	}
	if o.batchSize < 1 || o.batchSize > maxBatchSize {
		bad("--batch_size: %d outside 1..%d", o.batchSize, maxBatchSize)
	}
	if o.threads < 1 || o.threads > maxThreads {
		bad("--threads: %d outside 1..%d", o.threads, maxThreads)
	}
	if o.duration <= 0 {
		bad("--duration: must be > 0")
	}
	if o.bufferSize == 0 {
		bad("--buffer_size: must be >= 1")
	}
	if o.mode == ModeInitiator {
		if o.segmentID == "" {
			bad("--segment_id: required in initiator mode (the target's host:port)")
		} else if _, _, err := splitSession(o.segmentID); err != nil {
			bad("--segment_id: %v", err)
		}
	} else if o.segmentID != "" {
		bad("--segment_id: only for --mode initiator")
	}
	if o.remoteAddr != 0 && o.mode != ModeInitiator {
		bad("--remote_addr: only for --mode initiator")
	}
	if _, _, err := splitServerName(o.localServerName); err != nil {
		bad("--local_server_name: %v", err)
	}
	if o.metadataServer != p2pHandshake {
		bad("--metadata_server: %q; the TCP engine only speaks %s (no etcd/redis/http metadata service)", o.metadataServer, p2pHandshake)
	}
	if o.protocol != "tcp" {
		bad("--protocol: %q; only tcp (RDMA and Ascend need the cgo engine, not benchmarked here)", o.protocol)
	}
	if _, ok := rateUnits[o.reportUnit]; !ok {
		bad("--report_unit: %q, want GB|GiB|Gb|MB|MiB|Mb|KB|KiB|Kb", o.reportUnit)
	}
	if o.reportPrecision < 0 || o.reportPrecision > 9 {
		bad("--report_precision: %d outside 0..9", o.reportPrecision)
	}
	if o.lanes < 1 {
		bad("--te_lanes: must be >= 1")
	}
	if o.chunkSize < 1 {
		bad("--te_chunk_size: must be >= 1")
	}
	if len(errs) > 0 {
		return "", errors.Join(errs...)
	}
	req, ok := o.required()
	if !ok {
		return "", errors.New("--block_size x --batch_size x --threads overflows 64 bits")
	}
	if o.bufferSize < req {
		note = fmt.Sprintf("buffer_size %d is smaller than block_size*batch_size*threads, adjusted to %d", o.bufferSize, req)
		o.bufferSize = req
	}
	return note, nil
}

// required is the bytes the threads touch: block_size*batch_size*threads
// (thread t's request i is at offset block_size*(i*threads + t)).
func (o *options) required() (uint64, bool) {
	hi, n := bits.Mul64(o.blockSize, uint64(o.batchSize))
	if hi != 0 {
		return 0, false
	}
	hi, n = bits.Mul64(n, uint64(o.threads))
	return n, hi == 0
}

// splitSession parses a session id "host:port".
func splitSession(s string) (string, int, error) {
	host, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, fmt.Errorf("%q: want host:port", s)
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 1 || port > 65535 || host == "" {
		return "", 0, fmt.Errorf("%q: want host:port with port 1..65535", s)
	}
	return host, port, nil
}

// splitServerName parses --local_server_name: "", "host" or "host:port"
// (port 0 = any free one).
func splitServerName(s string) (string, int, error) {
	if s == "" {
		return "", 0, nil
	}
	if !strings.Contains(s, ":") || (strings.Count(s, ":") > 1 && !strings.HasPrefix(s, "[")) {
		return s, 0, nil // a host name or a bare IPv6 address
	}
	host, p, err := net.SplitHostPort(s)
	if err != nil {
		return "", 0, fmt.Errorf("%q: want host[:port]", s)
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("%q: port must be 0..65535", s)
	}
	return host, port, nil
}

// seconds is a duration flag that takes transfer_engine_bench's seconds
// ("10", "0.5") or a Go duration ("500ms").
type seconds time.Duration

func (s *seconds) String() string {
	if s == nil {
		return "0"
	}
	return strconv.FormatFloat(time.Duration(*s).Seconds(), 'f', -1, 64)
}

func (s *seconds) Set(v string) error {
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		if f <= 0 || f > 1e6 {
			return fmt.Errorf("%q: want seconds in (0, 1e6]", v)
		}
		*s = seconds(f * float64(time.Second))
		return nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return fmt.Errorf("%q: want seconds (10, 0.5) or a duration (500ms)", v)
	}
	*s = seconds(d)
	return nil
}
