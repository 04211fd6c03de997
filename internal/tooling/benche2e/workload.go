package benche2e

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"time"
)

// Workload is one preset, possibly changed by flags.
type Workload struct {
	Name string `json:"name"`
	// Requests is the number of requests (for mixed: of the long ones).
	Requests int `json:"requests"`
	// Blocks is the blocks per request (small: the most, each request
	// drawing 1..Blocks; mixed: of the long requests).
	Blocks int `json:"blocks"`
	// Short and Interval (mixed only): Short 1-block requests, one every
	// Interval from the start, while the long ones run.
	Short    int           `json:"short,omitempty"`
	Interval time.Duration `json:"interval_ns,omitempty"`
	// Slow (slowpeer only): requests to a stalled prefill rank (its side
	// channel answers, its transfer engine never does), loaded among the
	// others, one after every Requests/Slow healthy ones.
	Slow int `json:"slow,omitempty"`

	PrefillTP int `json:"prefill_tp"`
	DecodeTP  int `json:"decode_tp"`

	// ModelLayers is the model's layer count; Layers the layers actually
	// allocated and moved (fewer when the caches would not fit MaxMem).
	ModelLayers int `json:"model_layers"`
	Layers      int `json:"layers"`
	KVHeads     int `json:"kv_heads"` // all ranks
	HeadDim     int `json:"head_dim"`
	BlockSize   int `json:"block_size"`
	// Seed drives the small preset's block counts.
	Seed uint64 `json:"seed"`
	// TEBackend is the workers' node.te_backend ("": tcp); with mooncake
	// they run Mooncake's engine over its tcp transport (loopback).
	TEBackend string `json:"te_backend,omitempty"`
}

// Workload names.
const (
	Long  = "long"
	Batch = "batch"
	Burst = "burst"
	Mixed = "mixed"
	Small = "small"
	// SlowPeer is burst-like traffic to a healthy prefill rank with some
	// requests to a stalled one among it: run "alone" (the healthy
	// requests only) and "kvflow" (with the stalled ones), it shows what
	// the stalled rank costs the healthy rank's requests. Not in "all".
	SlowPeer = "slowpeer"
	All      = "all"
)

// Names lists the presets in the order "all" runs them.
func Names() []string { return []string{Long, Batch, Burst, Mixed, Small} }

// llama is a Llama-3-8B-like cache: 32 layers, 8 KV heads, head dim 128,
// block 128, bf16 (16 MiB per block across all ranks, K and V).
func llama(w Workload) Workload {
	w.ModelLayers, w.KVHeads, w.HeadDim, w.BlockSize = 32, 8, 128, 128
	return w
}

// Preset returns the named workload at TP 1 → 1 (0 layers: sized later).
func Preset(name string) (Workload, error) {
	w := Workload{Name: name, PrefillTP: 1, DecodeTP: 1, Seed: 1}
	switch name {
	case Long:
		w.Requests, w.Blocks = 8, 128
		return llama(w), nil
	case Batch:
		w.Requests, w.Blocks = 64, 16
		return llama(w), nil
	case Burst:
		w.Requests, w.Blocks = 512, 1
		return llama(w), nil
	case Mixed:
		// Four long requests take ~0.3-0.6 s here (8 of 32 layers under
		// the 3 GiB cap); 64 short ones arriving every 4 ms (256 ms) all
		// arrive while they run.
		w.Requests, w.Blocks, w.Short, w.Interval = 4, 128, 64, 4*time.Millisecond
		return llama(w), nil
	case SlowPeer:
		// 256 one-block requests to the healthy rank and 32 to a
		// stalled one: the stalled rank's requests take up to 24 of
		// the 32 read workers (read.peer_workers) until read.timeout.
		w.Requests, w.Blocks, w.Slow = 256, 1, 32
		return llama(w), nil
	case Small:
		// A TP-8 deployment's rank: block 16, one KV head per prefill
		// rank (KVHeads follows the prefill TP), 1-8 blocks per request.
		w.Requests, w.Blocks = 512, 8
		w.ModelLayers, w.KVHeads, w.HeadDim, w.BlockSize = 32, 1, 128, 16
		return w, nil
	}
	return Workload{}, fmt.Errorf("unknown workload %q (want one of %s, or %s)", name, strings.Join(Names(), ", "), All)
}

// bytesPerLayerBlock is one block of one layer, K and V, all KV heads (all
// ranks of one side together), bf16.
func (w Workload) bytesPerLayerBlock() int64 {
	return 2 * int64(w.KVHeads) * int64(w.HeadDim) * int64(w.BlockSize) * 2
}

// BlockBytes is one block across all layers moved and all ranks of one side.
func (w Workload) BlockBytes() int64 { return int64(w.Layers) * w.bytesPerLayerBlock() }

// reqSpec is one request of a run.
type reqSpec struct {
	blocks  int
	short   bool          // mixed: a 1-block request
	slow    bool          // slowpeer: to the stalled rank
	arrival time.Duration // offset from the start of the run
	local   []int         // decode block ids (distinct across the run)
	remote  []int         // prefill block ids (shared pool, read only)
}

// requests lays out the run: local blocks distinct and consecutive per
// request, remote blocks drawn from a pool of poolBlocks.
func (w Workload) requests() (reqs []reqSpec, localBlocks, poolBlocks int) {
	rng := rand.New(rand.NewPCG(w.Seed, 0x6b76))
	for range w.Requests {
		n := w.Blocks
		if w.Name == Small {
			n = 1 + rng.IntN(w.Blocks)
		}
		reqs = append(reqs, reqSpec{blocks: n})
	}
	for i := range w.Short {
		reqs = append(reqs, reqSpec{blocks: 1, short: true, arrival: time.Duration(i+1) * w.Interval})
	}
	if w.Slow > 0 {
		every := max(1, w.Requests/w.Slow)
		mixed := make([]reqSpec, 0, len(reqs)+w.Slow)
		added := 0
		for i, r := range reqs {
			mixed = append(mixed, r)
			if (i+1)%every == 0 && added < w.Slow {
				mixed = append(mixed, reqSpec{blocks: w.Blocks, slow: true})
				added++
			}
		}
		for ; added < w.Slow; added++ {
			mixed = append(mixed, reqSpec{blocks: w.Blocks, slow: true})
		}
		reqs = mixed
	}
	sort.SliceStable(reqs, func(i, j int) bool { return reqs[i].arrival < reqs[j].arrival })
	maxN := 0
	for _, r := range reqs {
		localBlocks += r.blocks
		maxN = max(maxN, r.blocks)
	}
	// Prefill blocks are only read: a pool of at least 64 blocks (or the
	// largest request) serves every request without the memory of all.
	poolBlocks = min(localBlocks, max(maxN, 64))
	next, rnext := 0, 0
	for i := range reqs {
		n := reqs[i].blocks
		reqs[i].local = seq(next, n)
		next += n
		if rnext+n > poolBlocks {
			rnext = 0
		}
		reqs[i].remote = seq(rnext, n)
		rnext += n
	}
	return reqs, localBlocks, poolBlocks
}

func seq(start, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = start + i
	}
	return s
}

// ErrTooBig: the caches would not fit the memory cap.
var ErrTooBig = errors.New("bench e2e: caches do not fit the memory cap")

// Size fixes Layers (0: as many of ModelLayers as fit maxMem) and checks
// the shape before anything is allocated. It returns the bytes of cache
// the run allocates (both sides).
func (w *Workload) Size(maxMem int64) (int64, error) {
	var errs []error
	if w.Requests < 1 {
		errs = append(errs, fmt.Errorf("requests: %d, want >= 1", w.Requests))
	}
	if w.Blocks < 1 {
		errs = append(errs, fmt.Errorf("blocks: %d, want >= 1", w.Blocks))
	}
	if w.PrefillTP < 1 || w.DecodeTP < 1 {
		errs = append(errs, fmt.Errorf("tp: prefill %d, decode %d, want >= 1", w.PrefillTP, w.DecodeTP))
	}
	if w.Layers < 0 || w.Layers > w.ModelLayers {
		errs = append(errs, fmt.Errorf("layers: %d, want 0 (auto) .. %d", w.Layers, w.ModelLayers))
	}
	if w.Slow < 0 || (w.Name == SlowPeer && w.Slow < 1) {
		errs = append(errs, fmt.Errorf("slow: %d requests to the stalled rank, want >= 1 (slowpeer) or 0", w.Slow))
	}
	if w.Name == Mixed && (w.Short < 1 || w.Interval <= 0) {
		errs = append(errs, fmt.Errorf("mixed: %d short requests every %v, want >= 1 and > 0", w.Short, w.Interval))
	}
	if len(errs) > 0 {
		return 0, errors.Join(errs...)
	}
	if w.Name == Small {
		w.KVHeads = max(w.PrefillTP, w.DecodeTP) // one KV head per rank
	}
	_, local, pool := w.requests()
	perLayer := int64(local+pool) * w.bytesPerLayerBlock()
	if w.Layers == 0 {
		w.Layers = int(min(int64(w.ModelLayers), maxMem/perLayer))
		if w.Layers < 1 {
			return 0, fmt.Errorf("%w: %s needs %s per layer (%d decode + %d prefill blocks), cap %s",
				ErrTooBig, w.Name, gib(perLayer), local, pool, gib(maxMem))
		}
	}
	total := int64(w.Layers) * perLayer
	if total > maxMem {
		return 0, fmt.Errorf("%w: %s with %d layers needs %s (%d decode + %d prefill blocks of %s), cap %s (fewer --layers, --requests or --blocks, or a larger --max-mem-gib)",
			ErrTooBig, w.Name, w.Layers, gib(total), local, pool, gib(w.BlockBytes()), gib(maxMem))
	}
	return total, nil
}

func gib(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
}
