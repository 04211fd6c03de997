package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/tooling/workers"
)

// The README's "Run a prefill and a decode worker" commands name every example config, and
// each example runs as written on one machine: `kvflow serve` on it gets
// ready (/readyz 200), and the prefill and decode examples together move a
// request (a decode rank reaches every prefill rank it needs). The configs
// are loaded and re-printed by workers.Launch, unchanged: no field is
// overridden. They bind fixed loopback ports (20001, 20101, 9100, 9101),
// as the README's commands do.
func TestExampleConfigsRunVerbatim(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var named []string
	for _, m := range regexp.MustCompile(`(?m)^bin/kvflow serve --config (deploy/examples/\S+\.json)`).FindAllSubmatch(readme, -1) {
		named = append(named, string(m[1]))
	}
	files, _ := filepath.Glob("../../deploy/examples/*.json")
	var examples []string
	for _, f := range files {
		examples = append(examples, filepath.ToSlash(filepath.Join("deploy/examples", filepath.Base(f))))
	}
	slices.Sort(named)
	named = slices.Compact(named)
	if len(examples) == 0 || !slices.Equal(named, examples) {
		t.Fatalf("README's serve commands name %q; deploy/examples holds %q", named, examples)
	}

	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	set, err := workers.NewSet(exe, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	byRole := map[config.Role]*workers.Worker{}
	for _, f := range examples {
		cfg, err := config.Load("../../" + f)
		if err != nil {
			t.Fatal(err)
		}
		w, err := set.Launch(ctx, workers.Spec{Name: filepath.Base(f), Config: cfg})
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if w.Metrics != cfg.Node.MetricsAddr {
			t.Errorf("%s: metrics on %s, want %s", f, w.Metrics, cfg.Node.MetricsAddr)
		}
		resp, err := http.Get("http://" + w.Metrics + "/readyz")
		if err != nil {
			t.Fatalf("%s: /readyz: %v", f, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: /readyz %s %q", f, resp.Status, body)
		}
		byRole[cfg.Role()] = w
	}
	p, d := byRole[config.Prefill], byRole[config.Decode]
	if p == nil || d == nil {
		t.Fatalf("the examples want one prefill and one decode config")
	}
	const id = "example-req-1"
	blocks := []int{0, 1, 2}
	r, err := p.Ctl.Call(map[string]any{"op": "send", "requests": []map[string]any{
		{"request_id": id, "delay_start_time": float64(time.Now().UnixNano()) / 1e9}}})
	if err != nil || !r.OK || len(r.Errors) != 1 || r.Errors[0] != nil {
		t.Fatalf("send: %+v %v", r, err)
	}
	r, err = d.Ctl.Call(map[string]any{"op": "load", "requests": []map[string]any{{
		"request_id": id, "local_block_ids": blocks,
		"kv_transfer_params": map[string]any{"remote_block_ids": blocks, "remote_engine_id": p.Config.KVTransfer.EngineID,
			"remote_host": p.Config.Node.SideChannelHost, "remote_port": int(p.Config.KVTransfer.KVPort)}}}})
	if err != nil || !r.OK || len(r.Errors) != 1 || r.Errors[0] != nil {
		t.Fatalf("load: %+v %v", r, err)
	}
	for recv, sent := false, false; !recv || !sent; time.Sleep(20 * time.Millisecond) {
		if ctx.Err() != nil {
			t.Fatalf("request not done on both sides (decode done %v, prefill freed %v); decode log:\n%s", recv, sent, workers.Tail(d.LogPath))
		}
		r, err := d.Ctl.Call(map[string]any{"op": "finished"})
		if err != nil {
			t.Fatal(err)
		}
		if len(r.FailedRecving) > 0 {
			t.Fatalf("decode failed the request: %+v", r.FailedRecving)
		}
		recv = recv || slices.Contains(r.DoneRecving, id)
		if r, err = p.Ctl.Call(map[string]any{"op": "finished"}); err != nil {
			t.Fatal(err)
		}
		sent = sent || slices.Contains(r.DoneSending, id)
	}

	// The README's next step: deploy/examples/one_request.py moves a
	// request through the same workers with the Python client and compares
	// its bytes.
	const py = "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import zmq, msgpack, numpy").Run(); err != nil {
		t.Logf("skipping deploy/examples/one_request.py: %s lacks zmq, msgpack or numpy (%v)", py, err)
		return
	}
	cmd := exec.CommandContext(ctx, py, "../../deploy/examples/one_request.py")
	cmd.Env = append(os.Environ(), "PREFILL_CTL="+p.Config.ControlEndpoint(), "DECODE_CTL="+d.Config.ControlEndpoint(),
		"PREFILL_CACHE="+p.Config.CachePath(), "DECODE_CACHE="+d.Config.CachePath(),
		fmt.Sprintf("REMOTE_PORT=%d", int(p.Config.KVTransfer.KVPort)))
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "0 of 64 (layer, part) blocks differ") {
		t.Fatalf("one_request.py: %v\n%s", err, out)
	}
}
