package mooncake

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// region is one registered memory range. pins counts transfers using it;
// Unregister removes the region from the table, then waits on drained.
type region struct {
	addr, length uint64
	name         string

	pins    atomic.Int64
	removed atomic.Bool
	once    sync.Once
	drained chan struct{}
}

func (r *region) end() uint64 { return r.addr + r.length }

func (r *region) unpin() {
	if r.pins.Add(-1) == 0 && r.removed.Load() {
		r.once.Do(func() { close(r.drained) })
	}
}

// regionTable is the set of registered regions, sorted by address.
type regionTable struct {
	mu   sync.RWMutex
	regs []*region // sorted by addr, non-overlapping
}

// checkRange validates a range's arithmetic.
func checkRange(addr, length uint64) error {
	if length == 0 {
		return ErrZeroLength
	}
	if addr+length < addr {
		return fmt.Errorf("%w: %#x + %d", ErrRange, addr, length)
	}
	return nil
}

func (t *regionTable) add(addr, length uint64, name string) error {
	if err := checkRange(addr, length); err != nil {
		return fmt.Errorf("register %#x+%d: %w", addr, length, err)
	}
	if addr == 0 {
		return fmt.Errorf("register %#x+%d: %w", addr, length, ErrNotRegistered)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].addr >= addr })
	if i < len(t.regs) && t.regs[i].addr < addr+length {
		o := t.regs[i]
		return fmt.Errorf("register %#x+%d: %w (%q at %#x+%d)", addr, length, ErrOverlap, o.name, o.addr, o.length)
	}
	if i > 0 && t.regs[i-1].end() > addr {
		o := t.regs[i-1]
		return fmt.Errorf("register %#x+%d: %w (%q at %#x+%d)", addr, length, ErrOverlap, o.name, o.addr, o.length)
	}
	r := &region{addr: addr, length: length, name: name, drained: make(chan struct{})}
	t.regs = slices.Insert(t.regs, i, r)
	return nil
}

// remove takes the region starting at addr out of the table and returns it;
// the caller waits on r.drained (closed once no transfer pins it).
func (t *regionTable) remove(addr uint64) (*region, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].addr >= addr })
	if i == len(t.regs) || t.regs[i].addr != addr {
		return nil, fmt.Errorf("unregister %#x: %w", addr, ErrNotRegistered)
	}
	r := t.regs[i]
	t.regs = slices.Delete(t.regs, i, i+1)
	r.removed.Store(true)
	if r.pins.Load() == 0 {
		r.once.Do(func() { close(r.drained) })
	}
	return r, nil
}

// lookupLocked finds the region fully containing the range.
func (t *regionTable) lookupLocked(addr, length uint64) *region {
	if checkRange(addr, length) != nil {
		return nil
	}
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].addr > addr }) - 1
	if i < 0 {
		return nil
	}
	r := t.regs[i]
	if addr+length > r.end() {
		return nil
	}
	return r
}

// pin finds the region fully containing the range and pins it; the caller
// must unpin it when the transfer is over.
func (t *regionTable) pin(addr, length uint64) (*region, error) {
	if err := checkRange(addr, length); err != nil {
		return nil, err
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	r := t.lookupLocked(addr, length)
	if r == nil {
		return nil, fmt.Errorf("%w: %#x+%d", ErrNotRegistered, addr, length)
	}
	r.pins.Add(1)
	return r, nil
}

func (t *regionTable) slice(addr, length uint64) ([]byte, error) {
	if err := checkRange(addr, length); err != nil {
		return nil, err
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.lookupLocked(addr, length) == nil {
		return nil, fmt.Errorf("%w: %#x+%d", ErrNotRegistered, addr, length)
	}
	return bytesAt(addr, length), nil
}

// buffers lists the regions for the segment descriptor.
func (t *regionTable) buffers() []BufferDesc {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := make([]BufferDesc, 0, len(t.regs))
	for _, r := range t.regs {
		out = append(out, BufferDesc{Addr: r.addr, Length: r.length, Name: r.name})
	}
	return out
}

// Range is an address range [Addr, Addr+Length).
type Range struct{ Addr, Length uint64 }

// grantTable holds reference-counted granted ranges. A request is covered
// when the union of the granted ranges contains it, so a transfer may span
// several adjacent grants (contiguous blocks grouped into one op); while
// open > 0 (grantAll: a held request whose blocks are not known) every
// registered range is covered.
//
// A request being served holds its range (hold, until release). revoke
// never waits: it drops the grants at once (new requests for a range no
// longer granted are refused) and returns a channel closed once no hold
// overlapping a range it ungranted is left, so the caller reports the
// blocks free only then (the owner may refill them at once, and an answer
// still streaming from them would carry the next request's bytes). A hold
// still there grace after the revoke has its connection cut (its
// reader stalled mid-range): the write fails, the serving goroutine
// releases the hold, and the channel closes.
type grantTable struct {
	mu     sync.Mutex
	counts map[Range]int
	merged []Range // sorted, disjoint, non-adjacent union of counts' keys
	open   int     // grantAll calls not yet ended by revokeAll

	holds map[uint64]*grantHold // requests being served, by hold id
	seq   uint64                // last hold id

	// grace is how long a revoke lets overlapping holds finish before it
	// cuts their connections (0: DefaultRevokeGrace).
	grace time.Duration
	// onCut, if set, is told how many connections a revoke's deadline cut
	// (called without g.mu).
	onCut func(n int)
	// revoking counts revokes waiting for holds (for tests and metrics).
	revoking int
}

// DefaultRevokeGrace is the grantTable's grace when none is set.
const DefaultRevokeGrace = time.Second

// grantHold is one request being served: its range, how to cut its
// connection, and the revokes waiting for it to end.
type grantHold struct {
	r       Range
	cut     func()
	waiters []*revocation
}

// revocation is a revoke waiting for the holds that overlap what it
// ungranted.
type revocation struct {
	left  int // holds still in flight
	done  chan struct{}
	timer *time.Timer
}

// closedChan is returned by a revoke that waits for nothing.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func (g *grantTable) grant(rs []Range) error {
	for _, r := range rs {
		if err := checkRange(r.Addr, r.Length); err != nil {
			return fmt.Errorf("grant %#x+%d: %w", r.Addr, r.Length, err)
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.counts == nil {
		g.counts = map[Range]int{}
	}
	for _, r := range rs {
		g.counts[r]++
	}
	g.rebuildLocked()
	return nil
}

// grantAll covers every range until the matching revokeAll (counted).
func (g *grantTable) grantAll() {
	g.mu.Lock()
	g.open++
	g.mu.Unlock()
}

// revokeAll ends one grantAll. Like revoke it never waits; reads already
// being served go on (nothing was promised about blocks never named).
func (g *grantTable) revokeAll() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.open == 0 {
		return errors.New("mooncake: revoke all: no grant of all ranges is open")
	}
	g.open--
	return nil
}

// revoke drops one reference to each range, at once: a range no longer
// granted is refused to every request from now on. It returns a channel
// closed when no request being served overlaps a range this call
// ungranted (already closed when none does), or once the connections of
// those still in flight after the grace period were cut and their serving
// goroutines let go. Unknown ranges are reported but do not stop the
// others from being revoked. It never blocks on a reader.
func (g *grantTable) revoke(rs []Range) (<-chan struct{}, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var missing int
	var zeroed []Range
	for _, r := range rs {
		switch c := g.counts[r]; {
		case c > 1:
			g.counts[r] = c - 1
		case c == 1:
			delete(g.counts, r)
			zeroed = append(zeroed, r)
		default:
			missing++
		}
	}
	g.rebuildLocked()
	var err error
	if missing > 0 {
		err = fmt.Errorf("mooncake: revoke: %d of %d ranges were not granted", missing, len(rs))
	}
	// Only bytes no grant names any more matter: a block another held
	// request shares is not freed by the engine, and its readers go on.
	// (grantAll does not count: the blocks this revoke names are freed
	// whatever else is open, so their readers are waited for.)
	var gone []Range
	for _, r := range zeroed {
		if !g.namedLocked(r.Addr, r.Length) {
			gone = append(gone, r)
		}
	}
	if len(gone) == 0 || len(g.holds) == 0 {
		return closedChan, err
	}
	rev := &revocation{done: make(chan struct{})}
	for _, h := range g.holds {
		if overlapsAny(h.r, gone) {
			h.waiters = append(h.waiters, rev)
			rev.left++
		}
	}
	if rev.left == 0 {
		return closedChan, err
	}
	g.revoking++
	grace := g.grace
	if grace <= 0 {
		grace = DefaultRevokeGrace
	}
	rev.timer = time.AfterFunc(grace, func() { g.expire(rev) })
	return rev.done, err
}

// expire cuts the connections of the holds rev still waits for.
func (g *grantTable) expire(rev *revocation) {
	g.mu.Lock()
	var cuts []func()
	for _, h := range g.holds {
		if slices.Contains(h.waiters, rev) && h.cut != nil {
			cuts = append(cuts, h.cut)
		}
	}
	onCut := g.onCut
	g.mu.Unlock()
	if onCut != nil && len(cuts) > 0 {
		onCut(len(cuts)) // before the cuts: counted by the time rev completes
	}
	for _, c := range cuts {
		c()
	}
}

// pendingRevokes is the number of revokes still waiting for holds.
func (g *grantTable) pendingRevokes() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.revoking
}

func overlapsAny(h Range, rs []Range) bool {
	for _, r := range rs {
		if h.Addr < r.Addr+r.Length && r.Addr < h.Addr+h.Length {
			return true
		}
	}
	return false
}

func (g *grantTable) rebuildLocked() {
	all := make([]Range, 0, len(g.counts))
	for r := range g.counts {
		all = append(all, r)
	}
	slices.SortFunc(all, func(a, b Range) int {
		switch {
		case a.Addr < b.Addr:
			return -1
		case a.Addr > b.Addr:
			return 1
		}
		return 0
	})
	merged := all[:0]
	for _, r := range all {
		if n := len(merged); n > 0 && merged[n-1].Addr+merged[n-1].Length >= r.Addr {
			last := &merged[n-1]
			if e := r.Addr + r.Length; e > last.Addr+last.Length {
				last.Length = e - last.Addr
			}
			continue
		}
		merged = append(merged, r)
	}
	g.merged = merged
}

// hold is covers, and on success records [addr, addr+length) as being
// served until release(id) (id is never 0). cut, never called with g.mu held
// (possibly more than once), closes the connection serving it (a revoke's
// deadline); nil: it cannot be cut.
func (g *grantTable) hold(addr, length uint64, cut func()) (id uint64, ok bool) {
	if checkRange(addr, length) != nil {
		return 0, false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.coversLocked(addr, length) {
		return 0, false
	}
	if g.holds == nil {
		g.holds = map[uint64]*grantHold{}
	}
	g.seq++
	g.holds[g.seq] = &grantHold{r: Range{Addr: addr, Length: length}, cut: cut}
	return g.seq, true
}

// release ends hold id (0: none), and completes the revokes for which it
// was the last.
func (g *grantTable) release(id uint64) {
	if id == 0 {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	h := g.holds[id]
	delete(g.holds, id)
	if h == nil {
		return
	}
	for _, rev := range h.waiters {
		if rev.left--; rev.left == 0 {
			rev.timer.Stop()
			close(rev.done)
			g.revoking--
		}
	}
}

func (g *grantTable) covers(addr, length uint64) bool {
	if checkRange(addr, length) != nil {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.coversLocked(addr, length)
}

func (g *grantTable) coversLocked(addr, length uint64) bool {
	return g.open > 0 || g.namedLocked(addr, length)
}

// namedLocked reports whether the ranges granted by name cover the range.
func (g *grantTable) namedLocked(addr, length uint64) bool {
	i := sort.Search(len(g.merged), func(i int) bool { return g.merged[i].Addr > addr }) - 1
	if i < 0 {
		return false
	}
	r := g.merged[i]
	return addr+length <= r.Addr+r.Length
}

func (g *grantTable) len() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.counts)
}
