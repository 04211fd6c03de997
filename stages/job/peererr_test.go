package job

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

func TestBlame(t *testing.T) {
	boom := errors.New("boom")
	a := AtPeer(HopRead, "h:1", boom)
	b := AtPeer(HopHandshake, "h:2", boom)
	for _, tc := range []struct {
		name string
		err  error
		want []string // hop@endpoint
	}{
		{"nil", nil, nil},
		{"unnamed", boom, nil},
		{"one", a, []string{"read@h:1"}},
		{"wrapped", fmt.Errorf("stage read: %w", a), []string{"read@h:1"}},
		{"joined", errors.Join(fmt.Errorf("x: %w", a), b), []string{"read@h:1", "handshake@h:2"}},
		{"two %w", fmt.Errorf("%w; re-fetch: %w", a, b), []string{"read@h:1", "handshake@h:2"}},
		{"nested hops", AtPeer(HopRead, "h:2", b), []string{"read@h:2", "handshake@h:2"}},
		{"same twice", errors.Join(a, fmt.Errorf("again: %w", a)), []string{"read@h:1"}},
		{"AtPeer idempotent", AtPeer(HopRead, "h:1", a), []string{"read@h:1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, pe := range Blame(tc.err) {
				got = append(got, pe.Hop+"@"+pe.Endpoint)
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("Blame = %v, want %v", got, tc.want)
			}
		})
	}
	if AtPeer(HopRead, "h:1", nil) != nil {
		t.Fatal("AtPeer(nil) != nil")
	}
	if a.Error() != boom.Error() || !errors.Is(a, boom) {
		t.Fatalf("PeerError hides its cause: %q", a)
	}
}

func TestMark(t *testing.T) {
	base := errors.New("sidechannel: timeout")
	m := Mark(base, ErrNoReply)
	if !errors.Is(m, ErrNoReply) || !errors.Is(m, base) || m.Error() != base.Error() {
		t.Fatalf("Mark: %q is ErrNoReply %v, base %v", m, errors.Is(m, ErrNoReply), errors.Is(m, base))
	}
	if Mark(nil, ErrNoReply) != nil || Mark(m, ErrNoReply) != m {
		t.Fatal("Mark(nil) or Mark of a marked error changed it")
	}
}
