package planstage

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

func topo() plan.Topology {
	return plan.Topology{
		Prefill: plan.Parallel{TP: 1, PP: 1, DP: 1},
		Decode:  plan.Parallel{TP: 1, PP: 1, DP: 1, KVPort: 6000},
		Model:   plan.Model{NumLayers: 1, NumKVHeads: 1, MLA: true},
	}
}

func request(id string) *job.Job {
	return job.New(plan.Request{ID: id, LocalBlockIDs: []int{1}, RemoteBlockIDs: []int{2}, RemoteHost: "127.0.0.1",
		RemotePort: 5000, RemoteEngineID: "P", RemotePCPSize: 1, RemoteDCPSize: 1}, time.Now())
}

type renewFunc func(ctx context.Context, endpoint string, ids []string) error

func (f renewFunc) Renew(ctx context.Context, endpoint string, ids []string) error {
	return f(ctx, endpoint, ids)
}

// Where a request is planned, and what the stage does at its end.
func TestStageAdmissionAndEnd(t *testing.T) {
	meta := job.Meta{EngineID: "P", TERPCPort: 1, BaseAddrs: []uint64{1}, NumBlocks: 8, LeaseTTL: time.Minute}
	for _, tc := range []struct {
		name   string
		leases bool
	}{{"no leases: planned by Process", false}, {"leases: planned and leased at admission", true}} {
		t.Run(tc.name, func(t *testing.T) {
			cache, err := handshake.NewCache(handshake.FetcherFunc(func(context.Context, string) (job.Meta, error) { return meta, nil }), handshake.Options{})
			if err != nil {
				t.Fatal(err)
			}
			d := Deps{Topology: topo(), Peers: cache, Registerer: prometheus.NewRegistry()}
			if tc.leases {
				d.Renewer = renewFunc(func(context.Context, string, []string) error { return nil })
			}
			s, err := New(Config{}, d)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close(context.Background())
			if (s.Leases() != nil) != tc.leases {
				t.Fatalf("keeper %v, want %v", s.Leases() != nil, tc.leases)
			}
			j := request("r")
			s.Admit(j)
			if planned := j.Plan.Tasks != nil; planned != tc.leases {
				t.Fatalf("planned at admission %v, want %v", planned, tc.leases)
			}
			if err := s.Process(context.Background(), j); err != nil || len(j.Plan.Tasks) != 1 || len(j.Metas) != 1 {
				t.Fatalf("Process: %v, %d tasks, %d metas", err, len(j.Plan.Tasks), len(j.Metas))
			}
			if tc.leases {
				// Admission started the fetch of the uncached rank; once it
				// lands the request is leased there.
				for deadline := time.Now().Add(5 * time.Second); s.Leases().Len() != 1; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("not leased after the admission's fetch")
					}
				}
			}
			s.End(pipeline.Result[*job.Job]{Item: j, Outcome: pipeline.Done})
			if tc.leases {
				if leased, pending, waiting := s.Leases().Tracked(); leased+pending+waiting != 0 {
					t.Fatalf("after End: %d leased, %d pending, %d waiting", leased, pending, waiting)
				}
			}
			// Canceled before it was planned: planned at its end, so that
			// notify can send the DONEs it owes; canceled in notify: left.
			for _, at := range []string{"handshake", "notify"} {
				c := request("c-" + at)
				s.End(pipeline.Result[*job.Job]{Item: c, Outcome: pipeline.Canceled, Err: pipeline.ErrCanceled, Stage: at})
				if planned := c.Plan.Tasks != nil; planned != (at != "notify") {
					t.Fatalf("canceled in %s: planned %v", at, planned)
				}
			}
		})
	}
}
