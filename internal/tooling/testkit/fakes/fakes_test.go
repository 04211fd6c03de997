package fakes

import (
	"context"
	"errors"
	"testing"

	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

func TestTransfer(t *testing.T) {
	ctx := context.Background()
	ops := []plan.Op{{Local: 1, Remote: 2, Len: 3}, {Local: 4, Remote: 5, Len: 6}}
	f := &Transfer{}
	if err := f.BatchRead(ctx, "h:1", &read.Batch{List: ops}); err != nil {
		t.Fatal(err)
	}
	if err := f.BatchRead(ctx, "h:1", &read.Batch{List: ops, Landed: make([]uint64, 2)}); err == nil {
		t.Error("a ledger was asked of a transfer without one")
	}
	if err := f.BatchRead(ctx, "h:1", &read.Batch{List: ops, Row: 16, Pitch: 64}); err == nil || f.Capabilities().LocalStride {
		t.Error("a strided read was asked of a transfer without LocalStride")
	}
	if r := f.Reads(); len(r) != 1 || r[0].Session != "h:1" || len(r[0].Ops) != 2 || r[0].Ops[1] != ops[1] || r[0].Compact {
		t.Fatalf("recorded %+v", r)
	}
	s := &Transfer{Strided: true, Err: errors.New("peer gone")}
	if err := s.BatchRead(ctx, "h:2", &read.Batch{List: ops, Row: 16, Pitch: 64}); err == nil || err.Error() != "peer gone" {
		t.Errorf("err %v, want Err", err)
	}
	if r := s.Reads(); !s.Capabilities().LocalStride || len(r) != 1 || r[0].Row != 16 || r[0].Pitch != 64 || len(s.Ops()[0]) != 2 {
		t.Errorf("strided: recorded %+v", r)
	}
}

func TestSender(t *testing.T) {
	ctx := context.Background()
	s := &BatchSender{Sender: Sender{Fail: map[string]bool{"a:1": true}}}
	if err := s.SendDone(ctx, "b:1", "r1"); err != nil {
		t.Fatal(err)
	}
	if err := s.SendDoneBatched(ctx, "a:1", "r2"); !errors.Is(err, ErrNoAck) {
		t.Errorf("to a failing endpoint: %v", err)
	}
	want := []Done{{"a:1", "r2", true}, {"b:1", "r1", false}}
	got := s.ByEndpoint()
	if len(got) != 2 || got[0] != want[0] || got[1] != want[1] {
		t.Errorf("ByEndpoint = %+v, want %+v", got, want)
	}
	if d := s.Dones(); len(d) != 2 || d[0] != want[1] {
		t.Errorf("Dones = %+v, not in the order sent", d)
	}
}
