package leasefake

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"
)

func TestRenewer(t *testing.T) {
	f := &Renewer{Block: map[string]bool{"dead:1": true}}
	ids := []string{"a", "b"}
	if err := f.Renew(context.Background(), "p:1", ids); err != nil {
		t.Fatal(err)
	}
	ids[0] = "changed" // the call keeps its own copy
	cut := errors.New("side channel cut")
	f.SetErr(cut)
	if err := f.Renew(context.Background(), "p:2", []string{"c"}); !errors.Is(err, cut) {
		t.Fatalf("after SetErr: %v", err)
	}
	f.SetErr(nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if err := f.Renew(ctx, "dead:1", []string{"d"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("blocked endpoint: %v, want its context's error", err)
	}
	if err := f.Renew(context.Background(), "p:1", []string{"e"}); err != nil {
		t.Fatalf("after SetErr(nil): %v", err)
	}
	if c := f.Calls(); len(c) != 4 || !slices.Equal(c[0].IDs, []string{"a", "b"}) || c[2].Endpoint != "dead:1" || c[0].At.IsZero() {
		t.Fatalf("calls %+v", c)
	}
	if to := f.To("p:1"); len(to) != 2 || !slices.Equal(to[1].IDs, []string{"e"}) {
		t.Fatalf("To(p:1) = %+v", to)
	}
	if !f.Carried("c") || !f.Carried("d") || f.Carried("changed") || f.Carried("x") {
		t.Fatal("Carried")
	}
}
