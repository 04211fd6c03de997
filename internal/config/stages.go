package config

import (
	"flag"

	"github.com/kvflow/kvflow/stages/conf"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan/planstage"
	"github.com/kvflow/kvflow/stages/read"
	"github.com/kvflow/kvflow/stages/stitch"
)

// This file composes the decode stages' configurations: each stage
// package owns its Config (defaults, Validate, RegisterFlags) and its pool
// default (DefaultPool); this file gives them their places in the file
// (pipeline.workers.<stage>, pipeline.queues.<stage>, and a section per
// stage with settings) and their flags. Adding a stage is a field in
// StageSizes and a row in stageTable; a stage with settings adds its
// section to Config (an alias of its Config) and a row in sections.

// Pipeline sizes the decode pipeline.
type Pipeline struct {
	Workers StageSizes `json:"workers"` // goroutines per stage
	Queues  StageSizes `json:"queues"`  // bounded queue in front of each stage
}

// StageSizes is one number per decode stage.
type StageSizes struct {
	Plan      int `json:"plan"`
	Handshake int `json:"handshake"`
	Read      int `json:"read"`
	Stitch    int `json:"stitch"`
	Notify    int `json:"notify"`
}

// stageRow is one decode stage as the configuration knows it: its name
// (JSON key and flag prefix), its pool default, and where its numbers live
// in a StageSizes.
type stageRow struct {
	name string
	pool func() conf.Pool
	at   func(*StageSizes) *int
}

// stageTable lists the decode stages in pipeline order.
var stageTable = []stageRow{
	{"plan", planstage.DefaultPool, func(s *StageSizes) *int { return &s.Plan }},
	{"handshake", handshake.DefaultPool, func(s *StageSizes) *int { return &s.Handshake }},
	{"read", read.DefaultPool, func(s *StageSizes) *int { return &s.Read }},
	{"stitch", stitch.DefaultPool, func(s *StageSizes) *int { return &s.Stitch }},
	{"notify", notify.DefaultPool, func(s *StageSizes) *int { return &s.Notify }},
}

// DefaultPipeline is every stage's DefaultPool.
func DefaultPipeline() Pipeline {
	var p Pipeline
	for _, st := range stageTable {
		pool := st.pool()
		*st.at(&p.Workers), *st.at(&p.Queues) = pool.Workers, pool.Queue
	}
	return p
}

// Pool is stage's pool as configured (zero for an unknown stage).
func (p Pipeline) Pool(stage string) conf.Pool {
	for _, st := range stageTable {
		if st.name == stage {
			return conf.Pool{Workers: *st.at(&p.Workers), Queue: *st.at(&p.Queues)}
		}
	}
	return conf.Pool{}
}

// section is a stage's settings: its JSON section (also its flag prefix)
// and its Config's Validate and RegisterFlags.
type section struct {
	name     string
	validate func() error
	flags    func(fs *flag.FlagSet, prefix string)
}

// sections are the stages' settings sections of c, in file order.
func (c *Config) sections() []section {
	return []section{
		{"handshake", c.Handshake.Validate, c.Handshake.RegisterFlags},
		{"read", c.Read.Validate, c.Read.RegisterFlags},
		{"notify", c.Notify.Validate, c.Notify.RegisterFlags},
		{"peers", c.Peers.Validate, c.Peers.RegisterFlags},
	}
}

// registerStageFlags binds the pools' flags (<stage>-workers,
// <stage>-queue) and each section's own (<section>-...).
func (c *Config) registerStageFlags(fs *flag.FlagSet) {
	for _, st := range stageTable {
		w, q := st.at(&c.Pipeline.Workers), st.at(&c.Pipeline.Queues)
		fs.IntVar(w, st.name+"-workers", *w, "goroutines of the "+st.name+" stage (pipeline.workers."+st.name+")")
		fs.IntVar(q, st.name+"-queue", *q, "queue capacity in front of the "+st.name+" stage (pipeline.queues."+st.name+")")
	}
	for _, s := range c.sections() {
		s.flags(fs, s.name+"-")
	}
}

// validateStages reports the pools' and the sections' problems, each as a
// *FieldError with its full path.
func (c Config) validateStages(v *validator) {
	for _, st := range stageTable {
		for _, fe := range conf.Fields(conf.Pool{Workers: *st.at(&c.Pipeline.Workers), Queue: *st.at(&c.Pipeline.Queues)}.Validate()) {
			kind := "pipeline.workers."
			if fe.Field == "queue" {
				kind = "pipeline.queues."
			}
			v.errs = append(v.errs, &FieldError{Path: kind + st.name, Msg: fe.Msg, Err: fe})
		}
	}
	for _, s := range c.sections() {
		for _, fe := range conf.Fields(s.validate()) {
			v.errs = append(v.errs, &FieldError{Path: s.name + "." + fe.Field, Msg: fe.Msg, Err: fe})
		}
	}
}

// Duration is a time.Duration written in JSON as a Go duration string
// ("30s", "1m30s", "250ms"); the stages' configurations share it.
type Duration = conf.Duration

// GrantsMode is read.grants (stages/read owns it).
type GrantsMode = read.GrantsMode

// The read.grants modes.
const (
	GrantsAuto = read.GrantsAuto
	GrantsOn   = read.GrantsOn
	GrantsOff  = read.GrantsOff
)
