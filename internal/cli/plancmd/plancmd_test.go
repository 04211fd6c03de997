package plancmd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvflow/kvflow/internal/cli/clierr"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/")

// small is a flags-only decode configuration: 4 layers, 4 KV heads of 16,
// bf16, 4-token blocks, 64 blocks.
var small = []string{"--role", "decode", "--engine-id", "d", "--prefill-dp", "1", "--decode-dp", "1",
	"--layers", "4", "--kv-heads", "4", "--head-dim", "16", "--block-size", "4", "--dtype", "bf16", "--num-blocks", "64"}

func with(base []string, more ...string) []string {
	return append(append([]string{}, base...), more...)
}

var req = []string{"--request-id", "req-7", "--local-blocks", "0-5", "--remote-blocks", "10-15", "--remote-port", "30000"}

func TestRunGolden(t *testing.T) {
	decode := []string{"--config", "testdata/decode-gqa.json"}
	prefill := []string{"--config", "testdata/prefill-gqa.json"}
	tests := []struct {
		name string
		args []string
	}{
		{"gqa-tp4-tp2", with(decode, "--request-id", "req-1", "--local-blocks", "0,1,2", "--remote-blocks", "5,6,7", "--remote-port", "20001")},
		{"gqa-tp4-tp2-json", with(decode, "--request-id", "req-1", "--local-blocks", "0,1,2", "--remote-blocks", "5,6,7", "--remote-port", "20001", "--json")},
		{"prefill-config-defaults", with(prefill, "--request-id", "req-1", "--local-blocks", "0-3")},
		{"decode-rank", with(prefill, "--request-id", "req-1", "--local-blocks", "0-3", "--decode-rank", "1")},
		{"flags-override-file", with(decode, "--request-id", "req-1", "--local-blocks", "0", "--remote-port", "20001", "--prefill-tp", "8", "--decode-tp", "1")},
		{"prefix-hit", with(small, "--prefill-tp", "2", "--decode-tp", "1", "--request-id", "req-7", "--local-blocks", "3,4", "--remote-blocks", "10-13", "--remote-port", "30000")},
		{"full-prefix-hit", with(small, "--prefill-tp", "2", "--decode-tp", "2", "--request-id", "req-7", "--local-blocks", "", "--remote-blocks", "10-13", "--remote-port", "30000")},
		{"prefill-pp2", with(small, append([]string{"--prefill-pp", "2", "--prefill-tp", "2", "--decode-tp", "2"}, req...)...)},
		{"pp-layer-partition", with(small, append([]string{"--prefill-pp", "2", "--prefill-tp", "1", "--decode-tp", "1", "--pp-layer-partition", "3,1"}, req...)...)},
		{"mla", with(small, append([]string{"--mla", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64", "--prefill-tp", "4", "--decode-tp", "2"}, req...)...)},
		{"sparse", with(small, append([]string{"--mla", "--sparse", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64", "--indexer-dim", "128", "--prefill-tp", "2", "--decode-tp", "1"}, req...)...)},
		{"split-pcp", with(small, append([]string{"--prefill-pcp", "2", "--prefill-tp", "2", "--decode-tp", "2"}, req...)...)},
		{"split-dcp-json", with(small, append([]string{"--prefill-dcp", "2", "--prefill-tp", "2", "--decode-tp", "2", "--json"}, req...)...)},
		{"kvflow-tp1-tp2", with(small, append([]string{"--prefill-tp", "1", "--decode-tp", "2"}, req...)...)},
		{"kvflow-tp2-tp4", with(small, append([]string{"--prefill-tp", "2", "--decode-tp", "4"}, req...)...)},
		{"kvflow-tp2-tp8-replicated", with(small, append([]string{"--prefill-tp", "2", "--decode-tp", "8"}, req...)...)},
		{"kvflow-mla-tp1-tp4", with(small, append([]string{"--mla", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64", "--prefill-tp", "1", "--decode-tp", "4"}, req...)...)},
		{"kvflow-decode-pp2", with(small, append([]string{"--prefill-tp", "1", "--decode-tp", "1", "--decode-pp", "2"}, req...)...)},
		{"kvflow-decode-pp2-prefill-pp2-json", with(small, append([]string{"--prefill-tp", "2", "--decode-tp", "1", "--prefill-pp", "2", "--pp-layer-partition", "3,1", "--decode-pp", "2", "--json"}, req...)...)},
		{"point-to-point", with(small, append([]string{"--prefill-pcp", "2", "--decode-pcp", "2", "--prefill-tp", "2", "--decode-tp", "2"}, req...)...)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if err := Run(context.Background(), tt.args, &stdout, &stderr); err != nil {
				t.Fatalf("Run: %v\nstderr: %s", err, stderr.String())
			}
			if strings.HasSuffix(tt.name, "json") && !json.Valid(stdout.Bytes()) {
				t.Fatalf("--json output is not JSON:\n%s", stdout.String())
			}
			golden(t, tt.name, stdout.Bytes())
		})
	}
}

func TestRunErrors(t *testing.T) {
	decode := []string{"--config", "testdata/decode-gqa.json"}
	tests := []struct {
		name string
		args []string
		want []string // substrings of the error
	}{
		{"negative-block", with(decode, "--request-id", "r", "--local-blocks", "0,-1", "--remote-port", "20001"), []string{"-local-blocks", "negative block id"}},
		{"negative-remote-block", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-blocks", "-3", "--remote-port", "20001"), []string{"-remote-blocks", "negative"}},
		{"local-more-than-remote", with(decode, "--request-id", "r", "--local-blocks", "0-3", "--remote-blocks", "1,2", "--remote-port", "20001"), []string{"--local-blocks: 4 blocks", "--remote-blocks"}},
		{"non-dividing-tp", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-port", "20001", "--prefill-tp", "3"), []string{"invalid configuration", "decode.tp_size: 2 does not divide", "prefill.tp_size: 3"}},
		{"decode-tp-not-multiple", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-port", "20001", "--decode-tp", "6"), []string{"decode.tp_size: 6 is not a multiple of", "prefill.tp_size 4"}},
		{"decode-tp-above-prefill-cp", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-port", "20001", "--decode-tp", "8", "--decode-dcp", "2", "--prefill-dcp", "2"), []string{"decode.tp_size: 8 > ", "context parallelism"}},
		{"decode-pp-partition", with(small, "--prefill-tp", "1", "--decode-tp", "1", "--decode-pp", "2", "--decode-pp-layer-partition", "4,0", "--request-id", "r", "--local-blocks", "0", "--remote-port", "20001"), []string{"model.decode_pp_layer_partition: decode stage 1 has no layers"}},
		{"missing-everything", decode, []string{"--request-id: required", "--local-blocks: required", "--remote-port: required"}},
		{"bad-remote-port", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-port", "70000"), []string{"--remote-port: 70000 outside 1..65535"}},
		{"decode-rank-range", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-port", "20001", "--decode-rank", "2"), []string{"--decode-rank: 2 outside [0, 2)"}},
		{"remote-pcp-mismatch", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-port", "20001", "--remote-pcp", "2"), []string{"--remote-pcp: 2 but prefill.pcp_size is 1"}},
		{"block-out-of-cache", with(decode, "--request-id", "r", "--local-blocks", "1024", "--remote-blocks", "0", "--remote-port", "20001"), []string{"local block 1024 outside [0, 1024)"}},
		{"missing-model", []string{"--prefill-tp", "1", "--prefill-dp", "1", "--decode-tp", "1", "--decode-dp", "1", "--request-id", "r", "--local-blocks", "0", "--remote-port", "1"}, []string{"invalid configuration", "model.num_layers"}},
		{"unknown-flag", with(decode, "--bogus"), []string{"bogus"}},
		{"positional", with(decode, "--request-id", "r", "--local-blocks", "0", "--remote-port", "20001", "extra"), []string{`unexpected arguments ["extra"]`}},
		{"bad-range", with(decode, "--request-id", "r", "--local-blocks", "5-2"), []string{"range end before its start"}},
		{"missing-config-file", []string{"--config", "testdata/nope.json"}, []string{"nope.json"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := Run(context.Background(), tt.args, &stdout, &stderr)
			if !clierr.IsUsage(err) {
				t.Fatalf("Run = %v, want a usage error", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q:\n%v", w, err)
				}
			}
			if stdout.Len() > 0 {
				t.Errorf("stdout not empty on error:\n%s", stdout.String())
			}
		})
	}
}

func TestRunHelp(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := Run(context.Background(), []string{"-h"}, &stdout, &stderr)
	if !errors.Is(err, flag.ErrHelp) || clierr.IsUsage(err) {
		t.Fatalf("Run(-h) = %v, want flag.ErrHelp", err)
	}
	for _, w := range []string{"usage: kvflow plan", "-request-id", "-local-blocks", "-decode-rank", "-prefill-tp"} {
		if !strings.Contains(stdout.String(), w) || stderr.Len() > 0 {
			t.Errorf("help lacks %q", w)
		}
	}
}

func TestRunWriteError(t *testing.T) {
	err := Run(context.Background(), with(small, append([]string{"--prefill-tp", "1", "--decode-tp", "1"}, req...)...), failWriter{}, &bytes.Buffer{})
	if err == nil || clierr.IsUsage(err) {
		t.Fatalf("Run to a failing writer = %v, want a runtime error", err)
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("output differs from %s (go test -update rewrites it):\n--- got\n%s\n--- want\n%s", path, got, want)
	}
}
