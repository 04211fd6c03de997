package planstage

import (
	"github.com/kvflow/kvflow/stages/conf"
)

// DefaultPool is the plan stage's pool: planning is pure arithmetic
// (microseconds per request), so 1 worker; vLLM's default max_num_seqs is
// 256, so a whole scheduler step's loads queue without blocking the
// engine.
func DefaultPool() conf.Pool { return conf.Pool{Workers: 1, Queue: 256} }

// Config is the plan stage's configuration: it has no settings of its own
// beyond its pool (DefaultPool), which the binary's pipeline section sizes.
type Config struct{}

// DefaultConfig is the plan stage's defaults.
func DefaultConfig() Config { return Config{} }

// Validate reports nothing: there is nothing to get wrong.
func (Config) Validate() error { return nil }
