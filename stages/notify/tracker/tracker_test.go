package tracker

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// op is one scripted call for the table-driven tests.
type op struct {
	kind   string // nt, delay, done, abort, fin
	id     string
	t      float64 // start (delay) or now (done, fin)
	n      int     // expected DONEs (delay)
	blocks []int

	// expectations
	gen    bool       // delay: held afterwards
	status DoneStatus // done
	err    error      // done
	rem    int        // done: Remaining
	freed  []Freed    // fin (exact, in order)
	ok     bool       // abort
}

func runScript(t *testing.T, tr *Tracker, ops []op) {
	t.Helper()
	for i, o := range ops {
		switch o.kind {
		case "nt":
			tr.AddNotTransfer(o.id)
		case "delay":
			g := tr.AddDelayed(o.id, at(o.t), o.n, o.blocks)
			if (g != 0) != o.gen {
				t.Fatalf("op %d delay %s: gen %d, want held=%v", i, o.id, g, o.gen)
			}
			if g != 0 && !tr.IsHeld(o.id, g) {
				t.Fatalf("op %d: IsHeld(%s, %d) false", i, o.id, g)
			}
		case "done":
			r, err := tr.Done(o.id, at(o.t))
			if r.Status != o.status || !errors.Is(err, o.err) || (o.err == nil && err != nil) || r.Remaining != o.rem {
				t.Fatalf("op %d done %s: %+v, %v; want %v rem %d, %v", i, o.id, r, err, o.status, o.rem, o.err)
			}
		case "abort":
			if got := tr.Abort(o.id); got != o.ok {
				t.Fatalf("op %d abort %s: %v", i, o.id, got)
			}
		case "fin":
			got := tr.Finished(at(o.t))
			if len(got) == 0 && len(o.freed) == 0 {
				continue
			}
			if !reflect.DeepEqual(got, o.freed) {
				t.Fatalf("op %d fin %v: %v, want %v", i, o.t, got, o.freed)
			}
		default:
			t.Fatalf("bad op %q", o.kind)
		}
	}
}

func fr(id string, r Reason) Freed { return Freed{ID: id, Reason: r} }

// leaseFr is a request force-freed at the end of its lease.
func leaseFr(id string) Freed { return Freed{ID: id, Reason: ReasonExpired, Lease: true} }

func TestScripts(t *testing.T) {
	tests := []struct {
		name string
		opts Options
		ops  []op
	}{
		{"delayed then done", Options{AbortTimeout: 10 * time.Second}, []op{
			{kind: "delay", id: "a", n: 1, gen: true},
			{kind: "done", id: "a", t: 1, status: DoneFreed},
			{kind: "fin", t: 1, freed: []Freed{fr("a", ReasonDone)}},
			{kind: "fin", t: 100},
		}},
		{"not transfer", Options{}, []op{
			{kind: "nt", id: "a"},
			{kind: "nt", id: "a"},
			{kind: "fin", t: 0, freed: []Freed{fr("a", ReasonNotTransfer)}},
			{kind: "fin", t: 0},
		}},
		{"expiry is strict and head-of-line", Options{AbortTimeout: 5 * time.Second}, []op{
			{kind: "delay", id: "late", t: 10, gen: true},
			{kind: "delay", id: "early", t: 0, gen: true},
			{kind: "fin", t: 6},
			{kind: "fin", t: 15, freed: nil},
			{kind: "fin", t: 15.5, freed: []Freed{fr("late", ReasonExpired), fr("early", ReasonExpired)}},
		}},
		{"§5b.5 N dones", Options{AbortTimeout: 10 * time.Second}, []op{
			{kind: "delay", id: "a", n: 3, gen: true},
			{kind: "done", id: "a", status: DoneWaiting, rem: 2},
			{kind: "fin", t: 1},
			{kind: "done", id: "a", status: DoneWaiting, rem: 1},
			{kind: "done", id: "a", status: DoneFreed},
			{kind: "done", id: "a", status: DoneDuplicate, err: ErrAlreadyFinished},
			{kind: "fin", t: 2, freed: []Freed{fr("a", ReasonDone)}},
		}},
		{"§5b.5 N dones, timeout", Options{AbortTimeout: 10 * time.Second}, []op{
			{kind: "delay", id: "a", n: 2, gen: true},
			{kind: "done", id: "a", status: DoneWaiting, rem: 1},
			{kind: "fin", t: 10.5, freed: []Freed{fr("a", ReasonExpired)}},
			{kind: "done", id: "a", t: 11, status: DoneDuplicate, err: ErrAlreadyFinished},
			{kind: "fin", t: 11},
		}},
		{"early done (seed): reported, then absorbs the delay", Options{AbortTimeout: 10 * time.Second}, []op{
			{kind: "done", id: "a", status: DoneEarly},
			{kind: "fin", t: 1, freed: []Freed{fr("a", ReasonDone)}},
			{kind: "delay", id: "a", t: 2, n: 1, gen: false},
			{kind: "delay", id: "a", t: 3, n: 1, gen: false}, // §5b.9: not re-armed
			{kind: "fin", t: 100},
		}},
		{"early quorum (§5b.5 with early DONEs)", Options{AbortTimeout: 10 * time.Second, EarlyDoneQuorum: 2}, []op{
			{kind: "done", id: "a", status: DoneEarly},
			{kind: "fin", t: 1},
			{kind: "delay", id: "a", t: 1, n: 3, gen: true}, // one early DONE counts
			{kind: "done", id: "a", t: 2, status: DoneWaiting, rem: 1},
			{kind: "done", id: "a", t: 2, status: DoneFreed},
			{kind: "fin", t: 2, freed: []Freed{fr("a", ReasonDone)}},
			{kind: "done", id: "b", t: 2, status: DoneEarly},
			{kind: "done", id: "b", t: 2, status: DoneEarly}, // quorum reached: reported
			{kind: "fin", t: 3, freed: []Freed{fr("b", ReasonDone)}},
			{kind: "delay", id: "b", t: 3, n: 2, gen: false},
			{kind: "done", id: "c", t: 3, status: DoneEarly},
			{kind: "delay", id: "c", t: 3, n: 1, gen: false}, // satisfied by the early DONE
			{kind: "fin", t: 3, freed: []Freed{fr("c", ReasonDone)}},
		}},
		{"early quorum per request (EarlyQuorum overrides EarlyDoneQuorum)", Options{AbortTimeout: 10 * time.Second, EarlyDoneQuorum: 5,
			EarlyQuorum: func(id string) int { return map[string]int{"two": 2, "zero": 0}[id] + map[string]int{"one": 1}[id] }}, []op{
			{kind: "done", id: "two", status: DoneEarly},
			{kind: "fin", t: 1},
			{kind: "done", id: "two", t: 1, status: DoneEarly}, // second of two: reported
			{kind: "fin", t: 1, freed: []Freed{fr("two", ReasonDone)}},
			{kind: "done", id: "one", t: 1, status: DoneEarly},
			{kind: "fin", t: 1, freed: []Freed{fr("one", ReasonDone)}},
			{kind: "done", id: "zero", t: 1, status: DoneEarly}, // below 1 reads as 1
			{kind: "fin", t: 1, freed: []Freed{fr("zero", ReasonDone)}},
		}},
		{"§5b.9 done then re-add", Options{AbortTimeout: 3 * time.Second}, []op{
			{kind: "delay", id: "p", t: 0, n: 1, gen: true},
			{kind: "done", id: "p", status: DoneFreed},
			{kind: "done", id: "p", status: DoneDuplicate, err: ErrAlreadyFinished},
			{kind: "fin", t: 0.5, freed: []Freed{fr("p", ReasonDone)}},
			{kind: "delay", id: "p", t: 1, n: 1, gen: false},
			{kind: "fin", t: 10},
		}},
		{"re-add of a held request refreshes in place", Options{AbortTimeout: 5 * time.Second}, []op{
			{kind: "delay", id: "x", t: 0, gen: true},
			{kind: "delay", id: "y", t: 1, gen: true},
			{kind: "delay", id: "x", t: 50, gen: true},
			{kind: "fin", t: 20},
			{kind: "fin", t: 56, freed: []Freed{fr("x", ReasonExpired), fr("y", ReasonExpired)}},
		}},
		{"not transfer of a held request frees it once", Options{AbortTimeout: 5 * time.Second}, []op{
			{kind: "delay", id: "a", t: 0, gen: true},
			{kind: "nt", id: "a"},
			{kind: "done", id: "a", status: DoneDuplicate, err: ErrAlreadyFinished},
			{kind: "fin", t: 1, freed: []Freed{fr("a", ReasonNotTransfer)}},
			{kind: "fin", t: 100},
		}},
		{"abort", Options{AbortTimeout: 5 * time.Second}, []op{
			{kind: "delay", id: "a", t: 0, gen: true},
			{kind: "abort", id: "a", ok: true},
			{kind: "abort", id: "a", ok: false},
			{kind: "abort", id: "zz", ok: false},
			{kind: "done", id: "a", status: DoneDuplicate, err: ErrAlreadyFinished},
			{kind: "fin", t: 1, freed: []Freed{fr("a", ReasonAborted)}},
		}},
		{"zero timeout", Options{AbortTimeout: -1}, []op{
			{kind: "delay", id: "z", t: 1, gen: true},
			{kind: "fin", t: 1},
			{kind: "fin", t: 1.25, freed: []Freed{fr("z", ReasonExpired)}},
		}},
		{"order: freed order, expired last", Options{AbortTimeout: time.Second}, []op{
			{kind: "delay", id: "e", t: 0, gen: true},
			{kind: "delay", id: "d", t: 5, gen: true},
			{kind: "nt", id: "b"},
			{kind: "done", id: "d", status: DoneFreed},
			{kind: "done", id: "a", status: DoneEarly},
			{kind: "fin", t: 2, freed: []Freed{fr("b", ReasonNotTransfer), fr("d", ReasonDone), fr("a", ReasonDone), fr("e", ReasonExpired)}},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			runScript(t, New(tc.opts), tc.ops)
		})
	}
}

func TestGenerationsAndGrants(t *testing.T) {
	tr := New(Options{AbortTimeout: 10 * time.Second})
	blocks := []int{4, 5, 6}
	g1 := tr.AddDelayed("a", at(0), 2, blocks)
	blocks[0] = 99 // the tracker copied them
	gen, got, ok := tr.Held("a")
	if !ok || gen != g1 || !slices.Equal(got, []int{4, 5, 6}) {
		t.Fatalf("Held = %d %v %v", gen, got, ok)
	}
	got[1] = -1 // a copy again
	if _, again, _ := tr.Held("a"); again[1] != 5 {
		t.Fatal("Held returned internal slice")
	}
	if tr.IsHeld("a", g1+1) || tr.IsHeld("a", 0) || tr.IsHeld("b", g1) {
		t.Fatal("IsHeld accepts a wrong generation or id")
	}
	g2 := tr.AddDelayed("b", at(0), 1, nil)
	if g2 == g1 || g2 == 0 {
		t.Fatalf("generations %d %d", g1, g2)
	}
	// re-add keeps the generation, replaces blocks, raises the count.
	if g := tr.AddDelayed("a", at(1), 3, []int{7}); g != g1 {
		t.Fatalf("re-add gen %d, want %d", g, g1)
	}
	if _, b, _ := tr.Held("a"); !slices.Equal(b, []int{7}) {
		t.Fatalf("blocks %v", b)
	}
	if r, _ := tr.Done("a", at(2)); r.Status != DoneWaiting || r.Remaining != 2 || r.Gen != g1 {
		t.Fatalf("done: %+v", r)
	}
	if tr.Len() != 2 {
		t.Fatalf("Len %d", tr.Len())
	}
	// force-free revokes the grant at once, before Finished reports it.
	tr.Abort("a")
	if tr.IsHeld("a", g1) {
		t.Fatal("grant survives abort")
	}
	if _, _, ok := tr.Held("a"); ok {
		t.Fatal("Held after abort")
	}
	tr.Finished(at(20)) // b expires
	if tr.IsHeld("b", g2) {
		t.Fatal("grant survives expiry")
	}
	st := tr.Stats()
	if st.Delayed != 2 || st.Refreshed != 1 || st.Forced() != 1 || st.Freed[ReasonAborted] != 1 || st.Held != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestBoundedRecords(t *testing.T) {
	t.Run("no aging", func(t *testing.T) {
		// Records are bounded by count only: a tombstone outlives any
		// timeout, so a DONE after a force-free, however late, is a
		// duplicate and never a second report (the soak's
		// TestShortAbortTimeoutGap found the time-aged version reporting
		// requests freed twice).
		tr := New(Options{AbortTimeout: 10 * time.Second})
		for _, id := range []string{"a", "b", "c"} {
			tr.Done(id, at(0)) // early, never followed by AddDelayed (§5b.6)
		}
		tr.AddDelayed("x", at(0), 1, nil)
		if got := freedIDs(tr.Finished(at(10.5))); !slices.Equal(got, []string{"a", "b", "c", "x"}) {
			t.Fatalf("reported %v", got)
		}
		tr.Finished(at(1e6))
		if st := tr.Stats(); st.Records != 4 || len(tr.byID) != 4 {
			t.Fatalf("records %+v, byID %d", st, len(tr.byID))
		}
		if r, err := tr.Done("x", at(1e6)); r.Status != DoneDuplicate || !errors.Is(err, ErrAlreadyFinished) {
			t.Fatalf("late DONE after force-free: %+v %v", r, err)
		}
		if g := tr.AddDelayed("a", at(1e6), 1, nil); g != 0 { // consumes a's early record, as the seed
			t.Fatal("early record re-armed")
		}
		if r, _ := tr.Done("a", at(1e6)); r.Status != DoneDuplicate {
			t.Fatalf("DONE after early record consumed: %+v", r)
		}
		if fs := tr.Finished(at(2e6)); len(fs) != 0 {
			t.Fatalf("reported again: %v", fs)
		}
	})
	t.Run("count", func(t *testing.T) {
		tr := New(Options{MaxRecords: 4})
		for i := range 10 {
			tr.Done(string(rune('a'+i)), at(float64(i)))
		}
		st := tr.Stats()
		if st.Records != 4 || st.RecordsEvicted != 6 {
			t.Fatalf("%+v", st)
		}
		// the oldest went first; the pending reports are all still there.
		if got := freedIDs(tr.Finished(at(20))); len(got) != 10 {
			t.Fatalf("reported %v", got)
		}
		if st := tr.Stats(); st.Records != 4 || len(tr.byID) != 4 {
			t.Fatalf("after report: %+v, byID %d", st, len(tr.byID))
		}
		// A record evicted before its report stays a finished entry until
		// reported: an AddDelayed in between must not hold it.
		tr2 := New(Options{MaxRecords: 1})
		tr2.Done("a", at(0))
		tr2.Done("b", at(0)) // evicts a's record; a is still pending
		if g := tr2.AddDelayed("a", at(0), 1, nil); g != 0 {
			t.Fatal("evicted pending record re-armed")
		}
		if got := freedIDs(tr2.Finished(at(1))); !slices.Equal(got, []string{"a", "b"}) {
			t.Fatalf("reported %v", got)
		}
	})
	t.Run("finished requests", func(t *testing.T) {
		tr := New(Options{AbortTimeout: 10000 * time.Second, MaxRecords: 100})
		for i := range 1000 {
			id := string(rune(0x100 + i))
			tr.AddDelayed(id, at(float64(i)), 1, nil)
			tr.Done(id, at(float64(i)))
			tr.Finished(at(float64(i)))
			if st := tr.Stats(); st.Records > 100 || len(tr.byID) > 101 {
				t.Fatalf("step %d: %+v, byID %d", i, st, len(tr.byID))
			}
		}
		if tr.Stats().RecordsEvicted == 0 {
			t.Fatal("MaxRecords never evicted")
		}
		tr.Finished(at(1e6))
		if len(tr.byID) != 100 || tr.mem.Len() != 100 || tr.held.Len() != 0 {
			t.Fatalf("want the 100 newest tombstones: byID %d mem %d held %d", len(tr.byID), tr.mem.Len(), tr.held.Len())
		}
	})
}

func TestOptions(t *testing.T) {
	o := New(Options{}).Options()
	if o.AbortTimeout != DefaultAbortTimeout || o.MaxRecords != DefaultMaxRecords || o.EarlyDoneQuorum != 1 {
		t.Fatalf("defaults %+v", o)
	}
	if o := New(Options{AbortTimeout: -5}).Options(); o.AbortTimeout != 0 {
		t.Fatalf("negative timeout -> %v", o.AbortTimeout)
	}
	if err := (Options{}).Validate(); err != nil {
		t.Fatal(err)
	}
	err := Options{MaxRecords: -1, EarlyDoneQuorum: -2}.Validate()
	if err == nil || !strings.Contains(err.Error(), "MaxRecords") || !strings.Contains(err.Error(), "EarlyDoneQuorum") {
		t.Fatalf("Validate: %v", err)
	}
}

func TestStrings(t *testing.T) {
	var names []string
	for _, r := range Reasons {
		names = append(names, r.String())
	}
	if !slices.Equal(names, []string{"done", "not_transfer", "expired", "aborted"}) {
		t.Fatal(names)
	}
	if Reason(0).String() != "unknown" || Reason(200).String() != "unknown" {
		t.Fatal("unknown reason")
	}
	if DoneFreed.String() != "freed" || DoneDuplicate.String() != "duplicate" || DoneStatus(9).String() != "unknown" {
		t.Fatal("done status strings")
	}
	_, err := New(Options{}).Done("x", at(0))
	if err != nil {
		t.Fatal(err)
	}
	tr := New(Options{})
	tr.AddNotTransfer("x")
	if _, err := tr.Done("x", at(0)); !errors.Is(err, ErrAlreadyFinished) || !strings.Contains(err.Error(), `"x"`) {
		t.Fatalf("err %v", err)
	}
}

func TestRenew(t *testing.T) {
	t.Run("lease extends the hold past the abort timeout", func(t *testing.T) {
		tr := New(Options{AbortTimeout: time.Second, LeaseTTL: 3 * time.Second})
		g := tr.AddDelayed("a", at(0), 1, []int{7})
		tr.AddDelayed("b", at(0), 1, nil) // never renewed: the seed's expiry
		if !tr.Renew("a", at(0.5)) {
			t.Fatal("Renew of a held request: false")
		}
		if fs := tr.Finished(at(1.5)); !reflect.DeepEqual(fs, []Freed{fr("b", ReasonExpired)}) {
			t.Fatalf("at 1.5: %v", fs)
		}
		if !tr.IsHeld("a", g) {
			t.Fatal("renewed request not held inside its lease")
		}
		tr.Renew("a", at(3))
		tr.Renew("a", at(2)) // a clock going back never shortens the lease
		if fs := tr.Finished(at(6)); len(fs) != 0 {
			t.Fatalf("at 6 (lease to 6): %v", fs)
		}
		if fs := tr.Finished(at(6.01)); !reflect.DeepEqual(fs, []Freed{leaseFr("a")}) {
			t.Fatalf("at 6.01: %v", fs)
		}
		if tr.IsHeld("a", g) || tr.Renew("a", at(7)) {
			t.Fatal("expired request still held / renewable")
		}
		st := tr.Stats()
		if st.Renewals != 3 || st.RenewMisses != 1 || st.Leased != 0 || st.Held != 0 || st.Forced() != 2 || st.LeaseExpired != 1 {
			t.Fatalf("stats %+v", st)
		}
	})
	// #18: a decode that renewed and then died (stopped renewing) gets its
	// blocks freed one TTL after its last renewal, not at the abort
	// timeout; a request never renewed still waits for the abort timeout.
	t.Run("a lease that ends frees before the abort timeout", func(t *testing.T) {
		tr := New(Options{AbortTimeout: 600 * time.Second, LeaseTTL: 10 * time.Second})
		tr.AddDelayed("a", at(0), 1, nil)
		tr.AddDelayed("never", at(0), 1, nil)
		tr.Renew("a", at(1)) // lease to 11, abort timeout to 600
		if fs := tr.Finished(at(11)); len(fs) != 0 {
			t.Fatalf("freed inside the lease: %v", fs)
		}
		if fs := tr.Finished(at(11.5)); !reflect.DeepEqual(fs, []Freed{leaseFr("a")}) {
			t.Fatalf("at 11.5: %v", fs)
		}
		if fs := tr.Finished(at(600)); len(fs) != 0 {
			t.Fatalf("never-renewed request freed at the abort timeout, not after: %v", fs)
		}
		if fs := tr.Finished(at(600.5)); !reflect.DeepEqual(fs, []Freed{fr("never", ReasonExpired)}) {
			t.Fatalf("at 600.5: %v", fs)
		}
		if st := tr.Stats(); st.LeaseExpired != 1 || st.Forced() != 2 {
			t.Fatalf("stats %+v", st)
		}
	})
	t.Run("a live lease does not hold back others", func(t *testing.T) {
		tr := New(Options{AbortTimeout: time.Second, LeaseTTL: time.Hour})
		tr.AddDelayed("live", at(0), 1, nil)
		tr.AddDelayed("dead", at(0), 1, nil)
		tr.AddDelayed("seed", at(0), 1, nil)
		tr.Renew("live", at(0.1))
		tr.Renew("dead", at(0.1)) // lease to 3600.1
		tr.Renew("live", at(0.2)) // live is now behind dead in lease order
		if fs := tr.Finished(at(2)); !reflect.DeepEqual(fs, []Freed{fr("seed", ReasonExpired)}) {
			t.Fatalf("at 2: %v", fs)
		}
		for i := 1; i < 10; i++ {
			tr.Renew("live", at(float64(i)*1000))
		}
		if fs := tr.Finished(at(3600.5)); !reflect.DeepEqual(fs, []Freed{leaseFr("dead")}) {
			t.Fatalf("at 3600.5: %v", fs)
		}
		if r, err := tr.Done("live", at(9500)); r.Status != DoneFreed || err != nil {
			t.Fatalf("DONE of the live request: %+v %v", r, err)
		}
		if fs := tr.Finished(at(9500)); !reflect.DeepEqual(fs, []Freed{fr("live", ReasonDone)}) {
			t.Fatalf("at 9500: %v", fs)
		}
	})
	t.Run("ended leases expire in lease order, whatever their start", func(t *testing.T) {
		tr := New(Options{AbortTimeout: 10 * time.Second, LeaseTTL: time.Second})
		tr.AddDelayed("late", at(5), 1, nil) // abort timeout at 15
		tr.AddDelayed("early", at(0), 1, nil)
		tr.Renew("late", at(5))  // lease to 6
		tr.Renew("early", at(6)) // lease to 7
		if fs := tr.Finished(at(6.5)); !reflect.DeepEqual(fs, []Freed{leaseFr("late")}) {
			t.Fatalf("at 6.5: %v", fs)
		}
		if fs := tr.Finished(at(7.5)); !reflect.DeepEqual(fs, []Freed{leaseFr("early")}) {
			t.Fatalf("at 7.5: %v", fs)
		}
	})
	t.Run("not held, leases off", func(t *testing.T) {
		tr := New(Options{LeaseTTL: time.Second})
		if tr.Renew("unknown", at(0)) {
			t.Fatal("Renew of an unknown request")
		}
		if tr.AddDelayed("unknown", at(0), 1, nil) == 0 || tr.Stats().Leased != 0 {
			t.Fatal("a Renew before AddDelayed left a record")
		}
		off := New(Options{AbortTimeout: time.Second})
		off.AddDelayed("a", at(0), 1, nil)
		if off.Renew("a", at(0.5)) {
			t.Fatal("Renew with LeaseTTL 0")
		}
		if fs := off.Finished(at(1.5)); !reflect.DeepEqual(fs, []Freed{fr("a", ReasonExpired)}) {
			t.Fatalf("leases off: %v", fs)
		}
		if err := (Options{LeaseTTL: -1}).Validate(); err == nil || !strings.Contains(err.Error(), "LeaseTTL") {
			t.Fatalf("Validate: %v", err)
		}
	})
	t.Run("abort, not-transfer and DONE end a leased hold", func(t *testing.T) {
		tr := New(Options{AbortTimeout: time.Second, LeaseTTL: time.Hour})
		for _, id := range []string{"a", "b", "c"} {
			tr.AddDelayed(id, at(0), 1, nil)
			tr.Renew(id, at(0))
		}
		tr.Abort("a")
		tr.AddNotTransfer("b")
		tr.Done("c", at(1))
		want := []Freed{fr("a", ReasonAborted), fr("b", ReasonNotTransfer), fr("c", ReasonDone)}
		if fs := tr.Finished(at(2)); !reflect.DeepEqual(fs, want) {
			t.Fatalf("%v", fs)
		}
		checkInvariants(t, tr)
		if st := tr.Stats(); st.Held != 0 || st.Leased != 0 {
			t.Fatalf("%+v", st)
		}
	})
}

// TestHoldEarly: with HoldEarly, DONEs for requests not held are never
// reported by themselves; a send consumes them; they are bounded by count
// and by age, and the drops are counted.
func TestHoldEarly(t *testing.T) {
	t0 := time.Unix(1000, 0)
	t.Run("flood of unknown ids", func(t *testing.T) {
		tr := New(Options{HoldEarly: true})
		for i := range 8192 {
			if res, err := tr.Done(fmt.Sprintf("unknown-%d", i), t0); err != nil || res.Status != DoneEarly || res.Reported {
				t.Fatalf("done %d: %+v %v", i, res, err)
			}
		}
		if got := tr.Finished(t0); len(got) != 0 {
			t.Fatalf("unknown DONEs reported to the engine: %d", len(got))
		}
		st := tr.Stats()
		if st.Early != DefaultMaxEarly || st.EarlyEvicted != 8192-DefaultMaxEarly {
			t.Fatalf("early %d evicted %d, want %d and %d", st.Early, st.EarlyEvicted, DefaultMaxEarly, 8192-DefaultMaxEarly)
		}
		if got := tr.Finished(t0.Add(DefaultEarlyTTL + time.Second)); len(got) != 0 {
			t.Fatalf("expired early DONEs reported: %d", len(got))
		}
		if st := tr.Stats(); st.Early != 0 || st.EarlyExpired != DefaultMaxEarly {
			t.Fatalf("after the ttl: early %d expired %d", st.Early, st.EarlyExpired)
		}
	})
	t.Run("send consumes early DONEs", func(t *testing.T) {
		tr := New(Options{HoldEarly: true})
		tr.Done("one", t0)
		tr.Done("two", t0)
		tr.Done("nt", t0)
		if got := tr.Finished(t0); len(got) != 0 {
			t.Fatalf("reported before the send: %+v", got)
		}
		if gen := tr.AddDelayed("one", t0, 1, []int{1}); gen != 0 {
			t.Fatal("satisfied request held")
		}
		if gen := tr.AddDelayed("two", t0, 2, []int{2}); gen == 0 {
			t.Fatal("request expecting 2 DONEs with 1 early is not held")
		}
		tr.AddNotTransfer("nt")
		got := tr.Finished(t0)
		if len(got) != 2 || got[0] != (Freed{ID: "one", Reason: ReasonDone}) || got[1] != (Freed{ID: "nt", Reason: ReasonNotTransfer}) {
			t.Fatalf("finished %+v", got)
		}
		if res, _ := tr.Done("two", t0); res.Status != DoneFreed {
			t.Fatalf("second DONE: %+v", res)
		}
		if got := tr.Finished(t0); len(got) != 1 || got[0].ID != "two" {
			t.Fatalf("finished %+v", got)
		}
	})
	t.Run("dropped early DONE", func(t *testing.T) {
		tr := New(Options{HoldEarly: true, EarlyTTL: time.Second, MaxEarly: 2})
		tr.Done("old", t0)
		tr.Finished(t0.Add(2 * time.Second)) // aged out
		if gen := tr.AddDelayed("old", t0.Add(2*time.Second), 1, nil); gen == 0 {
			t.Fatal("a request whose early DONE aged out is not held (it waits for its abort timeout)")
		}
		for _, id := range []string{"a", "b", "c"} {
			tr.Done(id, t0.Add(3*time.Second))
		}
		if st := tr.Stats(); st.Early != 2 || st.EarlyEvicted != 1 || st.EarlyExpired != 1 {
			t.Fatalf("stats %+v", st)
		}
	})
}

// TestHoldEarlyInvariants drives random operations under HoldEarly and
// checks after each step: Finished names only requests handed over
// (AddDelayed or AddNotTransfer), each at most once; early DONEs kept stay
// within MaxEarly.
func TestHoldEarlyInvariants(t *testing.T) {
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 99))
		const maxEarly = 8
		tr := New(Options{HoldEarly: true, MaxEarly: maxEarly, EarlyTTL: 5 * time.Second, AbortTimeout: 20 * time.Second})
		now := time.Unix(1e6, 0)
		sent := map[string]bool{}
		reported := map[string]bool{}
		for step := range 400 {
			id := fmt.Sprintf("r%d", rng.IntN(40))
			switch op := rng.IntN(10); {
			case op < 5:
				tr.Done(id, now)
			case op < 7:
				tr.AddDelayed(id, now, 1+rng.IntN(3), []int{1})
				sent[id] = true
			case op < 8:
				tr.AddNotTransfer(id)
				sent[id] = true
			case op < 9:
				tr.Abort(id)
			default:
				now = now.Add(time.Duration(rng.IntN(3000)) * time.Millisecond)
			}
			for _, f := range tr.Finished(now) {
				if !sent[f.ID] {
					t.Fatalf("seed %d step %d: %s reported (%v) but never handed over", seed, step, f.ID, f.Reason)
				}
				if reported[f.ID] {
					t.Fatalf("seed %d step %d: %s reported twice", seed, step, f.ID)
				}
				reported[f.ID] = true
			}
			st := tr.Stats()
			if st.Early > maxEarly {
				t.Fatalf("seed %d step %d: %d early DONEs kept, bound %d", seed, step, st.Early, maxEarly)
			}
		}
	}
}
