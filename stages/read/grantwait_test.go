package read

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// grantPeer fails batches the way hw/mooncake's TCP engine does against a
// prefill with read grants: one *mooncake.BatchError with an error per
// op. Attempt k (from 0) follows script[min(k, len-1)], one letter per op:
// L landed, R refused (the v2 reject status), N not attempted (skipped
// after another op failed), C connection closed by the peer, T no
// progress (I/O timeout). A script of only L's succeeds.
type grantPeer struct {
	script []string

	mu       sync.Mutex
	attempts []int // ops posted per attempt
}

func (g *grantPeer) Capabilities() Capabilities { return Capabilities{Classify: ClassifyFailure} }

func (g *grantPeer) BatchRead(_ context.Context, session string, b *Batch) error {
	g.mu.Lock()
	k := len(g.attempts)
	g.attempts = append(g.attempts, b.Len())
	g.mu.Unlock()
	s := g.script[min(k, len(g.script)-1)]
	if len(s) != b.Len() {
		return fmt.Errorf("script %q for %d ops", s, b.Len())
	}
	ops := make([]mooncake.Op, b.Len())
	errs := make([]error, b.Len())
	failed := false
	for i := range ops {
		op := b.At(i)
		ops[i] = mooncake.Op{Local: op.Local, Remote: op.Remote, Length: op.Len}
		switch s[i] {
		case 'L':
		case 'R':
			errs[i] = fmt.Errorf("%s: %w", session, fmt.Errorf("%w (status 1)", mooncake.ErrRejected))
		case 'N':
			errs[i] = mooncake.ErrNotAttempted
		case 'C':
			errs[i] = fmt.Errorf("%s: %w", session, mooncake.ErrPeerClosed)
		case 'T':
			errs[i] = fmt.Errorf("%s: no progress for 1s: %w", session, os.ErrDeadlineExceeded)
		}
		failed = failed || errs[i] != nil
	}
	if !failed {
		return nil
	}
	return &mooncake.BatchError{Session: session, Dir: mooncake.DirRead, Ops: ops, Errs: errs}
}

// A read that meets the prefill before its grant for the request is read
// again, whole, within GrantWait: refused outright, or (the grant arriving
// while the batch was in flight) with some ops landed and only refusals
// among the rest. Any other failure mixed in ends the job as before.
// Virtual time: the backoff (2, 4, 8, 16, 32 ms...) against GrantWait 50 ms
// allows four reads again after the first.
func TestGrantWait(t *testing.T) {
	for _, tc := range []struct {
		name      string
		script    []string
		grantWait time.Duration
		wantErr   string // "" : the job is read
		waits     int    // reads again, kvflow_read_grant_waits_total
	}{
		{name: "refused outright, then granted", script: []string{"RNNN", "LLLL"}, waits: 1},
		{name: "granted during the first batch", script: []string{"LRNN", "LLLL"}, waits: 1},
		{name: "granted during a batch read again", script: []string{"RNNN", "LRLN", "LLLL"}, waits: 2},
		{name: "refusals on two connections", script: []string{"LRLR", "LLLL"}, waits: 1},
		{name: "never granted", script: []string{"RNNN"}, wantErr: "rejected by peer", waits: 4},
		{name: "granted mid-batch then freed", script: []string{"LRNN"}, wantErr: "rejected by peer", waits: 4},
		{name: "partly refused, no wait", script: []string{"LRNN", "LLLL"}, grantWait: -1, wantErr: "rejected by peer"},
		{name: "partly refused and a connection lost", script: []string{"LRCN", "LLLL"}, wantErr: "rejected by peer"},
		{name: "partly refused and a timeout", script: []string{"RLTN", "LLLL"}, wantErr: "rejected by peer"},
		{name: "lost connection alone", script: []string{"LCNN", "LLLL"}, wantErr: "peer closed"},
		// Today's rule, kept: nothing landed and some op refused.
		{name: "refused and a timeout, nothing landed", script: []string{"RTNN", "LLLL"}, waits: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				gw := tc.grantWait
				if gw == 0 {
					gw = 50 * time.Millisecond
				}
				g := &grantPeer{script: tc.script}
				var invalidated int
				s, err := build(g, Options{
					Layout:     plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
					Local:      plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
					Invalidate: func(*job.Job, int) { invalidated++ },
					GrantWait:  gw,
				})
				if err != nil {
					t.Fatal(err)
				}
				j := testJob(1)
				j.Submitted = time.Now()
				err = s.Process(context.Background(), j)
				if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				if n := testutil.ToFloat64(s.m.grantWaits); n != float64(tc.waits) {
					t.Fatalf("kvflow_read_grant_waits_total = %v, want %d", n, tc.waits)
				}
				if len(g.attempts) != tc.waits+1 {
					t.Fatalf("%d reads, want %d", len(g.attempts), tc.waits+1)
				}
				for k, n := range g.attempts {
					if n != g.attempts[0] {
						t.Fatalf("read %d posted %d ops, the first %d: want the whole task each time", k, n, g.attempts[0])
					}
				}
				if elapsed := time.Since(j.Submitted); elapsed > max(gw, 0) {
					t.Fatalf("ended %v after admission, past GrantWait %v", elapsed, gw)
				}
				if tc.wantErr == "" {
					if got, want := j.BytesRead.Load(), uint64(4*2*4096); got != want || invalidated != 0 {
						t.Fatalf("%d bytes read, invalidated %d; want %d and none", got, invalidated, want)
					}
				} else if invalidated != 1 {
					t.Fatalf("invalidated %d times, want once", invalidated)
				}
			})
		})
	}
}

// ClassifyFailure reads hw/mooncake's per-op errors.
func TestClassifyFailure(t *testing.T) {
	rej := fmt.Errorf("127.0.0.1:1: %w", mooncake.ErrRejected)
	closed := fmt.Errorf("127.0.0.1:1: %w", mooncake.ErrPeerClosed)
	timeout := fmt.Errorf("no progress: %w", os.ErrDeadlineExceeded)
	batch := func(errs ...error) error {
		return fmt.Errorf("read task 0: %w", &mooncake.BatchError{Dir: mooncake.DirRead, Ops: make([]mooncake.Op, len(errs)), Errs: errs})
	}
	for _, tc := range []struct {
		name string
		err  error
		want Failure
		race bool // grantRace: read again within GrantWait
	}{
		{"refused outright", batch(rej, mooncake.ErrNotAttempted), Failure{Refused: true, RefusedOnly: true}, true},
		{"refused after some landed", batch(nil, rej, mooncake.ErrNotAttempted), Failure{Moved: true, Refused: true, RefusedOnly: true}, true},
		{"refused and closed", batch(nil, rej, closed), Failure{Moved: true, Refused: true, ConnLost: true}, false},
		{"refused and timed out", batch(rej, timeout), Failure{Refused: true}, true},
		{"refused and timed out after some landed", batch(nil, rej, timeout), Failure{Moved: true, Refused: true}, false},
		{"closed after some landed", batch(nil, closed), Failure{Moved: true, ConnLost: true}, false},
		{"local range refused before any I/O", batch(fmt.Errorf("local: %w", mooncake.ErrNotRegistered), mooncake.ErrNotAttempted), Failure{}, false},
		{"refused, not a batch", fmt.Errorf("x: %w", mooncake.ErrRejected), Failure{Refused: true}, true},
		{"connection refused", fmt.Errorf("dial: %w", syscall.ECONNREFUSED), Failure{ConnLost: true}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ClassifyFailure(tc.err)
			if got != tc.want {
				t.Fatalf("ClassifyFailure = %+v, want %+v", got, tc.want)
			}
			if r := grantRace(got); r != tc.race {
				t.Fatalf("grantRace = %v, want %v", r, tc.race)
			}
		})
	}
}
