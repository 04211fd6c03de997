package main

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/kvflow/kvflow/internal/config"
)

// The prefill ranks a decode rank dials, as the README's rank -> port
// table states them (8 KV heads).
func TestPrefillPeers(t *testing.T) {
	for _, tc := range []struct {
		name       string
		ptp, dtp   int
		mla        bool
		decodeRank int
		want       []int
	}{
		{"1->1", 1, 1, false, 0, []int{0}},
		{"4->2 rank 0", 4, 2, false, 0, []int{0, 1}},
		{"4->2 rank 1", 4, 2, false, 1, []int{2, 3}},
		{"8->2 rank 1", 8, 2, false, 1, []int{4, 5, 6, 7}},
		{"4->4 rank 3", 4, 4, false, 3, []int{3}},
		{"mla 4->2: chosen per request, any rank", 4, 2, true, 0, []int{0, 1, 2, 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := config.Example(config.Decode)
			ex := &cfg.KVTransfer.KVConnectorExtraConfig
			ex.Prefill.TPSize, ex.Decode.TPSize, cfg.Rank.TP = tc.ptp, tc.dtp, tc.decodeRank
			cfg.Model.NumKVHeads = 8
			if tc.mla {
				cfg.Model.MLA, cfg.Model.KVLoraRank, cfg.Model.QKRopeHeadDim = true, 512, 64
			}
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			got, err := prefillPeers(cfg)
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("prefillPeers = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

// A decode worker logs, once at start, the prefill ranks and ports it will
// dial; ignored kv_connector_extra_config keys are logged once at warn.
func TestLogStartup(t *testing.T) {
	cfg := config.Example(config.Decode)
	cfg.Rank.TP = 1
	cfg.KVTransfer.KVConnectorExtraConfig.Extra = map[string]json.RawMessage{"use_ascend_direct": json.RawMessage("true")}
	var buf bytes.Buffer
	logStartup(slog.New(slog.NewTextHandler(&buf, nil)), cfg)
	out := buf.String()
	for _, want := range []string{
		`level=WARN msg="kv_connector_extra_config keys other than prefill and decode are ignored`, `keys=[use_ascend_direct]`,
		`prefill_ranks="[2 3]"`, `ports="remote_port+2 (prefill tp 2, pp/pcp 0), remote_port+3 (prefill tp 3, pp/pcp 0)"`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("start-up log lacks %s:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "\n"); n != 2 {
		t.Errorf("%d lines, want 2:\n%s", n, out)
	}
}
