package handshake

import (
	"flag"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/stages/conf"
)

// Config is the handshake stage's configuration: GET_META's per-attempt
// timeout, attempts and backoff (the side channel's handshake client, and
// together the bound of a job's whole handshake: FetchTimeout) and the
// metadata cache's size. Its JSON keys are the binary's handshake.* keys.
type Config struct {
	Timeout      conf.Duration `json:"timeout"`       // one attempt's wait for the reply
	Attempts     int           `json:"attempts"`      // tries per call (1 = no retry)
	RetryBackoff conf.Duration `json:"retry_backoff"` // pause before a retry
	// CacheSize bounds the cached metadata entries, one per (engine id,
	// handshake port).
	CacheSize int `json:"cache_size"`
}

// DefaultConfig is the handshake stage's defaults.
func DefaultConfig() Config {
	return Config{
		// The seed's 1 s socket timeout; loopback and LAN replies take
		// well under 1 ms.
		Timeout: conf.Duration(time.Second),
		// The seed's max_retries.
		Attempts: 3,
		// The seed's sleep between retries; longer than ZMQ's 100 ms
		// reconnect interval would not help more.
		RetryBackoff: conf.Duration(100 * time.Millisecond),
		// One entry per (engine id, handshake port), a few KiB each:
		// 4096 covers 256 prefill instances of 16 ranks.
		CacheSize: 4096,
	}
}

// DefaultPool is the handshake stage's pool: handshakes are network round
// trips, cached and deduplicated; a few in parallel hide a slow peer (8).
// After planning items wait on the network; 64 queued per stage bounds the
// memory held while showing backpressure early.
func DefaultPool() conf.Pool { return conf.Pool{Workers: 8, Queue: 64} }

// FetchTimeout bounds one fetch with its retries, and so a job's whole
// handshake: Attempts × (Timeout + RetryBackoff).
func (c Config) FetchTimeout() time.Duration {
	return time.Duration(max(1, c.Attempts)) * (c.Timeout.D() + c.RetryBackoff.D())
}

// Validate reports every problem (conf.FieldErrors named by JSON key).
func (c Config) Validate() error {
	var v conf.Problems
	v.Positive("timeout", c.Timeout)
	v.AtLeast("attempts", c.Attempts, 1)
	v.NonNegative("retry_backoff", c.RetryBackoff)
	v.AtLeast("cache_size", c.CacheSize, 1)
	return v.Err()
}

// RegisterFlags binds c's fields to flags named prefix+"timeout", ...,
// with c's current values as defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.Var(&c.Timeout, prefix+"timeout", "wait for one GET_META reply ("+conf.Key(prefix, "timeout")+")")
	fs.IntVar(&c.Attempts, prefix+"attempts", c.Attempts, "GET_META tries ("+conf.Key(prefix, "attempts")+")")
	fs.Var(&c.RetryBackoff, prefix+"retry-backoff", "pause before a GET_META retry ("+conf.Key(prefix, "retry_backoff")+")")
	fs.IntVar(&c.CacheSize, prefix+"cache-size", c.CacheSize, "cached remote metadata entries ("+conf.Key(prefix, "cache_size")+")")
}

// Deps is what the handshake stage works with.
type Deps struct {
	// Fetcher fetches a side channel's metadata (GET_META).
	Fetcher Fetcher
	// LocalEngineID is this worker's engine id; a peer claiming it is
	// rejected.
	LocalEngineID string
	// Check, if set, is the compatibility check of every peer's cache
	// against this worker's (nil: no check).
	Check *CompatOptions
	// Leases, if set, takes every job whose handshake ended (nil: no
	// leases).
	Leases     Leaser
	Registerer prometheus.Registerer
}

// New makes the handshake stage: its metadata cache (CacheSize entries,
// each fetch bounded by FetchTimeout) and, with Deps.Check, its
// compatibility check.
func New(cfg Config, d Deps) (*Stage, error) {
	c, err := NewCache(d.Fetcher, Options{
		Size: cfg.CacheSize, Timeout: cfg.FetchTimeout(), LocalEngineID: d.LocalEngineID, Registerer: d.Registerer,
	})
	if err != nil {
		return nil, err
	}
	s := &Stage{Cache: c, Leases: d.Leases}
	if d.Check != nil {
		o := *d.Check
		o.Registerer = d.Registerer
		if s.Compat, err = NewCompat(o); err != nil {
			return nil, err
		}
	}
	return s, nil
}
