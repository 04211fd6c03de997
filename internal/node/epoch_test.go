package node

import (
	"context"
	"strings"
	"testing"

	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/verify"
	"github.com/kvflow/kvflow/stages/plan"
)

// loadEpochs loads request id on d with kv_transfer_params that carry
// kvflow_boot_epochs, as a kvflow prefill's scheduler hands them over.
func loadEpochs(t *testing.T, c *cluster, id string, local, remote []int, epochs ...uint64) decode.Result {
	t.Helper()
	e := make([]int64, len(epochs))
	for i, v := range epochs {
		e[i] = int64(v)
	}
	err := c.decode[0].Decode.Load(context.Background(), []decode.LoadRequest{{RequestID: id, LocalBlockIDs: local,
		Params: decode.KVTransferParams{RemoteBlockIDs: remote, RemoteEngineID: "P", RemoteHost: "127.0.0.1", RemotePort: c.kvPort, BootEpochs: e}}})[0]
	if err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 30e9)
	if r.RequestID != id {
		t.Fatalf("result of %s, want %s", r.RequestID, id)
	}
	return r
}

// hold fills blocks with request id's pattern on p and sends it (the
// engine's prefill finished; its blocks wait for decode).
func hold(t *testing.T, p *Node, id string, blocks []int) {
	t.Helper()
	verify.FillBlocks(p.Device, p.Shape.NumLayers, p.Device.Layout().NumParts(), plan.DeviceIndex(p.Config.Topology().Prefill, p.Config.Self()),
		blocks, plan.StringToInt64Hash(id))
	if err := p.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: blocks}})[0]; err != nil {
		t.Fatal(err)
	}
}

// TestRequestFromOldBootEpoch: a prefill worker hands a request over
// (kv_transfer_params with its boot epoch), restarts on the same ports,
// and its new process prefills another request into the same blocks
// (memory reused: with read grants on, those blocks are readable again).
// A decode given the old request's params must fail it naming the
// restart, read nothing, and send the new process no DONE (it never held
// the request); a request the new process hands over is read, byte for
// byte. Both for a fresh decode (it never saw the old process: only the
// params' epoch can tell) and for one that cached the old process's
// metadata (the re-fetch after the failed read shows the new epoch).
func TestRequestFromOldBootEpoch(t *testing.T) {
	for _, warmDecode := range []bool{false, true} {
		t.Run(map[bool]string{false: "fresh decode", true: "decode cached old metadata"}[warmDecode], func(t *testing.T) {
			c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2), grants: true}, patientRefetch)
			p1 := c.prefill[0]
			e1 := p1.Prefill.BootEpoch()
			if warmDecode {
				hold(t, p1, "warm", []int{9})
				if r := loadEpochs(t, c, "warm", []int{9}, []int{9}, e1); r.Err != nil {
					t.Fatalf("warm-up request: %v", r.Err)
				}
			}
			hold(t, p1, "old", []int{3, 4})

			p2 := restartPrefill(t, c, 0)
			e2 := p2.Prefill.BootEpoch()
			if e2 == e1 || e1 == 0 {
				t.Fatalf("boot epochs %d then %d: want two different ones", e1, e2)
			}
			hold(t, p2, "reuse", []int{3, 4}) // the new process's own request, same blocks

			reg := c.regs[c.decode[0]]
			bytesBefore := counter(t, reg, "kvflow_read_bytes_total", nil)
			r := loadEpochs(t, c, "old", []int{1, 2}, []int{3, 4}, e1)
			if r.Err == nil {
				t.Fatal("a request of the old prefill process ended done")
			}
			t.Logf("failed: %v", r.Err)
			for _, want := range []string{"prefill 127.0.0.1:", "restarted (boot epoch ", "request from epoch ", "its blocks are gone"} {
				if !strings.Contains(r.Err.Error(), want) {
					t.Errorf("failure %q does not say %q", r.Err, want)
				}
			}
			if got := counter(t, reg, "kvflow_read_bytes_total", nil); got != bytesBefore {
				t.Errorf("%v bytes read for the old request, want none", got-bytesBefore)
			}
			if n := counter(t, reg, "kvflow_decode_failures_total", map[string]string{"reason": "peer_restarted"}); n != 1 {
				t.Errorf("%v failures with reason peer_restarted, want 1", n)
			}
			if n := counter(t, reg, "kvflow_notify_done_messages_total", map[string]string{"result": "skipped_restarted"}); n != 1 {
				t.Errorf("%v DONEs skipped, want 1", n)
			}
			if n := counter(t, c.regs[p2], "kvflow_prefill_done_messages_total", nil); n != 0 {
				t.Errorf("the new prefill process got %v DONEs for a request it never held", n)
			}
			if st := p2.Prefill.Status(); st["held"] != 1 || st["early_dones"] != 0 {
				t.Errorf("new process: held %v (want 1: reuse), early DONEs %v (want 0)", st["held"], st["early_dones"])
			}

			// A request the new process hands over is read as usual.
			hold(t, p2, "new", []int{5, 6, 7})
			if r := loadEpochs(t, c, "new", []int{5, 6, 7}, []int{5, 6, 7}, e2); r.Err != nil {
				t.Fatalf("request after the restart: %v", r.Err)
			}
			checkBytes(t, c, "new", []int{5, 6, 7}, []int{5, 6, 7})
		})
	}
}
