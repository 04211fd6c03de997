package notify

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

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
			var rec *fakes.Sender
			if tc.batcher {
				b := &fakes.BatchSender{}
				s, rec = b, &b.Sender
			} else {
				rec = &fakes.Sender{}
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
			got := rec.ByEndpoint()
			if len(got) != 3 {
				t.Fatalf("%d DONEs, want 3", len(got))
			}
			nb := 0
			for i, c := range got {
				if c.Endpoint != "10.0.0.1:"+string(rune('1'+i)) || c.ID != "r1" || c.Batched != tc.want[i] {
					t.Errorf("task %d: %+v, want batched=%v", i, c, tc.want[i])
				}
				if c.Batched {
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
	s := &fakes.BatchSender{Sender: fakes.Sender{Fail: map[string]bool{"10.0.0.1:2": true}}}
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
	if n := len(s.Dones()); n != 2 {
		t.Fatalf("%d DONEs, want 2", n)
	}
}

// TestNoDoneAfterRestart: a rank whose metadata shows another boot epoch
// than the request's params gets no DONE (the process that held the
// request is gone; the new one never held it), counted; the other ranks
// get theirs; ranks without an epoch on either side get theirs as before.
func TestNoDoneAfterRestart(t *testing.T) {
	rec := &fakes.Sender{}
	st, err := New(Config{}, Deps{Sender: rec})
	if err != nil {
		t.Fatal(err)
	}
	j := job.New(plan.Request{ID: "r1", BootEpochs: []uint64{5, 5, 0}}, time.Now())
	j.Plan.RemoteHost = "10.0.0.1"
	for r := range 3 {
		j.Plan.Tasks = append(j.Plan.Tasks, plan.Task{RemoteRank: r, HandshakePort: 1 + r})
	}
	j.Metas = []job.Meta{{BootEpoch: 5}, {BootEpoch: 6}, {BootEpoch: 7}}
	if err := st.ProcessFailed(context.Background(), j, job.ErrBootEpoch); err != nil {
		t.Fatal(err)
	}
	got := rec.ByEndpoint()
	if len(got) != 2 || got[0].Endpoint != "10.0.0.1:1" || got[1].Endpoint != "10.0.0.1:3" {
		t.Fatalf("DONEs %+v, want to ports 1 and 3 only", got)
	}
	if v := testutil.ToFloat64(st.m.skipped); v != 1 {
		t.Errorf("skipped %v, want 1", v)
	}
}
