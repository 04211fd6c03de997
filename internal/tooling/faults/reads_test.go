package faults

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// testReads is 10 ops: 2 tensors x 5 single-block runs.
func testReads(t *testing.T) *plan.Reads {
	t.Helper()
	var rd plan.Reads
	ids := []int{0, 2, 4, 6, 8}
	err := rd.Build(plan.CacheLayout{BlockLen: []uint64{64}, CachesPerLayer: 2},
		plan.Task{P: 1, LayerStart: 0, LayerEnd: 1, LocalBlockIDs: ids, RemoteBlockIDs: ids},
		plan.Caches{Base: []uint64{0x100000, 0x300000}}, plan.Caches{Base: []uint64{0x200000, 0x400000}})
	if err != nil || rd.Len() != 10 {
		t.Fatalf("reads: %v, %d ops", err, rd.Len())
	}
	return &rd
}

// Compact reads draw the same faults as their expanded op list (same key),
// reach a compact-taking transfer still compact unless a fault cuts the
// batch, and the wrapper's ledger shows what ran.
func TestTransferCompactReads(t *testing.T) {
	rd := testReads(t)
	all := rd.AppendTo(nil)
	if readKey("h:1", &read.Batch{Reads: rd}) != readKey("h:1", &read.Batch{List: all}) {
		t.Fatal("compact and expanded batches have different keys")
	}
	for _, kind := range []Kind{None, Fail, Delay, Truncate, ShortRead, Duplicate} {
		t.Run(kind.String(), func(t *testing.T) {
			var rates Rates
			switch kind {
			case Fail:
				rates.Fail = 1
			case Delay:
				rates.Delay = 1
			case Truncate:
				rates.Truncate = 1
			case ShortRead:
				rates.ShortRead = 1
			case Duplicate:
				rates.Duplicate = 1
			}
			s := Schedule{Seed: 3, Read: rates, MaxDelay: time.Millisecond}
			// The same call as a plain op list, for reference.
			ref := &fakes.Transfer{}
			refErr := mustNew(t, s).Transfer(ref).BatchRead(context.Background(), "h:1", &read.Batch{List: all})

			f := &fakes.Transfer{}
			landed := make([]uint64, rd.Len())
			tr := mustNew(t, s).Transfer(f)
			if !tr.Capabilities().Ledger {
				t.Fatal("the wrapper has no ledger")
			}
			err := tr.BatchRead(context.Background(), "h:1", &read.Batch{Reads: rd, Landed: landed})
			if (err != nil) != (refErr != nil) || (err != nil && !errors.Is(err, ErrInjected)) {
				t.Fatalf("err %v, op-list call %v", err, refErr)
			}
			calls, refCalls, reads := f.Ops(), ref.Ops(), f.Reads()
			if len(calls) != len(refCalls) {
				t.Fatalf("%d inner calls, op-list call made %d", len(calls), len(refCalls))
			}
			for i := range calls {
				if !slices.Equal(calls[i], refCalls[i]) {
					t.Fatalf("call %d ran %v, op-list call ran %v", i, calls[i], refCalls[i])
				}
				whole := len(calls[i]) == len(all)
				if reads[i].Compact != whole {
					t.Errorf("call %d of %d ops compact=%v", i, len(calls[i]), reads[i].Compact)
				}
			}
			ran := 0 // ops whose bytes landed: the last run's (a prefix when cut)
			if len(calls) > 0 {
				ran = len(calls[len(calls)-1])
			}
			for i, op := range all {
				want := uint64(0)
				if i < ran {
					want = op.Len
				}
				if landed[i] != want {
					t.Fatalf("landed[%d] = %d, want %d (%d ops ran)", i, landed[i], want, ran)
				}
			}
		})
	}
}

// The wrapper offers strided reads exactly when the inner transfer does;
// under each read fault a strided batch runs whole, twice, or not at all,
// never in part, and a cut one (Truncate, ShortRead) fails: with no
// ledger, a silent partial read could not be caught.
func TestTransferStridedReads(t *testing.T) {
	if mustNew(t, Schedule{}).Transfer(&fakes.Transfer{}).Capabilities().LocalStride {
		t.Fatal("wrapper of a non-strided transfer offers strided reads")
	}
	rd := testReads(t)
	for _, c := range []struct {
		kind  Kind
		rates Rates
		calls int
		fails bool
	}{
		{None, Rates{}, 1, false},
		{Fail, Rates{Fail: 1}, 0, true},
		{Delay, Rates{Delay: 1}, 1, false},
		{Truncate, Rates{Truncate: 1}, 0, true},
		{ShortRead, Rates{ShortRead: 1}, 0, true},
		{Duplicate, Rates{Duplicate: 1}, 2, false},
	} {
		t.Run(c.kind.String(), func(t *testing.T) {
			f := &fakes.Transfer{Strided: true}
			tr := mustNew(t, Schedule{Seed: 3, Read: c.rates, MaxDelay: time.Millisecond}).Transfer(f)
			if !tr.Capabilities().LocalStride {
				t.Fatal("wrapper of a strided transfer does not offer strided reads")
			}
			err := tr.BatchRead(context.Background(), "h:1", &read.Batch{Reads: rd, Row: 16, Pitch: 64})
			if (err != nil) != c.fails || (err != nil && !errors.Is(err, ErrInjected)) {
				t.Fatalf("err %v, want failure %v", err, c.fails)
			}
			if len(f.Ops()) != c.calls {
				t.Fatalf("%d inner calls, want %d", len(f.Ops()), c.calls)
			}
			for i, r := range f.Reads() {
				s := [2]uint64{r.Row, r.Pitch}
				if s != [2]uint64{16, 64} || len(f.Ops()[i]) != rd.Len() {
					t.Fatalf("call %d: stride %v, %d ops", i, s, len(f.Ops()[i]))
				}
			}
		})
	}
}
