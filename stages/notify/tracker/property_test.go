package tracker

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing"
	"time"
)

// checkInvariants verifies the tracker's internal structure.
func checkInvariants(t testing.TB, tr *Tracker) {
	t.Helper()
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if tr.mem.Len() > tr.opts.MaxRecords {
		t.Fatalf("mem %d > MaxRecords %d", tr.mem.Len(), tr.opts.MaxRecords)
	}
	if len(tr.pending) != len(tr.pendingSet) {
		t.Fatalf("pending %d vs set %d", len(tr.pending), len(tr.pendingSet))
	}
	for _, f := range tr.pending {
		if _, ok := tr.pendingSet[f.ID]; !ok {
			t.Fatalf("pending %s not in set", f.ID)
		}
	}
	inHeld, inMem := 0, 0
	for el := tr.held.Front(); el != nil; el = el.Next() {
		e := el.Value.(*entry)
		if e.st != stHeld || e.leased || tr.byID[e.id] != e || e.el != el || e.gen == 0 || e.received >= e.expected {
			t.Fatalf("bad held entry %+v", e)
		}
		inHeld++
	}
	var lastLease time.Time
	for el := tr.leased.Front(); el != nil; el = el.Next() {
		e := el.Value.(*entry)
		if e.st != stHeld || !e.leased || tr.byID[e.id] != e || e.el != el || e.gen == 0 || e.received >= e.expected {
			t.Fatalf("bad leased entry %+v", e)
		}
		if e.lease.Before(lastLease) {
			t.Fatalf("lease ends decrease at %s", e.id)
		}
		lastLease = e.lease
		inHeld++
	}
	var last time.Time
	for el := tr.mem.Front(); el != nil; el = el.Next() {
		e := el.Value.(*entry)
		if (e.st != stEarly && e.st != stGone) || tr.byID[e.id] != e || e.el != el {
			t.Fatalf("bad mem entry %+v", e)
		}
		if e.stamp.Before(last) {
			t.Fatalf("mem stamps decrease at %s", e.id)
		}
		last = e.stamp
		inMem++
	}
	for id, e := range tr.byID {
		if e.el == nil {
			// only freed requests awaiting their report
			if _, ok := tr.pendingSet[id]; !ok || e.st != stGone {
				t.Fatalf("orphan entry %+v", e)
			}
		}
	}
}

// reqScript is one request's life in the lifecycle property test.
type reqScript struct {
	id    string
	n     int
	gen   uint64
	nt    bool // AddNotTransfer issued
	abort bool // Abort returned true
	// observed
	dones, earlyDones int
	armed             bool
	lastStart         time.Time
	lastRenew         time.Time // last Renew that returned true
	reported          int
	reason            Reason
}

type event struct {
	at   float64
	req  *reqScript
	kind string
}

// TestPropertyLifecycles: random interleavings of many requests' lives
// (not-transfer; delayed with N DONEs, some early, some missing, some
// duplicated; re-adds; aborts; stray ops after the end). Every request is
// reported exactly once with a reason its history justifies, grants end
// when it is freed, and nothing stays behind.
func TestPropertyLifecycles(t *testing.T) {
	for seed := range uint64(200) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { lifecycles(t, seed) })
	}
}

func lifecycles(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0x6b76666c6f77))
	const timeout = 100.0
	quorum := 1
	if rng.IntN(3) == 0 {
		quorum = 2
	}
	var lease time.Duration
	if rng.IntN(2) == 0 {
		lease = 30 * time.Second
	}
	tr := New(Options{AbortTimeout: timeout * time.Second, LeaseTTL: lease, EarlyDoneQuorum: quorum, MaxRecords: 1 << 20})
	var evs []event
	reqs := make([]*reqScript, 40+rng.IntN(80))
	for i := range reqs {
		r := &reqScript{id: fmt.Sprintf("req-%d-%d", seed, i), n: 1 + rng.IntN(3)}
		reqs[i] = r
		base := rng.Float64() * 300
		at := func() float64 { return base + rng.Float64()*20 } // a life spans < timeout
		if rng.IntN(5) == 0 {
			evs = append(evs, event{base, r, "nt"})
		} else {
			evs = append(evs, event{base + 1, r, "delay"})
			nd := rng.IntN(r.n + 2) // 0..n+1 DONEs
			for range nd {
				evs = append(evs, event{at(), r, "done"})
			}
			if rng.IntN(4) == 0 {
				evs = append(evs, event{at(), r, "delay"}) // re-add
			}
			if rng.IntN(6) == 0 {
				evs = append(evs, event{at(), r, "abort"})
			}
			if rng.IntN(2) == 0 { // renewals, some long after the abort timeout
				for k := range 1 + rng.IntN(6) {
					evs = append(evs, event{base + 1 + float64(k)*(10+rng.Float64()*30), r, "renew"})
				}
			}
		}
		if rng.IntN(4) == 0 { // stray op late in its life
			evs = append(evs, event{base + 20 + rng.Float64()*10, r, []string{"done", "nt", "delay"}[rng.IntN(3)]})
		}
	}
	for now := 0.0; now < 450; now += 0.5 + rng.Float64()*3 {
		evs = append(evs, event{at: now, kind: "fin"})
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].at < evs[j].at })

	byID := map[string]*reqScript{}
	for _, r := range reqs {
		byID[r.id] = r
	}
	finish := func(now float64) {
		for _, f := range tr.Finished(at(now)) {
			r := byID[f.ID]
			r.reported++
			r.reason = f.Reason
			if r.reported > 1 {
				t.Fatalf("%s reported twice", r.id)
			}
			switch f.Reason {
			case ReasonDone:
				need := r.n
				if r.earlyDones > 0 { // the early quorum may free it first
					need = min(r.n, quorum)
				}
				if r.dones < need {
					t.Fatalf("%s freed done after %d DONEs (n=%d, early %d, quorum %d)", r.id, r.dones, r.n, r.earlyDones, quorum)
				}
			case ReasonNotTransfer:
				if !r.nt {
					t.Fatalf("%s not_transfer without AddNotTransfer", r.id)
				}
			case ReasonAborted:
				if !r.abort {
					t.Fatalf("%s aborted without Abort", r.id)
				}
			case ReasonExpired:
				if !r.armed || r.dones >= r.n {
					t.Fatalf("%s expired wrongly: armed %v, dones %d/%d", r.id, r.armed, r.dones, r.n)
				}
				if f.Lease != !r.lastRenew.IsZero() {
					t.Fatalf("%s expired with Lease %v, renewed at %v", r.id, f.Lease, r.lastRenew)
				}
				if r.lastRenew.IsZero() && at(now).Sub(r.lastStart) <= timeout*time.Second {
					t.Fatalf("%s expired before its abort timeout: now %v start %v", r.id, now, r.lastStart)
				}
				if !r.lastRenew.IsZero() && !at(now).After(r.lastRenew.Add(lease)) {
					t.Fatalf("%s expired at %v inside its lease (renewed %v, ttl %v)", r.id, now, r.lastRenew, lease)
				}
			}
			if r.gen != 0 && tr.IsHeld(r.id, r.gen) {
				t.Fatalf("%s reported but still held", r.id)
			}
		}
	}
	for _, ev := range evs {
		r := ev.req
		switch ev.kind {
		case "fin":
			finish(ev.at)
		case "nt":
			r.nt = true
			tr.AddNotTransfer(r.id)
		case "delay":
			if g := tr.AddDelayed(r.id, at(ev.at), r.n, []int{1, 2}); g != 0 {
				if r.reported > 0 {
					t.Fatalf("%s re-armed after its report", r.id)
				}
				if r.gen != 0 && g != r.gen {
					t.Fatalf("%s generation changed %d -> %d", r.id, r.gen, g)
				}
				r.gen, r.armed, r.lastStart = g, true, at(ev.at)
			}
		case "done":
			res, err := tr.Done(r.id, at(ev.at))
			switch {
			case err != nil:
				if !errors.Is(err, ErrAlreadyFinished) || res.Status != DoneDuplicate {
					t.Fatalf("%s: %+v %v", r.id, res, err)
				}
			case res.Status == DoneEarly:
				r.dones++
				r.earlyDones++
			default:
				if r.reported > 0 {
					t.Fatalf("%s: DONE counted after its report: %+v", r.id, res)
				}
				r.dones++
			}
		case "renew":
			held := r.armed && r.reported == 0 && tr.IsHeld(r.id, r.gen)
			got := tr.Renew(r.id, at(ev.at))
			if got != (held && lease > 0) {
				t.Fatalf("%s: Renew %v, held %v, lease %v", r.id, got, held, lease)
			}
			if got {
				r.lastRenew = at(ev.at)
			}
		case "abort":
			if tr.Abort(r.id) {
				r.abort = true
				if tr.IsHeld(r.id, r.gen) {
					t.Fatalf("%s held after abort", r.id)
				}
			}
		}
		checkInvariants(t, tr)
	}
	finish(1e4)
	finish(2e4)
	for _, r := range reqs {
		if r.reported != 1 {
			t.Fatalf("%s reported %d times (n=%d nt=%v armed=%v dones=%d)", r.id, r.reported, r.n, r.nt, r.armed, r.dones)
		}
	}
	st := tr.Stats()
	var sum uint64
	for _, n := range st.Freed {
		sum += n
	}
	if sum != uint64(len(reqs)) {
		t.Fatalf("stats freed %d, want %d", sum, len(reqs))
	}
	if len(tr.byID) != tr.mem.Len() || tr.held.Len() != 0 || tr.leased.Len() != 0 || len(tr.pending) != 0 {
		t.Fatalf("left behind: byID %d held %d leased %d mem %d pending %d", len(tr.byID), tr.held.Len(), tr.leased.Len(), tr.mem.Len(), len(tr.pending))
	}
	// Tombstones do not age: a DONE however late is never reported again.
	for _, r := range reqs {
		if _, err := tr.Done(r.id, at(1e6)); err == nil && tr.byID[r.id].st != stEarly {
			t.Fatalf("%s: late DONE accepted", r.id)
		}
		tr.AddDelayed(r.id, at(1e6), 1, nil)
		tr.Renew(r.id, at(1e6))
	}
	if fs := tr.Finished(at(1e7)); len(fs) != 0 {
		t.Fatalf("late DONEs reported again: %v", fs)
	}
}

// runOps drives arbitrary operations on a small id pool from a byte
// stream (shared by the adversarial property test and the fuzz target).
func runOps(t testing.TB, data []byte) {
	if len(data) < 2 {
		return
	}
	tr := New(Options{
		AbortTimeout:    time.Duration(data[0]%8) * time.Second,
		LeaseTTL:        time.Duration(data[0]/8%4) * time.Second,
		MaxRecords:      1 + int(data[1]%6),
		EarlyDoneQuorum: 1 + int(data[1]/6%3),
	})
	now := 0.0
	lastReport := map[string]float64{}
	gens := map[string]uint64{}
	for i := 2; i+1 < len(data); i += 2 {
		id := fmt.Sprintf("r%d", data[i+1]%6)
		switch data[i] % 8 {
		case 0:
			tr.AddNotTransfer(id)
		case 1, 2:
			start := now - float64(data[i+1]%4)
			if g := tr.AddDelayed(id, at(start), 1+int(data[i+1]/6%3), []int{int(data[i])}); g != 0 {
				gens[id] = g
			}
		case 3:
			res, err := tr.Done(id, at(now))
			if (err != nil) != (res.Status == DoneDuplicate) {
				t.Fatalf("Done %s: %+v %v", id, res, err)
			}
		case 4:
			tr.Abort(id)
		case 5:
			now += float64(data[i+1] % 5)
			seen := map[string]bool{}
			for _, f := range tr.Finished(at(now)) {
				if seen[f.ID] {
					t.Fatalf("%s twice in one batch", f.ID)
				}
				seen[f.ID] = true
				if f.Reason < ReasonDone || f.Reason > ReasonAborted {
					t.Fatalf("bad reason %d", f.Reason)
				}
				lastReport[f.ID] = now
				if tr.IsHeld(f.ID, gens[f.ID]) {
					t.Fatalf("%s reported and held", f.ID)
				}
			}
		case 6:
			g, _, ok := tr.Held(id)
			if ok != tr.IsHeld(id, g) {
				t.Fatalf("Held/IsHeld disagree for %s", id)
			}
		case 7:
			_, _, held := tr.Held(id)
			if got := tr.Renew(id, at(now-float64(data[i+1]%3))); got != (held && tr.opts.LeaseTTL > 0) {
				t.Fatalf("Renew %s: %v, held %v", id, got, held)
			}
		}
		checkInvariants(t, tr)
	}
	// Every hold ends once time moves far enough; only tombstones (at most
	// MaxRecords) stay.
	for range 2 {
		now += 1e3
		tr.Finished(at(now))
	}
	if len(tr.byID) != tr.mem.Len() || tr.held.Len() != 0 || tr.leased.Len() != 0 || len(tr.pending) != 0 {
		t.Fatalf("not drained: byID %d held %d leased %d mem %d", len(tr.byID), tr.held.Len(), tr.leased.Len(), tr.mem.Len())
	}
}

func TestPropertyAdversarial(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for range 2000 {
		data := make([]byte, 2+rng.IntN(200))
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		runOps(t, data)
	}
}

func FuzzOps(f *testing.F) {
	f.Add([]byte{5, 3, 1, 0, 3, 0, 5, 4, 1, 1, 3, 1, 3, 1, 5, 2})
	f.Add([]byte{0, 0, 3, 2, 1, 2, 1, 2, 5, 0, 0, 2, 5, 4})
	f.Fuzz(func(t *testing.T, data []byte) { runOps(t, data) })
}

// TestConcurrent: lives on disjoint ids from several goroutines while one
// goroutine polls Finished; run with -race.
func TestConcurrent(t *testing.T) {
	tr := New(Options{AbortTimeout: time.Hour})
	const workers, per = 8, 500
	var wg sync.WaitGroup
	var mu sync.Mutex
	seen := map[string]int{}
	stop := make(chan struct{})
	collect := func() {
		fs := tr.Finished(at(0))
		mu.Lock()
		for _, f := range fs {
			seen[f.ID]++
		}
		mu.Unlock()
	}
	pollDone := make(chan struct{})
	go func() {
		defer close(pollDone)
		for {
			select {
			case <-stop:
				return
			default:
				collect()
			}
		}
	}()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range per {
				id := fmt.Sprintf("w%d-%d", w, i)
				switch i % 4 {
				case 0:
					tr.AddNotTransfer(id)
				case 1:
					g := tr.AddDelayed(id, at(0), 2, []int{i})
					tr.IsHeld(id, g)
					tr.Done(id, at(0))
					tr.Held(id)
					tr.Done(id, at(0))
				case 2:
					tr.Done(id, at(0))
					tr.AddDelayed(id, at(0), 1, nil)
				case 3:
					tr.AddDelayed(id, at(0), 1, nil)
					tr.Abort(id)
				}
				tr.Stats()
				tr.Len()
			}
		}()
	}
	wg.Wait()
	close(stop)
	<-pollDone
	collect()
	if len(seen) != workers*per {
		t.Fatalf("reported %d of %d", len(seen), workers*per)
	}
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("%s reported %d times", id, n)
		}
	}
}
