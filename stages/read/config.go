package read

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/stages/conf"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// Config is the read stage's configuration. Its JSON keys are the binary's
// read.* keys; Grants is read by the prefill side (which reads its
// transfer engine serves), the rest by the decode side's read stage.
type Config struct {
	Timeout conf.Duration `json:"timeout"` // one task's batch, end to end
	// PerPeerConcurrency bounds the batches in flight to one remote rank.
	PerPeerConcurrency int `json:"per_peer_concurrency"`
	// Grants (prefill) says which blocks the transfer engine serves:
	// auto (the default) serves a held request's blocks when its send
	// names them (kvflow's connector always does), and every block while
	// a request whose send named none is held (an engine that cannot
	// give them; warned at the first such send); on serves only named
	// blocks of held requests; off serves every registered byte at any
	// time, as Mooncake does. With grants, a read after a force-free, an
	// abort or a forged DONE is refused rather than served from reused
	// memory. A Mooncake or seed decode reads exactly the blocks of the
	// send (trimmed for prefix hits, whole prefill blocks for every head
	// slice), so it reads as before. A decode worker serves no read
	// whatever this says (nothing pulls from it), and no engine takes
	// peers' writes. true and false read as on and off.
	Grants GrantsMode `json:"grants"`
	// FusedStitch (decode) reads each prefill rank's slice of a block
	// straight into its place in the stitched block, row by row, when one
	// decode rank pulls from several prefill ranks and the transfer
	// engine can (the tcp backend; not mooncake): the head transpose then
	// costs no pass of its own over the cache. False reads as the seed
	// does and runs the stitch kernel afterwards. The bytes are the same.
	FusedStitch bool `json:"fused_stitch"`
}

// DefaultConfig is the read stage's defaults.
func DefaultConfig() Config {
	return Config{
		// A task moves at most a few GiB; at >= 1 GB/s that is seconds.
		// 30 s fails a wedged transfer long before the prefill side's
		// 480 s abort timeout frees the blocks under it.
		Timeout: conf.Duration(30 * time.Second),
		// Mooncake's 4 TCP lanes per peer: more batches to one peer
		// only queue behind them.
		PerPeerConcurrency: 4,
		FusedStitch:        true,
		// On wherever the engine names the blocks (kvflow's connector
		// always does), open only while a request it could not name
		// is held: a forged or early DONE cannot make a decode read
		// reused blocks, and Mooncake and seed peers read as before.
		Grants: GrantsAuto,
	}
}

// DefaultPool is the read stage's pool. A read worker waits for its
// request's batches: at least one round trip, however few bytes. Large
// batches are bounded per peer by PerPeerConcurrency (the engine's lanes),
// so more workers do not oversubscribe a link; they let small requests'
// round trips overlap (small 1-8 block requests across a 1 ms link: 8
// workers capped them at ~440 req/s), hence 32. 64 queued.
func DefaultPool() conf.Pool { return conf.Pool{Workers: 32, Queue: 64} }

// Validate reports every problem (conf.FieldErrors named by JSON key).
func (c Config) Validate() error {
	var v conf.Problems
	v.Positive("timeout", c.Timeout)
	v.AtLeast("per_peer_concurrency", c.PerPeerConcurrency, 1)
	if !c.Grants.Valid() {
		v.Add("grants", "want auto, on or off, got %q", string(c.Grants))
	}
	return v.Err()
}

// RegisterFlags binds c's fields to flags named prefix+"timeout",
// prefix+"per-peer", prefix+"grants" and (its name older than the
// prefix) "fused-stitch", with c's current values as defaults.
func (c *Config) RegisterFlags(fs *flag.FlagSet, prefix string) {
	fs.Var(&c.Timeout, prefix+"timeout", "one task's transfer batch ("+conf.Key(prefix, "timeout")+")")
	fs.IntVar(&c.PerPeerConcurrency, prefix+"per-peer", c.PerPeerConcurrency, "batches in flight per remote rank ("+conf.Key(prefix, "per_peer_concurrency")+")")
	fs.BoolVar(&c.FusedStitch, "fused-stitch", c.FusedStitch, "decode: land pulled slices straight in their stitched place when the engine can ("+conf.Key(prefix, "fused_stitch")+")")
	fs.Var(&c.Grants, prefix+"grants", "prefill: which blocks peers may read: auto (held requests' blocks; all while one without block ids is held), on (held requests' named blocks only), off (everything); default auto; give a mode with '=': --"+prefix+"grants=off (alone it means on) ("+conf.Key(prefix, "grants")+")")
}

// GrantsMode is read.grants: which reads a prefill worker's transfer
// engine serves. JSON: "auto", "on" or "off" (true and false read as "on"
// and "off", the setting's earlier boolean form).
type GrantsMode string

const (
	// GrantsAuto, the default: a held request whose send carries block
	// ids (kvflow's connector always sends them) has exactly those blocks
	// readable while it is held; one whose send carries none (an engine
	// that cannot name them) opens every block while it is held, with a
	// warning the first time. With no request held nothing is readable.
	GrantsAuto GrantsMode = "auto"
	// GrantsOn: only blocks named by a held request's send are readable;
	// a send without block ids makes nothing readable (its decode's reads
	// are refused).
	GrantsOn GrantsMode = "on"
	// GrantsOff: every registered byte is readable by any peer that
	// reaches the data port, at any time (Mooncake's behaviour).
	GrantsOff GrantsMode = "off"
)

// UnmarshalJSON implements json.Unmarshaler.
func (g *GrantsMode) UnmarshalJSON(b []byte) error {
	switch s := string(bytes.TrimSpace(b)); s {
	case "null":
		return nil
	case "true":
		*g = GrantsOn
		return nil
	case "false":
		*g = GrantsOff
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf(`want "auto", "on" or "off", got %s`, conf.Describe(b))
	}
	return g.Set(s)
}

// String implements flag.Value.
func (g *GrantsMode) String() string {
	if g == nil || *g == "" {
		return string(GrantsAuto)
	}
	return string(*g)
}

// Set implements flag.Value (auto, on, off; true and false as on and off).
func (g *GrantsMode) Set(s string) error {
	switch v := strings.ToLower(strings.TrimSpace(s)); v {
	case "auto", "on", "off":
		*g = GrantsMode(v)
	case "true", "1":
		*g = GrantsOn
	case "false", "0":
		*g = GrantsOff
	default:
		return fmt.Errorf(`want auto, on or off, got %q`, s)
	}
	return nil
}

// IsBoolFlag lets --read-grants alone mean on.
func (g *GrantsMode) IsBoolFlag() bool { return true }

// Valid reports whether g is one of the modes ("" reads as auto).
func (g GrantsMode) Valid() bool {
	return g == "" || g == GrantsAuto || g == GrantsOn || g == GrantsOff
}

// Peers is the handshake stage's metadata cache as a read sees it
// (handshake.Stage): a read that failed drops its rank's cached metadata
// (Invalidate), or, when its peer may have restarted, re-fetches it
// (Refetch: one fetch for all the reads that failed together, checked for
// compatibility like any other) to read once more.
type Peers interface {
	Invalidate(j *job.Job, task int)
	Refetch(ctx context.Context, j *job.Job, task int, used job.Meta, failedAt time.Time) (job.Meta, error)
}

// Deps is what the read stage works with.
type Deps struct {
	Transfer Transfer
	// Layout is the cache layout (block length per part, parts per
	// layer) shared by both sides; Local is this worker's caches.
	Layout plan.CacheLayout
	Local  plan.Caches
	// BlockSize is the tokens per block; with a LocalStride transfer and
	// Config.FusedStitch the stage fuses the head transpose into the
	// reads.
	BlockSize int
	// Peers, if set, is the metadata cache to invalidate and re-fetch
	// through after a failed read (nil: neither; no retry).
	Peers Peers
	// Guard, if set, is the stale-read guard (nil or checking nothing:
	// none).
	Guard      *Guard
	Registerer prometheus.Registerer
}

// New makes the read stage from its configuration and dependencies.
func New(cfg Config, d Deps) (*Stage, error) {
	o := Options{
		Layout: d.Layout, Local: d.Local, BlockSize: d.BlockSize,
		PerSession: cfg.PerPeerConcurrency, Timeout: cfg.Timeout.D(), NoFuse: !cfg.FusedStitch,
		Guard: d.Guard, Registerer: d.Registerer,
	}
	if d.Peers != nil {
		o.Invalidate, o.Refetch = d.Peers.Invalidate, d.Peers.Refetch
	}
	return build(d.Transfer, o)
}
