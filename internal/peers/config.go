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
	// ReadPark: requests of all peers together that may wait beyond
	// their peer's ReadQueue (parked: the stage before read goes on at
	// once, so a slow peer never holds the others); 0 = four times the
	// read queue, -1 = none. A parked request costs its job record only
	// (its blocks were allocated by the engine before load).
	ReadPark int `json:"read_park"`
	// ReadStall bounds how long a peer's reads may run with none ending
	// well before the peer is stalled; it is stalled sooner, after eight
	// times its recent read time (the stage's while it has none; never
	// under 50 ms). Once the park budget is spent, a stalled peer's
	// requests beyond ReadQueue fail at once (reason peer_stalled)
	// instead of holding the stages before read. 0 = never (they wait).
	ReadStall conf.Duration `json:"read_stall"`
	// NotifyWorkers, NotifyQueue, NotifyPark, NotifyStall: the same for
	// the DONEs (0: all the notify workers but 1 in 16, half its queue, four times
	// its queue; never).
	NotifyWorkers int           `json:"notify_workers"`
	NotifyQueue   int           `json:"notify_queue"`
	NotifyPark    int           `json:"notify_park"`
	NotifyStall   conf.Duration `json:"notify_stall"`
	// DownAfter failed or timed-out handshakes, reads or DONEs in a row
	// (each counted against the peer whose hop failed; stall refusals do
	// not count, see the package doc) mark a peer down: its requests then
	// fail at once (reason peer_down) until a GET_META probe, every
	// ProbeInterval, answers.
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
		// The bound of the adaptive stall (see ReadStall). A healthy task
		// moves a few GiB at >= 1 GB/s: seconds. 10 s without one read
		// ending well is a wedged peer whatever its history, well before
		// read.timeout (30 s) fails its reads one by one.
		ReadStall: conf.Duration(10 * time.Second),
		// A DONE round trip takes a millisecond (so the adaptive stall is
		// its 50 ms floor); 5 s without one ACK is a peer that no longer
		// answers whatever its history (a DONE's retries end in 3.3 s).
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
	v.AtLeast("read_park", c.ReadPark, -1)
	v.NonNegative("read_stall", c.ReadStall)
	v.AtLeast("notify_workers", c.NotifyWorkers, 0)
	v.AtLeast("notify_queue", c.NotifyQueue, 0)
	v.AtLeast("notify_park", c.NotifyPark, -1)
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
	fs.IntVar(&c.ReadWorkers, prefix+"read-workers", c.ReadWorkers, "decode: one peer's requests reading at once, 0 = all read workers but 1 in 16 (at least 1)"+k("read_workers"))
	fs.IntVar(&c.ReadQueue, prefix+"read-queue", c.ReadQueue, "decode: one peer's requests waiting to read, 0 = half the read queue"+k("read_queue"))
	fs.IntVar(&c.ReadPark, prefix+"read-park", c.ReadPark, "decode: requests parked beyond their peer's read queue, all peers, 0 = 4x the read queue, -1 = none"+k("read_park"))
	fs.Var(&c.ReadStall, prefix+"read-stall", "decode: at most this long with no good read (sooner: 8x the peer's read time, >= 50ms) a peer is stalled; its overflow beyond the park fails at once, 0 = never"+k("read_stall"))
	fs.IntVar(&c.NotifyWorkers, prefix+"notify-workers", c.NotifyWorkers, "decode: one peer's requests in the notify stage at once, 0 = all its workers but 1 in 16 (at least 1)"+k("notify_workers"))
	fs.IntVar(&c.NotifyQueue, prefix+"notify-queue", c.NotifyQueue, "decode: one peer's requests waiting to notify, 0 = half the notify queue"+k("notify_queue"))
	fs.IntVar(&c.NotifyPark, prefix+"notify-park", c.NotifyPark, "decode: requests parked beyond their peer's notify queue, all peers, 0 = 4x the notify queue, -1 = none"+k("notify_park"))
	fs.Var(&c.NotifyStall, prefix+"notify-stall", "decode: at most this long with no ACK (sooner: 8x the peer's DONE time, >= 50ms) a peer is stalled; its overflow beyond the park fails at once, 0 = never"+k("notify_stall"))
	fs.IntVar(&c.DownAfter, prefix+"down-after", c.DownAfter, "decode: failed reads or DONEs in a row that mark a peer down"+k("down_after"))
	fs.Var(&c.ProbeInterval, prefix+"probe-interval", "decode: GET_META probe of a down peer, this often"+k("probe_interval"))
}
