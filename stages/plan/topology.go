package plan

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Parallel is one instance's parallel layout (vLLM's parallel config plus
// kv_connector_extra_config.<role>.{tp_size,dp_size,pp_size}).
//
// TP, PP and DP must be at least 1 (a zero means "missing" and is reported by
// Validate). PCP and DCP (prefill / decode context parallel world sizes) may
// be left 0, which means 1. KVPort is the instance's kv_port (the base of its
// handshake ports); 0 means unknown and skips the port-range checks.
type Parallel struct {
	TP, PP, DP int
	PCP, DCP   int
	KVPort     int
}

// pcp and dcp return the context-parallel sizes with 0 read as 1.
func (p Parallel) pcp() int { return one(p.PCP) }
func (p Parallel) dcp() int { return one(p.DCP) }

func one(v int) int {
	if v == 0 {
		return 1
	}
	return v
}

// Workers is the number of workers of one DP replica times DP: the seed's
// max_device_id (tp * dp * pcp * pp).
func (p Parallel) Workers() int { return p.TP * p.DP * p.pcp() * p.PP }

// Model is the part of the model shape that planning depends on.
type Model struct {
	NumLayers  int  // hf_config.num_hidden_layers
	NumKVHeads int  // hf_config.num_key_value_heads (ignored for rank choice when MLA or Sparse)
	MLA        bool // model_config.is_deepseek_mla
	Sparse     bool // 3-part (sparse attention) KV cache: the seed's use_sparse
}

// Topology is the whole P/D configuration one request is planned against.
//
// PPLayerPartition is the prefill instance's VLLM_PP_LAYER_PARTITION
// ("" when unset): comma-separated layer counts per prefill PP stage. It is a
// value here; nothing in this package reads the environment.
// DecodePPLayerPartition is the same for the decode instance (kvflow only:
// the seed has no decode PP).
type Topology struct {
	Prefill, Decode        Parallel
	Model                  Model
	PPLayerPartition       string
	DecodePPLayerPartition string
}

// NeedsKvflowPeer reports whether the topology is one the seed cannot
// serve: decode TP larger than prefill TP, or decode PP > 1. Both sides
// must then be kvflow (the prefill side must count the DONEs this package
// plans); a seed peer is refused.
func (t Topology) NeedsKvflowPeer() bool {
	return t.Decode.TP > t.Prefill.TP || t.Decode.PP > 1
}

// Rank is one worker's position in its instance. DCP is informational (the
// seed derives nothing from the decode DCP rank when planning).
type Rank struct {
	TP, PP, DP, PCP, DCP int
}

// Mode is how a request's KV is split between prefill ranks.
type Mode int

const (
	// ModeTP: no context parallelism anywhere; the decode rank pulls from
	// tp_num_need_pulls prefill TP ranks of every prefill PP stage.
	ModeTP Mode = iota
	// ModePointToPoint: PCP/DCP sizes equal on both sides; each decode rank
	// pulls its own context shard from the matching prefill ranks.
	ModePointToPoint
	// ModeSplit: decode PCP 1 and sizes differ; each decode rank pulls from
	// remote_pcp * (remote_dcp / dcp) prefill ranks, a slice of blocks each.
	ModeSplit
)

func (m Mode) String() string {
	switch m {
	case ModeTP:
		return "tp"
	case ModePointToPoint:
		return "point_to_point"
	case ModeSplit:
		return "split"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// modeFor is the seed's branch choice in _get_kv_split_metadata (and, for
// ModeTP, the plain start_load_kv path).
func modeFor(decode Parallel, remotePCP, remoteDCP int) Mode {
	if remotePCP*remoteDCP*decode.pcp()*decode.dcp() == 1 {
		return ModeTP
	}
	if decode.pcp() == remotePCP && decode.dcp() == remoteDCP {
		return ModePointToPoint
	}
	return ModeSplit
}

// Mode is the split mode of requests whose prefill PCP/DCP sizes are the
// topology's.
func (t Topology) Mode() Mode { return modeFor(t.Decode, t.Prefill.pcp(), t.Prefill.dcp()) }

// usesMLALayout is the seed's use_mla of register_kv_caches: a 2-part cache,
// which a sparse (3-part) model does not have.
func (t Topology) usesMLALayout() bool { return t.Model.MLA && !t.Model.Sparse }

// NeedPulls is tp_num_need_pulls: 1 for MLA, else
// max(1, H // decode_tp) // max(1, H // prefill_tp).
func NeedPulls(m Model, prefillTP, decodeTP int) int {
	if m.MLA {
		return 1
	}
	if prefillTP <= 0 || decodeTP <= 0 {
		return 1
	}
	d := max(1, m.NumKVHeads/decodeTP)
	p := max(1, m.NumKVHeads/prefillTP)
	return d / p
}

// NeedPulls is tp_num_need_pulls for this topology (P in the package docs);
// 1 when decode TP > prefill TP (kvflow only: each decode rank reads one
// prefill rank, where the seed's formula gives 0).
func (t Topology) NeedPulls() int {
	if t.Decode.TP > t.Prefill.TP {
		return 1
	}
	return NeedPulls(t.Model, t.Prefill.TP, t.Decode.TP)
}

// SideChannelPort is the seed's side_channel_port: kv_port + dp_rank*tp*pp*pcp,
// the base handshake port of a DP replica.
func SideChannelPort(kvPort int, p Parallel, dpRank int) int {
	return kvPort + dpRank*p.TP*p.PP*p.pcp()
}

// HandshakePort is the port a worker listens on (the seed's handshake_port):
// SideChannelPort + (pp_rank + pcp_rank)*tp + tp_rank.
func HandshakePort(kvPort int, p Parallel, r Rank) int {
	return SideChannelPort(kvPort, p, r.DP) + DeviceIndex(p, r)
}

// DeviceIndex is a worker's handshake port relative to its replica's side
// channel port: (pp_rank + pcp_rank)*tp + tp_rank. It is also the "remote
// rank" a decode worker adds to remote_port.
func DeviceIndex(p Parallel, r Rank) int { return (r.PP+r.PCP)*p.TP + r.TP }

// Validate reports every problem of p on its own (sizes, PP with PCP),
// each naming the field as "<name>.<field>".
func (p Parallel) Validate(name string) error {
	var errs []error
	pos := func(field string, v int) {
		if v < 1 {
			errs = append(errs, fmt.Errorf("%s.%s: must be >= 1, got %d (missing?)", name, field, v))
		}
	}
	pos("tp_size", p.TP)
	pos("pp_size", p.PP)
	pos("dp_size", p.DP)
	if p.PCP < 0 {
		errs = append(errs, fmt.Errorf("%s.pcp_size: must be >= 1 (or 0 for 1), got %d", name, p.PCP))
	}
	if p.DCP < 0 {
		errs = append(errs, fmt.Errorf("%s.dcp_size: must be >= 1 (or 0 for 1), got %d", name, p.DCP))
	}
	if p.PP > 1 && p.pcp() > 1 {
		errs = append(errs, fmt.Errorf("%s: pp_size %d with pcp_size %d: pp and pcp cannot be enabled at the same time", name, p.PP, p.pcp()))
	}
	if p.DCP > 1 && p.TP >= 1 && p.TP%p.DCP != 0 {
		errs = append(errs, fmt.Errorf("%s.dcp_size: %d does not divide tp_size %d", name, p.DCP, p.TP))
	}
	if p.KVPort != 0 && p.TP >= 1 && p.PP >= 1 && p.DP >= 1 && p.PCP >= 0 {
		last := p.KVPort + p.Workers() - 1
		if p.KVPort < 1 || last > 65535 {
			errs = append(errs, fmt.Errorf("%s.kv_port: handshake ports %d..%d outside 1..65535", name, p.KVPort, last))
		}
	}
	return errors.Join(errs...)
}

// Validate checks the whole P/D configuration before any request runs and
// returns every problem found (errors.Join), each naming its field. A
// topology that passes can be planned for any in-range decode rank and any
// well-formed request; the deviations from the seed that are decided here
// (sparse without MLA, duplicate split ports) are listed in the package docs.
func (t Topology) Validate() error {
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	add(t.Prefill.Validate("prefill"))
	add(t.Decode.Validate("decode"))
	m := t.Model
	if m.NumLayers < 1 {
		add(fmt.Errorf("model.num_hidden_layers: must be >= 1, got %d", m.NumLayers))
	}
	if m.NumKVHeads < 1 {
		add(fmt.Errorf("model.num_key_value_heads: must be >= 1, got %d", m.NumKVHeads))
	}
	if m.Sparse && !m.MLA {
		// §5b.8: the seed treats heads as 1 for the rank choice but uses the
		// GQA head count for tp_num_need_pulls, and indexes out of range.
		add(errors.New("model: sparse (3-part) KV cache without MLA (is_deepseek_mla=false) is not supported"))
	}
	ptp, dtp := t.Prefill.TP, t.Decode.TP
	sizesOK := ptp >= 1 && dtp >= 1 && t.Prefill.PP >= 1 && t.Decode.PP >= 1 && m.NumKVHeads >= 1 && m.NumLayers >= 1
	if !sizesOK {
		return errors.Join(errs...)
	}
	cp := t.Prefill.pcp()*t.Prefill.dcp()*t.Decode.pcp()*t.Decode.dcp() > 1
	// tpOK: the TP sizes and the heads fit each other; the rank grouping
	// derived from them is checked only then (with sizes already refused,
	// its error would only restate theirs).
	tpOK := true
	switch {
	case ptp < dtp:
		// kvflow only: each decode rank reads a head slice (GQA) or the
		// whole latent (MLA) of one prefill rank.
		if cp {
			add(fmt.Errorf("decode.tp_size: %d > prefill.tp_size %d with context parallelism (pcp/dcp > 1) is not supported", dtp, ptp))
		}
		if !m.MLA && dtp%ptp != 0 {
			add(fmt.Errorf("decode.tp_size: %d is not a multiple of prefill.tp_size %d: a decode rank's heads would span two prefill ranks", dtp, ptp))
		}
	case ptp%dtp != 0:
		tpOK = false
		add(fmt.Errorf("decode.tp_size: %d does not divide prefill.tp_size %d", dtp, ptp))
	}
	if t.Decode.PP > 1 {
		// kvflow only: each decode stage pulls its own layers.
		if m.NumLayers < t.Decode.PP {
			add(fmt.Errorf("model.num_hidden_layers: %d layers for decode.pp_size %d stages", m.NumLayers, t.Decode.PP))
		}
		if cp {
			add(fmt.Errorf("decode.pp_size: %d with context parallelism (pcp/dcp > 1) is not supported", t.Decode.PP))
		}
		if parts, err := parsePartitionFor("decode_pp_layer_partition", "decode.pp_size", t.DecodePPLayerPartition, m.NumLayers, t.Decode.PP); err != nil {
			add(err)
		} else if i := slices.Index(parts, 0); i >= 0 {
			add(fmt.Errorf("decode_pp_layer_partition: decode stage %d has no layers in %q", i, t.DecodePPLayerPartition))
		}
	} else if t.DecodePPLayerPartition != "" {
		if _, err := parsePartitionFor("decode_pp_layer_partition", "decode.pp_size", t.DecodePPLayerPartition, m.NumLayers, t.Decode.PP); err != nil {
			add(err)
		}
	}
	if !m.MLA {
		h := m.NumKVHeads
		for _, s := range []struct {
			name string
			tp   int
		}{{"prefill.tp_size", ptp}, {"decode.tp_size", dtp}} {
			if h%s.tp != 0 && s.tp%h != 0 {
				tpOK = false
				add(fmt.Errorf("%s: %d and model.num_key_value_heads %d: neither divides the other", s.name, s.tp, h))
			}
		}
	}
	if m.NumLayers < t.Prefill.PP {
		add(fmt.Errorf("model.num_hidden_layers: %d layers for prefill.pp_size %d stages", m.NumLayers, t.Prefill.PP))
	}
	if _, err := parsePartition(t.PPLayerPartition, m.NumLayers, t.Prefill.PP); err != nil {
		add(err)
	}
	if cp && t.Prefill.PP > 1 {
		add(fmt.Errorf("prefill.pp_size: %d with context parallelism (pcp/dcp > 1) is not supported", t.Prefill.PP))
	}
	if ptp >= dtp && tpOK {
		if err := t.validateGroups(); err != nil {
			add(err)
		}
	}
	switch t.Mode() {
	case ModePointToPoint:
		if !m.MLA && ptp != dtp && m.NumKVHeads < dtp {
			add(fmt.Errorf("decode.tp_size: point-to-point context parallel with num_key_value_heads %d < decode tp %d and prefill tp %d != decode tp pairs ranks holding different heads", m.NumKVHeads, dtp, ptp))
		}
	case ModeSplit:
		add(t.validateSplit())
	}
	return errors.Join(errs...)
}

// validateGroups checks that the seed's rank grouping is well formed: the
// random branch reshapes a stage's prefill TP ranks into rows of num_groups,
// and every decode rank must get exactly tp_num_need_pulls ranks per stage.
func (t Topology) validateGroups() error {
	cfg := t.rankConfig()
	ng := cfg.numGroups()
	if cfg.randomBranch() {
		if t.Prefill.TP%ng != 0 {
			return fmt.Errorf("prefill.tp_size: %d not a multiple of the %d head groups", t.Prefill.TP, ng)
		}
		k := cfg.sampleK()
		if k > ng {
			return fmt.Errorf("decode.tp_size: %d decode ranks need %d of %d head groups", t.Decode.TP, k, ng)
		}
		if per := t.Prefill.TP / ng * k; per != t.Decode.TP*cfg.P {
			return fmt.Errorf("decode.tp_size: %d decode ranks x tp_num_need_pulls %d != %d chosen prefill ranks per stage", t.Decode.TP, cfg.P, per)
		}
		return nil
	}
	if gs := t.Prefill.TP / t.Decode.TP; gs != cfg.P {
		return fmt.Errorf("model.num_key_value_heads: %d heads give tp_num_need_pulls %d but each decode rank maps to %s", t.Model.NumKVHeads, cfg.P, plural(gs, "prefill rank"))
	}
	return nil
}

func (t Topology) validateSplit() error {
	var errs []error
	d, p := t.Decode, t.Prefill
	if d.pcp() != 1 {
		errs = append(errs, fmt.Errorf("decode.pcp_size: %d differs from prefill pcp %d/dcp %d; only decode pcp 1 can pull a split context", d.pcp(), p.pcp(), p.dcp()))
	}
	if t.usesMLALayout() {
		if !((d.dcp() == 1 && (d.TP == 1 || d.TP == p.TP)) || (d.dcp() == p.dcp() && d.TP == p.TP)) {
			errs = append(errs, fmt.Errorf("decode.tp_size: MLA split context needs decode dcp 1 with tp 1 or prefill tp %d, or dcp equal to prefill dcp %d with equal tp (got tp %d, dcp %d)", p.TP, p.dcp(), d.TP, d.dcp()))
		}
	} else {
		if d.TP != p.TP || !(d.dcp() == 1 || d.dcp() == p.dcp()) {
			errs = append(errs, fmt.Errorf("decode.tp_size: split context needs decode tp equal to prefill tp %d and decode dcp 1 or %d (got tp %d, dcp %d)", p.TP, p.dcp(), d.TP, d.dcp()))
		}
	}
	if p.dcp()%d.dcp() != 0 {
		errs = append(errs, fmt.Errorf("decode.dcp_size: %d does not divide prefill dcp_size %d", d.dcp(), p.dcp()))
	} else if r := p.dcp() / d.dcp(); r > p.TP {
		// §5b.11: the seed would dial duplicate ports.
		errs = append(errs, fmt.Errorf("prefill.dcp_size: %d / decode dcp %d = %d exceeds prefill tp_size %d: split ports would repeat", p.dcp(), d.dcp(), r, p.TP))
	}
	return errors.Join(errs...)
}

// checkDecodeRank reports every field of self outside the decode instance.
func (t Topology) checkDecodeRank(self Rank) error {
	var errs []error
	chk := func(field string, v, size int) {
		if v < 0 || v >= size {
			errs = append(errs, fmt.Errorf("rank.%s: %d outside [0, %d)", field, v, size))
		}
	}
	chk("tp_rank", self.TP, t.Decode.TP)
	chk("pp_rank", self.PP, t.Decode.PP)
	chk("dp_rank", self.DP, t.Decode.DP)
	chk("pcp_rank", self.PCP, t.Decode.pcp())
	chk("dcp_rank", self.DCP, t.Decode.dcp())
	return errors.Join(errs...)
}

func (t Topology) checkPrefillRank(self Rank) error {
	var errs []error
	chk := func(field string, v, size int) {
		if v < 0 || v >= size {
			errs = append(errs, fmt.Errorf("rank.%s: %d outside [0, %d)", field, v, size))
		}
	}
	chk("tp_rank", self.TP, t.Prefill.TP)
	chk("pp_rank", self.PP, t.Prefill.PP)
	chk("dp_rank", self.DP, t.Prefill.DP)
	chk("pcp_rank", self.PCP, t.Prefill.pcp())
	chk("dcp_rank", self.DCP, t.Prefill.dcp())
	return errors.Join(errs...)
}

// trimSpace is Python's str.strip() for the ASCII whitespace int() accepts.
func trimSpace(s string) string { return strings.Trim(s, " \t\n\r\v\f") }

// plural is "1 noun" or "n nouns".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
