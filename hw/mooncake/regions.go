package mooncake

import (
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
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
// several adjacent grants (contiguous blocks grouped into one op).
//
// A request being served holds its range (hold, until release), and
// revoke returns only once no hold overlapping a revoked range is left:
// the caller frees the blocks after revoke, and the owner may refill them
// at once, so an answer still streaming from them would carry the next
// request's bytes and be reported done.
type grantTable struct {
	mu     sync.Mutex
	counts map[Range]int
	merged []Range // sorted, disjoint, non-adjacent union of counts' keys

	holds   map[uint64]Range // requests being served, by hold id
	seq     uint64           // last hold id
	waiting int              // revokes waiting for holds to end
	drained sync.Cond        // signalled when a hold ends while waiting > 0
}

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

// revoke drops one reference to each range and then waits until no
// request being served overlaps any of them (they are refused from now
// on); unknown ranges are reported but do not stop the others from being
// revoked.
func (g *grantTable) revoke(rs []Range) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	defer g.awaitLocked(rs)
	var missing int
	for _, r := range rs {
		switch c := g.counts[r]; {
		case c > 1:
			g.counts[r] = c - 1
		case c == 1:
			delete(g.counts, r)
		default:
			missing++
		}
	}
	g.rebuildLocked()
	if missing > 0 {
		return fmt.Errorf("mooncake: revoke: %d of %d ranges were not granted", missing, len(rs))
	}
	return nil
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

// awaitLocked waits (g.mu held, released while waiting) until no hold
// overlaps rs.
func (g *grantTable) awaitLocked(rs []Range) {
	if g.drained.L == nil {
		g.drained.L = &g.mu
	}
	for g.overlapsHoldLocked(rs) {
		g.waiting++
		g.drained.Wait()
		g.waiting--
	}
}

func (g *grantTable) overlapsHoldLocked(rs []Range) bool {
	for _, h := range g.holds {
		for _, r := range rs {
			if h.Addr < r.Addr+r.Length && r.Addr < h.Addr+h.Length {
				return true
			}
		}
	}
	return false
}

// hold is covers, and on success records [addr, addr+length) as being
// served until release(id) (id is never 0).
func (g *grantTable) hold(addr, length uint64) (id uint64, ok bool) {
	if checkRange(addr, length) != nil {
		return 0, false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.coversLocked(addr, length) {
		return 0, false
	}
	if g.holds == nil {
		g.holds = map[uint64]Range{}
	}
	g.seq++
	g.holds[g.seq] = Range{Addr: addr, Length: length}
	return g.seq, true
}

// release ends hold id (0: none).
func (g *grantTable) release(id uint64) {
	if id == 0 {
		return
	}
	g.mu.Lock()
	delete(g.holds, id)
	if g.waiting > 0 {
		g.drained.Broadcast()
	}
	g.mu.Unlock()
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
