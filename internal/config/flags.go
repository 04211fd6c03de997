package config

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
)

// RegisterFlags binds flags to c's fields, with c's current values as the
// flags' defaults, so that parsing them overrides what c holds (load the
// file first). See Parse for handling --config itself.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	kv := &c.KVTransfer
	ex := &kv.KVConnectorExtraConfig
	fs.Var(&kvTransferFlag{kv}, "kv-transfer-config", "vLLM's --kv-transfer-config `JSON`, verbatim (merged into kv_transfer_config)")
	fs.Var(&roleFlag{&kv.KVRole}, "role", "worker `role`: prefill|decode (or kv_producer|kv_consumer) (kv_transfer_config.kv_role)")
	fs.StringVar(&kv.EngineID, "engine-id", kv.EngineID, "this instance's vLLM engine_id (kv_transfer_config.engine_id)")
	fs.Var(&kv.KVPort, "kv-port", "base handshake `port` of the instance (kv_transfer_config.kv_port)")
	fs.StringVar(&kv.KVConnector, "kv-connector", kv.KVConnector, "kv_transfer_config.kv_connector (informational)")
	for _, p := range []struct {
		name string
		par  *Parallel
	}{{"prefill", &ex.Prefill}, {"decode", &ex.Decode}} {
		path := "kv_connector_extra_config." + p.name
		fs.IntVar(&p.par.TPSize, p.name+"-tp", p.par.TPSize, p.name+" tensor parallel size ("+path+".tp_size)")
		fs.IntVar(&p.par.DPSize, p.name+"-dp", p.par.DPSize, p.name+" data parallel size ("+path+".dp_size)")
		fs.IntVar(&p.par.PPSize, p.name+"-pp", p.par.PPSize, p.name+" pipeline parallel size ("+path+".pp_size)")
		fs.IntVar(&p.par.PCPSize, p.name+"-pcp", p.par.PCPSize, p.name+" prefill context parallel size, 0 = 1 ("+path+".pcp_size)")
		fs.IntVar(&p.par.DCPSize, p.name+"-dcp", p.par.DCPSize, p.name+" decode context parallel size, 0 = 1 ("+path+".dcp_size)")
	}

	m := &c.Model
	fs.IntVar(&m.NumLayers, "layers", m.NumLayers, "model layers, all PP stages (model.num_layers)")
	fs.IntVar(&m.NumKVHeads, "kv-heads", m.NumKVHeads, "model KV heads, all TP ranks (model.num_kv_heads)")
	fs.IntVar(&m.HeadDim, "head-dim", m.HeadDim, "GQA head dimension (model.head_dim)")
	fs.IntVar(&m.BlockSize, "block-size", m.BlockSize, "tokens per cache block (model.block_size)")
	fs.StringVar(&m.DType, "dtype", m.DType, "cache dtype: bf16|fp16|fp32|int8|fp8 (model.dtype)")
	fs.IntVar(&m.NumBlocks, "num-blocks", m.NumBlocks, "blocks per cache tensor (model.num_blocks)")
	fs.BoolVar(&m.MLA, "mla", m.MLA, "MLA model, 2-part cache (model.mla)")
	fs.IntVar(&m.KVLoraRank, "kv-lora-rank", m.KVLoraRank, "MLA latent width (model.kv_lora_rank)")
	fs.IntVar(&m.QKRopeHeadDim, "qk-rope-head-dim", m.QKRopeHeadDim, "MLA rope width (model.qk_rope_head_dim)")
	fs.BoolVar(&m.Sparse, "sparse", m.Sparse, "sparse attention, 3-part cache; needs -mla (model.sparse)")
	fs.IntVar(&m.IndexerDim, "indexer-dim", m.IndexerDim, "sparse indexer width (model.indexer_dim)")
	fs.StringVar(&m.PPLayerPartition, "pp-layer-partition", m.PPLayerPartition, "prefill's VLLM_PP_LAYER_PARTITION, e.g. 16,16 (model.pp_layer_partition)")
	fs.StringVar(&m.DecodePPLayerPartition, "decode-pp-layer-partition", m.DecodePPLayerPartition, "decode's VLLM_PP_LAYER_PARTITION with decode pp > 1, kvflow peers only (model.decode_pp_layer_partition)")

	r := &c.Rank
	fs.IntVar(&r.TP, "tp-rank", r.TP, "this worker's tensor parallel rank (rank.tp)")
	fs.IntVar(&r.PP, "pp-rank", r.PP, "this worker's pipeline parallel rank (rank.pp)")
	fs.IntVar(&r.DP, "dp-rank", r.DP, "this worker's data parallel rank (rank.dp)")
	fs.IntVar(&r.PCP, "pcp-rank", r.PCP, "this worker's prefill context parallel rank (rank.pcp)")
	fs.IntVar(&r.DCP, "dcp-rank", r.DCP, "this worker's decode context parallel rank (rank.dcp)")

	ca := &c.Cache
	fs.StringVar(&ca.Mode, "cache", ca.Mode, "cache memory: anonymous|shm|shm_attach (cache.mode)")
	fs.StringVar(&ca.Path, "cache-path", ca.Path, "shared-memory file; empty derives one under /dev/shm (cache.path)")
	fs.BoolVar(&ca.RemoveOnClose, "cache-remove-on-close", ca.RemoveOnClose, "remove the shm file at exit (cache.remove_on_close)")
	fs.BoolVar(&ca.NoHugePages, "no-huge-pages", ca.NoHugePages, "skip huge pages (cache.no_huge_pages)")
	fs.BoolVar(&ca.NoLock, "no-lock", ca.NoLock, "leave the caches pageable instead of locking them in memory (cache.no_lock)")

	n := &c.Node
	fs.StringVar(&n.SideChannelHost, "side-channel-host", n.SideChannelHost, "side channel bind address, the worker's IP (node.side_channel_host)")
	fs.StringVar(&n.TEBackend, "te-backend", n.TEBackend, "transfer engine: tcp, shm (tcp plus same-host reads by mapping the peer's cache file, negotiated per peer), or mooncake (Mooncake's engine; a binary built with -tags mooncake) (node.te_backend)")
	fs.StringVar(&n.Mooncake.Protocol, "mooncake-protocol", n.Mooncake.Protocol, "te_backend mooncake: the transport, rdma|tcp|ascend|... (node.mooncake.protocol)")
	fs.StringVar(&n.Mooncake.Location, "mooncake-location", n.Mooncake.Location, "te_backend mooncake: the registered memory's location tag (node.mooncake.location)")
	fs.StringVar(&n.Mooncake.NICPriorityMatrix, "mooncake-nic-priority-matrix", n.Mooncake.NICPriorityMatrix, "te_backend mooncake, rdma: JSON NIC priority matrix; empty = discover (node.mooncake.nic_priority_matrix)")
	fs.StringVar(&n.TEHost, "te-host", n.TEHost, "transfer engine listen host; empty = side channel host (node.te_host)")
	fs.IntVar(&n.TEPort, "te-port", n.TEPort, "transfer engine RPC port, 0 = any free (node.te_port)")
	fs.IntVar(&n.TEDataPort, "te-data-port", n.TEDataPort, "transfer engine data port, 0 = any free; te_backend tcp or shm (node.te_data_port)")
	fs.StringVar(&n.Control, "control", n.Control, "control socket endpoint; empty derives ipc:///tmp/kvflow-... (node.control)")
	fs.StringVar(&n.MetricsAddr, "metrics-addr", n.MetricsAddr, "host:port of /metrics, /healthz, /readyz; empty = off (node.metrics_addr)")
	fs.BoolVar(&n.Pprof, "pprof", n.Pprof, "also serve /debug/pprof/ on the metrics address (node.pprof)")
	l := &n.Limits
	fs.Var(&l.TEFirstByteTimeout, "te-first-byte-timeout", "close a transfer-engine data connection with no request this long after connecting (node.limits.te_first_byte_timeout)")
	fs.Var(&l.TEIdleTimeout, "te-idle-timeout", "close a transfer-engine data connection idle this long (node.limits.te_idle_timeout)")
	fs.IntVar(&l.TEMaxConns, "te-max-conns", l.TEMaxConns, "open connections per transfer-engine port (node.limits.te_max_conns)")
	fs.IntVar(&l.TEMaxConnsPerPeer, "te-max-conns-per-peer", l.TEMaxConnsPerPeer, "connections per transfer-engine port from one address not yet past a valid first request, capped once the port is half full (node.limits.te_max_conns_per_peer)")
	fs.IntVar(&l.FDReserve, "fd-reserve", l.FDReserve, "file descriptors kept free for control, side channel and HTTP; 0 = no check (node.limits.fd_reserve)")
	fs.IntVar(&l.SideChannelMaxConns, "side-channel-max-conns", l.SideChannelMaxConns, "prefill: open connections of the side-channel port (node.limits.side_channel_max_conns)")
	fs.IntVar(&l.SideChannelMaxConnsPerPeer, "side-channel-max-conns-per-peer", l.SideChannelMaxConnsPerPeer, "prefill: open connections of the side-channel port from one address (node.limits.side_channel_max_conns_per_peer)")
	fs.IntVar(&l.HTTPMaxConns, "http-max-conns", l.HTTPMaxConns, "open connections of the metrics endpoint (node.limits.http_max_conns)")

	c.registerStageFlags(fs)
	fs.Var(&c.Tracker.AbortRequestTimeout, "abort-timeout", "prefill: force-free requests not DONE within this, as VLLM_NIXL_ABORT_REQUEST_TIMEOUT; decode: the prefill's, assumed for peers without leases (reads that would start later are refused; keep them equal) (tracker.abort_request_timeout)")
	fs.Var(&c.Tracker.LeaseTTL, "lease-ttl", "prefill: advertise leases; a RENEW keeps a request held this long, 0 = off (tracker.lease_ttl)")
	fs.Var(&c.Tracker.HeldAgeAlert, "held-age-alert", "prefill: requests held longer than this count in kvflow_tracker_requests_held_past_age (tracker.held_age_alert)")
	fs.BoolVar(&c.Tracker.BatchDone, "batch-done", c.Tracker.BatchDone, "prefill: advertise batched DONEs to kvflow decode workers (tracker.batch_done)")
	fs.Var(&c.Shutdown.DrainTimeout, "drain-timeout", "shutdown: time to finish accepted requests before canceling (shutdown.drain_timeout)")

	fs.StringVar(&c.Log.Level, "log-level", c.Log.Level, "debug|info|warn|error (log.level)")
	fs.StringVar(&c.Log.Format, "log-format", c.Log.Format, "auto|text|json (log.format)")

	a := &c.Auth
	fs.StringVar(&a.Mode, "auth", a.Mode, "side channel authentication: off|curve (auth.mode)")
	fs.StringVar(&a.SecretKeyFile, "auth-secret-key-file", a.SecretKeyFile, "CURVE secret key file (auth.secret_key_file)")
	fs.StringVar(&a.PublicKeyFile, "auth-public-key-file", a.PublicKeyFile, "CURVE public key file (auth.public_key_file)")
	fs.StringVar(&a.ServerPublicKeyFile, "auth-server-public-key-file", a.ServerPublicKeyFile, "decode: prefill servers' CURVE public key file (auth.server_public_key_file)")
	fs.StringVar(&a.AuthorizedKeysFile, "auth-authorized-keys-file", a.AuthorizedKeysFile, "prefill: allowed client public keys, one per line (auth.authorized_keys_file)")
	fs.StringVar(&a.DataPlane, "auth-data-plane", a.DataPlane, "with auth curve: authenticated (default) or open transfer engine ports (auth.data_plane)")
}

// ConfigFlag is the name of the flag naming the configuration file.
const ConfigFlag = "config"

// Parse builds the configuration from command-line arguments: it finds
// --config (or -config, with = or a separate value) among args, loads that
// file on top of Default, binds every flag of RegisterFlags (and --config)
// to fs, and parses args with fs, so flags override the file whatever their
// order. fs may hold other flags of the caller; they are parsed as usual.
// fs must not already hold the flags of RegisterFlags (flag would panic on
// the redefinition). Parse does not call Validate. Errors: the file's problems, or fs.Parse's
// (flag.ErrHelp for -h).
func Parse(args []string, fs *flag.FlagSet) (Config, error) {
	path, err := findConfig(args, fs)
	if err != nil {
		return Config{}, err
	}
	cfg, err := Load(path)
	if err != nil {
		return Config{}, err
	}
	if fs.Lookup(ConfigFlag) == nil {
		fs.String(ConfigFlag, path, "JSON configuration file (flags override its fields)")
	}
	cfg.RegisterFlags(fs)
	src := &sources{}
	restore := src.watch(fs, &cfg.KVTransfer)
	err = fs.Parse(args)
	restore() // the flags' own types again, for PrintDefaults
	if err != nil {
		return Config{}, err
	}
	if err := src.conflicts(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// kvFlagPaths maps the flags that set a kv_transfer_config field to that
// field's path inside kv_transfer_config, and a getter in a form both
// sources share.
var kvFlagPaths = func() map[string]kvField {
	m := map[string]kvField{
		"role":         {"kv_role", func(kv *KVTransferConfig) string { return kv.KVRole }},
		"engine-id":    {"engine_id", func(kv *KVTransferConfig) string { return kv.EngineID }},
		"kv-port":      {"kv_port", func(kv *KVTransferConfig) string { return kv.KVPort.String() }},
		"kv-connector": {"kv_connector", func(kv *KVTransferConfig) string { return kv.KVConnector }},
	}
	for _, side := range []string{"prefill", "decode"} {
		par := func(kv *KVTransferConfig) *Parallel {
			if side == "prefill" {
				return &kv.KVConnectorExtraConfig.Prefill
			}
			return &kv.KVConnectorExtraConfig.Decode
		}
		for _, f := range []struct {
			flag, key string
			get       func(*Parallel) int
		}{
			{"tp", "tp_size", func(p *Parallel) int { return p.TPSize }},
			{"dp", "dp_size", func(p *Parallel) int { return p.DPSize }},
			{"pp", "pp_size", func(p *Parallel) int { return p.PPSize }},
			{"pcp", "pcp_size", func(p *Parallel) int { return p.PCPSize }},
			{"dcp", "dcp_size", func(p *Parallel) int { return p.DCPSize }},
		} {
			m[side+"-"+f.flag] = kvField{"kv_connector_extra_config." + side + "." + f.key,
				func(kv *KVTransferConfig) string { return fmt.Sprint(f.get(par(kv))) }}
		}
	}
	return m
}()

type kvField struct {
	path string // inside kv_transfer_config
	get  func(*KVTransferConfig) string
}

// sources records, for each kv_transfer_config field set on the command
// line, which flag set it to what, so that two flags giving one setting
// different values (--kv-transfer-config '{"kv_role":"kv_producer"}' and
// --role decode) are an error instead of the later one winning silently.
// One flag given twice is not a conflict: the last one wins, as usual.
type sources struct {
	seen map[string]source // by path inside kv_transfer_config
	errs []error
}

type source struct{ flag, value string }

func (s *sources) record(path, flag, value string) {
	if s.seen == nil {
		s.seen = map[string]source{}
	}
	prev, ok := s.seen[path]
	switch {
	case !ok || prev.flag == flag:
		// One flag given again wins, as flags do (a wrapper appending
		// an override); two different flags must agree.
		s.seen[path] = source{flag, value}
	case prev.value != value:
		s.errs = append(s.errs, &FieldError{Path: "kv_transfer_config." + path,
			Msg: fmt.Sprintf("conflicting values: --%s gives %q, --%s gives %q (give the setting once)", prev.flag, prev.value, flag, value)})
	}
}

func (s *sources) conflicts() error { return errors.Join(s.errs...) }

// watch wraps fs's kv_transfer_config flags (registered by RegisterFlags
// for kv) so that each Set is recorded; restore puts the flags' own values
// back.
func (s *sources) watch(fs *flag.FlagSet, kv *KVTransferConfig) (restore func()) {
	orig := map[*flag.Flag]flag.Value{}
	for name, field := range kvFlagPaths {
		if f := fs.Lookup(name); f != nil {
			orig[f] = f.Value
			f.Value = &recorded{Value: f.Value, set: func() { s.record(field.path, name, field.get(kv)) }}
		}
	}
	if f := fs.Lookup("kv-transfer-config"); f != nil {
		orig[f] = f.Value
		f.Value = &recordedKV{Value: f.Value, s: s}
	}
	return func() {
		for f, v := range orig {
			f.Value = v
		}
	}
}

// recorded is a flag.Value that calls set after each successful Set.
type recorded struct {
	flag.Value
	set func()
}

// String is safe on a zero recorded (flag.PrintDefaults makes one).
func (r *recorded) String() string {
	if r == nil || r.Value == nil {
		return ""
	}
	return r.Value.String()
}

func (r *recorded) Set(v string) error {
	if err := r.Value.Set(v); err != nil {
		return err
	}
	r.set()
	return nil
}

// recordedKV records every field that a --kv-transfer-config object gives.
type recordedKV struct {
	flag.Value
	s *sources
}

// String is safe on a zero recordedKV (flag.PrintDefaults makes one).
func (r *recordedKV) String() string {
	if r == nil || r.Value == nil {
		return ""
	}
	return r.Value.String()
}

func (r *recordedKV) Set(v string) error {
	if err := r.Value.Set(v); err != nil {
		return err
	}
	var own KVTransferConfig
	_ = decodeKVTransfer(&own, []byte(v), "--kv-transfer-config") // decoded without error just above
	for _, field := range kvFlagPaths {
		if jsonHas([]byte(v), strings.Split(field.path, ".")) {
			r.s.record(field.path, "kv-transfer-config", field.get(&own))
		}
	}
	return nil
}

// jsonHas reports whether the JSON object doc has the member at path.
func jsonHas(doc []byte, path []string) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(doc, &m) != nil {
		return false
	}
	v, ok := m[path[0]]
	if !ok || len(path) == 1 {
		return ok
	}
	return jsonHas(v, path[1:])
}

// findConfig parses args once with a throw-away flag set that knows every
// flag (fs's and ours, values discarded) to find --config exactly as fs will
// read it. If that parse fails the real one reports the same error.
func findConfig(args []string, fs *flag.FlagSet) (string, error) {
	scratch := flag.NewFlagSet("scan", flag.ContinueOnError)
	scratch.SetOutput(io.Discard)
	var path string
	fs.VisitAll(func(f *flag.Flag) {
		if f.Name == ConfigFlag {
			return
		}
		scratch.Var(discard{bool: isBool(f.Value)}, f.Name, "")
	})
	var tmp Config
	tmpFS := flag.NewFlagSet("tmp", flag.ContinueOnError)
	tmp.RegisterFlags(tmpFS)
	tmpFS.VisitAll(func(f *flag.Flag) {
		if scratch.Lookup(f.Name) == nil {
			scratch.Var(discard{bool: isBool(f.Value)}, f.Name, "")
		}
	})
	scratch.StringVar(&path, ConfigFlag, "", "")
	if err := scratch.Parse(args); err != nil && !errors.Is(err, flag.ErrHelp) {
		// Leave the error to fs.Parse, which has the real flags and output.
		return path, nil
	}
	if f := fs.Lookup(ConfigFlag); f != nil && path == "" {
		path = f.Value.String()
	}
	return path, nil
}

func isBool(v flag.Value) bool {
	b, ok := v.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// discard accepts any value.
type discard struct{ bool bool }

func (d discard) String() string   { return "" }
func (d discard) Set(string) error { return nil }
func (d discard) IsBoolFlag() bool { return d.bool }

// roleFlag sets kv_role from a role name.
type roleFlag struct{ kvRole *string }

func (f *roleFlag) String() string {
	if f == nil || f.kvRole == nil {
		return ""
	}
	return *f.kvRole
}

func (f *roleFlag) Set(s string) error {
	r, err := ParseRole(strings.TrimSpace(s))
	if err != nil {
		return err
	}
	*f.kvRole = r.KVRole()
	return nil
}

// kvTransferFlag merges a kv_transfer_config JSON object.
type kvTransferFlag struct{ kv *KVTransferConfig }

func (f *kvTransferFlag) String() string { return "" }

func (f *kvTransferFlag) Set(s string) error {
	return decodeKVTransfer(f.kv, []byte(s), "--kv-transfer-config")
}
