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

// Transfer wraps t. The wrapper has a ledger (Capabilities.Ledger)
// whatever t has, and t's other capabilities (strided local rows, gathered
// remote rows, failure classification), so a job under faults is read the
// way it would be without them.
func (in *Injector) Transfer(t read.Transfer) read.Transfer {
	caps := t.Capabilities()
	caps.Ledger = true
	return transfer{in: in, t: t, inner: t.Capabilities(), caps: caps}
}

// Fetcher wraps f.
func (in *Injector) Fetcher(f handshake.Fetcher) handshake.Fetcher { return fetcher{in, f} }

// Sender wraps s.
func (in *Injector) Sender(s notify.Sender) notify.Sender { return sender{in, s} }

type transfer struct {
	in    *Injector
	t     read.Transfer
	inner read.Capabilities // t's
	caps  read.Capabilities // the wrapper's: t's with a ledger
}

func (t transfer) Capabilities() read.Capabilities { return t.caps }

// readKey names a batch by its session and where its first and last ops
// land: the same request's batch has the same key on every run, compact or
// not.
func readKey(session string, b *read.Batch) uint64 {
	h := hashString(0, session)
	n := b.Len()
	h = mix(h ^ uint64(n))
	if n > 0 {
		f, l := b.At(0), b.At(n-1)
		h = mix(h ^ f.Local)
		h = mix(h ^ f.Remote)
		h = mix(h ^ l.Local)
		h = mix(h ^ l.Remote)
	}
	return h
}

// BatchRead runs b under the schedule and, when b.Landed is set, reports
// per op the bytes that really ran — the byte counters of an engine whose
// completion status lies (a ShortRead returns nil, but its skipped ops
// show 0 bytes landed). The inner transfer's own ledger is used when it
// has one. A strided batch (local rows or gathered remote rows) has no
// ledger and no prefix form: Truncate and ShortRead run none of its ops
// and fail it (a silent short read could not be told from a whole one
// there; the ledger tests cover it on the plain form). Fail, Delay and
// Duplicate act on every form.
func (t transfer) BatchRead(ctx context.Context, session string, b *read.Batch) error {
	n := b.Len()
	d := t.in.decide(Read, readKey(session, b), n)
	strided := b.Row > 0 || b.Gather
	switch d.Kind {
	case Fail:
		return injected(Read, Fail, session)
	case Delay:
		if err := sleep(ctx, d.Delay); err != nil {
			return err
		}
	case Truncate, ShortRead:
		if strided {
			return injected(Read, d.Kind, fmt.Sprintf("%s: strided, 0 of %d ops run", session, n))
		}
		if d.Keep > 0 {
			pre := &read.Batch{List: b.AppendTo(nil)[:d.Keep]}
			if b.Landed != nil {
				pre.Landed = b.Landed[:d.Keep]
			}
			if err := t.run(ctx, session, pre); err != nil {
				return err
			}
		}
		if d.Kind == ShortRead {
			return nil // the silent partial transfer
		}
		return injected(Read, Truncate, fmt.Sprintf("%s: %d of %d ops run", session, d.Keep, n))
	case Duplicate:
		if err := t.run(ctx, session, b); err != nil {
			return err
		}
	}
	return t.run(ctx, session, b)
}

// run hands b to the inner transfer; b.Landed (when set) comes from the
// inner ledger, or is every op's length when a ledger-less inner transfer
// succeeds.
func (t transfer) run(ctx context.Context, session string, b *read.Batch) error {
	if b.Landed == nil || t.inner.Ledger {
		return t.t.BatchRead(ctx, session, b)
	}
	landed := b.Landed
	inner := *b
	inner.Landed = nil
	err := t.t.BatchRead(ctx, session, &inner)
	if err == nil {
		for i := range landed {
			landed[i] = b.At(i).Len
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
