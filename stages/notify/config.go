package notify

import (
	"flag"
	"time"

	"github.com/kvflow/kvflow/stages/conf"
)

// Config is the notify stage's configuration: the decode side's
// acknowledged messages to prefill, DONE_RECVING (plain or batched) and
// RENEW (leases). They are small idempotent messages answered "ACK", so
// they share a side-channel client of their own whose per-attempt Timeout,
// Attempts and RetryBackoff are these; together they also bound a job's
// whole notify stage (JobTimeout). Its JSON keys are the binary's
// notify.* keys.
type Config struct {
	Timeout      conf.Duration `json:"timeout"`       // one attempt's wait for the ACK
	Attempts     int           `json:"attempts"`      // tries per DONE (1 = no retry)
	RetryBackoff conf.Duration `json:"retry_backoff"` // pause before a retry
}

// DefaultConfig is the notify stage's defaults: the seed's DONE_RECVING
// uses the same 1 s timeout and 3 tries as its handshake.
func DefaultConfig() Config {
	return Config{
		Timeout:      conf.Duration(time.Second),
		Attempts:     3,
		RetryBackoff: conf.Duration(100 * time.Millisecond),
	}
}

// DefaultPool is the notify stage's pool: DONE/ACK round trips take ~1 ms
// each on a LAN and a request sends one per task; 16 workers match the
// side channel's sockets per peer. 64 queued.
func DefaultPool() conf.Pool { return conf.Pool{Workers: 16, Queue: 64} }

// JobTimeout bounds the DONE/ACK exchanges of one job: Attempts ×
// (Timeout + RetryBackoff).
func (c Config) JobTimeout() time.Duration {
	return time.Duration(max(1, c.Attempts)) * (c.Timeout.D() + c.RetryBackoff.D())
}

// Validate reports every problem (conf.FieldErrors named by JSON key).
func (c Config) Validate() error {
	var v conf.Problems
	v.Positive("timeout", c.Timeout)
	v.AtLeast("attempts", c.Attempts, 1)
	v.NonNegative("retry_backoff", c.RetryBackoff)
	return v.Err()
}

// RegisterFlags binds c's fields to flags named prefix+"timeout", ...,
// with c's current values as defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.Var(&c.Timeout, prefix+"timeout", "wait for one DONE_RECVING or RENEW ACK ("+conf.Key(prefix, "timeout")+")")
	fs.IntVar(&c.Attempts, prefix+"attempts", c.Attempts, "DONE_RECVING and RENEW tries ("+conf.Key(prefix, "attempts")+")")
	fs.Var(&c.RetryBackoff, prefix+"retry-backoff", "pause before a DONE_RECVING or RENEW retry ("+conf.Key(prefix, "retry_backoff")+")")
}
