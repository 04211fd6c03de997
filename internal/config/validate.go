package config

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
)

// maxUnixPath is the longest ipc:// path libzmq can bind (sun_path is 108
// bytes with the terminating NUL).
const maxUnixPath = 107

// Validate reports every problem of c at once (errors.Join of *FieldError),
// each naming its field by JSON path, e.g.
//
//	kv_transfer_config.kv_connector_extra_config.decode.tp_size: must be >= 1, got 0 (missing?)
//
// It includes plan.Topology.Validate (with the topology's field names mapped
// to this file's paths) and, once the model fields are sound,
// npu.Shape.Validate of this worker's shape. Validate does no I/O: key files
// and the cache file are checked when they are opened.
func (c Config) Validate() error {
	v := &validator{}
	c.validateKV(v)
	c.validateModel(v)
	c.validateRank(v)
	c.validateCache(v)
	c.validateNode(v)
	c.validateSettings(v)
	return errors.Join(v.errs...)
}

type validator struct{ errs []error }

func (v *validator) add(path, format string, args ...any) {
	v.errs = append(v.errs, &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)})
}

func (v *validator) addErr(err error) {
	if err != nil {
		v.errs = append(v.errs, err)
	}
}

func (v *validator) atLeast(path string, got, lo int) {
	if got < lo {
		v.add(path, "must be >= %d, got %d", lo, got)
	}
}

func (v *validator) positive(path string, d Duration) {
	if d <= 0 {
		v.add(path, "must be > 0, got %s", d.D())
	}
}

func (v *validator) oneOf(path, got string, allowed ...string) {
	for _, a := range allowed {
		if got == a {
			return
		}
	}
	v.add(path, "must be one of %s, got %q", strings.Join(allowed, ", "), got)
}

func (c Config) validateKV(v *validator) {
	kv := c.KVTransfer
	if _, err := ParseRole(kv.KVRole); err != nil {
		v.add("kv_transfer_config.kv_role", "%s", err)
	}
	if strings.TrimSpace(kv.EngineID) == "" {
		v.add("kv_transfer_config.engine_id", "missing: must equal the vLLM instance's engine_id (peers see it as remote_engine_id)")
	}
	if kv.KVPort < 1 || kv.KVPort > 65535 {
		v.add("kv_transfer_config.kv_port", "must be in 1..65535, got %d", kv.KVPort)
	}
	// The topology: sizes, divisibility, GQA heads, PP, context parallel,
	// the layer partition and this instance's handshake port range.
	if kv.KVPort >= 1 && kv.KVPort <= 65535 {
		v.addErr(rewrite(c.Topology().Validate()))
	} else {
		t := c.Topology()
		t.Prefill.KVPort, t.Decode.KVPort = 0, 0 // reported above
		v.addErr(rewrite(t.Validate()))
	}
}

func (c Config) validateModel(v *validator) {
	m := c.Model
	n := len(v.errs)
	// num_layers and num_kv_heads >= 1, sparse without mla and the layer
	// partition are reported by the topology.
	v.atLeast("model.block_size", m.BlockSize, 1)
	v.atLeast("model.num_blocks", m.NumBlocks, 1)
	if m.DType == "" {
		v.add("model.dtype", "missing: want bf16, fp16, fp32, int8 or fp8")
	} else if _, err := npu.ParseDType(m.DType); err != nil {
		v.add("model.dtype", "%s", strings.TrimPrefix(err.Error(), "npu: "))
	}
	unset := func(path string, got int, why string) {
		if got != 0 {
			v.add(path, "set to %d %s", got, why)
		}
	}
	if m.MLA {
		v.atLeast("model.kv_lora_rank", m.KVLoraRank, 1)
		v.atLeast("model.qk_rope_head_dim", m.QKRopeHeadDim, 1)
	} else {
		v.atLeast("model.head_dim", m.HeadDim, 1)
		unset("model.kv_lora_rank", m.KVLoraRank, "without mla")
		unset("model.qk_rope_head_dim", m.QKRopeHeadDim, "without mla")
	}
	if m.Sparse {
		v.atLeast("model.indexer_dim", m.IndexerDim, 1)
	} else {
		unset("model.indexer_dim", m.IndexerDim, "without sparse")
	}
	// The per-rank shape's own checks (sizes that would overflow) once the
	// fields above are sound.
	if len(v.errs) == n && m.NumLayers >= 1 && m.NumKVHeads >= 1 && (!m.Sparse || m.MLA) && c.Role() != 0 {
		// Layer-partition and rank problems are reported elsewhere.
		if _, err := c.Shape(); errors.Is(err, npu.ErrInvalidShape) {
			v.addErr(err)
		}
	}
}

func (c Config) validateRank(v *validator) {
	role := c.Role()
	if role == 0 {
		return // ranges unknown; kv_role is reported
	}
	own := c.own()
	inst := "kv_transfer_config.kv_connector_extra_config." + role.String()
	r := c.Rank
	chk := func(field string, got, size int, sizeField string, sizeOK bool) {
		switch {
		case got < 0:
			v.add("rank."+field, "must be >= 0, got %d", got)
		case sizeOK && got >= size:
			v.add("rank."+field, "%d outside [0, %s.%s %d)", got, inst, sizeField, size)
		}
	}
	chk("tp", r.TP, own.TPSize, "tp_size", own.TPSize >= 1)
	chk("pp", r.PP, own.PPSize, "pp_size", own.PPSize >= 1)
	chk("dp", r.DP, own.DPSize, "dp_size", own.DPSize >= 1)
	chk("pcp", r.PCP, max(own.PCPSize, 1), "pcp_size", own.PCPSize >= 0)
	chk("dcp", r.DCP, max(own.DCPSize, 1), "dcp_size", own.DCPSize >= 0)
}

func (c Config) validateCache(v *validator) {
	ca := c.Cache
	v.oneOf("cache.mode", ca.Mode, CacheAnonymous, CacheShm, CacheShmAttach)
	switch ca.Mode {
	case CacheAnonymous:
		if ca.Path != "" {
			v.add("cache.path", "set to %q with cache.mode %s (a path needs mode %s or %s)", ca.Path, ca.Mode, CacheShm, CacheShmAttach)
		}
		if ca.RemoveOnClose {
			v.add("cache.remove_on_close", "set with cache.mode %s (only mode %s creates a file)", ca.Mode, CacheShm)
		}
	case CacheShm, CacheShmAttach:
		if ca.Path != "" && !strings.HasPrefix(ca.Path, "/") {
			v.add("cache.path", "must be an absolute path, got %q", ca.Path)
		}
		if ca.Mode == CacheShmAttach && ca.RemoveOnClose {
			v.add("cache.remove_on_close", "set with cache.mode %s: kvflow never removes a file it did not create", ca.Mode)
		}
	}
}

func (c Config) validateNode(v *validator) {
	n := c.Node
	host := func(path, h string, empty bool) {
		switch {
		case h == "":
			if !empty {
				v.add(path, "missing: want an IP address or host name")
			}
		case strings.ContainsAny(h, " /\t") || (strings.Contains(h, ":") && net.ParseIP(h) == nil):
			v.add(path, "want an IP address or host name without a port, got %q", h)
		}
	}
	host("node.side_channel_host", n.SideChannelHost, false)
	c.validateBackend(v)
	host("node.te_host", n.TEHost, true)
	if n.TEPort < 0 || n.TEPort > 65535 {
		v.add("node.te_port", "must be in 0..65535 (0 = pick a free port), got %d", n.TEPort)
	} else if n.TEPort != 0 && c.Role() != 0 && n.TEPort == c.HandshakePort() && c.TEHost() == n.SideChannelHost {
		v.add("node.te_port", "%d is this worker's side-channel handshake port", n.TEPort)
	}
	switch {
	case n.TEDataPort < 0 || n.TEDataPort > 65535:
		v.add("node.te_data_port", "must be in 0..65535 (0 = pick a free port), got %d", n.TEDataPort)
	case n.TEDataPort == 0:
	case n.TEDataPort == n.TEPort:
		v.add("node.te_data_port", "%d is also node.te_port: the transfer engine's RPC and data ports must differ", n.TEDataPort)
	case c.Role() != 0 && n.TEDataPort == c.HandshakePort() && c.TEHost() == n.SideChannelHost:
		v.add("node.te_data_port", "%d is this worker's side-channel handshake port", n.TEDataPort)
	}
	l := n.Limits
	v.positive("node.limits.te_first_byte_timeout", l.TEFirstByteTimeout)
	v.positive("node.limits.te_idle_timeout", l.TEIdleTimeout)
	v.atLeast("node.limits.te_max_conns", l.TEMaxConns, 1)
	v.atLeast("node.limits.te_max_conns_per_peer", l.TEMaxConnsPerPeer, 1)
	if l.TEMaxConnsPerPeer > l.TEMaxConns && l.TEMaxConns >= 1 {
		v.add("node.limits.te_max_conns_per_peer", "%d exceeds node.limits.te_max_conns (%d)", l.TEMaxConnsPerPeer, l.TEMaxConns)
	}
	v.atLeast("node.limits.fd_reserve", l.FDReserve, 0)
	v.atLeast("node.limits.side_channel_max_conns", l.SideChannelMaxConns, 1)
	v.atLeast("node.limits.side_channel_max_conns_per_peer", l.SideChannelMaxConnsPerPeer, 1)
	if l.SideChannelMaxConnsPerPeer > l.SideChannelMaxConns && l.SideChannelMaxConns >= 1 {
		v.add("node.limits.side_channel_max_conns_per_peer", "%d exceeds node.limits.side_channel_max_conns (%d)",
			l.SideChannelMaxConnsPerPeer, l.SideChannelMaxConns)
	}
	v.atLeast("node.limits.http_max_conns", l.HTTPMaxConns, 1)
	ep := c.ControlEndpoint()
	switch {
	case strings.HasPrefix(ep, "ipc://"):
		p := strings.TrimPrefix(ep, "ipc://")
		switch {
		case p == "":
			v.add("node.control", "ipc:// endpoint without a path")
		case len(p) > maxUnixPath:
			what := "node.control"
			if n.Control == "" {
				what += " (derived from engine_id)"
			}
			v.add("node.control", "socket path %q is %d bytes, longer than the %d a unix socket allows; set %s to a shorter one", p, len(p), maxUnixPath, what)
		}
	case strings.HasPrefix(ep, "tcp://"):
		if _, port, err := net.SplitHostPort(strings.TrimPrefix(ep, "tcp://")); err != nil {
			v.add("node.control", "want tcp://host:port, got %q", ep)
		} else if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
			v.add("node.control", "port of %q must be in 1..65535", ep)
		}
	default:
		v.add("node.control", "want an ipc:// or tcp:// endpoint, got %q", ep)
	}
	if n.MetricsAddr != "" {
		if _, port, err := net.SplitHostPort(n.MetricsAddr); err != nil {
			v.add("node.metrics_addr", "want host:port (port 0 = any free port) or \"\" for off, got %q", n.MetricsAddr)
		} else if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
			v.add("node.metrics_addr", "port of %q must be in 0..65535", n.MetricsAddr)
		}
	} else if n.Pprof {
		v.add("node.pprof", "needs node.metrics_addr (the profiler is served there)")
	}
}

func (c Config) validateSettings(v *validator) {
	c.validateStages(v)
	v.positive("tracker.abort_request_timeout", c.Tracker.AbortRequestTimeout)
	v.positive("tracker.held_age_alert", c.Tracker.HeldAgeAlert)
	if l := c.Tracker.LeaseTTL; l != 0 && l < Duration(MinLeaseTTL) {
		v.add("tracker.lease_ttl", "must be 0 (off) or >= %s, got %s", MinLeaseTTL, l.D())
	}
	if c.Shutdown.DrainTimeout < 0 {
		v.add("shutdown.drain_timeout", "must be >= 0 (0 = cancel at once), got %s", c.Shutdown.DrainTimeout.D())
	}
	v.oneOf("log.level", c.Log.Level, "debug", "info", "warn", "error")
	v.oneOf("log.format", c.Log.Format, "auto", "text", "json")

	a := c.Auth
	v.oneOf("auth.mode", a.Mode, AuthOff, AuthCurve)
	files := []struct {
		path, val string
	}{
		{"auth.secret_key_file", a.SecretKeyFile},
		{"auth.public_key_file", a.PublicKeyFile},
		{"auth.server_public_key_file", a.ServerPublicKeyFile},
		{"auth.authorized_keys_file", a.AuthorizedKeysFile},
	}
	if a.DataPlane != "" {
		v.oneOf("auth.data_plane", a.DataPlane, DataPlaneAuthenticated, DataPlaneOpen)
	}
	switch a.Mode {
	case AuthOff:
		for _, f := range files {
			if f.val != "" {
				v.add(f.path, "set with auth.mode %s (set auth.mode %s to use it)", AuthOff, AuthCurve)
			}
		}
		if a.DataPlane == DataPlaneAuthenticated {
			v.add("auth.data_plane", "%s needs auth.mode %s (the side channel hands out the credentials)", DataPlaneAuthenticated, AuthCurve)
		}
	case AuthCurve:
		if a.SecretKeyFile == "" {
			v.add("auth.secret_key_file", "missing: auth.mode curve needs this worker's secret key")
		}
		if a.PublicKeyFile == "" {
			v.add("auth.public_key_file", "missing: auth.mode curve needs this worker's public key")
		}
		if c.Role() == Decode && a.ServerPublicKeyFile == "" {
			v.add("auth.server_public_key_file", "missing: a decode worker with auth.mode curve needs the prefill servers' public key")
		}
	}
}

const extraPath = "kv_transfer_config.kv_connector_extra_config."

// topologyNames maps package plan's field names to this file's JSON paths.
var topologyNames = func() *strings.Replacer {
	var pairs []string
	for _, inst := range []string{"prefill", "decode"} {
		for _, f := range []string{"tp_size", "pp_size", "dp_size", "pcp_size", "dcp_size"} {
			pairs = append(pairs, inst+"."+f, extraPath+inst+"."+f)
		}
		pairs = append(pairs, inst+".kv_port", "kv_transfer_config.kv_port")
	}
	pairs = append(pairs,
		"model.num_hidden_layers", "model.num_layers",
		"model.num_key_value_heads", "model.num_kv_heads",
	)
	return strings.NewReplacer(pairs...)
}()

// rewrite turns the (joined) errors of package plan into *FieldError with
// this file's paths, keeping each original error as the cause.
func rewrite(err error) error {
	if err == nil {
		return nil
	}
	var out []error
	var walk func(error)
	walk = func(e error) {
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			for _, x := range j.Unwrap() {
				walk(x)
			}
			return
		}
		msg := topologyNames.Replace(e.Error())
		for _, p := range []struct{ old, new string }{
			{"prefill: ", extraPath + "prefill: "},
			{"decode: ", extraPath + "decode: "},
			{"pp_layer_partition: ", "model.pp_layer_partition: "},
			{"decode_pp_layer_partition: ", "model.decode_pp_layer_partition: "},
		} {
			if strings.HasPrefix(msg, p.old) {
				msg = p.new + strings.TrimPrefix(msg, p.old)
			}
		}
		path, rest, ok := strings.Cut(msg, ": ")
		if !ok || strings.ContainsAny(path, " ") {
			path, rest = "", msg
		}
		out = append(out, &FieldError{Path: path, Msg: rest, Err: e})
	}
	walk(err)
	return errors.Join(out...)
}

// MinLeaseTTL is the shortest tracker.lease_ttl: decode workers renew every
// TTL/3, so below ~50 ms renewals would be a busy loop of side-channel
// calls, and one side-channel round trip could outlast the lease.
const MinLeaseTTL = 50 * time.Millisecond
