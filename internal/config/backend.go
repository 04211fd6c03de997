package config

import (
	"errors"
	"strings"
)

// ErrMooncakeNotBuilt is why node.te_backend mooncake is rejected by a
// binary built without the mooncake tag.
var ErrMooncakeNotBuilt = errors.New(`"mooncake" needs a kvflow built with -tags mooncake against an installed Mooncake, ` +
	`and this binary was built without it: build it with ` +
	`CGO_CFLAGS=-I$MOONCAKE_PREFIX/include CGO_LDFLAGS="<Mooncake's libraries>" go build -tags mooncake ./cmd/kvflow ` +
	`(hw/mooncake/README.md lists the libraries), or use tcp, which speaks Mooncake's TCP transport`)

// Fallback is one thing the configured transfer backend cannot do as
// configured, and what the worker does instead: logged at warn when it
// starts, and listed by kvflow serve --print-config.
type Fallback struct {
	// Key is the setting concerned (a JSON path).
	Key string
	// Note says what happens instead, and why.
	Note string
}

func (f Fallback) String() string { return f.Key + ": " + f.Note }

// BackendFallbacks lists what node.te_backend cannot do of what the rest
// of c asks (nothing for tcp, which has every capability). Mooncake's C
// API has no read grants, no kvflow data-plane credential, no strided
// reads (local rows or remote gathers) and no per-connection limits; its
// per-op byte counts come from its transfer status.
func (c Config) BackendFallbacks() []Fallback {
	if c.Node.TEBackend != BackendMooncake {
		return nil
	}
	var out []Fallback
	add := func(key, note string) { out = append(out, Fallback{key, note}) }
	switch c.Role() {
	case Prefill:
		if c.Read.Grants != GrantsOff {
			add("read.grants", string(c.Read.Grants)+" → off: Mooncake's engine serves every registered byte to any peer that reaches its port, "+
				"so a decode reading after an abort, a force-free or an early DONE may get reused blocks and report them done")
		}
	case Decode:
		if c.Node.Mooncake.Protocol != "rdma" {
			add("node.te_backend", "the decode cache is registered without remote access, which Mooncake's "+c.Node.Mooncake.Protocol+
				" transport does not enforce: it serves reads and writes of it to any peer that reaches its port "+
				"(the tcp engine and Mooncake's rdma transport serve a decode cache to no one)")
		}
		if c.Read.FusedStitch {
			add("read.fused_stitch", "true → false: Mooncake's C API has no strided read, so with tp_num_need_pulls > 1 "+
				"the stitch kernel transposes the heads after the reads, as in the seed")
		}
		kv := c.KVTransfer.KVConnectorExtraConfig
		if kv.Decode.TPSize > kv.Prefill.TPSize {
			add("read (decode tp above prefill tp)", "one read per token row of a head slice instead of kvflow's strided READ "+
				"(Mooncake's C API has no gathered read)")
		}
		add("read (ledger)", "the bytes each op landed are Mooncake's transfer status (transferred_bytes), reconciled with what was posted")
		add("handshake (compatibility check)", "peers without a cache fingerprint (seed, Mooncake) are not checked against their segment descriptor, "+
			"which Mooncake's C API does not expose (counted in kvflow_handshake_peers_unchecked_total); kvflow peers are checked as with tcp")
	}
	if c.Auth.Mode == AuthCurve && c.Auth.DataPlane == "" {
		add("auth.data_plane", "authenticated → open: Mooncake's transports take no kvflow credential; "+
			"the side channel stays CURVE-authenticated, the transfer engine's ports are open")
	}
	add("node.limits", "te_first_byte_timeout, te_idle_timeout, te_max_conns, te_max_conns_per_peer and fd_reserve "+
		"do not apply to the transfer engine's ports: they bound kvflow's tcp engine, and Mooncake's transports manage their own connections "+
		"(fd_reserve and the side_channel_* caps still bound the side channel)")
	return out
}

// ReadGrants is the read.grants the transfer engine applies: off with a
// backend that has none (BackendFallbacks), read.grants otherwise.
func (c Config) ReadGrants() GrantsMode {
	if c.Node.TEBackend == BackendMooncake {
		return GrantsOff
	}
	return c.Read.Grants
}

// DataPlaneAuth reports whether the transfer engine's ports require
// kvflow's authentication: Auth.DataPlaneAuth with the tcp engine;
// never with mooncake (Validate refuses an explicit authenticated there,
// and the default falls back to open, BackendFallbacks).
func (c Config) DataPlaneAuth() bool {
	return c.Auth.DataPlaneAuth() && c.Node.TEBackend != BackendMooncake
}

// validateBackend checks node.te_backend and what it implies.
func (c Config) validateBackend(v *validator) {
	n := c.Node
	switch n.TEBackend {
	case BackendTCP:
		return
	case BackendShm:
		if c.Role() == Prefill && c.Cache.Mode == CacheAnonymous {
			v.add("node.te_backend", "shm on a prefill worker needs its cache in a file (cache.mode shm or shm_attach), not %s memory", CacheAnonymous)
		}
		return
	case BackendMooncake:
	default:
		v.add("node.te_backend", "must be %s, %s or %s, got %q", BackendTCP, BackendShm, BackendMooncake, n.TEBackend)
		return
	}
	if !MooncakeBuilt {
		v.add("node.te_backend", "%s", ErrMooncakeNotBuilt)
	}
	word := func(path, val, what string) {
		switch {
		case val == "":
			v.add(path, "missing: node.te_backend mooncake needs %s", what)
		case strings.ContainsAny(val, " \t\n\"'"):
			v.add(path, "want %s without spaces or quotes, got %q", what, val)
		}
	}
	word("node.mooncake.protocol", n.Mooncake.Protocol, "a transport name (rdma, tcp, ascend, ...)")
	word("node.mooncake.location", n.Mooncake.Location, "a location tag (cpu:0, npu:0, ...)")
	// In P2P handshake mode Mooncake picks its RPC port (at random in the
	// process-wide MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, 15000–17000 by
	// default) whatever it is asked; its data port too, from the same range.
	if n.TEPort != 0 {
		v.add("node.te_port", "%d: Mooncake's engine picks its own RPC port (in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT of its environment, "+
			"15000..17000 by default); set 0 (the metadata advertises the port it took)", n.TEPort)
	}
	if n.TEDataPort != 0 {
		v.add("node.te_data_port", "%d: Mooncake's engine picks its own data port (its tcp transport takes one in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, "+
			"and its C API takes none); set 0, or use te_backend %s or %s to fix it", n.TEDataPort, BackendTCP, BackendShm)
	}
	if c.Role() == Prefill && c.Read.Grants == GrantsOn {
		v.add("read.grants", "on needs node.te_backend %s: Mooncake's engine serves every registered byte to any peer "+
			"(set off; auto falls back to off with a warning)", BackendTCP)
	}
	if c.Auth.Mode == AuthCurve && c.Auth.DataPlane == DataPlaneAuthenticated {
		v.add("auth.data_plane", "%s needs node.te_backend %s: Mooncake's transports take no kvflow credential "+
			"(set %s; left empty it falls back to %s with a warning)", DataPlaneAuthenticated, BackendTCP, DataPlaneOpen, DataPlaneOpen)
	}
}
