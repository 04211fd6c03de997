package decode

import (
	"github.com/prometheus/client_golang/prometheus"

	"log/slog"

	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/conf"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/lease"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan/planstage"
	"github.com/kvflow/kvflow/stages/read"
	"github.com/kvflow/kvflow/stages/stitch"
)

// This file is the decode chain: the one table of its stages, in order.
// Adding a stage is a package under stages/ (its Config, DefaultPool,
// metrics and New), a row here (and its field in StageSizes), and its
// pool's place in the binary's configuration (internal/config/stages.go).

// stageRow is one stage of the chain.
type stageRow struct {
	name string
	// pool is the stage package's DefaultPool; size is where
	// Options.Stages sizes the stage.
	pool func() conf.Pool
	size func(*StageSizes) *StageSize
	// seesFailed: failed jobs visit the stage too (notify must free the
	// prefill's blocks whatever happened).
	seesFailed bool
	// build makes the stage from the worker's options and the stages
	// built before it (b). What it returns may also act at admission,
	// when a request ends and at shutdown (hooks.go).
	build func(b *builder) (pipeline.Stage[*job.Job], error)
}

// chain is the decode pipeline, plan → handshake → read → stitch → notify.
var chain = []stageRow{
	{name: "plan", pool: planstage.DefaultPool, size: func(s *StageSizes) *StageSize { return &s.Plan }, build: (*builder).plan},
	{name: "handshake", pool: handshake.DefaultPool, size: func(s *StageSizes) *StageSize { return &s.Handshake }, build: (*builder).handshake},
	{name: "read", pool: read.DefaultPool, size: func(s *StageSizes) *StageSize { return &s.Read }, build: (*builder).read},
	{name: "stitch", pool: stitch.DefaultPool, size: func(s *StageSizes) *StageSize { return &s.Stitch }, build: (*builder).stitch},
	{name: "notify", pool: notify.DefaultPool, size: func(s *StageSizes) *StageSize { return &s.Notify }, build: (*builder).notify, seesFailed: true},
}

// StageSize is one stage's pool: its workers and the queue in front of it.
type StageSize = conf.Pool

// StageSizes are each stage's pool.
type StageSizes struct {
	Plan, Handshake, Read, Stitch, Notify StageSize
}

// DefaultStageSizes is every stage's DefaultPool (the stage packages hold
// the numbers and why; the binary's configuration defaults to the same).
func DefaultStageSizes() StageSizes {
	var s StageSizes
	for _, row := range chain {
		*row.size(&s) = row.pool()
	}
	return s
}

// SizesOf is StageSizes with each stage's pool from pool(name), e.g. the
// binary's configured pipeline section (config.Pipeline.Pool).
func SizesOf(pool func(stage string) conf.Pool) StageSizes {
	var s StageSizes
	for _, row := range chain {
		*row.size(&s) = pool(row.name)
	}
	return s
}

// Renewer sends kvflow's RENEW for request ids to a prefill rank's side
// channel and waits for the ACK (sidechannel.Client.Renew).
type Renewer = lease.Renewer

// builder builds the chain's stages in order; each may use the ones
// built before it.
type builder struct {
	o     Options
	reg   prometheus.Registerer
	log   *slog.Logger
	hooks hooks

	pl *planstage.Stage
	hs *handshake.Stage
}

func (b *builder) plan() (pipeline.Stage[*job.Job], error) {
	// The plan stage owns admission and the leases: it peeks at and fills
	// the handshake stage's cache, which it makes here for the handshake
	// stage to take over (one cache for both).
	hs, err := handshake.New(b.o.Handshake, handshake.Deps{
		Fetcher: b.o.Fetcher, LocalEngineID: b.o.LocalEngineID, Check: b.compat(), Registerer: b.reg,
	})
	if err != nil {
		return nil, err
	}
	b.hs = hs
	pl, err := planstage.New(planstage.Config{}, planstage.Deps{
		Topology: b.o.Topology, Self: b.o.Self, Renewer: b.o.Renewer, Peers: hs.Cache, Logger: b.log, Registerer: b.reg,
	})
	if err != nil {
		return nil, err
	}
	b.pl = pl
	return pl, nil
}

// compat is the handshake stage's compatibility check, with
// Options.LocalCache.
func (b *builder) compat() *handshake.CompatOptions {
	if b.o.LocalCache == nil {
		return nil
	}
	return &handshake.CompatOptions{Topology: b.o.Topology, Layout: b.o.Layout, Local: *b.o.LocalCache, Segments: b.o.PeerBuffers}
}

func (b *builder) handshake() (pipeline.Stage[*job.Job], error) {
	if k := b.pl.Leases(); k != nil {
		b.hs.Leases = k // leased at exactly the ranks its metadata advertised
	}
	return b.hs, nil
}

func (b *builder) read() (pipeline.Stage[*job.Job], error) {
	g := &read.Guard{AbortTimeout: b.o.PeerAbortTimeout}
	if k := b.pl.Leases(); k != nil {
		// A lease protects only when this worker renews it.
		g.Leases = k
	}
	return read.New(b.o.Read, read.Deps{
		Transfer: b.o.Transfer, Layout: b.o.Layout, Local: b.o.Local, BlockSize: b.o.BlockSize,
		Peers: b.hs, Guard: g, Registerer: b.reg,
	})
}

func (b *builder) stitch() (pipeline.Stage[*job.Job], error) {
	return stitch.New(stitch.Config{}, stitch.Deps{Kernel: b.o.Kernel}), nil
}

func (b *builder) notify() (pipeline.Stage[*job.Job], error) {
	return notify.New(b.o.Notify, notify.Deps{Sender: b.o.Sender, Logger: b.log, Registerer: b.reg})
}
