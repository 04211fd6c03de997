package notify

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

type call struct {
	endpoint, reqID string
	batched         bool
}

// plainSender has only SendDone.
type plainSender struct {
	mu    sync.Mutex
	calls []call
	fail  map[string]bool // endpoint → error
}

func (s *plainSender) record(c call) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = append(s.calls, c)
	if s.fail[c.endpoint] {
		return errors.New("no ACK")
	}
	return nil
}

func (s *plainSender) SendDone(_ context.Context, ep, id string) error {
	return s.record(call{ep, id, false})
}

func (s *plainSender) sorted() []call {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := slices.Clone(s.calls)
	slices.SortFunc(out, func(a, b call) int {
		if a.endpoint < b.endpoint {
			return -1
		}
		if a.endpoint > b.endpoint {
			return 1
		}
		return 0
	})
	return out
}

// batchSender also batches.
type batchSender struct{ plainSender }

func (s *batchSender) SendDoneBatched(_ context.Context, ep, id string) error {
	return s.record(call{ep, id, true})
}

func testJob(ports []int, batch []bool) *job.Job {
	j := job.New(plan.Request{ID: "r1"}, time.Now())
	j.Plan.RemoteHost = "10.0.0.1"
	for _, p := range ports {
		j.Plan.Tasks = append(j.Plan.Tasks, plan.Task{HandshakePort: p})
	}
	for _, b := range batch {
		j.Metas = append(j.Metas, job.Meta{BatchDone: b})
	}
	return j
}

// TestNegotiation: batched DONEs only to ranks whose metadata advertised
// them, and only with a BatchSender; plain DONEs otherwise.
func TestNegotiation(t *testing.T) {
	cases := []struct {
		name    string
		batcher bool
		batch   []bool // Metas (shorter than the tasks: handshake failed)
		want    []bool // per task (ports 1, 2, 3)
	}{
		{"all advertise", true, []bool{true, true, true}, []bool{true, true, true}},
		{"mixed", true, []bool{true, false, true}, []bool{true, false, true}},
		{"seed peers", true, []bool{false, false, false}, []bool{false, false, false}},
		{"no metas", true, nil, []bool{false, false, false}},
		{"short metas", true, []bool{true}, []bool{true, false, false}},
		{"plain sender", false, []bool{true, true, true}, []bool{false, false, false}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var s Sender
			var rec *plainSender
			if tc.batcher {
				b := &batchSender{}
				s, rec = b, &b.plainSender
			} else {
				rec = &plainSender{}
				s = rec
			}
			reg := prometheus.NewRegistry()
			st, err := New(Config{}, Deps{Sender: s, Registerer: reg})
			if err != nil {
				t.Fatal(err)
			}
			j := testJob([]int{1, 2, 3}, tc.batch)
			if err := st.Process(context.Background(), j); err != nil {
				t.Fatal(err)
			}
			got := rec.sorted()
			if len(got) != 3 {
				t.Fatalf("%d DONEs, want 3", len(got))
			}
			nb := 0
			for i, c := range got {
				if c.endpoint != "10.0.0.1:"+string(rune('1'+i)) || c.reqID != "r1" || c.batched != tc.want[i] {
					t.Errorf("task %d: %+v, want batched=%v", i, c, tc.want[i])
				}
				if c.batched {
					nb++
				}
			}
			if v := testutil.ToFloat64(st.m.batched); v != float64(nb) {
				t.Errorf("batched counter %v, want %d", v, nb)
			}
			if v := testutil.ToFloat64(st.m.sent); v != 3 {
				t.Errorf("acked %v, want 3", v)
			}
		})
	}
}

// TestUndelivered: a batched DONE that fails is counted like a plain one,
// and after a failed job too.
func TestUndelivered(t *testing.T) {
	s := &batchSender{plainSender{fail: map[string]bool{"10.0.0.1:2": true}}}
	st, err := New(Config{}, Deps{Sender: s})
	if err != nil {
		t.Fatal(err)
	}
	j := testJob([]int{1, 2}, []bool{true, true})
	if err := st.ProcessFailed(context.Background(), j, errors.New("read failed")); err != nil {
		t.Fatal(err)
	}
	if j.DoneUndelivered.Load() != 1 || testutil.ToFloat64(st.m.undelivered) != 1 || testutil.ToFloat64(st.m.sent) != 1 {
		t.Fatalf("undelivered %d / %v, acked %v", j.DoneUndelivered.Load(), testutil.ToFloat64(st.m.undelivered), testutil.ToFloat64(st.m.sent))
	}
	// A job that failed before planning notifies nobody.
	if err := st.ProcessFailed(context.Background(), job.New(plan.Request{ID: "x"}, time.Now()), errors.New("bad")); err != nil {
		t.Fatal(err)
	}
	if n := len(s.sorted()); n != 2 {
		t.Fatalf("%d DONEs, want 2", n)
	}
}
