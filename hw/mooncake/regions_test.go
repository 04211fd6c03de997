package mooncake

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestRegions(t *testing.T) {
	var rt regionTable
	const base = 0x10000
	steps := []struct {
		name       string
		addr, size uint64
		want       error
	}{
		{"first", base, 0x1000, nil},
		{"duplicate", base, 0x1000, ErrOverlap},
		{"overlap start", base - 0x10, 0x20, ErrOverlap},
		{"overlap end", base + 0xfff, 0x10, ErrOverlap},
		{"inside", base + 0x10, 0x10, ErrOverlap},
		{"covering", base - 0x100, 0x2000, ErrOverlap},
		{"adjacent after", base + 0x1000, 0x1000, nil},
		{"adjacent before", base - 0x1000, 0x1000, nil},
		{"zero length", 0x90000, 0, ErrZeroLength},
		{"wraps", ^uint64(0) - 10, 100, ErrRange},
		{"null", 0, 0x10, ErrNotRegistered},
	}
	for _, s := range steps {
		if err := rt.add(s.addr, s.size, s.name); !errors.Is(err, s.want) || (s.want == nil) != (err == nil) {
			t.Errorf("%s: %v, want %v", s.name, err, s.want)
		}
	}
	lookups := []struct {
		addr, size uint64
		ok         bool
	}{
		{base, 0x1000, true},
		{base + 0xff0, 0x10, true},
		{base + 0xff0, 0x11, false}, // straddles two adjacent regions
		{base - 0x1000, 1, true},
		{base - 0x1001, 1, false},
		{base + 0x2000, 1, false},
		{base, 0, false},
	}
	for _, l := range lookups {
		r, err := rt.pin(l.addr, l.size)
		if (err == nil) != l.ok {
			t.Errorf("pin %#x+%d: %v", l.addr, l.size, err)
		}
		if err == nil {
			r.unpin()
		}
	}
	if _, err := rt.remove(base + 1); !errors.Is(err, ErrNotRegistered) {
		t.Errorf("remove inside: %v", err)
	}
	// A pinned region drains only when unpinned.
	r, _ := rt.pin(base, 8)
	rr, err := rt.remove(base)
	if err != nil || rr != r {
		t.Fatal(err)
	}
	select {
	case <-rr.drained:
		t.Fatal("drained while pinned")
	default:
	}
	r.unpin()
	<-rr.drained
	if _, err := rt.pin(base, 8); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("pin after remove: %v", err)
	}
	if n := len(rt.buffers()); n != 2 {
		t.Fatalf("%d buffers", n)
	}
}

func TestGrantTable(t *testing.T) {
	var g grantTable
	if g.covers(0x1000, 1) {
		t.Fatal("empty table covers")
	}
	g.grant([]Range{{0x1000, 0x100}, {0x1100, 0x100}, {0x1300, 0x100}})
	for _, c := range []struct {
		addr, n uint64
		want    bool
	}{
		{0x1000, 0x200, true}, // spans two adjacent grants
		{0x10ff, 2, true},
		{0x1000, 0x201, false}, // runs into the gap
		{0x1200, 1, false},
		{0x1300, 0x100, true},
		{0xfff, 1, false},
		{0x1000, 0, false},
	} {
		if got := g.covers(c.addr, c.n); got != c.want {
			t.Errorf("covers %#x+%#x = %v", c.addr, c.n, got)
		}
	}
	if err := g.grant([]Range{{0x1, 0}}); !errors.Is(err, ErrZeroLength) {
		t.Fatalf("zero grant: %v", err)
	}
	if _, err := g.revoke([]Range{{0x1100, 0x100}, {0x9000, 1}}); err == nil {
		t.Fatal("revoke of an ungranted range: no error")
	}
	if g.covers(0x1000, 0x200) || !g.covers(0x1000, 0x100) {
		t.Fatal("revoke not applied")
	}
	if g.len() != 2 {
		t.Fatalf("len %d", g.len())
	}
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultTCPConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	c := DefaultTCPConfig()
	c.Lanes, c.ChunkSize, c.IOTimeout, c.RPCPort, c.ProtoVersion = 0, 10, 0, 70000, 3
	err := c.Validate()
	if err == nil {
		t.Fatal("no error")
	}
	if n := len(err.(interface{ Unwrap() []error }).Unwrap()); n != 5 {
		t.Fatalf("%d problems reported: %v", n, err)
	}
}

func TestMetricsShared(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, b := newMetrics(reg), newMetrics(reg) // two engines, one registry
	a.ops.WithLabelValues(dirRead).Inc()
	b.ops.WithLabelValues(dirRead).Inc()
	if got := testutil.ToFloat64(a.ops.WithLabelValues(dirRead)); got != 2 {
		t.Fatalf("shared counter = %v", got)
	}
	n, err := testutil.GatherAndCount(reg)
	if err != nil || n == 0 {
		t.Fatalf("gather: %d %v", n, err)
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(""), "kvflow_transfer_rejected_total"); err == nil {
		t.Fatal("rejected counter not exported with zero-initialised reasons")
	}
}

// TestGrantRevokeAsync: revoke returns at once, and a revoked range takes
// no new hold; its channel closes only once no request being served (a
// hold) overlaps the bytes it ungranted. Holds elsewhere, and holds of
// bytes another grant still covers (a block shared by two requests), do
// not delay it.
func TestGrantRevokeAsync(t *testing.T) {
	var g grantTable
	g.grace = time.Hour // never cut here
	a, b := Range{Addr: 0x1000, Length: 0x1000}, Range{Addr: 0x8000, Length: 0x1000}
	if err := g.grant([]Range{a, b, b}); err != nil { // b shared by two requests
		t.Fatal(err)
	}
	ha, ok := g.hold(0x1800, 0x100, nil)
	if !ok {
		t.Fatal("hold inside a grant refused")
	}
	hb, ok := g.hold(0x8000, 0x1000, nil)
	if !ok {
		t.Fatal("hold of a whole grant refused")
	}
	shared, err := g.revoke([]Range{b}) // b is still granted once
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-shared:
	default:
		t.Fatal("revoke of a block another grant covers waits for its readers")
	}
	done, err := g.revoke([]Range{a})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := g.hold(0x1000, 0x10, nil); ok {
		t.Error("a revoked range took a new hold")
	}
	g.release(hb) // elsewhere: still waiting
	select {
	case <-done:
		t.Fatal("revoke done while a serve of its range was in progress")
	default:
	}
	if n := g.pendingRevokes(); n != 1 {
		t.Fatalf("%d revokes pending, want 1", n)
	}
	g.release(ha)
	select {
	case <-done:
	default:
		t.Fatal("revoke still waiting after the hold ended")
	}
	g.release(0) // no hold: no-op
	if len(g.holds) != 0 || g.pendingRevokes() != 0 {
		t.Errorf("%d holds, %d revokes left", len(g.holds), g.pendingRevokes())
	}
}

// TestGrantRevokeCutsStalledHold: a hold still in flight one grace after
// the revoke has its connection cut; the revoke completes when the cut
// serve lets go.
func TestGrantRevokeCutsStalledHold(t *testing.T) {
	g := grantTable{grace: 20 * time.Millisecond}
	cuts := make(chan int, 4)
	g.onCut = func(n int) { cuts <- n }
	r := Range{Addr: 0x1000, Length: 0x1000}
	if err := g.grant([]Range{r}); err != nil {
		t.Fatal(err)
	}
	var id uint64
	cut := make(chan struct{})
	id, ok := g.hold(0x1000, 0x1000, func() { close(cut) })
	if !ok {
		t.Fatal("hold refused")
	}
	done, _ := g.revoke([]Range{r})
	select {
	case <-cut: // the serving goroutine sees its write fail and releases
		g.release(id)
	case <-time.After(10 * time.Second):
		t.Fatal("stalled hold never cut")
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("revoke never completed after the cut")
	}
	if n := <-cuts; n != 1 {
		t.Fatalf("cut %d connections, want 1", n)
	}
}

// TestGrantAll: grantAll covers everything until its revokeAll.
func TestGrantAll(t *testing.T) {
	var g grantTable
	if g.covers(0x1000, 1) {
		t.Fatal("covered before any grant")
	}
	g.grantAll()
	g.grantAll()
	if !g.covers(0x1000, 1) {
		t.Fatal("grantAll does not cover")
	}
	for range 2 {
		if err := g.revokeAll(); err != nil {
			t.Fatal(err)
		}
	}
	if g.covers(0x1000, 1) {
		t.Fatal("covered after every revokeAll")
	}
	if err := g.revokeAll(); err == nil {
		t.Fatal("revokeAll without grantAll: no error")
	}
	// A named range freed while everything is open: its reader is still
	// waited for (the engine reuses the block whatever else is open).
	g.grace = time.Hour
	r := Range{Addr: 0x1000, Length: 0x100}
	g.grant([]Range{r})
	g.grantAll()
	id, ok := g.hold(0x1000, 0x100, nil)
	if !ok {
		t.Fatal("hold refused")
	}
	done, _ := g.revoke([]Range{r})
	select {
	case <-done:
		t.Fatal("revoke of a named range done while its reader is in flight (all open)")
	default:
	}
	g.release(id)
	<-done
}
