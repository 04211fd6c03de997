package soak

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/tooling/faults"
	"github.com/kvflow/kvflow/internal/tooling/testkit/loopback"
	"github.com/kvflow/kvflow/stages/plan"
)

// Options shape a loopback cluster: prefill instances of PrefillTP ranks
// each, one decode instance of DecodeTP ranks, all real workers (real
// side channel over ZMQ, real TCP transfer engine, host memory caches).
type Options struct {
	// PrefillTP and DecodeTP are the instances' tensor-parallel sizes;
	// PrefillTP >= DecodeTP keeps one DONE per prefill rank. 4 and 2: a
	// stitch (P = 2) and two decode ranks reading different prefill ranks.
	PrefillTP, DecodeTP int
	// Prefills is the number of prefill instances at start. 2: one can be
	// killed while the other keeps serving.
	Prefills int
	// Layers and Blocks size the model: 2 layers keep batches small; 128
	// blocks per cache leave room for ~30 requests of up to 4 blocks.
	Layers, Blocks int
	// AbortTimeout is the prefill side's force-free timeout: a request whose
	// DONE was dropped is freed after it. 2 s: far above a request's latency
	// under the injected delays (tens of ms), short enough to wait out.
	AbortTimeout time.Duration
	// LeaseTTL is the prefill side's tracker.lease_ttl (0: leases off, the
	// default here, so the other tests see the seed's expiry alone); decode
	// workers renew at ranks that advertise it. Decode workers know
	// AbortTimeout too (decode.Options.PeerAbortTimeout): without a lease,
	// a read that would start past it fails instead of reading.
	LeaseTTL time.Duration
	// HandshakeTimeout is one side-channel attempt's timeout (3 attempts).
	// 300 ms: a dead peer fails a request within ~1.5 s.
	HandshakeTimeout time.Duration
	Logger           *slog.Logger
}

// DefaultOptions are the options the driver tests use.
func DefaultOptions() Options {
	return Options{PrefillTP: 4, DecodeTP: 2, Prefills: 2, Layers: 2, Blocks: 128,
		AbortTimeout: 2 * time.Second, HandshakeTimeout: 300 * time.Millisecond}
}

func (o Options) withDefaults() Options {
	d := DefaultOptions()
	if o.PrefillTP == 0 {
		o.PrefillTP = d.PrefillTP
	}
	if o.DecodeTP == 0 {
		o.DecodeTP = d.DecodeTP
	}
	if o.Prefills == 0 {
		o.Prefills = d.Prefills
	}
	if o.Layers == 0 {
		o.Layers = d.Layers
	}
	if o.Blocks == 0 {
		o.Blocks = d.Blocks
	}
	if o.AbortTimeout == 0 {
		o.AbortTimeout = d.AbortTimeout
	}
	if o.HandshakeTimeout == 0 {
		o.HandshakeTimeout = d.HandshakeTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Prefill is one prefill instance: PrefillTP ranks behind kv_port Port.
type Prefill struct {
	Name  string // engine id
	Port  int
	Ranks []*node.Node
	Dead  bool
	regs  []*prometheus.Registry // each rank's metrics
}

// DecodeRank is one decode rank: a node (its cache, engine and side-channel
// client; the node's own decode worker stays idle) and the decode worker
// of the current round, built with fault wrappers around adapters of the
// node's client and engine.
type DecodeRank struct {
	Node   *node.Node
	Worker *decode.Worker
	Faults *faults.Injector
	reg    *prometheus.Registry // the node's metrics

	mu        sync.Mutex
	doneSends map[doneKey]int // SendDone calls reaching the real client
}

type doneKey struct{ endpoint, id string }

// DoneSent reports how many DONEs for request id to the side channel at
// endpoint reached the real client (after fault injection: a dropped DONE
// is not counted, a duplicated one twice).
func (d *DecodeRank) DoneSent(endpoint, id string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.doneSends[doneKey{endpoint, id}]
}

func (d *DecodeRank) forget(endpoints []string, id string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, ep := range endpoints {
		delete(d.doneSends, doneKey{ep, id})
	}
}

// Cluster is a loopback cluster.
type Cluster struct {
	Opts    Options
	Prefill []*Prefill
	Decode  []*DecodeRank
	next    int    // prefill instances started
	keys    string // the CURVE key files' directory, removed by Close
}

// Start starts a cluster; decode workers are built by Reset.
func Start(o Options) (_ *Cluster, err error) {
	o = o.withDefaults()
	c := &Cluster{Opts: o}
	defer func() {
		if err != nil {
			c.Close()
		}
	}()
	if err := c.writeKeys(); err != nil {
		return nil, fmt.Errorf("soak: keys: %w", err)
	}
	for range o.Prefills {
		if _, err := c.AddPrefill(); err != nil {
			return nil, err
		}
	}
	if err := c.startDecode(); err != nil {
		return nil, fmt.Errorf("soak: start decode: %w", err)
	}
	return c, nil
}

func (c *Cluster) config(role config.Role, kvPort int, engine string) config.Config {
	o := c.Opts
	cfg := loopback.Config(loopback.Worker{Role: role, EngineID: engine, KVPort: kvPort,
		Prefill: loopback.TP(o.PrefillTP), Decode: loopback.TP(o.DecodeTP),
		Model:            config.Model{NumLayers: o.Layers, NumKVHeads: 8, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: o.Blocks},
		HandshakeTimeout: o.HandshakeTimeout})
	cfg.Tracker.AbortRequestTimeout = config.Duration(o.AbortTimeout)
	cfg.Tracker.LeaseTTL = config.Duration(o.LeaseTTL)
	return cfg
}

// The cluster runs with auth.mode curve, as a production fleet whose
// data plane is authenticated: every side channel is encrypted, a prefill
// serves only the decode keys in its authorized_keys, and each GET_META
// reply hands the decode's transfer engine the credential it must present
// on the prefill's RPC and data ports (DataPlaneAuth counts them).
const (
	prefillKey     = "prefill"
	authorizedKeys = "authorized_keys"
)

func decodeKey(rank int) string { return fmt.Sprintf("decode-%d", rank) }

// writeKeys writes the prefill instances' key pair (one for all, as a
// fleet's prefill workers share the public key its decode workers are
// given), one key pair per decode rank, and the prefill's authorized_keys
// listing the decode ranks' public keys, in a new directory.
func (c *Cluster) writeKeys() error {
	dir, err := os.MkdirTemp("", "kvflow-soak-keys-")
	if err != nil {
		return err
	}
	c.keys = dir
	var authorized []byte
	for _, name := range append([]string{prefillKey}, decodeKeys(c.Opts.DecodeTP)...) {
		sec, pub := c.keyFiles(name)
		public, err := sidechannel.WriteKeyPair(sec, pub)
		if err != nil {
			return err
		}
		if name != prefillKey {
			authorized = append(authorized, public+"\n"...)
		}
	}
	return os.WriteFile(filepath.Join(dir, authorizedKeys), authorized, 0o600)
}

func decodeKeys(n int) []string {
	names := make([]string, n)
	for r := range names {
		names[r] = decodeKey(r)
	}
	return names
}

// keyFiles are the secret and public key files of key pair name.
func (c *Cluster) keyFiles(name string) (secret, public string) {
	return filepath.Join(c.keys, name+".key"), filepath.Join(c.keys, name+".pub")
}

// prefillAuth and decodeAuth are the auth sections of a prefill rank and
// of decode rank r.
func (c *Cluster) prefillAuth() config.Auth {
	sec, pub := c.keyFiles(prefillKey)
	return config.Auth{Mode: config.AuthCurve, SecretKeyFile: sec, PublicKeyFile: pub,
		AuthorizedKeysFile: filepath.Join(c.keys, authorizedKeys), DataPlane: config.DataPlaneAuthenticated}
}

func (c *Cluster) decodeAuth(r int) config.Auth {
	sec, pub := c.keyFiles(decodeKey(r))
	_, server := c.keyFiles(prefillKey)
	return config.Auth{Mode: config.AuthCurve, SecretKeyFile: sec, PublicKeyFile: pub, ServerPublicKeyFile: server,
		DataPlane: config.DataPlaneAuthenticated}
}

// AddPrefill starts a new prefill instance on free ports.
func (c *Cluster) AddPrefill() (*Prefill, error) {
	name := fmt.Sprintf("P%d", c.next)
	regs := make([]*prometheus.Registry, c.Opts.PrefillTP)
	ranks, port, err := loopback.StartRanks(nil, func(port int) []config.Config {
		cfgs := make([]config.Config, c.Opts.PrefillTP)
		for r := range cfgs {
			cfgs[r] = c.config(config.Prefill, port, name)
			cfgs[r].Rank = config.Rank{TP: r}
			cfgs[r].Auth = c.prefillAuth()
		}
		return cfgs
	}, func(r int) node.Deps {
		regs[r] = prometheus.NewRegistry()
		return node.Deps{Logger: c.Opts.Logger, Registerer: regs[r]}
	})
	if err != nil {
		return nil, fmt.Errorf("soak: start prefill instance: %w", err)
	}
	p := &Prefill{Name: name, Port: port, Ranks: ranks, regs: regs}
	c.next++
	c.Prefill = append(c.Prefill, p)
	return p, nil
}

// Kill closes every rank of p (a prefill instance dying); requests in
// flight to it must fail.
func (c *Cluster) Kill(p *Prefill) error {
	if p.Dead {
		return nil
	}
	p.Dead = true
	return loopback.CloseNodes(p.Ranks...)
}

// startDecode starts the decode instance's ranks on a free kv_port.
func (c *Cluster) startDecode() error {
	regs := make([]*prometheus.Registry, c.Opts.DecodeTP)
	ns, _, err := loopback.StartRanks(nil, func(port int) []config.Config {
		cfgs := make([]config.Config, c.Opts.DecodeTP)
		for r := range cfgs {
			cfgs[r] = c.config(config.Decode, port, "D")
			cfgs[r].Rank = config.Rank{TP: r}
			cfgs[r].Auth = c.decodeAuth(r)
		}
		return cfgs
	}, func(r int) node.Deps {
		regs[r] = prometheus.NewRegistry()
		return node.Deps{Logger: c.Opts.Logger, Registerer: regs[r]}
	})
	if err != nil {
		return err
	}
	c.Decode = nil
	for r, n := range ns {
		c.Decode = append(c.Decode, &DecodeRank{Node: n, reg: regs[r], doneSends: map[doneKey]int{}})
	}
	return nil
}

// Reset closes the decode workers of the last round (draining them) and
// builds new ones whose stage interfaces are wrapped by an injector of
// sched(rank). The wrapped interfaces are the node's own (node.Node's
// Fetcher and Transfer): GET_META over CURVE hands the transfer engine
// each prefill's data-plane credential, as in a node's decode worker.
func (c *Cluster) Reset(sched func(rank int) faults.Schedule) error {
	if err := c.closeWorkers(); err != nil {
		return err
	}
	for r, d := range c.Decode {
		in, err := faults.New(sched(r))
		if err != nil {
			return err
		}
		n := d.Node
		cfg := n.Config
		w, err := decode.New(decode.Options{
			Topology:         cfg.Topology(),
			Self:             cfg.Self(),
			LocalEngineID:    cfg.KVTransfer.EngineID,
			Fetcher:          in.Fetcher(n.Fetcher),
			Transfer:         in.Transfer(n.Transfer),
			Sender:           in.Sender(sender{n.Notify, d}),
			Renewer:          n.Notify,
			PeerAbortTimeout: cfg.Tracker.AbortRequestTimeout.D(),
			Kernel:           n.Device,
			Layout:           node.CacheLayout(n.Device.Layout()),
			Local:            plan.Caches{Base: n.Device.BaseAddrs(), NumBlocks: n.Shape.NumBlocks},
			Handshake:        cfg.Handshake,
			Read:             cfg.Read,
			Notify:           cfg.Notify,
			Registerer:       prometheus.NewRegistry(),
			Logger:           c.Opts.Logger,
		})
		if err != nil {
			return err
		}
		d.Worker, d.Faults = w, in
	}
	return nil
}

func (c *Cluster) closeWorkers() error {
	var errs []error
	for _, d := range c.Decode {
		if d.Worker == nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		errs = append(errs, d.Worker.Close(ctx))
		cancel()
		d.Worker = nil
	}
	return errors.Join(errs...)
}

// Close stops everything.
func (c *Cluster) Close() error {
	errs := []error{c.closeWorkers()}
	for _, d := range c.Decode {
		errs = append(errs, loopback.CloseNodes(d.Node))
	}
	for _, p := range c.Prefill {
		errs = append(errs, c.Kill(p))
	}
	c.Decode, c.Prefill = nil, nil
	if c.keys != "" {
		errs = append(errs, os.RemoveAll(c.keys))
		c.keys = ""
	}
	return errors.Join(errs...)
}

// sender is a side-channel sender that counts DONEs.
type sender struct {
	c *sidechannel.Client
	d *DecodeRank
}

func (s sender) SendDone(ctx context.Context, endpoint, reqID string) error {
	s.d.mu.Lock()
	s.d.doneSends[doneKey{endpoint, reqID}]++
	s.d.mu.Unlock()
	return s.c.SendDone(ctx, endpoint, reqID)
}

// Auth is what authentication did in the cluster so far: connections to
// the prefill ranks' transfer engines by outcome (kvflow_transfer_auth_total,
// every prefill instance started, killed ones included) and GET_META
// replies the decode ranks refused (kvflow_handshake_meta_refusals_total).
type Auth struct {
	OK, NoHello, BadProof, Incomplete int
	MetaRefused                       int
}

func (a Auth) String() string {
	return fmt.Sprintf("data-plane connections authenticated %d, refused: no hello %d, bad proof %d, incomplete %d; GET_META replies refused %d",
		a.OK, a.NoHello, a.BadProof, a.Incomplete, a.MetaRefused)
}

// Auth sums the counters of every node's registry.
func (c *Cluster) Auth() (Auth, error) {
	var a Auth
	for _, p := range c.Prefill {
		for _, reg := range p.regs {
			by, err := counters(reg, "kvflow_transfer_auth_total", "outcome")
			if err != nil {
				return Auth{}, err
			}
			a.OK += int(by["ok"])
			a.NoHello += int(by["no_hello"])
			a.BadProof += int(by["bad_proof"])
			a.Incomplete += int(by["incomplete"])
		}
	}
	for _, d := range c.Decode {
		by, err := counters(d.reg, "kvflow_handshake_meta_refusals_total", "reason")
		if err != nil {
			return Auth{}, err
		}
		for _, n := range by {
			a.MetaRefused += int(n)
		}
	}
	return a, nil
}

// counters sums counter name in reg by the value of its label.
func counters(reg *prometheus.Registry, name, label string) (map[string]float64, error) {
	mfs, err := reg.Gather()
	if err != nil {
		return nil, fmt.Errorf("soak: gather %s: %w", name, err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == label {
					out[lp.GetValue()] += m.GetCounter().GetValue()
				}
			}
		}
	}
	return out, nil
}
