package faults

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// sent is what s was asked to send, as "endpoint/id" ("endpoint/batched:id"
// through the batched path).
func sent(s *fakes.Sender) []string {
	var out []string
	for _, d := range s.Dones() {
		id := d.ID
		if d.Batched {
			id = "batched:" + id
		}
		out = append(out, d.Endpoint+"/"+id)
	}
	return out
}

var meta = job.Meta{EngineID: "P", TERPCPort: 9000, BaseAddrs: []uint64{0x1000, 0x9000}, NumBlocks: 64}

func fakeFetcher() handshake.Fetcher {
	return handshake.FetcherFunc(func(context.Context, string) (job.Meta, error) { return meta, nil })
}

func ops(n int) []plan.Op {
	out := make([]plan.Op, n)
	for i := range out {
		out[i] = plan.Op{Local: uint64(0x100000 + i*64), Remote: uint64(0x200000 + i*64), Len: 64}
	}
	return out
}

func mustNew(t *testing.T, s Schedule) *Injector {
	t.Helper()
	in, err := New(s)
	if err != nil {
		t.Fatal(err)
	}
	return in
}

func TestValidate(t *testing.T) {
	cases := []struct {
		name string
		s    Schedule
		want []string // substrings of the error; none = valid
	}{
		{name: "zero", s: Schedule{}},
		{name: "full", s: Schedule{Read: Rates{Fail: .2, Delay: .2, Truncate: .2, ShortRead: .2, Duplicate: .2},
			Meta: Rates{Fail: .5, Corrupt: .5}, Done: Rates{Drop: 1}}},
		{name: "out of range", s: Schedule{Read: Rates{Fail: 1.5}, Done: Rates{Delay: -0.1}}, want: []string{"read fail rate 1.5", "send_done delay rate -0.1"}},
		{name: "sum", s: Schedule{Meta: Rates{Fail: .6, Delay: .6}}, want: []string{"get_meta rates sum"}},
		{name: "inapplicable", s: Schedule{Read: Rates{Corrupt: .1}, Meta: Rates{Truncate: .1}, Done: Rates{Fail: .1}},
			want: []string{"read does not accept corrupt", "get_meta does not accept truncate", "send_done does not accept fail"}},
		{name: "nan", s: Schedule{Read: Rates{Delay: math.NaN()}}, want: []string{"read delay rate NaN"}},
		{name: "delay and corruption", s: Schedule{MaxDelay: -1, Corruptions: []Corruption{9}}, want: []string{"MaxDelay", "unknown corruption 9"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.s.Validate()
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("valid schedule rejected: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("invalid schedule accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if _, nerr := New(tc.s); nerr == nil {
				t.Error("New accepted an invalid schedule")
			}
		})
	}
}

// The same seed gives the same decisions; another seed other ones; rates
// are honoured.
func TestDecideDeterministicAndRates(t *testing.T) {
	s := Schedule{Seed: 42, Read: Rates{Fail: .1, Delay: .2, Truncate: .05, ShortRead: .05, Duplicate: .1}, MaxDelay: 5 * time.Millisecond}
	other := s
	other.Seed = 43
	const n = 20000
	counts := map[Kind]int{}
	differ := 0
	for i := range uint64(n) {
		a, b := s.Decide(Read, i*7919, 0, 8), s.Decide(Read, i*7919, 0, 8)
		if a != b {
			t.Fatalf("key %d: %+v then %+v", i, a, b)
		}
		if a != other.Decide(Read, i*7919, 0, 8) {
			differ++
		}
		if a != s.Decide(Read, i*7919, 1, 8) {
			differ++
		}
		counts[a.Kind]++
		switch a.Kind {
		case Delay:
			if a.Delay <= 0 || a.Delay > s.MaxDelay {
				t.Fatalf("delay %v outside (0, %v]", a.Delay, s.MaxDelay)
			}
		case Truncate, ShortRead:
			if a.Keep < 0 || a.Keep >= 8 {
				t.Fatalf("keep %d outside [0, 8)", a.Keep)
			}
		}
	}
	if differ < n/4 {
		t.Errorf("another seed or call number changed only %d of %d decisions", differ, 2*n)
	}
	want := map[Kind]float64{Fail: .1, Delay: .2, Truncate: .05, ShortRead: .05, Duplicate: .1, None: .5}
	for k, p := range want {
		got := float64(counts[k]) / n
		if math.Abs(got-p) > 0.015 {
			t.Errorf("%s: rate %.3f, want %.3f", k, got, p)
		}
	}
	for _, k := range []Kind{Drop, Corrupt} {
		if counts[k] != 0 {
			t.Errorf("%s injected into read %d times", k, counts[k])
		}
	}
}

// An injector replays: two injectors with one seed fed the same calls in
// different goroutine orders inject the same faults into the same calls.
func TestInjectorReplay(t *testing.T) {
	s := Schedule{Seed: 9, Done: Rates{Drop: .3, Duplicate: .2}}
	run := func(reverse bool) map[string]int {
		in := mustNew(t, s)
		fs := &fakes.Sender{}
		snd := in.Sender(fs)
		var wg sync.WaitGroup
		for i := range 200 {
			if reverse {
				i = 199 - i
			}
			wg.Go(func() { snd.SendDone(context.Background(), "h:1", fmt.Sprintf("req-%d", i)) })
		}
		wg.Wait()
		got := map[string]int{}
		for _, id := range sent(fs) {
			got[id]++
		}
		return got
	}
	a, b := run(false), run(true)
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Fatalf("replay differs:\n%v\n%v", a, b)
	}
	var drops, dups int
	for i := range 200 {
		switch a[fmt.Sprintf("h:1/req-%d", i)] {
		case 0:
			drops++
		case 2:
			dups++
		}
	}
	if drops == 0 || dups == 0 {
		t.Errorf("drops %d, duplicates %d: want some of each", drops, dups)
	}
}

func TestTransferKinds(t *testing.T) {
	cases := []struct {
		kind    Kind
		rates   Rates
		wantErr bool
		check   func(t *testing.T, calls [][]plan.Op)
	}{
		{kind: Fail, rates: Rates{Fail: 1}, wantErr: true, check: func(t *testing.T, c [][]plan.Op) {
			if len(c) != 0 {
				t.Errorf("failed batch ran %d times", len(c))
			}
		}},
		{kind: Delay, rates: Rates{Delay: 1}, check: func(t *testing.T, c [][]plan.Op) {
			if len(c) != 1 || len(c[0]) != 5 {
				t.Errorf("delayed batch: %d runs", len(c))
			}
		}},
		{kind: Truncate, rates: Rates{Truncate: 1}, wantErr: true, check: func(t *testing.T, c [][]plan.Op) {
			if len(c) > 1 || (len(c) == 1 && len(c[0]) >= 5) {
				t.Errorf("truncated batch ran %v", c)
			}
		}},
		{kind: ShortRead, rates: Rates{ShortRead: 1}, check: func(t *testing.T, c [][]plan.Op) {
			if len(c) > 1 || (len(c) == 1 && len(c[0]) >= 5) {
				t.Errorf("short read ran %v", c)
			}
		}},
		{kind: Duplicate, rates: Rates{Duplicate: 1}, check: func(t *testing.T, c [][]plan.Op) {
			if len(c) != 2 || len(c[0]) != 5 || len(c[1]) != 5 {
				t.Errorf("duplicated batch ran %v", c)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.kind.String(), func(t *testing.T) {
			in := mustNew(t, Schedule{Seed: 1, Read: tc.rates, MaxDelay: time.Millisecond})
			ft := &fakes.Transfer{}
			err := in.Transfer(ft).BatchRead(context.Background(), "h:1", &read.Batch{List: ops(5)})
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v", err, tc.wantErr)
			}
			if err != nil && !errors.Is(err, ErrInjected) {
				t.Errorf("%v does not wrap ErrInjected", err)
			}
			tc.check(t, ft.Ops())
			c := in.Counts()
			if c.Of(Read, tc.kind) != 1 || c.Calls[Read] != 1 || c.Total() != 1 {
				t.Errorf("counts %+v", c)
			}
		})
	}
	// The wrapped transfer's error is returned as is.
	inner := errors.New("peer gone")
	in := mustNew(t, Schedule{Read: Rates{Duplicate: 1}})
	if err := in.Transfer(&fakes.Transfer{Err: inner}).BatchRead(context.Background(), "h:1", &read.Batch{List: ops(2)}); !errors.Is(err, inner) || errors.Is(err, ErrInjected) {
		t.Errorf("inner error: %v", err)
	}
}

// A delay ends with its context; the operation is then not run.
func TestDelayHonoursContext(t *testing.T) {
	in := mustNew(t, Schedule{Read: Rates{Delay: 1}, Done: Rates{Delay: 1}, Meta: Rates{Delay: 1}, MaxDelay: time.Hour})
	ctx, cancel := context.WithTimeoutCause(context.Background(), 20*time.Millisecond, errors.New("deadline"))
	defer cancel()
	start := time.Now()
	ft, fs := &fakes.Transfer{}, &fakes.Sender{}
	if err := in.Transfer(ft).BatchRead(ctx, "h:1", &read.Batch{List: ops(1)}); err == nil || err.Error() != "deadline" {
		t.Errorf("read: %v", err)
	}
	if err := in.Sender(fs).SendDone(ctx, "h:1", "r"); err == nil {
		t.Error("send: no error")
	}
	if _, err := in.Fetcher(fakeFetcher()).GetMeta(ctx, "h:1"); err == nil {
		t.Error("get meta: no error")
	}
	if time.Since(start) > 5*time.Second || len(ft.Ops()) != 0 || len(sent(fs)) != 0 {
		t.Errorf("delay not cut short: %v, %d reads, %d sends", time.Since(start), len(ft.Ops()), len(sent(fs)))
	}
}

func TestSenderKinds(t *testing.T) {
	for _, tc := range []struct {
		rates   Rates
		sent    int
		wantErr bool
	}{
		{Rates{Drop: 1}, 0, true},
		{Rates{Delay: 1}, 1, false},
		{Rates{Duplicate: 1}, 2, false},
		{Rates{}, 1, false},
	} {
		in := mustNew(t, Schedule{Done: tc.rates, MaxDelay: time.Millisecond})
		fs := &fakes.Sender{}
		err := in.Sender(fs).SendDone(context.Background(), "h:1", "r")
		if (err != nil) != tc.wantErr || len(sent(fs)) != tc.sent {
			t.Errorf("%+v: err %v, sent %d, want %d", tc.rates, err, len(sent(fs)), tc.sent)
		}
	}
}

// The injector's sender forwards batched DONEs to the inner sender's
// batched path, with the same faults, and to its plain path when it has
// none.
func TestSenderBatched(t *testing.T) {
	for _, tc := range []struct {
		rates   Rates
		sent    int
		wantErr bool
	}{
		{Rates{Drop: 1}, 0, true},
		{Rates{Duplicate: 1}, 2, false},
		{Rates{}, 1, false},
	} {
		in := mustNew(t, Schedule{Done: tc.rates, MaxDelay: time.Millisecond})
		bs := &fakes.BatchSender{}
		snd, ok := in.Sender(bs).(notify.BatchSender)
		if !ok {
			t.Fatal("injector's sender has no batched path")
		}
		err := snd.SendDoneBatched(context.Background(), "h:1", "r")
		if (err != nil) != tc.wantErr || len(sent(&bs.Sender)) != tc.sent {
			t.Errorf("%+v: err %v, sent %d, want %d", tc.rates, err, len(sent(&bs.Sender)), tc.sent)
		}
		for _, s := range sent(&bs.Sender) {
			if s != "h:1/batched:r" {
				t.Errorf("%+v: sent %q, want the batched path", tc.rates, s)
			}
		}
	}
	fs := &fakes.Sender{}
	if err := mustNew(t, Schedule{}).Sender(fs).(notify.BatchSender).SendDoneBatched(context.Background(), "h:1", "r"); err != nil || len(sent(fs)) != 1 || sent(fs)[0] != "h:1/r" {
		t.Errorf("plain inner sender: err %v, sent %v", err, sent(fs))
	}
}

func TestFetcherCorrupt(t *testing.T) {
	for _, c := range []Corruption{CorruptEngineID, CorruptBaseFar, CorruptBaseNear, CorruptNumBlocks} {
		t.Run(c.String(), func(t *testing.T) {
			in := mustNew(t, Schedule{Meta: Rates{Corrupt: 1}, Corruptions: []Corruption{c}, NearShift: 256})
			m, err := in.Fetcher(fakeFetcher()).GetMeta(context.Background(), "h:1")
			if err != nil {
				t.Fatal(err)
			}
			switch c {
			case CorruptEngineID:
				if m.EngineID == meta.EngineID {
					t.Error("engine id unchanged")
				}
			case CorruptBaseFar:
				if m.BaseAddrs[0] != meta.BaseAddrs[0]+farShift {
					t.Errorf("base %#x", m.BaseAddrs[0])
				}
			case CorruptBaseNear:
				if m.BaseAddrs[1] != meta.BaseAddrs[1]+256 {
					t.Errorf("base %#x", m.BaseAddrs[1])
				}
			case CorruptNumBlocks:
				if m.NumBlocks != 32 {
					t.Errorf("num_blocks %d", m.NumBlocks)
				}
			}
			if meta.BaseAddrs[0] != 0x1000 {
				t.Fatal("Apply modified the source metadata")
			}
			if got := in.Counts().Corrupted[c]; got != 1 {
				t.Errorf("corrupted count %d", got)
			}
		})
	}
	in := mustNew(t, Schedule{Meta: Rates{Fail: 1}})
	if _, err := in.Fetcher(fakeFetcher()).GetMeta(context.Background(), "h:1"); !errors.Is(err, ErrInjected) {
		t.Errorf("fail: %v", err)
	}
}

func TestDisabledAndCounts(t *testing.T) {
	in := mustNew(t, Schedule{Read: Rates{Fail: 1}, Done: Rates{Drop: 1}})
	in.SetEnabled(false)
	ft := &fakes.Transfer{}
	if err := in.Transfer(ft).BatchRead(context.Background(), "h:1", &read.Batch{List: ops(1)}); err != nil {
		t.Fatalf("disabled injector failed a read: %v", err)
	}
	if c := in.Counts(); c.Total() != 0 || c.Calls[Read] != 0 {
		t.Errorf("disabled injector counted: %+v", c)
	}
	in.SetEnabled(true)
	in.Transfer(ft).BatchRead(context.Background(), "h:1", &read.Batch{List: ops(1)})
	in.Sender(&fakes.Sender{}).SendDone(context.Background(), "h:1", "r")
	sum := in.Counts().Add(in.Counts())
	if sum.Of(Read, Fail) != 2 || sum.Of(SendDone, Drop) != 2 || sum.Total() != 4 {
		t.Errorf("sum %+v", sum)
	}
	s := sum.String()
	for _, w := range []string{"read: 2 calls, fail 2", "send_done: 2 calls, drop 2", "get_meta: 0 calls"} {
		if !strings.Contains(s, w) {
			t.Errorf("String() = %q lacks %q", s, w)
		}
	}
}
