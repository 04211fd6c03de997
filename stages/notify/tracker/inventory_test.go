package tracker

import (
	"testing"
	"time"
)

// TestInventory: every held request is listed with its blocks, age,
// expected and seen DONEs, and its lease or abort-timeout deadline; freed
// ones are not; HeldPast counts those held past an age.
func TestInventory(t *testing.T) {
	t0 := time.Unix(1000, 0)
	tr := New(Options{AbortTimeout: 100 * time.Second, LeaseTTL: 10 * time.Second})
	tr.AddDelayed("old", t0, 2, []int{1, 2, 3})
	tr.AddDelayed("leased", t0.Add(30*time.Second), 1, []int{4})
	tr.AddDelayed("new", t0.Add(50*time.Second), 1, []int{5, 6})
	tr.AddDelayed("gone", t0.Add(50*time.Second), 1, []int{7})
	if _, err := tr.Done("old", t0.Add(55*time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Done("gone", t0.Add(55*time.Second)); err != nil {
		t.Fatal(err)
	}
	if !tr.Renew("leased", t0.Add(56*time.Second)) {
		t.Fatal("renew refused")
	}
	now := t0.Add(60 * time.Second)
	inv := tr.Inventory(now)
	want := []Held{
		{RequestID: "old", Blocks: 3, Age: 60 * time.Second, ExpectedDones: 2, DonesSeen: 1, AbortIn: 40 * time.Second},
		{RequestID: "leased", Blocks: 1, Age: 30 * time.Second, ExpectedDones: 1, Leased: true, LeaseRemaining: 6 * time.Second},
		{RequestID: "new", Blocks: 2, Age: 10 * time.Second, ExpectedDones: 1, AbortIn: 90 * time.Second},
	}
	if len(inv) != len(want) {
		t.Fatalf("inventory %+v, want %+v", inv, want)
	}
	for i := range want {
		if inv[i] != want[i] {
			t.Errorf("entry %d: %+v, want %+v", i, inv[i], want[i])
		}
	}
	for _, c := range []struct {
		age  time.Duration
		want int
	}{{5 * time.Second, 3}, {20 * time.Second, 2}, {45 * time.Second, 1}, {time.Minute, 0}} {
		if got := tr.HeldPast(now, c.age); got != c.want {
			t.Errorf("HeldPast(%v) = %d, want %d", c.age, got, c.want)
		}
	}
}
