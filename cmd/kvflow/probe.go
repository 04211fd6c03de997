package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

func runProbe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("probe")
	remote := fs.String("remote", "", "side channel `HOST:PORT` of a prefill worker (seed or kvflow)")
	done := fs.String("done", "", "also send DONE_RECVING for this `REQUEST_ID` and wait for the ACK: the prefill frees that request's blocks as after a decode's DONE (a decode still reading it fails); an id it has not sent yet is kept up to 30 s and frees it on arrival")
	asJSON := fs.Bool("json", false, "print JSON")
	timeout := fs.Duration("timeout", 3*time.Second, "overall timeout")
	cfgPath := fs.String("config", "", "a decode worker's JSON configuration `FILE` (as kvflow serve's --config): compare the peer's cache with the one it expects")
	// The same flags as kvflow serve's auth.* (a decode worker's view).
	var auth probeAuth
	fs.StringVar(&auth.mode, "auth", config.AuthOff, "side channel authentication: off|curve (as the server's auth.mode)")
	fs.StringVar(&auth.serverPublic, "auth-server-public-key-file", "", "with --auth curve: the prefill server's CURVE public key `FILE` (its auth.public_key_file)")
	fs.StringVar(&auth.secret, "auth-secret-key-file", "", "with --auth curve: this client's CURVE secret key `FILE` (kvflow keygen); with --auth-public-key-file, or neither for a one-off pair")
	fs.StringVar(&auth.public, "auth-public-key-file", "", "with --auth curve: this client's CURVE public key `FILE`; a server with auth.authorized_keys_file must list it")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	if *remote == "" {
		return usagef("--remote HOST:PORT is required")
	}
	if *timeout < time.Millisecond {
		return usagef("--timeout %v: must be at least 1ms", *timeout)
	}
	host, _, err := net.SplitHostPort(*remote)
	if err != nil {
		return usagef("--remote %q: want HOST:PORT: %v", *remote, err)
	}
	if err := auth.validate(); err != nil {
		return err
	}
	var exp *probeExpect
	if *cfgPath != "" {
		e, err := loadProbeExpect(*cfgPath)
		if err != nil {
			return err
		}
		exp = &e
	}
	// ZMQ resolves a name in the background and retries forever: an
	// unresolvable host would read as "no reply". Name the DNS failure.
	if net.ParseIP(host) == nil {
		rctx, cancel := context.WithTimeout(ctx, *timeout)
		_, err := net.DefaultResolver.LookupHost(rctx, host)
		cancel()
		if err != nil {
			return fmt.Errorf("resolve %s: %w", host, err)
		}
	}
	curve, err := auth.load()
	if err != nil {
		return err
	}
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		return err
	}
	defer zctx.Close()
	opts := sidechannel.DefaultClientOptions()
	opts.Attempts = 1
	opts.AttemptTimeout = *timeout
	opts.Curve = curve
	c, err := sidechannel.NewClient(zctx, opts)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	t0 := time.Now()
	m, err := c.GetMeta(ctx, *remote)
	if err != nil {
		return fmt.Errorf("get_meta from %s: %w%s", *remote, err, auth.hint(err, *timeout))
	}
	rtt := time.Since(t0)
	out := map[string]any{
		"remote": *remote, "engine_id": m.EngineID, "te_rpc_port": m.TERPCPort,
		"num_blocks": m.NumBlocks, "kv_caches_base_addr": m.KVCachesBaseAddr,
		"boot_epoch": m.Ext.BootEpoch, "get_meta_rtt_us": rtt.Microseconds(),
	}
	if m.Ext.Cache != nil {
		out["cache"] = fingerprintJSON(m.Ext.Cache)
	}
	var incompatible error
	if exp != nil {
		incompatible = exp.check(ctx, *remote, m)
		out["compatible"] = incompatible == nil
		if incompatible != nil {
			out["mismatch"] = incompatible.Error()
		}
	}
	var doneRTT time.Duration
	if *done != "" {
		t1 := time.Now()
		if err := c.SendDone(ctx, *remote, *done); err != nil {
			return fmt.Errorf("done_recving %q to %s: %w%s", *done, *remote, err, auth.hint(err, *timeout))
		}
		out["done_request_id"] = *done
		out["ack"] = true
		doneRTT = time.Since(t1)
		out["done_rtt_us"] = doneRTT.Microseconds()
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(out); err != nil {
			return err
		}
		return incompatible
	}
	fmt.Fprintf(stdout, "remote       %s\nengine_id    %s\nte_rpc_port  %d\nnum_blocks   %d\ncaches       %d base addresses (first %#x)\nboot_epoch   %d\nget_meta     %v\n",
		*remote, m.EngineID, m.TERPCPort, m.NumBlocks, len(m.KVCachesBaseAddr), first(m.KVCachesBaseAddr), m.Ext.BootEpoch, rtt)
	if *done != "" {
		fmt.Fprintf(stdout, "done         %q acked in %v\n", *done, doneRTT)
	}
	if f := m.Ext.Cache; f != nil {
		fmt.Fprintf(stdout, "cache        %s %s, block_size %d, kv_heads %d, head_dim %d, kv_lora_rank %d, qk_rope_head_dim %d, indexer_dim %d\n",
			f.Kind, f.DType, f.BlockSize, f.KVHeads, f.HeadDim, f.KVLoraRank, f.QKRopeHeadDim, f.IndexerDim)
		fmt.Fprintf(stdout, "             layers %d, block_len %v, num_blocks %d\n", f.Layers, f.BlockLens, f.NumBlocks)
		fmt.Fprintf(stdout, "             prefill tp/pp/pcp/dcp %d/%d/%d/%d, decode %d/%d/%d/%d, rank tp %d pp %d pcp %d\n",
			f.Prefill.TP, f.Prefill.PP, f.Prefill.PCP, f.Prefill.DCP, f.Decode.TP, f.Decode.PP, f.Decode.PCP, f.Decode.DCP, f.Rank.TP, f.Rank.PP, f.Rank.PCP)
	} else {
		fmt.Fprintf(stdout, "cache        no fingerprint (a seed or Mooncake peer, or an older kvflow)\n")
	}
	if exp != nil {
		if incompatible != nil {
			fmt.Fprintf(stdout, "compatible   no: %v\n", incompatible)
		} else {
			fmt.Fprintf(stdout, "compatible   yes (%s)\n", exp.what(m))
		}
	}
	return incompatible
}

// probeExpect is what a decode worker configured as --config says expects
// from a prefill peer.
type probeExpect struct {
	cfg    config.Config
	compat *handshake.Compat
}

func loadProbeExpect(path string) (probeExpect, error) {
	cfg, err := config.Load(path)
	if err != nil {
		return probeExpect{}, usageError{fmt.Errorf("--config: %w", err)}
	}
	if err := cfg.Validate(); err != nil {
		return probeExpect{}, usageError{fmt.Errorf("--config %s: invalid configuration:\n%w", path, err)}
	}
	if cfg.Role() != config.Decode {
		return probeExpect{}, usageError{fmt.Errorf("--config %s: kv_role %q: want a decode worker's configuration (kv_consumer)", path, cfg.KVTransfer.KVRole)}
	}
	shape, err := cfg.Shape()
	if err != nil {
		return probeExpect{}, usageError{fmt.Errorf("--config %s: %w", path, err)}
	}
	layout, err := npu.NewLayout(shape)
	if err != nil {
		return probeExpect{}, usageError{fmt.Errorf("--config %s: %w", path, err)}
	}
	c, err := handshake.NewCompat(handshake.CompatOptions{Topology: cfg.Topology(), Layout: node.CacheLayout(layout), Local: node.Fingerprint(cfg, layout)})
	if err != nil {
		return probeExpect{}, err
	}
	return probeExpect{cfg: cfg, compat: c}, nil
}

// rank is the peer's rank: the one its fingerprint states, else tp 0 of PP
// stage 0 (a seed peer does not say).
func (e probeExpect) rank(m sidechannel.Metadata) npu.RankPos {
	if m.Ext.Cache != nil {
		return m.Ext.Cache.Rank
	}
	return npu.RankPos{}
}

func (e probeExpect) what(m sidechannel.Metadata) string {
	r := e.rank(m)
	s := fmt.Sprintf("as prefill rank tp %d pp %d pcp %d", r.TP, r.PP, r.PCP)
	if m.Ext.Cache == nil {
		s += "; without a fingerprint only the number of base addresses is checked here (a decode worker also checks the registered buffers)"
	}
	return s
}

// check compares m with what the configured decode worker expects of the
// peer at remote, as its handshake stage would before reading.
func (e probeExpect) check(ctx context.Context, remote string, m sidechannel.Metadata) error {
	topo := e.cfg.Topology()
	r := e.rank(m)
	start, end, err := plan.PPIndices(topo.Model.NumLayers, r.PP, max(1, topo.Prefill.PP), topo.PPLayerPartition)
	if err != nil {
		return fmt.Errorf("peer's pp rank %d: %w", r.PP, err)
	}
	host, _, _ := net.SplitHostPort(remote)
	t := plan.Task{P: topo.NeedPulls(), LayerStart: start, LayerEnd: end, PPStage: r.PP,
		RemoteRank: r.TP + (r.PP+r.PCP)*max(1, topo.Prefill.TP)}
	j := job.New(plan.Request{ID: "probe", RemoteHost: host, RemoteEngineID: m.EngineID}, time.Now())
	defer j.Release()
	j.Plan = plan.Plan{RequestID: "probe", RemoteHost: host, RemoteEngineID: m.EngineID, P: t.P, Tasks: []plan.Task{t}}
	j.Metas = []job.Meta{{EngineID: m.EngineID, TERPCPort: m.TERPCPort, BaseAddrs: m.KVCachesBaseAddr, NumBlocks: m.NumBlocks, Cache: m.Ext.Cache}}
	return e.compat.Check(ctx, j, 0)
}

// fingerprintJSON is f with the wire's key names.
func fingerprintJSON(f *npu.Fingerprint) map[string]any {
	return map[string]any{
		"kind": f.Kind.String(), "dtype": f.DType.String(), "block_size": f.BlockSize, "kv_heads": f.KVHeads,
		"head_dim": f.HeadDim, "kv_lora_rank": f.KVLoraRank, "qk_rope_head_dim": f.QKRopeHeadDim, "indexer_dim": f.IndexerDim,
		"layers": f.Layers, "block_len": f.BlockLens, "num_blocks": f.NumBlocks,
		"prefill": []int{f.Prefill.TP, f.Prefill.PP, f.Prefill.PCP, f.Prefill.DCP},
		"decode":  []int{f.Decode.TP, f.Decode.PP, f.Decode.PCP, f.Decode.DCP},
		"rank":    []int{f.Rank.TP, f.Rank.PP, f.Rank.PCP},
	}
}

func first(a []uint64) uint64 {
	if len(a) == 0 {
		return 0
	}
	return a[0]
}

// probeAuth is probe's CURVE settings, named and checked as kvflow serve's
// auth.* for a decode worker, except that the client's own key pair is
// optional (without it the client uses a one-off pair, which a server
// without auth.authorized_keys_file admits).
type probeAuth struct {
	mode                         string
	serverPublic, secret, public string
}

func (a probeAuth) validate() error {
	var errs []error
	switch a.mode {
	case config.AuthOff:
		for _, f := range []struct{ flag, val string }{
			{"--auth-server-public-key-file", a.serverPublic},
			{"--auth-secret-key-file", a.secret},
			{"--auth-public-key-file", a.public},
		} {
			if f.val != "" {
				errs = append(errs, fmt.Errorf("%s set without --auth curve", f.flag))
			}
		}
	case config.AuthCurve:
		if a.serverPublic == "" {
			errs = append(errs, errors.New("--auth curve needs --auth-server-public-key-file (the prefill server's public key)"))
		}
		if (a.secret == "") != (a.public == "") {
			errs = append(errs, errors.New("--auth-secret-key-file and --auth-public-key-file go together (this client's key pair; omit both for a one-off pair)"))
		}
	default:
		errs = append(errs, fmt.Errorf("--auth %q: want %s or %s", a.mode, config.AuthOff, config.AuthCurve))
	}
	if len(errs) > 0 {
		return usageError{errors.Join(errs...)}
	}
	return nil
}

// load reads the key files (nil without --auth curve).
func (a probeAuth) load() (*sidechannel.Curve, error) {
	if a.mode != config.AuthCurve {
		return nil, nil
	}
	c, err := sidechannel.LoadCurveKeys(a.secret, a.public, a.serverPublic, "")
	if err != nil {
		return nil, fmt.Errorf("auth keys: %w", err)
	}
	return &c, nil
}

// hint explains a call that got no reply within timeout (the attempt's or
// the overall one, whichever fired first), which is also how a mismatch of
// authentication shows: a CURVE client and server that disagree never
// complete the handshake, so neither side sees an error.
func (a probeAuth) hint(err error, timeout time.Duration) string {
	if !errors.Is(err, sidechannel.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
		return ""
	}
	if a.mode == config.AuthCurve {
		return fmt.Sprintf(" (no reply within %v; with --auth curve a wrong server public key, a server without auth, or a client key the server's authorized keys do not list also look like this)", timeout)
	}
	return fmt.Sprintf(" (no reply within %v; a server with auth.mode curve also looks like this: pass --auth curve --auth-server-public-key-file FILE)", timeout)
}
