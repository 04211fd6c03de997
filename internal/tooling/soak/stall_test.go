package soak

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/faults"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

// A prefill instance that does not answer (dead, or a black hole) stalls
// the decode's handshake stage: each of its requests holds a handshake
// worker until GET_META times out, and the requests behind them — to a
// live instance whose metadata is cached — wait there past the prefill's
// abort timeout (the kill rounds of TestSoak, seed 1796308279556702693).
// With leases those requests are leased from their admission, so the
// prefill holds their blocks however long they wait and they end done with
// every byte right. Without, the prefill force-frees their blocks while
// they wait, and the decode, which knows the abort timeout
// (decode.Options.PeerAbortTimeout), refuses to read them rather than
// read whatever those blocks hold by then.
func TestStalledHandshake(t *testing.T) {
	const abort = 300 * time.Millisecond
	for _, tc := range []struct {
		name string
		ttl  time.Duration
	}{
		{"leases", 600 * time.Millisecond},
		{"no leases: stale reads refused", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := Measure()
			c := startCluster(t, Options{PrefillTP: 1, DecodeTP: 1, Prefills: 1, Blocks: 32, AbortTimeout: abort, LeaseTTL: tc.ttl})
			if err := c.Reset(func(int) faults.Schedule { return faults.Schedule{} }); err != nil {
				t.Fatal(err)
			}
			pre, dr := c.Prefill[0], c.Decode[0]
			pn := pre.Ranks[0]
			lay := pn.Device.Layout()
			var rows []int
			for p := range lay.NumParts() {
				rows = append(rows, lay.BlockLen(p)/pn.Shape.BlockSize)
			}
			ghost := testkit.ClosedPort(t)
			load := func(id string, port int, engine string, local, remote []int) plan.Request {
				t.Helper()
				req := plan.Request{ID: id, LocalBlockIDs: local, RemoteBlockIDs: remote, RemoteHost: "127.0.0.1",
					RemotePort: port, RemoteEngineID: engine, RemotePCPSize: 1, RemoteDCPSize: 1}
				if err := dr.Worker.Load(context.Background(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: local,
					Params: decode.KVTransferParams{RemoteBlockIDs: remote, RemoteEngineID: engine, RemoteHost: "127.0.0.1",
						RemotePort: port, RemotePCPSize: 1, RemoteDCPSize: 1}}})[0]; err != nil {
					t.Fatal(err)
				}
				return req
			}
			live := func(id string, local, remote []int) plan.Request {
				t.Helper()
				verify.FillBlocks(pn.Device, c.Opts.Layers, lay.NumParts(), 0, remote, plan.StringToInt64Hash(id))
				if err := pn.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: remote}})[0]; err != nil {
					t.Fatal(err)
				}
				return load(id, pre.Port, pre.Name, local, remote)
			}
			ended := map[string]*decode.Failure{}
			endedAt, freedAt := map[string]time.Time{}, map[string]time.Time{}
			poll := func() {
				done, failed := dr.Worker.Finished()
				for _, id := range done {
					ended[id], endedAt[id] = nil, time.Now()
				}
				for _, f := range failed {
					ended[f.RequestID], endedAt[f.RequestID] = &f, time.Now()
				}
				for _, id := range pn.Prefill.Finished() {
					freedAt[id] = time.Now()
				}
			}
			wait := func(ids ...string) {
				t.Helper()
				deadline := time.Now().Add(20 * time.Second)
				for {
					poll()
					n := 0
					for _, id := range ids {
						if _, ok := ended[id]; ok {
							n++
						}
					}
					if n == len(ids) {
						return
					}
					if time.Now().After(deadline) {
						t.Fatalf("%d of %v ended", n, ids)
					}
					time.Sleep(2 * time.Millisecond)
				}
			}

			// The live instance's metadata gets cached by a first request.
			live("warm", []int{0}, []int{0})
			wait("warm")
			if f := ended["warm"]; f != nil {
				t.Fatalf("warm-up failed: %s", f.Reason)
			}
			// Eight requests to the silent instance: before handshake
			// failures were shared with the requests waiting on them, two
			// rounds of GET_META timeouts on the four handshake workers
			// (about 1 s each); now one, which the requests share.
			var all []string
			for k := range 8 {
				id := fmt.Sprintf("ghost-%d", k)
				load(id, ghost, "ghost", []int{20 + k}, []int{k})
				all = append(all, id)
			}
			// Behind them, requests to the live instance.
			reqs := map[string]plan.Request{}
			for k := range 4 {
				id := fmt.Sprintf("live-%d", k)
				reqs[id] = live(id, []int{2 + 2*k, 3 + 2*k}, []int{2 + 2*k, 3 + 2*k})
				all = append(all, id)
			}
			admitted := time.Now()
			wait(all...)
			for k := range 8 {
				if f := ended[fmt.Sprintf("ghost-%d", k)]; f == nil {
					t.Fatalf("ghost-%d ended done", k)
				}
			}
			// The prefill frees the live ones (DONE, or force-free).
			for time.Since(admitted) < 10*time.Second && len(freedAt) < 5 {
				poll()
				time.Sleep(2 * time.Millisecond)
			}
			for id, req := range reqs {
				f, took := ended[id], endedAt[id].Sub(admitted)
				if took < 2*abort {
					t.Fatalf("%s ended %v after admission: the handshake stage did not stall past the abort timeout %v", id, took, abort)
				}
				if tc.ttl > 0 {
					if f != nil {
						t.Errorf("%s failed under a lease: %s", id, f.Reason)
						continue
					}
					if freedAt[id].Before(endedAt[id].Add(-50 * time.Millisecond)) {
						t.Errorf("%s freed by the prefill %v before the decode ended it, under a lease", id, endedAt[id].Sub(freedAt[id]))
					}
					pl, err := plan.PlanRequest(dr.Node.Config.Topology(), dr.Node.Config.Self(), req)
					if err != nil {
						t.Fatal(err)
					}
					if bad, err := verify.Check(dr.Node.Device, pl, rows, plan.StringToInt64Hash(id)); bad != 0 || err != nil {
						t.Errorf("%s: %d bad bytes: %v", id, bad, err)
					}
					continue
				}
				if f == nil || !strings.Contains(f.Reason, "past the prefill's abort timeout") {
					t.Errorf("%s without a lease, waited %v: %+v, want it refused as a stale read", id, took, f)
				}
				if freed, ok := freedAt[id]; !ok || freed.After(endedAt[id]) {
					t.Errorf("%s: the prefill did not force-free it before the decode ended it (the control shows nothing)", id)
				}
			}
			t.Logf("live requests ended %v..%v after admission (abort timeout %v, lease ttl %v)",
				endedAt["live-0"].Sub(admitted).Round(time.Millisecond), endedAt["live-3"].Sub(admitted).Round(time.Millisecond), abort, tc.ttl)
			checkLeaks(t, before, c)
		})
	}
}
