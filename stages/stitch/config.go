package stitch

import "github.com/kvflow/kvflow/stages/conf"

// DefaultPool is the stitch stage's pool: the stitch is a memory-bound
// copy, and 2 workers saturate memory bandwidth on small hosts without
// starving the transport; 64 queued.
func DefaultPool() conf.Pool { return conf.Pool{Workers: 2, Queue: 64} }

// Deps is what the stitch stage works on.
type Deps struct {
	// Kernel reorders blocks in place (hw/npu's Device); it may be nil
	// when no plan needs a stitch (tp_num_need_pulls == 1).
	Kernel Kernel
}

// Config is the stitch stage's configuration: it has no settings of its
// own beyond its pool (DefaultPool), which the binary's pipeline section
// sizes.
type Config struct{}

// DefaultConfig is the stitch stage's defaults.
func DefaultConfig() Config { return Config{} }

// Validate reports nothing: there is nothing to get wrong.
func (Config) Validate() error { return nil }

// New makes the stage.
func New(_ Config, d Deps) Stage { return Stage{Kernel: d.Kernel} }
