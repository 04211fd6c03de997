package config

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/stages/plan"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// problems splits a joined error into its messages.
func problems(err error) []string {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []string
		for _, e := range j.Unwrap() {
			out = append(out, problems(e)...)
		}
		return out
	}
	return []string{err.Error()}
}

// paths is the Path of every *FieldError of err.
func paths(t *testing.T, err error) []string {
	t.Helper()
	var out []string
	var walk func(error)
	walk = func(e error) {
		if j, ok := e.(interface{ Unwrap() []error }); ok {
			for _, x := range j.Unwrap() {
				walk(x)
			}
			return
		}
		var fe *FieldError
		if !errors.As(e, &fe) {
			t.Errorf("problem %q is not a *FieldError", e)
			return
		}
		out = append(out, fe.Path)
	}
	if err != nil {
		walk(err)
	}
	return out
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kvflow.json")
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestGolden(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		mod      func(c *Config)
	}{
		{"default", "", nil},
		{"example-decode", "testdata/example-decode.json", nil},
		{"example-prefill", "testdata/example-prefill.json", nil},
		// The fallbacks of te_backend mooncake lead the printout, as a
		// comment key: the output still loads back to itself.
		{"mooncake-decode", "testdata/example-decode.json", func(c *Config) {
			c.Node.TEBackend, c.Node.Mooncake.Protocol = BackendMooncake, "tcp"
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Load(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			if tc.mod != nil {
				tc.mod(&c)
			}
			if tc.in != "" && (MooncakeBuilt || c.Node.TEBackend != BackendMooncake) {
				if err := c.Validate(); err != nil {
					t.Fatalf("example does not validate:\n%v", err)
				}
			}
			var buf bytes.Buffer
			if err := c.Print(&buf); err != nil {
				t.Fatal(err)
			}
			golden := filepath.Join("testdata", tc.name+".golden.json")
			if *update {
				if err := os.WriteFile(golden, buf.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test -update)", err)
			}
			if !bytes.Equal(buf.Bytes(), want) {
				t.Errorf("Print differs from %s (go test -update to accept):\n%s", golden, buf.String())
			}
			// The printed config loads back to itself.
			back, err := FromJSON(buf.Bytes())
			if err != nil {
				t.Fatalf("printed config does not load: %v", err)
			}
			var again bytes.Buffer
			if err := back.Print(&again); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(again.Bytes(), buf.Bytes()) {
				t.Errorf("Print is not a fixed point:\n%s", again.String())
			}
		})
	}
}

func TestDefaultReportsDeploymentFieldsMissing(t *testing.T) {
	err := Default().Validate()
	got := paths(t, err)
	want := []string{
		"kv_transfer_config.kv_role",
		"kv_transfer_config.engine_id",
		"kv_transfer_config.kv_connector_extra_config.prefill.tp_size",
		"kv_transfer_config.kv_connector_extra_config.prefill.dp_size",
		"kv_transfer_config.kv_connector_extra_config.decode.tp_size",
		"kv_transfer_config.kv_connector_extra_config.decode.dp_size",
		"model.num_layers",
		"model.num_kv_heads",
		"model.block_size",
		"model.num_blocks",
		"model.dtype",
		"model.head_dim",
	}
	if !slices.Equal(got, want) {
		t.Errorf("Default().Validate() paths:\n got %q\nwant %q\nerror:\n%v", got, want, err)
	}
}

func TestExample(t *testing.T) {
	for _, r := range []Role{Prefill, Decode} {
		c := Example(r)
		if err := c.Validate(); err != nil {
			t.Errorf("Example(%v): %v", r, err)
		}
		if c.Role() != r {
			t.Errorf("Example(%v).Role() = %v", r, c.Role())
		}
	}
	topo := Example(Decode).Topology()
	if topo.NeedPulls() != 2 {
		t.Errorf("demo shape NeedPulls = %d, want 2 (the stitch must run)", topo.NeedPulls())
	}
}

func TestLoadVLLMStyle(t *testing.T) {
	// As vllm-ascend's docs write it: kv_port a string, dp_size before
	// tp_size, no pp_size, connector-specific extra keys.
	kvJSON := `{"kv_connector": "MooncakeConnectorV1", "kv_buffer_device": "npu", "kv_role": "kv_producer",
		"kv_parallel_size": 1, "kv_port": "20001", "engine_id": "0",
		"kv_connector_module_path": "vllm_ascend.distributed.mooncake_connector",
		"kv_connector_extra_config": {"use_ascend_direct": true, "prefill": {"dp_size": 2, "tp_size": 8}, "decode": {"dp_size": 2, "tp_size": 8}, "other_plugin": [1, 2]}}`
	model := `"model": {"num_layers": 61, "num_kv_heads": 1, "block_size": 128, "dtype": "bfloat16", "num_blocks": 100, "mla": true, "kv_lora_rank": 512, "qk_rope_head_dim": 64}`
	check := func(t *testing.T, c Config) {
		t.Helper()
		kv := c.KVTransfer
		if kv.KVPort != 20001 || kv.EngineID != "0" || c.Role() != Prefill {
			t.Errorf("kv_port %d engine_id %q role %v", kv.KVPort, kv.EngineID, c.Role())
		}
		ex := kv.KVConnectorExtraConfig
		if ex.Prefill.TPSize != 8 || ex.Prefill.DPSize != 2 || ex.Prefill.PPSize != 1 {
			t.Errorf("prefill %+v", ex.Prefill)
		}
		if string(ex.Extra["use_ascend_direct"]) != "true" || string(ex.Extra["other_plugin"]) != "[1, 2]" {
			t.Errorf("unknown extra-config keys not preserved: %q", ex.Extra)
		}
		if got := ex.UnknownExtraKeys(); !slices.Equal(got, []string{"other_plugin", "use_ascend_direct"}) {
			t.Errorf("UnknownExtraKeys = %q", got)
		}
		if kv.KVBufferDevice == nil || *kv.KVBufferDevice != "npu" || kv.KVParallelSize == nil || *kv.KVParallelSize != 1 {
			t.Errorf("vLLM-only fields not kept: %+v", kv)
		}
		if err := c.Validate(); err != nil {
			t.Errorf("Validate: %v", err)
		}
		var buf bytes.Buffer
		if err := c.Print(&buf); err != nil {
			t.Fatal(err)
		}
		for _, s := range []string{`"use_ascend_direct": true`, `"other_plugin": [`, `"kv_port": 20001`, `"kv_buffer_device": "npu"`} {
			if !strings.Contains(buf.String(), s) {
				t.Errorf("Print lacks %s:\n%s", s, buf.String())
			}
		}
	}
	t.Run("file", func(t *testing.T) {
		c, err := Load(writeFile(t, `{"kv_transfer_config": `+kvJSON+`, `+model+`}`))
		if err != nil {
			t.Fatal(err)
		}
		check(t, c)
	})
	t.Run("flag", func(t *testing.T) {
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		c, err := Parse([]string{"--config", writeFile(t, `{`+model+`}`), "--kv-transfer-config", kvJSON}, fs)
		if err != nil {
			t.Fatal(err)
		}
		check(t, c)
	})
}

func TestLoadErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		doc  string
		want []string // one substring per reported problem, in order
	}{
		{"unknown top-level field", `{"modle": {}}`, []string{`:1:2: modle: unknown field (did you mean "model"?)`}},
		{"unknown nested field", `{"kv_transfer_config": {"kv_rol": "kv_consumer"}}`,
			[]string{`:1:25: kv_transfer_config.kv_rol: unknown field (did you mean "kv_role"?)`}},
		{"unknown field far from any", `{"node": {"zzzzzzzz": 1}}`, []string{`node.zzzzzzzz: unknown field`}},
		{"ill-typed int", "{\n  \"model\": {\"num_layers\": \"32\"}\n}",
			[]string{`:2:27: model.num_layers: want an integer, got string "32"`}},
		{"fraction for int", `{"rank": {"tp": 1.5}}`, []string{`rank.tp: want an integer, got number 1.5`}},
		{"ill-typed bool", `{"model": {"mla": "yes"}}`, []string{`model.mla: want true or false, got string "yes"`}},
		{"ill-typed extra-config size", `{"kv_transfer_config": {"kv_connector_extra_config": {"decode": {"tp_size": "2"}}}}`,
			[]string{`kv_transfer_config.kv_connector_extra_config.decode.tp_size: want an integer, got string "2"`}},
		{"typo inside extra config prefill", `{"kv_transfer_config": {"kv_connector_extra_config": {"prefill": {"pp_szie": 2}}}}`,
			[]string{`kv_transfer_config.kv_connector_extra_config.prefill.pp_szie: unknown field (did you mean "pp_size"?)`}},
		{"unknown key inside extra config decode", `{"kv_transfer_config": {"kv_connector_extra_config": {"decode": {"new_knob": 1}}}}`,
			[]string{`kv_transfer_config.kv_connector_extra_config.decode.new_knob: unknown field`}},
		{"misspelt prefill", `{"kv_transfer_config": {"kv_connector_extra_config": {"prefil": {"tp_size": 2}}}}`,
			[]string{`kv_transfer_config.kv_connector_extra_config.prefil: unknown field (did you mean "prefill"?)`}},
		{"misspelt decode", `{"kv_transfer_config": {"kv_connector_extra_config": {"Decode": {"tp_size": 2}}}}`,
			[]string{`kv_transfer_config.kv_connector_extra_config.Decode: unknown field (did you mean "decode"?)`}},
		{"extra config not an object", `{"kv_transfer_config": {"kv_connector_extra_config": []}}`,
			[]string{`kv_transfer_config.kv_connector_extra_config: want an object, got an array`}},
		{"bad port string", `{"kv_transfer_config": {"kv_port": "20x01"}}`,
			[]string{`kv_transfer_config.kv_port: want a port number or a string holding one, got string "20x01"`}},
		{"duration as number", `{"read": {"timeout": 30}}`, []string{`read.timeout: want a duration string such as "30s", got number 30`}},
		{"bad duration", `{"read": {"timeout": "30 seconds"}}`, []string{`read.timeout: want a duration such as "30s" or "250ms", got "30 seconds"`}},
		{"section not an object", `{"model": 3}`, []string{`model: want an object, got number 3`}},
		{"document not an object", `[1]`, []string{`:1:1: want an object, got an array`}},
		{"duplicate field", `{"rank": {"tp": 1, "tp": 2}}`, []string{`rank.tp: duplicate field`}},
		{"syntax error", "{\n \"rank\": {\"tp\": 1,}\n}", []string{`:2:19: invalid JSON: invalid character '}'`}},
		{"trailing data", `{} {}`, []string{`invalid JSON: invalid character '{' after top-level value`}},
		{"empty", ``, []string{`invalid JSON: unexpected end of JSON input`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := writeFile(t, tc.doc)
			_, err := Load(p)
			got := problems(err)
			if len(got) != len(tc.want) {
				t.Fatalf("got %d problems, want %d:\n%v", len(got), len(tc.want), err)
			}
			for i, w := range tc.want {
				if !strings.Contains(got[i], w) {
					t.Errorf("problem %d = %q, want it to contain %q", i, got[i], w)
				}
				if !strings.HasPrefix(got[i], p+":") {
					t.Errorf("problem %d = %q lacks the file position", i, got[i])
				}
			}
		})
	}
}

func TestLoadReportsEveryProblem(t *testing.T) {
	doc := `{
  "kv_transfer_config": {"kv_rol": "x", "kv_port": "abc",
    "kv_connector_extra_config": {"foo": 1, "prefill": {"tp_size": "4", "bar": 2}}},
  "model": {"num_layers": 1.5, "dtype": 3},
  "modle": {},
  "read": {"timeout": 30},
  "// comment": "ignored",
  "auth": {"mode": "off", "//": "ignored too"}
}`
	_, err := FromJSON([]byte(doc))
	want := []string{
		"2:26: kv_transfer_config.kv_rol: unknown field",
		"2:52: kv_transfer_config.kv_port: want a port number",
		"3:68: kv_transfer_config.kv_connector_extra_config.prefill.tp_size: want an integer",
		"3:73: kv_transfer_config.kv_connector_extra_config.prefill.bar: unknown field",
		"4:27: model.num_layers: want an integer",
		"4:41: model.dtype: want a string",
		"5:3: modle: unknown field",
		"6:23: read.timeout: want a duration string",
	}
	got := problems(err)
	if len(got) != len(want) {
		t.Fatalf("got %d problems, want %d:\n%v", len(got), len(want), err)
	}
	for i := range want {
		if !strings.HasPrefix(got[i], want[i]) {
			t.Errorf("problem %d = %q, want prefix %q", i, got[i], want[i])
		}
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.json"))
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Load(missing) = %v, want ErrNotExist", err)
	}
}

func TestLoadMergesOntoDefaults(t *testing.T) {
	c, err := FromJSON([]byte(`{"pipeline": {"workers": {"read": 3}}, "kv_transfer_config": {"kv_connector_extra_config": {"prefill": {"tp_size": 2}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	d := Default()
	if c.Pipeline.Workers.Read != 3 || c.Pipeline.Workers.Stitch != d.Pipeline.Workers.Stitch || c.Pipeline.Queues != d.Pipeline.Queues {
		t.Errorf("partial section did not merge: %+v", c.Pipeline)
	}
	if p := c.KVTransfer.KVConnectorExtraConfig.Prefill; p.TPSize != 2 || p.PPSize != 1 {
		t.Errorf("pp_size default lost: %+v", p)
	}
	if c.KVTransfer.KVPort != 14579 {
		t.Errorf("kv_port default = %d, want vLLM's 14579", c.KVTransfer.KVPort)
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		role Role
		mod  func(c *Config)
		want []string // each must appear in some problem, and the count must match
	}{
		{"decode tp missing", Decode, func(c *Config) { c.KVTransfer.KVConnectorExtraConfig.Decode.TPSize = 0 },
			[]string{"kv_transfer_config.kv_connector_extra_config.decode.tp_size: must be >= 1, got 0"}},
		{"kv_both", Decode, func(c *Config) { c.KVTransfer.KVRole = "kv_both" },
			[]string{`kv_transfer_config.kv_role: "kv_both" is not supported`}},
		{"unknown role", Decode, func(c *Config) { c.KVTransfer.KVRole = "consumer" },
			[]string{`kv_transfer_config.kv_role: unknown role "consumer"`}},
		{"port out of range", Prefill, func(c *Config) { c.KVTransfer.KVPort = 70000 },
			[]string{"kv_transfer_config.kv_port: must be in 1..65535, got 70000"}},
		{"handshake ports overflow", Prefill, func(c *Config) { c.KVTransfer.KVPort = 65534 },
			[]string{"kv_transfer_config.kv_port: handshake ports 65534..65537 outside 1..65535"}},
		{"decode tp > prefill tp (kvflow only)", Decode, func(c *Config) { c.KVTransfer.KVConnectorExtraConfig.Decode.TPSize = 8 }, nil},
		{"decode tp not a multiple of prefill tp", Decode, func(c *Config) { c.KVTransfer.KVConnectorExtraConfig.Decode.TPSize = 6; c.Model.NumKVHeads = 24 },
			[]string{"kv_transfer_config.kv_connector_extra_config.decode.tp_size: 6 is not a multiple of kv_transfer_config.kv_connector_extra_config.prefill.tp_size 4"}},
		{"gqa heads", Decode, func(c *Config) { c.Model.NumKVHeads = 3 },
			// Only what is wrong: not the rank grouping derived from it.
			[]string{"prefill.tp_size: 4 and model.num_kv_heads 3: neither divides", "decode.tp_size: 2 and model.num_kv_heads 3: neither divides"}},
		{"decode pp (kvflow only)", Decode, func(c *Config) { c.KVTransfer.KVConnectorExtraConfig.Decode.PPSize = 2 }, nil},
		{"decode pp partition", Decode, func(c *Config) {
			c.KVTransfer.KVConnectorExtraConfig.Decode.PPSize = 2
			c.Model.DecodePPLayerPartition = "10,10"
		}, []string{"model.decode_pp_layer_partition: partitions in \"10,10\" sum to 20, not model.num_layers 32"}},
		{"tp rank out of range", Decode, func(c *Config) { c.Rank.TP = 2 },
			[]string{"rank.tp: 2 outside [0, kv_transfer_config.kv_connector_extra_config.decode.tp_size 2)"}},
		{"prefill tp rank ok at 3", Prefill, func(c *Config) { c.Rank.TP = 3 }, nil},
		{"negative ranks", Prefill, func(c *Config) { c.Rank.PP, c.Rank.DP = -1, -2 },
			[]string{"rank.pp: must be >= 0, got -1", "rank.dp: must be >= 0, got -2"}},
		{"pcp rank without pcp", Prefill, func(c *Config) { c.Rank.PCP = 1 },
			[]string{"rank.pcp: 1 outside [0, kv_transfer_config.kv_connector_extra_config.prefill.pcp_size 1)"}},
		{"layer partition", Prefill, func(c *Config) {
			c.KVTransfer.KVConnectorExtraConfig.Prefill.PPSize = 2
			c.Model.PPLayerPartition = "10,10"
		}, []string{"model.pp_layer_partition: partitions in \"10,10\" sum to 20, not model.num_layers 32"}},
		{"bad dtype", Decode, func(c *Config) { c.Model.DType = "fp4" }, []string{`model.dtype: unknown dtype "fp4"`}},
		{"mla parts", Decode, func(c *Config) { c.Model.MLA = true },
			[]string{"model.kv_lora_rank: must be >= 1, got 0", "model.qk_rope_head_dim: must be >= 1, got 0"}},
		{"mla dims without mla", Decode, func(c *Config) { c.Model.KVLoraRank = 512 },
			[]string{"model.kv_lora_rank: set to 512 without mla"}},
		{"sparse without mla", Decode, func(c *Config) { c.Model.Sparse, c.Model.IndexerDim = true, 128 },
			[]string{"model: sparse (3-part) KV cache without MLA", "chosen prefill ranks per stage"}},
		{"shape overflow", Decode, func(c *Config) { c.Model.NumBlocks = 1 << 40 }, []string{"model: npu: invalid cache shape"}},
		{"cache mode", Decode, func(c *Config) { c.Cache.Mode = "tmpfs" },
			[]string{`cache.mode: must be one of anonymous, shm, shm_attach, got "tmpfs"`}},
		{"cache path with anonymous", Decode, func(c *Config) { c.Cache.Path, c.Cache.RemoveOnClose = "/dev/shm/x", true },
			[]string{"cache.path: set to", "cache.remove_on_close: set with cache.mode anonymous"}},
		{"relative cache path", Decode, func(c *Config) { c.Cache.Mode, c.Cache.Path = CacheShm, "shm/x" },
			[]string{"cache.path: must be an absolute path"}},
		{"attach never removes", Decode, func(c *Config) { c.Cache.Mode, c.Cache.RemoveOnClose = CacheShmAttach, true },
			[]string{"cache.remove_on_close: set with cache.mode shm_attach"}},
		{"side channel host with port", Decode, func(c *Config) { c.Node.SideChannelHost = "10.0.0.1:5000" },
			[]string{"node.side_channel_host: want an IP address or host name without a port"}},
		{"side channel host missing", Decode, func(c *Config) { c.Node.SideChannelHost = "" },
			[]string{"node.side_channel_host: missing"}},
		{"ipv6 host ok", Decode, func(c *Config) { c.Node.SideChannelHost = "::1" }, nil},
		{"te port", Decode, func(c *Config) { c.Node.TEPort = -1 }, []string{"node.te_port: must be in 0..65535"}},
		{"te port clashes with handshake", Decode, func(c *Config) { c.Node.TEPort = 20101 },
			[]string{"node.te_port: 20101 is this worker's side-channel handshake port"}},
		{"te data port range", Decode, func(c *Config) { c.Node.TEDataPort = 65536 }, []string{"node.te_data_port: must be in 0..65535 (0 = pick a free port), got 65536"}},
		{"te data port negative", Prefill, func(c *Config) { c.Node.TEDataPort = -1 }, []string{"node.te_data_port: must be in 0..65535"}},
		{"te data port fixed", Prefill, func(c *Config) { c.Node.TEPort, c.Node.TEDataPort = 17000, 17001 }, nil},
		{"te data port alone", Decode, func(c *Config) { c.Node.TEDataPort = 17001 }, nil},
		{"te data port is the rpc port", Prefill, func(c *Config) { c.Node.TEPort, c.Node.TEDataPort = 17000, 17000 },
			[]string{"node.te_data_port: 17000 is also node.te_port: the transfer engine's RPC and data ports must differ"}},
		{"te data port clashes with handshake", Decode, func(c *Config) { c.Node.TEDataPort = 20101 },
			[]string{"node.te_data_port: 20101 is this worker's side-channel handshake port"}},
		{"te data port on another host than the side channel", Decode, func(c *Config) { c.Node.TEDataPort, c.Node.TEHost = 20101, "10.0.0.9" }, nil},
		{"te data port with shm", Prefill, func(c *Config) {
			c.Node.TEBackend, c.Cache.Mode, c.Node.TEDataPort = BackendShm, CacheShm, 17001
		}, nil},
		{"te backend", Decode, func(c *Config) { c.Node.TEBackend = "rdma" }, []string{`node.te_backend: must be tcp, shm or mooncake, got "rdma"`}},
		{"te backend shm on anonymous prefill memory", Prefill, func(c *Config) { c.Node.TEBackend = BackendShm; c.Cache.Mode = CacheAnonymous },
			[]string{`node.te_backend: shm on a prefill worker needs its cache in a file`}},
		// mooncake runs only in a binary built with -tags mooncake; what
		// it cannot do is refused when asked for explicitly.
		{"te backend mooncake", Decode, func(c *Config) { c.Node.TEBackend = BackendMooncake }, mooncakeWant()},
		{"te backend mooncake prefill defaults", Prefill, func(c *Config) { c.Node.TEBackend = BackendMooncake }, mooncakeWant()},
		{"te backend mooncake grants off", Prefill, func(c *Config) { c.Node.TEBackend, c.Read.Grants = BackendMooncake, GrantsOff }, mooncakeWant()},
		{"te backend mooncake grants on", Prefill, func(c *Config) { c.Node.TEBackend, c.Read.Grants = BackendMooncake, GrantsOn },
			mooncakeWant("read.grants: on needs node.te_backend tcp")},
		{"te backend mooncake decode ignores grants", Decode, func(c *Config) { c.Node.TEBackend, c.Read.Grants = BackendMooncake, GrantsOn }, mooncakeWant()},
		{"te backend mooncake data plane authenticated", Prefill, func(c *Config) {
			c.Node.TEBackend = BackendMooncake
			c.Auth = Auth{Mode: AuthCurve, SecretKeyFile: "/s", PublicKeyFile: "/p", DataPlane: DataPlaneAuthenticated}
		}, mooncakeWant("auth.data_plane: authenticated needs node.te_backend tcp")},
		{"te backend mooncake data plane default", Prefill, func(c *Config) {
			c.Node.TEBackend = BackendMooncake
			c.Auth = Auth{Mode: AuthCurve, SecretKeyFile: "/s", PublicKeyFile: "/p"}
		}, mooncakeWant()},
		{"te backend mooncake settings", Decode, func(c *Config) {
			c.Node.TEBackend = BackendMooncake
			c.Node.Mooncake = MooncakeTE{Location: "cpu 0"}
		}, mooncakeWant("node.mooncake.protocol: missing", `node.mooncake.location: want a location tag (cpu:0, npu:0, ...) without spaces or quotes, got "cpu 0"`)},
		{"te backend mooncake fixed te port", Decode, func(c *Config) { c.Node.TEBackend, c.Node.TEPort = BackendMooncake, 25000 },
			mooncakeWant("node.te_port: 25000: Mooncake's engine picks its own RPC port")},
		{"te backend mooncake fixed te data port", Prefill, func(c *Config) {
			c.Node.TEBackend, c.Read.Grants, c.Node.TEDataPort = BackendMooncake, GrantsOff, 25001
		}, mooncakeWant("node.te_data_port: 25001: Mooncake's engine picks its own data port")},
		{"mooncake settings ignored with tcp", Decode, func(c *Config) { c.Node.Mooncake = MooncakeTE{} }, nil},
		{"control scheme", Decode, func(c *Config) { c.Node.Control = "/tmp/x.sock" },
			[]string{`node.control: want an ipc:// or tcp:// endpoint, got "/tmp/x.sock"`}},
		{"control tcp port", Decode, func(c *Config) { c.Node.Control = "tcp://127.0.0.1:0" }, []string{"node.control: port of"}},
		{"derived control path too long", Decode, func(c *Config) { c.KVTransfer.EngineID = strings.Repeat("e", 90) },
			[]string{"node.control: socket path \"/tmp/kvflow-eeee"}},
		{"metrics addr", Decode, func(c *Config) { c.Node.MetricsAddr = "9100" }, []string{`node.metrics_addr: want host:port`}},
		{"metrics off", Decode, func(c *Config) { c.Node.MetricsAddr = "" }, nil},
		{"pprof without metrics", Decode, func(c *Config) { c.Node.MetricsAddr, c.Node.Pprof = "", true }, []string{"node.pprof: needs node.metrics_addr"}},
		{"limits", Prefill, func(c *Config) {
			l := &c.Node.Limits
			l.TEFirstByteTimeout, l.TEIdleTimeout, l.FDReserve, l.HTTPMaxConns = 0, -1, -1, 0
			l.TEMaxConns, l.TEMaxConnsPerPeer = 8, 9
		}, []string{"node.limits.te_first_byte_timeout: must be > 0", "node.limits.te_idle_timeout: must be > 0",
			"node.limits.te_max_conns_per_peer: 9 exceeds node.limits.te_max_conns (8)", "node.limits.fd_reserve: must be >= 0",
			"node.limits.http_max_conns: must be >= 1"}},
		{"limits: no fd reserve", Prefill, func(c *Config) { c.Node.Limits.FDReserve = 0 }, nil},
		{"limits: side channel caps", Prefill, func(c *Config) {
			c.Node.Limits.SideChannelMaxConns, c.Node.Limits.SideChannelMaxConnsPerPeer = 0, -1
		}, []string{"node.limits.side_channel_max_conns: must be >= 1, got 0", "node.limits.side_channel_max_conns_per_peer: must be >= 1, got -1"}},
		{"limits: side channel per peer above total", Prefill, func(c *Config) {
			c.Node.Limits.SideChannelMaxConns, c.Node.Limits.SideChannelMaxConnsPerPeer = 8, 9
		}, []string{"node.limits.side_channel_max_conns_per_peer: 9 exceeds node.limits.side_channel_max_conns (8)"}},
		{"limits: side channel per peer equal to total", Decode, func(c *Config) {
			c.Node.Limits.SideChannelMaxConns, c.Node.Limits.SideChannelMaxConnsPerPeer = 2, 2
		}, nil},
		{"pools and queues", Decode, func(c *Config) {
			c.Pipeline.Workers.Read, c.Pipeline.Queues.Notify = 0, -1
		}, []string{"pipeline.workers.read: must be >= 1, got 0", "pipeline.queues.notify: must be >= 1, got -1"}},
		{"timeouts", Prefill, func(c *Config) {
			c.Handshake.Timeout, c.Read.Timeout, c.Notify.Timeout = 0, -1, 0
			c.Tracker.AbortRequestTimeout, c.Shutdown.DrainTimeout = 0, Duration(-time.Second)
			c.Handshake.RetryBackoff = Duration(-time.Millisecond)
		}, []string{"handshake.timeout: must be > 0", "handshake.retry_backoff: must be >= 0", "read.timeout: must be > 0",
			"notify.timeout: must be > 0", "tracker.abort_request_timeout: must be > 0", "shutdown.drain_timeout: must be >= 0"}},
		{"drain 0 allowed", Prefill, func(c *Config) { c.Shutdown.DrainTimeout = 0 }, nil},
		{"lease off", Prefill, func(c *Config) { c.Tracker.LeaseTTL = 0 }, nil},
		{"lease at the minimum", Prefill, func(c *Config) { c.Tracker.LeaseTTL = Duration(MinLeaseTTL) }, nil},
		{"lease too short", Prefill, func(c *Config) { c.Tracker.LeaseTTL = Duration(10 * time.Millisecond) },
			[]string{"tracker.lease_ttl: must be 0 (off) or >= 50ms, got 10ms"}},
		{"lease negative", Prefill, func(c *Config) { c.Tracker.LeaseTTL = Duration(-time.Second) },
			[]string{"tracker.lease_ttl: must be 0 (off) or >= 50ms, got -1s"}},
		{"retries and cache", Decode, func(c *Config) {
			c.Handshake.Attempts, c.Notify.Attempts, c.Handshake.CacheSize, c.Read.PerPeerConcurrency = 0, 0, 0, 0
		}, []string{"handshake.attempts", "handshake.cache_size", "read.per_peer_concurrency", "notify.attempts"}},
		{"log", Decode, func(c *Config) { c.Log.Level, c.Log.Format = "verbose", "xml" },
			[]string{`log.level: must be one of debug, info, warn, error, got "verbose"`, `log.format: must be one of auto, text, json, got "xml"`}},
		{"auth files without curve", Decode, func(c *Config) { c.Auth.SecretKeyFile = "/k" },
			[]string{"auth.secret_key_file: set with auth.mode off"}},
		{"curve needs keys", Decode, func(c *Config) { c.Auth.Mode = AuthCurve },
			[]string{"auth.secret_key_file: missing", "auth.public_key_file: missing", "auth.server_public_key_file: missing"}},
		{"curve prefill keys only", Prefill, func(c *Config) {
			c.Auth = Auth{Mode: AuthCurve, SecretKeyFile: "/s", PublicKeyFile: "/p"}
		}, nil},
		{"auth mode", Decode, func(c *Config) { c.Auth.Mode = "tls" }, []string{`auth.mode: must be one of off, curve, got "tls"`}},
		{"data plane value", Prefill, func(c *Config) {
			c.Auth = Auth{Mode: AuthCurve, SecretKeyFile: "/s", PublicKeyFile: "/p", DataPlane: "tls"}
		}, []string{`auth.data_plane: must be one of authenticated, open, got "tls"`}},
		{"data plane open with curve", Prefill, func(c *Config) {
			c.Auth = Auth{Mode: AuthCurve, SecretKeyFile: "/s", PublicKeyFile: "/p", DataPlane: DataPlaneOpen}
		}, nil},
		{"data plane authenticated without curve", Prefill, func(c *Config) { c.Auth.DataPlane = DataPlaneAuthenticated },
			[]string{"auth.data_plane: authenticated needs auth.mode curve"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Example(tc.role)
			tc.mod(&c)
			err := c.Validate()
			got := problems(err)
			paths(t, err) // every problem is a *FieldError
			if len(got) != len(tc.want) {
				t.Fatalf("got %d problems, want %d:\n%v", len(got), len(tc.want), err)
			}
			for _, w := range tc.want {
				if !slices.ContainsFunc(got, func(g string) bool { return strings.Contains(g, w) }) {
					t.Errorf("no problem contains %q:\n%v", w, err)
				}
			}
		})
	}
}

// mooncakeWant is what Validate reports for node.te_backend mooncake: the
// missing build tag in a binary built without it, then extra.
func mooncakeWant(extra ...string) []string {
	if MooncakeBuilt {
		return extra
	}
	return append([]string{`node.te_backend: "mooncake" needs a kvflow built with -tags mooncake against an installed Mooncake, and this binary was built without it: build it with`}, extra...)
}

// TestBackendFallbacks: what the mooncake backend cannot do of what the
// configuration asks is listed, per role; tcp has no fallback.
func TestBackendFallbacks(t *testing.T) {
	for _, tc := range []struct {
		name string
		role Role
		mod  func(c *Config)
		want []string // the keys, in order
	}{
		{"tcp prefill", Prefill, func(c *Config) {}, nil},
		{"tcp decode", Decode, func(c *Config) {}, nil},
		{"prefill", Prefill, func(c *Config) { c.Node.TEBackend = BackendMooncake }, []string{"read.grants", "node.limits"}},
		{"prefill grants off", Prefill, func(c *Config) { c.Node.TEBackend, c.Read.Grants = BackendMooncake, GrantsOff }, []string{"node.limits"}},
		{"prefill curve", Prefill, func(c *Config) {
			c.Node.TEBackend = BackendMooncake
			c.Auth = Auth{Mode: AuthCurve, SecretKeyFile: "/s", PublicKeyFile: "/p"}
		}, []string{"read.grants", "auth.data_plane", "node.limits"}},
		{"prefill curve open", Prefill, func(c *Config) {
			c.Node.TEBackend = BackendMooncake
			c.Auth = Auth{Mode: AuthCurve, SecretKeyFile: "/s", PublicKeyFile: "/p", DataPlane: DataPlaneOpen}
		}, []string{"read.grants", "node.limits"}},
		{"decode rdma", Decode, func(c *Config) { c.Node.TEBackend = BackendMooncake },
			[]string{"read.fused_stitch", "read (ledger)", "handshake (compatibility check)", "node.limits"}},
		{"decode tcp transport", Decode, func(c *Config) { c.Node.TEBackend, c.Node.Mooncake.Protocol = BackendMooncake, "tcp" },
			[]string{"node.te_backend", "read.fused_stitch", "read (ledger)", "handshake (compatibility check)", "node.limits"}},
		{"decode unfused, tp above prefill", Decode, func(c *Config) {
			c.Node.TEBackend, c.Read.FusedStitch, c.Node.Mooncake.Protocol = BackendMooncake, false, "tcp"
			c.KVTransfer.KVConnectorExtraConfig.Decode.TPSize = 8
		}, []string{"node.te_backend", "read (decode tp above prefill tp)", "read (ledger)", "handshake (compatibility check)", "node.limits"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Example(tc.role)
			tc.mod(&c)
			var keys []string
			for _, f := range c.BackendFallbacks() {
				keys = append(keys, f.Key)
				if f.Note == "" || !strings.HasPrefix(f.String(), f.Key+": ") {
					t.Errorf("fallback %q", f)
				}
			}
			if !slices.Equal(keys, tc.want) {
				t.Errorf("fallbacks %q, want %q", keys, tc.want)
			}
			mc := c.Node.TEBackend == BackendMooncake
			if got := c.ReadGrants(); mc && got != GrantsOff || !mc && got != c.Read.Grants {
				t.Errorf("ReadGrants %q (read.grants %q)", got, c.Read.Grants)
			}
			if got := c.DataPlaneAuth(); got != (c.Auth.DataPlaneAuth() && !mc) {
				t.Errorf("DataPlaneAuth %v", got)
			}
		})
	}
}

func TestValidateReportsEverythingAtOnce(t *testing.T) {
	c := Example(Decode)
	c.KVTransfer.EngineID = ""
	c.KVTransfer.KVConnectorExtraConfig.Decode.TPSize = 0
	c.Model.BlockSize = 0
	c.Rank.DP = 5
	c.Cache.Mode = "x"
	c.Node.TEBackend = "y"
	c.Pipeline.Workers.Plan = 0
	c.Read.Timeout = 0
	c.Log.Level = "z"
	c.Auth.Mode = "w"
	got := paths(t, c.Validate())
	want := []string{
		"kv_transfer_config.engine_id",
		"kv_transfer_config.kv_connector_extra_config.decode.tp_size",
		"model.block_size",
		"rank.dp",
		"cache.mode",
		"node.te_backend",
		"pipeline.workers.plan",
		"read.timeout",
		"log.level",
		"auth.mode",
	}
	if !slices.Equal(got, want) {
		t.Errorf("paths:\n got %q\nwant %q", got, want)
	}
}

func TestDataPlaneAuth(t *testing.T) {
	for _, tc := range []struct {
		a    Auth
		want bool
	}{
		{Auth{Mode: AuthOff}, false},
		{Auth{Mode: AuthOff, DataPlane: DataPlaneOpen}, false},
		{Auth{Mode: AuthCurve}, true},
		{Auth{Mode: AuthCurve, DataPlane: DataPlaneAuthenticated}, true},
		{Auth{Mode: AuthCurve, DataPlane: DataPlaneOpen}, false},
	} {
		if got := tc.a.DataPlaneAuth(); got != tc.want {
			t.Errorf("%+v: DataPlaneAuth %v, want %v", tc.a, got, tc.want)
		}
	}
}

func TestFieldErrorKeepsCause(t *testing.T) {
	c := Example(Decode)
	c.Model.NumBlocks = 1 << 40
	if err := c.Validate(); !errors.Is(err, npu.ErrInvalidShape) {
		t.Errorf("shape problem does not wrap npu.ErrInvalidShape: %v", err)
	}
}

func TestParseRole(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Role
		err  string
	}{
		{"kv_producer", Prefill, ""}, {"prefill", Prefill, ""},
		{"kv_consumer", Decode, ""}, {"decode", Decode, ""},
		{"kv_both", 0, "not supported"}, {"", 0, "missing"}, {"Prefill", 0, "unknown role"},
	} {
		r, err := ParseRole(tc.in)
		if r != tc.want || (err == nil) != (tc.err == "") || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("ParseRole(%q) = %v, %v; want %v, %q", tc.in, r, err, tc.want, tc.err)
		}
	}
	if Prefill.KVRole() != KVProducer || Decode.KVRole() != KVConsumer || Role(0).KVRole() != "" {
		t.Error("KVRole")
	}
	if Prefill.String() != "prefill" || Decode.String() != "decode" || Role(7).String() != "Role(7)" {
		t.Error("String")
	}
}

func TestAccessors(t *testing.T) {
	c := Example(Prefill)
	c.KVTransfer.KVConnectorExtraConfig.Prefill = Parallel{TPSize: 4, DPSize: 2, PPSize: 2}
	c.Model.PPLayerPartition = "20,12"
	c.Rank = Rank{TP: 3, PP: 1, DP: 1}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	topo := c.Topology()
	want := plan.Topology{
		Prefill:          plan.Parallel{TP: 4, PP: 2, DP: 2, KVPort: 20001},
		Decode:           plan.Parallel{TP: 2, PP: 1, DP: 1},
		Model:            plan.Model{NumLayers: 32, NumKVHeads: 8},
		PPLayerPartition: "20,12",
	}
	if !reflect.DeepEqual(topo, want) {
		t.Errorf("Topology = %+v\nwant %+v", topo, want)
	}
	if self := c.Self(); self != (plan.Rank{TP: 3, PP: 1, DP: 1}) {
		t.Errorf("Self = %+v", self)
	}
	// kv_port + dp*tp*pp + pp*tp + tp = 20001 + 8 + 4 + 3.
	if got := c.HandshakePort(); got != 20016 || got != plan.HandshakePort(20001, topo.Prefill, c.Self()) {
		t.Errorf("HandshakePort = %d, want 20016", got)
	}
	if got := c.SideChannelPort(); got != 20009 {
		t.Errorf("SideChannelPort = %d, want 20009", got)
	}
	s, err := c.Shape()
	if err != nil {
		t.Fatal(err)
	}
	wantShape := npu.Shape{NumLayers: 12, NumBlocks: 1024, BlockSize: 128, DType: npu.BF16, NumKVHeads: 2, HeadDim: 128}
	if s != wantShape {
		t.Errorf("Shape = %+v\nwant %+v", s, wantShape)
	}

	d := Example(Decode)
	d.Model = Model{NumLayers: 61, NumKVHeads: 128, HeadDim: 192, BlockSize: 128, DType: "bf16", NumBlocks: 64,
		MLA: true, KVLoraRank: 512, QKRopeHeadDim: 64, Sparse: true, IndexerDim: 128}
	if err := d.Validate(); err != nil {
		t.Fatal(err)
	}
	s, err = d.Shape()
	if err != nil {
		t.Fatal(err)
	}
	if s.Kind() != npu.Sparse || s.NumLayers != 61 || s.NumKVHeads != 0 || s.HeadDim != 0 || s.IndexerDim != 128 {
		t.Errorf("MLA/sparse Shape = %+v", s)
	}
	bad := Example(Decode)
	bad.Model.DType = "nope"
	var fe *FieldError
	if _, err := bad.Shape(); !errors.As(err, &fe) || fe.Path != "model.dtype" {
		t.Errorf("Shape with a bad dtype = %v", err)
	}
}

func TestDerivedNames(t *testing.T) {
	c := Example(Decode)
	c.KVTransfer.EngineID = "tenant/a b"
	c.Rank.TP = 1
	if got, want := c.ControlEndpoint(), "ipc:///tmp/kvflow-tenant_a_b-decode-dp0-pp0-tp1.sock"; got != want {
		t.Errorf("ControlEndpoint = %q, want %q", got, want)
	}
	if c.CachePath() != "" {
		t.Errorf("CachePath in anonymous mode = %q", c.CachePath())
	}
	c.Cache.Mode = CacheShm
	if got, want := c.CachePath(), "/dev/shm/kvflow-tenant_a_b-decode-dp0-pp0-tp1"; got != want {
		t.Errorf("CachePath = %q, want %q", got, want)
	}
	c.Cache.Path = "/dev/shm/mine"
	c.Node.Control = "tcp://127.0.0.1:5555"
	if c.CachePath() != "/dev/shm/mine" || c.ControlEndpoint() != "tcp://127.0.0.1:5555" {
		t.Errorf("explicit values not used: %q %q", c.CachePath(), c.ControlEndpoint())
	}
	if c.TEHost() != "127.0.0.1" {
		t.Errorf("TEHost = %q, want the side channel host", c.TEHost())
	}
	c.Node.TEHost = "10.1.1.1"
	if c.TEHost() != "10.1.1.1" {
		t.Errorf("TEHost = %q", c.TEHost())
	}
	p := Example(Prefill)
	p.KVTransfer.KVConnectorExtraConfig.Prefill.PCPSize = 2
	p.Rank.PCP = 1
	if got := p.ControlEndpoint(); got != "ipc:///tmp/kvflow-prefill-0-prefill-dp0-pp0-pcp1-tp0.sock" {
		t.Errorf("ControlEndpoint with pcp = %q", got)
	}
}

func TestFlagsOverrideFile(t *testing.T) {
	file := writeFile(t, `{
  "kv_transfer_config": {"kv_role": "kv_consumer", "kv_port": "20101", "engine_id": "from-file",
    "kv_connector_extra_config": {"prefill": {"tp_size": 4, "dp_size": 1}, "decode": {"tp_size": 2, "dp_size": 1}}},
  "model": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 128, "dtype": "bf16", "num_blocks": 10},
  "read": {"timeout": "45s"},
  "log": {"level": "debug"}
}`)
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"config first", []string{"--config", file, "--engine-id", "from-flag", "--tp-rank=1", "--abort-timeout", "1m", "-mla=false", "--kv-port", "30000"}},
		{"config last", []string{"--engine-id", "from-flag", "-tp-rank", "1", "--abort-timeout=1m", "--kv-port=30000", "-config=" + file}},
		{"caller flags mixed in", []string{"-print-config", "--engine-id=from-flag", "--tp-rank", "1", "--config=" + file, "--abort-timeout", "60s", "--kv-port", "30000", "extra-arg"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := flag.NewFlagSet("serve", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			printCfg := fs.Bool("print-config", false, "print")
			c, err := Parse(tc.args, fs)
			if err != nil {
				t.Fatal(err)
			}
			if c.KVTransfer.EngineID != "from-flag" || c.Rank.TP != 1 || c.Tracker.AbortRequestTimeout.D() != time.Minute || c.KVTransfer.KVPort != 30000 {
				t.Errorf("flags did not override: engine %q tp %d abort %v port %d", c.KVTransfer.EngineID, c.Rank.TP, c.Tracker.AbortRequestTimeout.D(), c.KVTransfer.KVPort)
			}
			if c.Read.Timeout.D() != 45*time.Second || c.Log.Level != "debug" || c.Model.NumBlocks != 10 {
				t.Errorf("file values lost: %+v %+v", c.Read, c.Log)
			}
			if c.Handshake != Default().Handshake {
				t.Errorf("defaults lost: %+v", c.Handshake)
			}
			if err := c.Validate(); err != nil {
				t.Error(err)
			}
			if tc.name == "caller flags mixed in" && (!*printCfg || !slices.Equal(fs.Args(), []string{"extra-arg"})) {
				t.Errorf("caller's flags: print-config %v args %q", *printCfg, fs.Args())
			}
		})
	}
}

func TestParseNoConfig(t *testing.T) {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	c, err := Parse([]string{"--role", "prefill", "--engine-id", "p", "--prefill-tp", "4", "--prefill-dp", "1",
		"--decode-tp", "2", "--decode-dp", "1", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
		"--block-size", "128", "--dtype", "bf16", "--num-blocks", "16", "--cache", "shm", "--cache-remove-on-close",
		"--metrics-addr", "", "--control", "ipc:///tmp/p.sock", "--side-channel-host", "10.0.0.2",
		"--te-host", "10.0.0.2", "--te-port", "17000", "--te-data-port", "17001", "--read-workers", "3", "--plan-queue", "9",
		"--side-channel-max-conns", "100", "--side-channel-max-conns-per-peer", "10",
		"--log-level", "warn", "--log-format", "json"}, fs)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.Role() != Prefill || c.KVTransfer.KVRole != KVProducer || c.Cache.Mode != CacheShm || !c.Cache.RemoveOnClose ||
		c.Node.MetricsAddr != "" || c.Pipeline.Workers.Read != 3 || c.Pipeline.Queues.Plan != 9 || c.Node.TEPort != 17000 ||
		c.Node.TEDataPort != 17001 || c.Node.Limits.SideChannelMaxConns != 100 || c.Node.Limits.SideChannelMaxConnsPerPeer != 10 {
		t.Errorf("flags not applied: %+v", c)
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"help", []string{"-h"}, flag.ErrHelp.Error()},
		{"kv_both role", []string{"--role", "kv_both"}, "not supported"},
		{"bad int", []string{"--tp-rank", "one"}, "tp-rank"},
		{"bad duration", []string{"--read-timeout", "5"}, `want a duration such as "30s"`},
		{"bad port", []string{"--kv-port", "x"}, "want a port number"},
		{"bad kv-transfer-config", []string{"--kv-transfer-config", `{"kv_port": "x", "kv_rol": 1}`}, "kv_transfer_config.kv_rol: unknown field"},
		{"unknown flag", []string{"--nope"}, "flag provided but not defined: -nope"},
		{"missing file", []string{"--config", "/nonexistent/kvflow.json"}, "no such file"},
		{"bad file", []string{"--config", "FILE"}, "modle: unknown field"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := slices.Clone(tc.args)
			for i, a := range args {
				if a == "FILE" {
					args[i] = writeFile(t, `{"modle": 1}`)
				}
			}
			fs := flag.NewFlagSet("serve", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			_, err := Parse(args, fs)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Parse(%q) = %v, want an error containing %q", args, err, tc.want)
			}
		})
	}
}

// Two command-line sources of one kv_transfer_config setting that disagree
// are an error, whatever their order; agreeing ones are not.
func TestParseConflictingSources(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string // "" = no error
	}{
		{"kv_role vs --role", []string{"--kv-transfer-config", `{"kv_role":"kv_producer"}`, "--role", "decode"},
			`kv_transfer_config.kv_role: conflicting values: --kv-transfer-config gives "kv_producer", --role gives "kv_consumer"`},
		{"--role first", []string{"--role", "decode", "--kv-transfer-config", `{"kv_role":"kv_producer"}`},
			`kv_transfer_config.kv_role: conflicting values: --role gives "kv_consumer", --kv-transfer-config gives "kv_producer"`},
		{"same role twice", []string{"--kv-transfer-config", `{"kv_role":"kv_consumer"}`, "--role", "decode"}, ""},
		{"kv_port string vs number agree", []string{"--kv-transfer-config", `{"kv_port":"20001"}`, "--kv-port", "20001"}, ""},
		{"kv_port", []string{"--kv-port", "20002", "--kv-transfer-config", `{"kv_port":"20001"}`},
			`kv_transfer_config.kv_port: conflicting values: --kv-port gives "20002", --kv-transfer-config gives "20001"`},
		{"engine id", []string{"--engine-id", "a", "--kv-transfer-config", `{"engine_id":"b"}`}, `kv_transfer_config.engine_id: conflicting`},
		{"extra config size", []string{"--kv-transfer-config", `{"kv_connector_extra_config":{"decode":{"tp_size":2}}}`, "--decode-tp", "4"},
			`kv_transfer_config.kv_connector_extra_config.decode.tp_size: conflicting values`},
		{"flag twice: the last wins", []string{"--role", "decode", "--role", "prefill"}, ""},
		{"flag twice, then a conflicting source", []string{"--role", "decode", "--role", "prefill", "--kv-transfer-config", `{"kv_role":"kv_consumer"}`},
			`--role gives "kv_producer", --kv-transfer-config gives "kv_consumer"`},
		{"different fields", []string{"--kv-transfer-config", `{"kv_role":"kv_producer"}`, "--engine-id", "x", "--decode-tp", "2"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := flag.NewFlagSet("serve", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			_, err := Parse(tc.args, fs)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Parse(%q): %v", tc.args, err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Parse(%q) = %v, want an error containing %q", tc.args, err, tc.want)
			}
		})
	}
}

func TestRegisterFlagsDefaultsAreCurrentValues(t *testing.T) {
	c := Example(Decode)
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	c.RegisterFlags(fs)
	for name, want := range map[string]string{
		"role": "kv_consumer", "kv-port": "20101", "engine-id": "decode-0", "decode-tp": "2", "prefill-tp": "4",
		"abort-timeout": "8m0s", "metrics-addr": "127.0.0.1:0", "cache": "anonymous", "read-workers": "32",
		"lease-ttl": "10s",
	} {
		f := fs.Lookup(name)
		if f == nil {
			t.Errorf("flag -%s not registered", name)
			continue
		}
		if f.DefValue != want {
			t.Errorf("-%s default %q, want %q", name, f.DefValue, want)
		}
	}
	// Every flag names the field it sets.
	fs.VisitAll(func(f *flag.Flag) {
		if !strings.Contains(f.Usage, "(") {
			t.Errorf("-%s usage %q does not name its field", f.Name, f.Usage)
		}
	})
}

func TestPortAndDurationJSON(t *testing.T) {
	var p Port
	for _, tc := range []struct {
		in   string
		want Port
	}{{`20001`, 20001}, {`"20001"`, 20001}, {`" 80 "`, 80}, {`null`, 80}} {
		if err := p.UnmarshalJSON([]byte(tc.in)); err != nil || p != tc.want {
			t.Errorf("Port(%s) = %d, %v; want %d", tc.in, p, err, tc.want)
		}
	}
	for _, in := range []string{`""`, `20001.5`, `true`, `"99999999999999999999"`, `[1]`} {
		if err := p.UnmarshalJSON([]byte(in)); err == nil {
			t.Errorf("Port(%s) accepted", in)
		}
	}
	var d Duration
	if err := d.UnmarshalJSON([]byte(`"1m30s"`)); err != nil || d.D() != 90*time.Second {
		t.Errorf("Duration = %v, %v", d.D(), err)
	}
	if b, _ := d.MarshalJSON(); string(b) != `"1m30s"` {
		t.Errorf("Duration JSON = %s", b)
	}
}
