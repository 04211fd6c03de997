package node

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

// TestReadBeforeSend: with read grants (the default for sends that carry
// block ids) a decode may reach the prefill before the prefill's engine
// has sent the request (the send comes a scheduler step after the router
// handed the request on). The refused read is tried again until the grant
// arrives, and the request ends done byte for byte instead of failing.
// The send may also reach the prefill while a batch is in flight: some
// reads land, the rest are refused, and the batch is read again too.
//
// With node.te_backend shm the decode reads the mapped cache file and the
// grant table refuses the same way (its request slot is granted before
// the blocks' words, so a read there may also copy some ops and then be
// refused).
func TestReadBeforeSend(t *testing.T) {
	for _, shm := range []bool{false, true} {
		t.Run(fmt.Sprintf("shm=%v", shm), func(t *testing.T) { readBeforeSend(t, shm) })
	}
}

func readBeforeSend(t *testing.T, shm bool) {
	c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2), grants: true, shm: shm})
	if r := pull(t, c, c.prefill[0], "warm", []int{1}, []int{1}, true); r.Err != nil {
		t.Fatal(r.Err)
	}
	p, d := c.prefill[0], c.decode[0]
	local, remote := []int{4, 5}, []int{6, 7}
	verify.FillBlocks(p.Device, p.Shape.NumLayers, p.Device.Layout().NumParts(), plan.DeviceIndex(p.Config.Topology().Prefill, p.Config.Self()),
		remote, plan.StringToInt64Hash("late"))
	if err := load(t, d, "late", local, remote, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	// The send goes out only once the decode has been refused at least
	// once (no sleep decides the order).
	for deadline := time.Now().Add(10 * time.Second); counter(t, c.regs[d], "kvflow_read_grant_waits_total", nil) < 1; time.Sleep(time.Millisecond) {
		select {
		case r := <-c.results:
			t.Fatalf("request ended before its send reached the prefill: %+v", r)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the decode's read was never refused and tried again")
		}
	}
	if err := p.Prefill.Send([]prefill.SendRequest{{RequestID: "late", BlockIDs: remote}})[0]; err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 30*time.Second)
	if r.RequestID != "late" || r.Err != nil {
		t.Fatalf("result %+v, want late done", r)
	}
	checkBytes(t, c, "late", local, remote)
	if shm {
		if n := counter(t, c.regs[d], "kvflow_shm_batches_total", map[string]string{"path": "shm"}); n == 0 {
			t.Error("the request was not read over shared memory")
		}
	}
}
