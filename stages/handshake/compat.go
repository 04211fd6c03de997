package handshake

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// ErrIncompatible is wrapped by every *MismatchError: the peer's cache is
// not the one this decode worker's read of it assumes.
var ErrIncompatible = errors.New("handshake: peer cache incompatible")

// Mismatch is one field that differs.
type Mismatch struct {
	Field string // the metrics label: one of MismatchFields
	What  string // the field as the message names it, e.g. "block_len of part 0"
	Got   string // the peer's value
	Want  string // what this decode worker expects
}

// MismatchError is a peer whose cache differs from the expected one; the
// request fails with it before any byte moves. Its message names the peer,
// then every differing field with both values, the first being the likely
// cause (fields are compared from the model shape down to the addresses).
type MismatchError struct {
	Peer       string // "peer P tp 2" (engine id, the peer's ranks)
	Mismatches []Mismatch
}

func (e *MismatchError) Error() string {
	var b strings.Builder
	b.WriteString(e.Peer)
	b.WriteString(": ")
	for i, m := range e.Mismatches {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s is %s, this decode expects %s", m.What, m.Got, m.Want)
	}
	return b.String()
}

func (e *MismatchError) Unwrap() error { return ErrIncompatible }

// MismatchFields are the label values of
// kvflow_handshake_peer_mismatches_total{field}: the first differing field
// of each refused handshake.
var MismatchFields = []string{
	"kind", "dtype", "block_size", "kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim", "indexer_dim",
	"layers", "parts", "block_len", "num_blocks", "base_addrs", "topology", "rank", "buffer", "buffer_len",
}

// Buffer is one registered buffer of a peer's transfer-engine segment.
type Buffer struct{ Addr, Len uint64 }

// SegmentLister lists the registered buffers of the transfer-engine peer
// at session "host:rpc_port" (its segment descriptor), handshaking with it
// if needed.
type SegmentLister interface {
	PeerBuffers(ctx context.Context, session string) ([]Buffer, error)
}

// SegmentListerFunc adapts a function to SegmentLister.
type SegmentListerFunc func(ctx context.Context, session string) ([]Buffer, error)

// PeerBuffers calls f.
func (f SegmentListerFunc) PeerBuffers(ctx context.Context, session string) ([]Buffer, error) {
	return f(ctx, session)
}

// CompatOptions configures a Compat.
type CompatOptions struct {
	// Topology is the P/D configuration the plan uses.
	Topology plan.Topology
	// Layout is the read stage's cache layout (this worker's block_len per
	// part, parts per layer).
	Layout plan.CacheLayout
	// Local is this worker's own cache fingerprint (npu.Layout.Fingerprint).
	Local npu.Fingerprint
	// Segments lists a peer's registered buffers, for peers whose metadata
	// carries no fingerprint (seed, Mooncake). nil: such peers are not
	// checked.
	Segments   SegmentLister
	Registerer prometheus.Registerer
}

// Compat checks that a peer's cache is the one the plan's reads assume.
type Compat struct {
	o          CompatOptions
	mismatches *prometheus.CounterVec
	unchecked  prometheus.Counter
}

// NewCompat makes the checker and registers its metrics.
func NewCompat(o CompatOptions) (*Compat, error) {
	if err := o.Layout.Validate(); err != nil {
		return nil, fmt.Errorf("handshake: compat layout: %w", err)
	}
	c := &Compat{o: o}
	c.mismatches = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_handshake_peer_mismatches_total",
		Help: "Requests failed before any read because a prefill peer's cache differs from the expected one, by the first differing field.",
	}, []string{"field"})
	for _, f := range MismatchFields {
		c.mismatches.WithLabelValues(f)
	}
	c.unchecked = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_handshake_peers_unchecked_total",
		Help: "Tasks read from a peer whose metadata carried no cache fingerprint while the transfer engine could not list the peer's buffers (nothing to compare).",
	})
	if o.Registerer != nil {
		for _, col := range []prometheus.Collector{c.mismatches, c.unchecked} {
			if err := o.Registerer.Register(col); err != nil {
				return nil, fmt.Errorf("handshake: register metrics: %w", err)
			}
		}
	}
	return c, nil
}

// Expect is the fingerprint this decode worker expects from the remote
// rank of task t: its own cache, with the layers of t's prefill PP stage,
// and heads and block lengths divided by t.P (tp_num_need_pulls: the read
// takes block_len/P bytes per remote block, as plan.Reads does) or, for a
// head-slice task (decode TP > prefill TP), multiplied by t.HeadSplit.
// NumBlocks is the peer's own (the metadata's); Prefill and Decode are this
// worker's topology.
func (c *Compat) Expect(t plan.Task, numBlocks int) npu.Fingerprint {
	l, o := c.o.Layout, c.o.Local
	// The remote block holds 1/P of ours (tp_num_need_pulls) or, when
	// decode TP exceeds prefill TP, HeadSplit times ours (the read takes
	// one head slice of every token row).
	p, split := max(1, t.P), max(1, t.HeadSplit)
	e := o
	e.Layers = t.LayerEnd - t.LayerStart
	if t.RemoteLayers > 0 { // decode PP: the task covers part of the stage
		e.Layers = t.RemoteLayers
	}
	e.NumBlocks = numBlocks
	e.BlockLens = make([]int, l.CachesPerLayer)
	for k := range e.BlockLens {
		e.BlockLens[k] = int(l.BlockLen[k%len(l.BlockLen)]) / p * split
	}
	if e.Kind == npu.GQA {
		e.KVHeads = o.KVHeads / p * split
	}
	tp := c.o.Topology
	e.Prefill = sizes(tp.Prefill)
	e.Decode = sizes(tp.Decode)
	return e
}

func sizes(p plan.Parallel) npu.Sizes {
	return npu.Sizes{TP: p.TP, PP: max(1, p.PP), PCP: max(1, p.PCP), DCP: max(1, p.DCP)}
}

// Check compares task i's peer (j.Metas[i]) with what the read of it
// assumes. A peer whose metadata carries a fingerprint is compared field by
// field; one without (seed, Mooncake) by its transfer engine's segment:
// each base address the plan uses must start a registered buffer of
// num_blocks × block_len bytes of its part. On a mismatch Check
// returns a *MismatchError (the Stage counts it); other errors (listing
// the segment) are returned as they are.
func (c *Compat) Check(ctx context.Context, j *job.Job, i int) error {
	t, m := j.Plan.Tasks[i], j.Metas[i]
	e := c.Expect(t, m.NumBlocks)
	var ms []Mismatch
	if m.Cache != nil {
		ms = compare(*m.Cache, e, t, c.o.Topology.Prefill.TP, m)
	} else {
		var err error
		if ms, err = c.compareSeed(ctx, j, i, e); err != nil {
			return err
		}
	}
	if len(ms) == 0 {
		return nil
	}
	return &MismatchError{Peer: peerName(m.EngineID, t, c.o.Topology), Mismatches: ms}
}

// observe counts err by its first differing field if it is (or wraps) a
// *MismatchError, and reports whether it is. A nil c observes nothing.
func (c *Compat) observe(err error) bool {
	var me *MismatchError
	if c == nil || !errors.As(err, &me) || len(me.Mismatches) == 0 {
		return false
	}
	c.mismatches.WithLabelValues(me.Mismatches[0].Field).Inc()
	return true
}

// peerName is "peer <engine id> tp <t>", with " pp <p>" / " cp <c>" when
// the prefill instance has those.
func peerName(engineID string, t plan.Task, tp plan.Topology) string {
	ptp := max(1, tp.Prefill.TP)
	s := fmt.Sprintf("peer %s tp %d", engineID, t.RemoteRank%ptp)
	if tp.Prefill.PP > 1 {
		s += " pp " + strconv.Itoa(t.PPStage)
	}
	if max(1, tp.Prefill.PCP) > 1 {
		s += " pcp " + strconv.Itoa(t.RemoteRank/ptp)
	}
	return s
}

func itoa(v int) string { return strconv.Itoa(v) }

// compare lists the fields of the peer's fingerprint f that differ from e.
func compare(f, e npu.Fingerprint, t plan.Task, prefillTP int, m job.Meta) []Mismatch {
	var ms []Mismatch
	add := func(field, what, got, want string) {
		ms = append(ms, Mismatch{Field: field, What: what, Got: got, Want: want})
	}
	num := func(field string, got, want int) {
		if got != want {
			add(field, field, itoa(got), itoa(want))
		}
	}
	if f.Kind != e.Kind {
		add("kind", "cache kind", f.Kind.String(), e.Kind.String())
	}
	if f.DType != e.DType {
		add("dtype", "dtype", f.DType.String(), e.DType.String())
	}
	num("block_size", f.BlockSize, e.BlockSize)
	num("kv_heads", f.KVHeads, e.KVHeads)
	num("head_dim", f.HeadDim, e.HeadDim)
	num("kv_lora_rank", f.KVLoraRank, e.KVLoraRank)
	num("qk_rope_head_dim", f.QKRopeHeadDim, e.QKRopeHeadDim)
	num("indexer_dim", f.IndexerDim, e.IndexerDim)
	num("layers", f.Layers, e.Layers)
	if len(f.BlockLens) != len(e.BlockLens) {
		add("parts", "parts per layer", itoa(len(f.BlockLens)), itoa(len(e.BlockLens)))
	} else {
		for p := range f.BlockLens {
			if f.BlockLens[p] != e.BlockLens[p] {
				add("block_len", "block_len of part "+itoa(p), itoa(f.BlockLens[p]), itoa(e.BlockLens[p]))
			}
		}
	}
	if f.NumBlocks != m.NumBlocks {
		add("num_blocks", "num_blocks of the cache fingerprint", itoa(f.NumBlocks), itoa(m.NumBlocks)+" (the metadata's num_blocks)")
	}
	if want := f.Layers * len(f.BlockLens); len(m.BaseAddrs) != want {
		add("base_addrs", "the number of kv_caches_base_addr", itoa(len(m.BaseAddrs)), itoa(want)+" (layers × parts)")
	}
	if f.Prefill != (npu.Sizes{}) || f.Decode != (npu.Sizes{}) {
		for _, s := range []struct {
			name      string
			got, want npu.Sizes
		}{{"prefill", f.Prefill, e.Prefill}, {"decode", f.Decode, e.Decode}} {
			g, w := s.got, s.want
			for _, v := range []struct {
				n    string
				g, w int
			}{{"tp_size", g.TP, w.TP}, {"pp_size", max(1, g.PP), w.PP}, {"pcp_size", max(1, g.PCP), w.PCP}, {"dcp_size", max(1, g.DCP), w.DCP}} {
				if v.g != v.w {
					add("topology", s.name+"."+v.n+" in the peer's configuration", itoa(v.g), itoa(v.w))
				}
			}
		}
		ptp := max(1, prefillTP)
		if got := f.Rank.TP + (f.Rank.PP+f.Rank.PCP)*ptp; got != t.RemoteRank || f.Rank.PP != t.PPStage {
			add("rank", "the peer's rank (tp, pp, pcp)", fmt.Sprintf("(%d, %d, %d)", f.Rank.TP, f.Rank.PP, f.Rank.PCP),
				fmt.Sprintf("rank %d of prefill pp stage %d", t.RemoteRank, t.PPStage))
		}
	}
	return ms
}

// compareSeed checks a peer without a fingerprint against its transfer
// engine's segment.
func (c *Compat) compareSeed(ctx context.Context, j *job.Job, i int, e npu.Fingerprint) ([]Mismatch, error) {
	m := j.Metas[i]
	parts := len(e.BlockLens)
	if want := e.Layers * parts; len(m.BaseAddrs) != want {
		return []Mismatch{{Field: "base_addrs", What: "the number of kv_caches_base_addr", Got: itoa(len(m.BaseAddrs)),
			Want: fmt.Sprintf("%d (%d layers × %d parts)", want, e.Layers, parts)}}, nil
	}
	if c.o.Segments == nil {
		c.unchecked.Inc()
		return nil, nil
	}
	bufs, err := c.o.Segments.PeerBuffers(ctx, j.Session(i))
	if err != nil {
		return nil, fmt.Errorf("handshake: transfer engine segment of %s: %w", j.Session(i), err)
	}
	if bufs == nil {
		c.unchecked.Inc()
		return nil, nil
	}
	lens := make(map[uint64]uint64, len(bufs))
	for _, b := range bufs {
		lens[b.Addr] = b.Len
	}
	var ms []Mismatch
	for k, a := range m.BaseAddrs {
		bl := uint64(e.BlockLens[k%parts])
		want := uint64(m.NumBlocks) * bl
		got, ok := lens[a]
		switch {
		case !ok:
			ms = append(ms, Mismatch{Field: "buffer", What: fmt.Sprintf("kv_caches_base_addr[%d] %#x", k, a),
				Got: "the start of no registered buffer", Want: "a registered buffer"})
		case got != want:
			ms = append(ms, Mismatch{Field: "buffer_len", What: fmt.Sprintf("the registered buffer at kv_caches_base_addr[%d] (part %d)", k, k%parts),
				Got: fmt.Sprintf("%d bytes", got), Want: fmt.Sprintf("%d (num_blocks %d × block_len %d)", want, m.NumBlocks, bl)})
		}
		if len(ms) == 4 { // enough to tell the cause
			break
		}
	}
	return ms, nil
}
