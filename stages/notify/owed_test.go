package notify

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/tooling/testkit/fakes"
	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

// Which requests owe DONEs at shutdown, and that Close sends them, one per
// task, once.
func TestOwedAtShutdown(t *testing.T) {
	mk := func(id string, ports ...int) *job.Job {
		j := job.New(plan.Request{ID: id}, time.Now())
		if ports != nil {
			j.Plan = plan.Plan{RequestID: id, RemoteHost: "127.0.0.1"}
			for _, p := range ports {
				j.Plan.Tasks = append(j.Plan.Tasks, plan.Task{HandshakePort: p})
			}
		}
		return j
	}
	snd := &fakes.Sender{}
	reg := prometheus.NewRegistry()
	st, err := New(Config{}, Deps{Sender: snd, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []pipeline.Result[*job.Job]{
		{Item: mk("canceled-in-read", 7000, 7001), Outcome: pipeline.Canceled, Stage: "read"},
		{Item: mk("canceled-in-notify", 7000), Outcome: pipeline.Canceled, Stage: "notify"}, // may have sent some
		{Item: mk("failed", 7000), Outcome: pipeline.Failed, Stage: "read"},                 // notify sent them
		{Item: mk("done", 7000), Outcome: pipeline.Done},
		{Item: mk("never-planned"), Outcome: pipeline.Canceled, Stage: "plan"}, // no endpoint
	} {
		st.End(r)
	}
	st.Close(context.Background())
	st.Close(context.Background()) // owed once
	var sent []string
	for _, d := range snd.Dones() {
		sent = append(sent, d.Endpoint+" "+d.ID)
	}
	slices.Sort(sent)
	want := []string{"127.0.0.1:7000 canceled-in-read", "127.0.0.1:7001 canceled-in-read"}
	if !slices.Equal(sent, want) {
		t.Fatalf("sent %q, want %q", sent, want)
	}
	if n := testutil.ToFloat64(st.m.shutdownDones.WithLabelValues("acked")); n != 2 {
		t.Fatalf("%v shutdown DONEs acked, want 2", n)
	}
}
