package node

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
)

// TestDoneNegotiation: through the real fetcher, client and notify stage,
// a side channel whose metadata advertises batch_done gets done_batch_msg
// and one that does not (a seed peer, an old kvflow one) plain
// done_recving_msg, each DONE delivered once.
func TestDoneNegotiation(t *testing.T) {
	reg := prometheus.NewRegistry()
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Close()
	c, err := sidechannel.NewClient(zctx, sidechannel.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	st, err := notify.New(notify.Config{}, notify.Deps{Sender: c})
	if err != nil {
		t.Fatal(err)
	}
	for _, advertise := range []bool{false, true} {
		var mu sync.Mutex
		var dones []string
		md := sidechannel.Metadata{EngineID: "P", TERPCPort: 1, KVCachesBaseAddr: []uint64{1}, NumBlocks: 1, Ext: sidechannel.Ext{BatchDone: advertise}}
		s, err := sidechannel.NewServer(zctx, sidechannel.ServerOptions{Addr: "127.0.0.1:0"}, sidechannel.HandlerFuncs{
			MetadataFunc: func() sidechannel.Metadata { return md },
			DoneFunc: func(id string) error {
				mu.Lock()
				dones = append(dones, id)
				mu.Unlock()
				return nil
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		host, portStr, _ := net.SplitHostPort(s.Addr())
		port, _ := strconv.Atoi(portStr)
		meta, err := fetcher{c: c}.GetMeta(context.Background(), s.Addr())
		if err != nil || meta.BatchDone != advertise {
			t.Fatalf("advertise=%v: meta %+v %v", advertise, meta, err)
		}
		const n = 20
		var wg sync.WaitGroup
		for i := range n {
			j := job.New(plan.Request{ID: fmt.Sprint("r", i)}, time.Now())
			j.Plan.RemoteHost = host
			j.Plan.Tasks = []plan.Task{{HandshakePort: port}}
			j.Metas = []job.Meta{meta}
			wg.Go(func() { _ = st.Process(context.Background(), j) })
		}
		wg.Wait()
		s.Close()
		mu.Lock()
		slices.Sort(dones)
		if len(dones) != n || len(slices.Compact(dones)) != n {
			t.Errorf("advertise=%v: %d DONEs delivered, want %d distinct", advertise, len(dones), n)
		}
		mu.Unlock()
		plain := counter(t, reg, "kvflow_sidechannel_requests_total", map[string]string{"role": "server", "op": "done", "outcome": "ok"})
		batched := counter(t, reg, "kvflow_sidechannel_requests_total", map[string]string{"role": "server", "op": "done_batch", "outcome": "ok"})
		if advertise && (plain != n || batched == 0 || batched > n) || !advertise && (plain != n || batched != 0) {
			t.Errorf("advertise=%v: server saw %v plain and %v batched messages (cumulative)", advertise, plain, batched)
		}
	}
	c.Close()
}
