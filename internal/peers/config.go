package peers

import (
	"flag"
	"time"

	"github.com/kvflow/kvflow/stages/conf"
)

// Config is a decode worker's prefill-peer isolation and health: the
// binary's peers.* keys. The read and notify stages keep one queue per
// peer (a keyed pipeline stage); the Tracker takes DownAfter and
// ProbeInterval. Zero Read*/Notify* sizes are derived from the stages'
// pools (see each field).
type Config struct {
	// MaxPeers bounds the distinct peers queued or tracked at once; a
	// request naming another fails (reason too_many_peers).
	MaxPeers int `json:"max_peers"`
	// ReadWorkers: one peer's requests in the read stage at once; 0 =
	// three quarters of the read workers, so a quarter is always free for
	// other peers.
	ReadWorkers int `json:"read_workers"`
	// ReadQueue: one peer's requests waiting for the read stage; 0 = half
	// its queue, so one peer never fills it.
	ReadQueue int `json:"read_queue"`
	// ReadStall: a peer none of whose reads succeeded for this long while
	// some ran is stalled, and its requests beyond ReadQueue fail at once
	// (reason peer_stalled) instead of holding the stages before read.
	// 0 = never (they wait).
	ReadStall conf.Duration `json:"read_stall"`
	// NotifyWorkers, NotifyQueue, NotifyStall: the same for the DONEs (0:
	// half the notify workers, half its queue; never).
	NotifyWorkers int           `json:"notify_workers"`
	NotifyQueue   int           `json:"notify_queue"`
	NotifyStall   conf.Duration `json:"notify_stall"`
	// DownAfter failed or timed-out reads or DONEs in a row mark a peer
	// down: its requests then fail at once (reason peer_down) until a
	// GET_META probe, every ProbeInterval, answers.
	DownAfter     int           `json:"down_after"`
	ProbeInterval conf.Duration `json:"probe_interval"`
}

// DefaultConfig is the defaults of Config.
func DefaultConfig() Config {
	return Config{
		// A decode worker talks to tens of prefill ranks, a large
		// deployment to hundreds: 1024 leaves room for both while a
		// flood of made-up peers costs at most 1024 small records.
		MaxPeers: DefaultMaxPeers,
		// A healthy task moves a few GiB at >= 1 GB/s: seconds. 10 s
		// without one read ending well is a wedged peer, well before
		// read.timeout (30 s) fails its reads one by one.
		ReadStall: conf.Duration(10 * time.Second),
		// A DONE round trip takes a millisecond; 5 s without one ACK is a
		// peer that no longer answers (a DONE's retries end in 3.3 s).
		NotifyStall:   conf.Duration(5 * time.Second),
		DownAfter:     DefaultDownAfter,
		ProbeInterval: conf.Duration(DefaultProbeInterval),
	}
}

// Validate reports every problem (conf.FieldErrors named by JSON key).
func (c Config) Validate() error {
	var v conf.Problems
	v.AtLeast("max_peers", c.MaxPeers, 1)
	v.AtLeast("read_workers", c.ReadWorkers, 0)
	v.AtLeast("read_queue", c.ReadQueue, 0)
	v.NonNegative("read_stall", c.ReadStall)
	v.AtLeast("notify_workers", c.NotifyWorkers, 0)
	v.AtLeast("notify_queue", c.NotifyQueue, 0)
	v.NonNegative("notify_stall", c.NotifyStall)
	v.AtLeast("down_after", c.DownAfter, 1)
	v.Positive("probe_interval", c.ProbeInterval)
	return v.Err()
}

// RegisterFlags binds c's fields to flags named prefix+"max" and so on,
// with c's current values as defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	k := func(key string) string { return " (" + conf.Key(prefix, key) + ")" }
	fs.IntVar(&c.MaxPeers, prefix+"max", c.MaxPeers, "decode: distinct prefill peers queued at once; more are refused"+k("max_peers"))
	fs.IntVar(&c.ReadWorkers, prefix+"read-workers", c.ReadWorkers, "decode: one peer's requests reading at once, 0 = 3/4 of the read workers"+k("read_workers"))
	fs.IntVar(&c.ReadQueue, prefix+"read-queue", c.ReadQueue, "decode: one peer's requests waiting to read, 0 = half the read queue"+k("read_queue"))
	fs.Var(&c.ReadStall, prefix+"read-stall", "decode: a peer with no good read for this long is stalled; its overflow fails at once, 0 = never"+k("read_stall"))
	fs.IntVar(&c.NotifyWorkers, prefix+"notify-workers", c.NotifyWorkers, "decode: one peer's requests in the notify stage at once, 0 = half its workers"+k("notify_workers"))
	fs.IntVar(&c.NotifyQueue, prefix+"notify-queue", c.NotifyQueue, "decode: one peer's requests waiting to notify, 0 = half the notify queue"+k("notify_queue"))
	fs.Var(&c.NotifyStall, prefix+"notify-stall", "decode: a peer with no ACK for this long is stalled; its overflow fails at once, 0 = never"+k("notify_stall"))
	fs.IntVar(&c.DownAfter, prefix+"down-after", c.DownAfter, "decode: failed reads or DONEs in a row that mark a peer down"+k("down_after"))
	fs.Var(&c.ProbeInterval, prefix+"probe-interval", "decode: GET_META probe of a down peer, this often"+k("probe_interval"))
}
