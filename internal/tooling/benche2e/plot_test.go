package benche2e

import (
	"encoding/xml"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func testResult() *Result {
	w, _ := Preset(Mixed)
	w.Layers = 4
	b, _ := Preset(Burst)
	b.PrefillTP, b.DecodeTP, b.Layers = 4, 2, 4
	stages := func(scale float64) []StageLatency {
		return []StageLatency{{Stage: "plan", Count: 10, P50: 30e-6 * scale, P99: 50e-6 * scale},
			{Stage: "read", Count: 10, P50: 2e-3 * scale, P99: 9e-3 * scale}, {Stage: "notify", Count: 10, P50: 1e-3 * scale, P99: 3e-3 * scale}}
	}
	run := func(mode string, gbps, rps, scale float64) RunReport {
		return RunReport{Mode: mode, Requests: 10, Wall: time.Second, GBps: gbps, ReqPerSec: rps, Stages: stages(scale)}
	}
	return &Result{GoVersion: "go1.x", CPUs: 2, Reports: []*Report{
		{Workload: w, RawTCP1: 2.1, Runs: []RunReport{run(ModePipeline, 1.5, 300, 1), run(ModeSerial, 1.1, 90, 0.5)}},
		{Workload: b, RawTCP1: 2.0, Runs: []RunReport{run(ModePipeline, 1.2, 200, 1), run(ModeSerial, 1.0, 70, 0.3)}},
	}}
}

// The plot is well-formed SVG that names what it draws.
func TestPlotSVG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "e2e.svg")
	if err := WritePlot(path, testResult()); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := xml.NewDecoder(f)
	var text strings.Builder
	root := ""
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("not XML: %v", err)
		}
		switch v := tok.(type) {
		case xml.StartElement:
			if root == "" {
				root = v.Name.Local
			}
		case xml.CharData:
			text.Write(v)
		}
	}
	if root != "svg" {
		t.Errorf("root element %q, want svg", root)
	}
	for _, want := range []string{"throughput", "GB/s", "req/s", "raw TCP", "mixed tp1-1", "burst tp4-2", "per-stage latency", "read", "notify", "kvflow p99", "serial p50"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("no %q in the SVG's text", want)
		}
	}
}

func TestPlotNothing(t *testing.T) {
	if err := Plot(io.Discard, &Result{}); err == nil {
		t.Error("empty result plotted")
	}
}
