package main

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/tooling/workers"
)

// TestOldBootEpochRefused runs `kvflow serve` processes: a prefill hands
// a request over (its boot epoch from status, as the connector's
// scheduler puts it in kv_transfer_params) and is killed; a new process
// starts on the same ports and cache file and prefills a request of its
// own into the same blocks. A decode that never met the old process,
// given the old request's params, fails it naming the restart, reads no
// byte and sends the new process no DONE; a request the new process hands
// over is read byte for byte.
func TestOldBootEpochRefused(t *testing.T) {
	c := newPDCluster(t, 1, []int{0}, nil)
	epoch := func(w *workers.Worker) uint64 {
		t.Helper()
		rep, err := w.Ctl.Call(map[string]any{"op": "status"})
		if err != nil {
			t.Fatal(err)
		}
		e, ok := rep.Status["boot_epoch"].(uint64)
		if !ok || e == 0 {
			t.Fatalf("status boot_epoch %v (%T)", rep.Status["boot_epoch"], rep.Status["boot_epoch"])
		}
		return e
	}
	load := func(q testReq, e uint64) {
		t.Helper()
		if _, err := c.decode.Ctl.Call(map[string]any{"op": "load", "requests": []map[string]any{{
			"request_id": q.id, "local_block_ids": q.local,
			"kv_transfer_params": map[string]any{"remote_block_ids": q.remote, "remote_engine_id": "prefill-0",
				"remote_host": "127.0.0.1", "remote_port": c.base, "remote_pcp_size": 1, "remote_dcp_size": 1,
				"kvflow_boot_epochs": []uint64{e}}}}}); err != nil {
			t.Fatalf("load %s: %v", q.id, err)
		}
	}
	wait := func(id string) string { // "" done, else the failure's reason
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			rep, err := c.decode.Ctl.Call(map[string]any{"op": "finished"})
			if err != nil {
				t.Fatalf("decode finished: %v", err)
			}
			for _, d := range rep.DoneRecving {
				if d == id {
					return ""
				}
			}
			for _, f := range rep.FailedRecving {
				if f.RequestID == id {
					return "failed: " + f.Reason
				}
			}
		}
		t.Fatalf("%s did not end within 30 s", id)
		return ""
	}
	metric := func(w *workers.Worker, name string) float64 {
		t.Helper()
		mfs, err := w.Scrape(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		sum := 0.0
		for _, mf := range mfs {
			if mf.GetName() == name {
				for _, m := range mf.GetMetric() {
					sum += m.GetCounter().GetValue()
				}
			}
		}
		return sum
	}

	p1 := c.prefill[0]
	e1 := epoch(p1)
	reqs := c.requests(2, 2) // old, then reuse on the same blocks; new on others
	old := reqs[0]
	old.id = "old"
	c.fill([]testReq{old})
	if _, err := c.send(p1, []testReq{old}); err != nil {
		t.Fatal(err)
	}
	syscall.Kill(p1.Pid(), syscall.SIGKILL)
	<-p1.Exited()
	p2, err := c.set.Launch(t.Context(), workers.Spec{Name: "prefill0-restarted", Config: p1.Config})
	if err != nil {
		t.Fatalf("restart the prefill on the same ports: %v", err)
	}
	c.prefill[0] = p2
	e2 := epoch(p2)
	if e2 == e1 {
		t.Fatalf("the restarted prefill kept boot epoch %d", e1)
	}
	reuse := testReq{id: "reuse", remote: old.remote, local: old.local}
	c.fill([]testReq{reuse})
	if _, err := c.send(p2, []testReq{reuse}); err != nil {
		t.Fatal(err)
	}

	load(old, e1)
	got := wait("old")
	t.Logf("old request: %s", got)
	for _, want := range []string{"failed: ", "restarted (boot epoch ", "request from epoch ", "its blocks are gone"} {
		if !strings.Contains(got, want) {
			t.Errorf("old request: %q, want it to say %q", got, want)
		}
	}
	if n := metric(c.decode, "kvflow_read_bytes_total"); n != 0 {
		t.Errorf("the decode read %v bytes for the old request", n)
	}
	if n := metric(p2, "kvflow_prefill_done_messages_total"); n != 0 {
		t.Errorf("the new prefill process got %v DONEs", n)
	}
	if rep, err := p2.Ctl.Call(map[string]any{"op": "status"}); err != nil || asInt(rep.Status["early_dones"]) != 0 || asInt(rep.Status["held"]) != 1 {
		t.Errorf("new process status %v (%v): want no early DONE, its own request held", rep.Status, err)
	}

	next := reqs[1]
	next.id = "new"
	c.fill([]testReq{next})
	if _, err := c.send(p2, []testReq{next}); err != nil {
		t.Fatal(err)
	}
	load(next, e2)
	if got := wait("new"); got != "" {
		t.Fatalf("request after the restart: %s", got)
	}
	if err := c.check(next); err != nil {
		t.Fatalf("request after the restart: %v", err)
	}
}
