package faults

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// ErrInjected is wrapped by every error an injected fault returns.
var ErrInjected = errors.New("faults: injected failure")

// maxKeys bounds the per-key call counts an Injector remembers (about
// 16 MiB at most); past it the counts restart, and replay is exact only
// for runs with fewer distinct keys. 1 << 20 keys is ~1 M requests.
const maxKeys = 1 << 20

// Injector applies a Schedule to the interfaces it wraps. It is safe for
// concurrent use; several wrappers may share one Injector.
type Injector struct {
	s       Schedule
	enabled atomic.Bool

	mu   sync.Mutex
	seen map[uint64]uint64 // calls so far per (op, key)

	calls    [numOps]atomic.Uint64
	injected [numOps][numKinds]atomic.Uint64
	corrupt  [numCorruptions]atomic.Uint64
}

// New makes an enabled injector for a valid schedule.
func New(s Schedule) (*Injector, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if s.NearShift == 0 {
		s.NearShift = 4096
	}
	in := &Injector{s: s, seen: map[uint64]uint64{}}
	in.enabled.Store(true)
	return in, nil
}

// Schedule returns the injector's schedule.
func (in *Injector) Schedule() Schedule { return in.s }

// SetEnabled turns injection on or off (off: every call passes through and
// is not counted), e.g. to let a test drain its requests cleanly.
func (in *Injector) SetEnabled(on bool) { in.enabled.Store(on) }

// decide draws the decision for one call and counts it.
func (in *Injector) decide(op Op, key uint64, n int) Decision {
	if !in.enabled.Load() {
		return Decision{}
	}
	k := mix(uint64(op)<<56 ^ key)
	in.mu.Lock()
	if len(in.seen) >= maxKeys {
		clear(in.seen)
	}
	nth := in.seen[k]
	in.seen[k] = nth + 1
	in.mu.Unlock()
	d := in.s.Decide(op, key, nth, n)
	in.calls[op].Add(1)
	if d.Kind != None {
		in.injected[op][d.Kind].Add(1)
	}
	if d.Kind == Corrupt {
		in.corrupt[d.Corruption].Add(1)
	}
	return d
}

func injected(op Op, k Kind, detail string) error {
	if detail != "" {
		return fmt.Errorf("faults: %s %s (%s): %w", op, k, detail, ErrInjected)
	}
	return fmt.Errorf("faults: %s %s: %w", op, k, ErrInjected)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// Transfer wraps t. The wrapper takes compact reads and has a ledger
// (read.ReadsLedgerTransfer) whatever t takes, and takes strided reads
// (read.StridedTransfer) when t does, so a P > 1 job under faults is read
// with its transpose fused, as without them.
func (in *Injector) Transfer(t read.Transfer) read.Transfer {
	if _, ok := t.(read.StridedTransfer); ok {
		return stridedTransfer{transfer{in, t}}
	}
	return transfer{in, t}
}

var _ read.StridedTransfer = stridedTransfer{}

// stridedTransfer is transfer for an inner read.StridedTransfer.
type stridedTransfer struct{ transfer }

// BatchReadsStrided runs the strided reads under the schedule. Strided
// reads have no ledger and no prefix form: Truncate and ShortRead run
// none of the ops and fail the batch (a silent short read could not be
// told from a whole one here; the ledger tests cover it on the other
// paths). Fail, Delay and Duplicate act as for the other forms.
func (t stridedTransfer) BatchReadsStrided(ctx context.Context, session string, r *plan.Reads, row, pitch uint64) error {
	inner := t.t.(read.StridedTransfer)
	run := func() error { return inner.BatchReadsStrided(ctx, session, r, row, pitch) }
	n := r.Len()
	d := t.in.decide(Read, readKey(session, batch{r: r}), n)
	switch d.Kind {
	case Fail:
		return injected(Read, Fail, session)
	case Delay:
		if err := sleep(ctx, d.Delay); err != nil {
			return err
		}
	case Truncate, ShortRead:
		return injected(Read, d.Kind, fmt.Sprintf("%s: strided, 0 of %d ops run", session, n))
	case Duplicate:
		if err := run(); err != nil {
			return err
		}
	}
	return run()
}

var _ read.ReadsLedgerTransfer = transfer{}
var _ read.LedgerTransfer = transfer{}

// Fetcher wraps f.
func (in *Injector) Fetcher(f handshake.Fetcher) handshake.Fetcher { return fetcher{in, f} }

// Sender wraps s.
func (in *Injector) Sender(s notify.Sender) notify.Sender { return sender{in, s} }

type transfer struct {
	in *Injector
	t  read.Transfer
}

// batch is the reads of one call: a task's compact reads (r) or a plain op
// list (ops).
type batch struct {
	r   *plan.Reads
	ops []plan.Op
}

func (b batch) len() int {
	if b.r != nil {
		return b.r.Len()
	}
	return len(b.ops)
}

func (b batch) at(i int) plan.Op {
	if b.r != nil {
		return b.r.At(i)
	}
	return b.ops[i]
}

// prefix is the first n ops, as a list (expanding compact reads: only the
// truncating faults need it).
func (b batch) prefix(n int) batch {
	if b.r != nil {
		return batch{ops: b.r.AppendTo(nil)[:n]}
	}
	return batch{ops: b.ops[:n]}
}

// readKey names a batch by its session and where its first and last ops
// land: the same request's batch has the same key on every run, compact or
// not.
func readKey(session string, b batch) uint64 {
	h := hashString(0, session)
	n := b.len()
	h = mix(h ^ uint64(n))
	if n > 0 {
		f, l := b.at(0), b.at(n-1)
		h = mix(h ^ f.Local)
		h = mix(h ^ f.Remote)
		h = mix(h ^ l.Local)
		h = mix(h ^ l.Remote)
	}
	return h
}

// BatchRead runs ops under the schedule.
func (t transfer) BatchRead(ctx context.Context, session string, ops []plan.Op) error {
	return t.apply(ctx, session, batch{ops: ops}, nil)
}

// BatchReadLedger runs ops under the schedule and, when landed is not nil,
// reports per op the bytes that really ran — the byte counters of an
// engine whose completion status lies (a ShortRead returns nil, but its
// skipped ops show 0 bytes landed). The inner transfer's own ledger is used
// when it has one.
func (t transfer) BatchReadLedger(ctx context.Context, session string, ops []plan.Op, landed []uint64) error {
	return t.apply(ctx, session, batch{ops: ops}, landed)
}

// BatchReads is BatchRead for compact reads: they reach the inner
// transfer still compact when it takes them (read.ReadsTransfer) and the
// fault leaves the batch whole.
func (t transfer) BatchReads(ctx context.Context, session string, r *plan.Reads) error {
	return t.apply(ctx, session, batch{r: r}, nil)
}

// BatchReadsLedger is BatchReadLedger for compact reads.
func (t transfer) BatchReadsLedger(ctx context.Context, session string, r *plan.Reads, landed []uint64) error {
	return t.apply(ctx, session, batch{r: r}, landed)
}

func (t transfer) apply(ctx context.Context, session string, b batch, landed []uint64) error {
	sub := func(n int) []uint64 {
		if landed == nil {
			return nil
		}
		return landed[:n]
	}
	n := b.len()
	d := t.in.decide(Read, readKey(session, b), n)
	switch d.Kind {
	case Fail:
		return injected(Read, Fail, session)
	case Delay:
		if err := sleep(ctx, d.Delay); err != nil {
			return err
		}
	case Truncate, ShortRead:
		if d.Keep > 0 {
			if err := t.run(ctx, session, b.prefix(d.Keep), sub(d.Keep)); err != nil {
				return err
			}
		}
		if d.Kind == ShortRead {
			return nil // the silent partial transfer
		}
		return injected(Read, Truncate, fmt.Sprintf("%s: %d of %d ops run", session, d.Keep, n))
	case Duplicate:
		if err := t.run(ctx, session, b, sub(n)); err != nil {
			return err
		}
	}
	return t.run(ctx, session, b, sub(n))
}

// run hands b to the inner transfer in the richest form it takes: compact
// reads stay compact for a read.ReadsTransfer and are expanded otherwise;
// landed (when not nil) comes from the inner ledger, or is every op's
// length when a ledger-less inner transfer succeeds.
func (t transfer) run(ctx context.Context, session string, b batch, landed []uint64) error {
	if b.r != nil {
		switch in := t.t.(type) {
		case read.ReadsLedgerTransfer:
			if landed != nil {
				return in.BatchReadsLedger(ctx, session, b.r, landed)
			}
			return in.BatchReads(ctx, session, b.r)
		case read.ReadsTransfer:
			err := in.BatchReads(ctx, session, b.r)
			if err == nil && landed != nil {
				i := 0
				for k := range b.r.Tensors() {
					tr := b.r.Tensor(k)
					for j := range b.r.Runs() {
						landed[i] = tr.Len * uint64(b.r.Run(j).Blocks)
						i++
					}
				}
			}
			return err
		}
		b = batch{ops: b.r.AppendTo(nil)}
	}
	ops := b.ops
	if lt, ok := t.t.(read.LedgerTransfer); ok && landed != nil {
		return lt.BatchReadLedger(ctx, session, ops, landed)
	}
	err := t.t.BatchRead(ctx, session, ops)
	if err == nil && landed != nil {
		for i, op := range ops {
			landed[i] = op.Len
		}
	}
	return err
}

type fetcher struct {
	in *Injector
	f  handshake.Fetcher
}

func (f fetcher) GetMeta(ctx context.Context, endpoint string) (job.Meta, error) {
	d := f.in.decide(GetMeta, hashString(0, endpoint), 0)
	switch d.Kind {
	case Fail:
		return job.Meta{}, injected(GetMeta, Fail, endpoint)
	case Delay:
		if err := sleep(ctx, d.Delay); err != nil {
			return job.Meta{}, err
		}
	}
	m, err := f.f.GetMeta(ctx, endpoint)
	if err != nil || d.Kind != Corrupt {
		return m, err
	}
	return d.Corruption.Apply(m, f.in.s.NearShift), nil
}

type sender struct {
	in *Injector
	s  notify.Sender
}

func (s sender) SendDone(ctx context.Context, endpoint, reqID string) error {
	return s.send(ctx, endpoint, reqID, s.s.SendDone)
}

// SendDoneBatched is SendDone through the inner sender's batched path
// (notify.BatchSender), so the soak puts batched DONEs under the same
// faults; an inner sender without it gets plain DONEs.
func (s sender) SendDoneBatched(ctx context.Context, endpoint, reqID string) error {
	if bs, ok := s.s.(notify.BatchSender); ok {
		return s.send(ctx, endpoint, reqID, bs.SendDoneBatched)
	}
	return s.SendDone(ctx, endpoint, reqID)
}

// send applies the fault decided for (endpoint, reqID) around do.
func (s sender) send(ctx context.Context, endpoint, reqID string, do func(ctx context.Context, endpoint, reqID string) error) error {
	d := s.in.decide(SendDone, hashString(hashString(0, endpoint), "\x00"+reqID), 0)
	switch d.Kind {
	case Drop:
		return injected(SendDone, Drop, reqID)
	case Delay:
		if err := sleep(ctx, d.Delay); err != nil {
			return err
		}
	case Duplicate:
		first := do(ctx, endpoint, reqID)
		second := do(ctx, endpoint, reqID)
		if first == nil || second == nil {
			return nil // delivered at least once
		}
		return second
	}
	return do(ctx, endpoint, reqID)
}

// Counts are an injector's calls and injected faults.
type Counts struct {
	// Calls by operation (calls made while enabled).
	Calls map[Op]uint64
	// Injected by operation and kind (kinds never injected are absent).
	Injected map[Op]map[Kind]uint64
	// Corrupted metadata by corruption.
	Corrupted map[Corruption]uint64
}

// Counts snapshots the counters.
func (in *Injector) Counts() Counts {
	c := Counts{Calls: map[Op]uint64{}, Injected: map[Op]map[Kind]uint64{}, Corrupted: map[Corruption]uint64{}}
	for _, op := range Ops {
		c.Calls[op] = in.calls[op].Load()
		for _, k := range Kinds {
			if n := in.injected[op][k].Load(); n > 0 {
				if c.Injected[op] == nil {
					c.Injected[op] = map[Kind]uint64{}
				}
				c.Injected[op][k] = n
			}
		}
	}
	for cr := CorruptEngineID; cr < numCorruptions; cr++ {
		if n := in.corrupt[cr].Load(); n > 0 {
			c.Corrupted[cr] = n
		}
	}
	return c
}

// Of is the number of kind faults injected into op.
func (c Counts) Of(op Op, k Kind) uint64 { return c.Injected[op][k] }

// Total is the number of faults injected.
func (c Counts) Total() uint64 {
	var n uint64
	for _, m := range c.Injected {
		for _, v := range m {
			n += v
		}
	}
	return n
}

// Add returns c plus o (merging several injectors' counts).
func (c Counts) Add(o Counts) Counts {
	out := Counts{Calls: map[Op]uint64{}, Injected: map[Op]map[Kind]uint64{}, Corrupted: map[Corruption]uint64{}}
	for _, x := range []Counts{c, o} {
		for op, n := range x.Calls {
			out.Calls[op] += n
		}
		for op, m := range x.Injected {
			if out.Injected[op] == nil {
				out.Injected[op] = map[Kind]uint64{}
			}
			for k, n := range m {
				out.Injected[op][k] += n
			}
		}
		for cr, n := range x.Corrupted {
			out.Corrupted[cr] += n
		}
	}
	return out
}

// String is one line per operation: "read: 1200 calls, delay 60, fail 12".
func (c Counts) String() string {
	var b strings.Builder
	for _, op := range Ops {
		fmt.Fprintf(&b, "%s: %d calls", op, c.Calls[op])
		var parts []string
		for k, n := range c.Injected[op] {
			parts = append(parts, fmt.Sprintf("%s %d", k, n))
		}
		sort.Strings(parts)
		for _, p := range parts {
			b.WriteString(", " + p)
		}
		if op == GetMeta && len(c.Corrupted) > 0 {
			var cs []string
			for cr, n := range c.Corrupted {
				cs = append(cs, fmt.Sprintf("%s %d", cr, n))
			}
			sort.Strings(cs)
			b.WriteString(" (" + strings.Join(cs, ", ") + ")")
		}
		b.WriteString("\n")
	}
	return b.String()
}
