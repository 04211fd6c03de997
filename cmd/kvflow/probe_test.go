package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/tooling/testkit/loopback"
)

// startProbePrefill starts an in-process prefill worker (a small cache, on
// a random free port) with auth and returns its side channel's host:port.
func startProbePrefill(t *testing.T, auth config.Auth) string {
	t.Helper()
	ns, _ := loopback.Start(t, func(kvPort int) []config.Config {
		c := loopback.Config(loopback.Worker{Role: config.Prefill, EngineID: "probe-P", KVPort: kvPort,
			Prefill: loopback.TP(1), Decode: loopback.TP(1),
			Model: config.Model{NumLayers: 2, NumKVHeads: 8, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: 16}})
		c.Auth = auth
		return []config.Config{c}
	}, func(int) node.Deps { return node.Deps{} })
	return fmt.Sprintf("127.0.0.1:%d", ns[0].Config.HandshakePort())
}

// keygen writes a key pair with `kvflow keygen` and returns its files.
func keygen(t *testing.T, dir, name string) (secret, public string) {
	t.Helper()
	secret, public = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub")
	if code, _, errOut := runCmd("keygen", "--secret", secret, "--public", public); code != exitOK {
		t.Fatalf("keygen %s: exit %d: %s", name, code, errOut)
	}
	return secret, public
}

// TestProbe: kvflow probe fetches a real prefill side channel's metadata,
// plain and with CURVE; with missing or wrong keys it fails within its
// --timeout with an error that names the likely cause, never hangs.
func TestProbe(t *testing.T) {
	dir := t.TempDir()
	pSec, pPub := keygen(t, dir, "prefill")
	cSec, cPub := keygen(t, dir, "client")
	oSec, oPub := keygen(t, dir, "other")
	pub, err := os.ReadFile(cPub)
	if err != nil {
		t.Fatal(err)
	}
	authorized := filepath.Join(dir, "authorized")
	if err := os.WriteFile(authorized, pub, 0o600); err != nil {
		t.Fatal(err)
	}
	plain := startProbePrefill(t, config.Auth{Mode: config.AuthOff})
	curve := startProbePrefill(t, config.Auth{Mode: config.AuthCurve, SecretKeyFile: pSec, PublicKeyFile: pPub, AuthorizedKeysFile: authorized})

	const timeout = 500 * time.Millisecond
	withKeys := []string{"--auth", "curve", "--auth-server-public-key-file", pPub, "--auth-secret-key-file", cSec, "--auth-public-key-file", cPub}
	noReply := "(no reply within 500ms; "
	cases := []struct {
		name   string
		remote string
		args   []string
		ok     bool
		want   []string // in stderr when !ok
	}{
		{name: "plain", remote: plain, ok: true},
		{name: "plain with done", remote: plain, args: []string{"--done", "req-1"}, ok: true},
		{name: "curve with keys", remote: curve, args: withKeys, ok: true},
		{name: "curve with keys and done", remote: curve, args: append([]string{"--done", "req-2"}, withKeys...), ok: true},
		{name: "curve server, no keys", remote: curve,
			want: []string{noReply, "a server with auth.mode curve also looks like this: pass --auth curve"}},
		{name: "curve server, wrong server key", remote: curve,
			args: []string{"--auth", "curve", "--auth-server-public-key-file", oPub, "--auth-secret-key-file", cSec, "--auth-public-key-file", cPub},
			want: []string{noReply, "wrong server public key"}},
		{name: "curve server, client key not authorized", remote: curve,
			args: []string{"--auth", "curve", "--auth-server-public-key-file", pPub, "--auth-secret-key-file", oSec, "--auth-public-key-file", oPub},
			want: []string{noReply, "authorized keys do not list"}},
		{name: "curve server, one-off client key", remote: curve,
			args: []string{"--auth", "curve", "--auth-server-public-key-file", pPub},
			want: []string{noReply, "authorized keys do not list"}},
		{name: "plain server, curve client", remote: plain, args: withKeys,
			want: []string{noReply, "a server without auth"}},
		// An unresolvable host names the DNS failure, not a timeout.
		{name: "unresolvable host", remote: "kvflow-no-such-host.invalid:20001",
			want: []string{"kvflow probe: resolve kvflow-no-such-host.invalid: lookup kvflow-no-such-host.invalid"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"probe", "--remote", tc.remote, "--json", "--timeout", timeout.String()}, tc.args...)
			start := time.Now()
			code, out, errOut := runCmd(args...)
			took := time.Since(start)
			if took > 5*time.Second {
				t.Errorf("took %v with --timeout %v", took, timeout)
			}
			if !tc.ok {
				if tc.name == "unresolvable host" && strings.Contains(errOut, "no reply") {
					t.Errorf("stderr %q reads as a timeout", errOut)
				}
				if code != exitRuntime {
					t.Errorf("exit %d, want %d; stdout %q", code, exitRuntime, out)
				}
				for _, w := range tc.want {
					if !strings.Contains(errOut, w) {
						t.Errorf("stderr %q does not contain %q", errOut, w)
					}
				}
				return
			}
			if code != exitOK {
				t.Fatalf("exit %d: %s", code, errOut)
			}
			var got map[string]any
			if err := json.Unmarshal([]byte(out), &got); err != nil {
				t.Fatalf("output %q: %v", out, err)
			}
			if got["engine_id"] != "probe-P" || got["num_blocks"] != float64(16) {
				t.Errorf("metadata %v", got)
			}
			if done := strings.Contains(strings.Join(tc.args, " "), "--done"); done && got["ack"] != true {
				t.Errorf("--done: no ack in %v", got)
			}
		})
	}
}

// TestProbeAuthFlags: probe's CURVE flags are checked before anything is
// dialled, each problem named.
func TestProbeAuthFlags(t *testing.T) {
	dir := t.TempDir()
	_, pPub := keygen(t, dir, "prefill")
	cSec, _ := keygen(t, dir, "client")
	notAKey := filepath.Join(dir, "bad.pub")
	if err := os.WriteFile(notAKey, []byte("not a key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	remote := []string{"probe", "--remote", "127.0.0.1:1", "--timeout", "200ms"}
	cases := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"curve without server key", []string{"--auth", "curve"}, exitUsage, "--auth curve needs --auth-server-public-key-file"},
		{"server key without curve", []string{"--auth-server-public-key-file", pPub}, exitUsage, "--auth-server-public-key-file set without --auth curve"},
		{"secret key without curve", []string{"--auth-secret-key-file", cSec}, exitUsage, "--auth-secret-key-file set without --auth curve"},
		{"half a client pair", []string{"--auth", "curve", "--auth-server-public-key-file", pPub, "--auth-secret-key-file", cSec}, exitUsage,
			"--auth-secret-key-file and --auth-public-key-file go together"},
		{"unknown mode", []string{"--auth", "tls"}, exitUsage, `--auth "tls": want off or curve`},
		{"zero timeout", []string{"--timeout", "0s"}, exitUsage, "--timeout 0s: must be at least 1ms"},
		{"missing key file", []string{"--auth", "curve", "--auth-server-public-key-file", filepath.Join(dir, "missing.pub")}, exitRuntime,
			"auth keys: sidechannel: read key file"},
		{"not a key", []string{"--auth", "curve", "--auth-server-public-key-file", notAKey}, exitRuntime, "auth keys: sidechannel: bad CURVE key"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := runCmd(slices.Concat(remote, tc.args)...)
			if code != tc.code || !strings.Contains(errOut, tc.want) {
				t.Errorf("exit %d (want %d), output %q does not contain %q", code, tc.code, out+errOut, tc.want)
			}
		})
	}
}

// TestProbeCompat: with a decode worker's --config, probe shows the peer's
// cache fingerprint and compares it as the decode worker would: a match
// exits 0, a mismatch exits 1 naming the field and both values, a
// configuration that is not a decode worker's exits 2.
func TestProbeCompat(t *testing.T) {
	remote := startProbePrefill(t, config.Auth{Mode: config.AuthOff})
	dir := t.TempDir()
	decodeConfig := func(name string, edit func(*config.Config)) string {
		c := config.Default()
		kv := &c.KVTransfer
		kv.KVConnectorExtraConfig.Prefill = config.Parallel{TPSize: 1, DPSize: 1, PPSize: 1}
		kv.KVConnectorExtraConfig.Decode = config.Parallel{TPSize: 1, DPSize: 1, PPSize: 1}
		kv.KVRole, kv.EngineID = config.KVConsumer, "probe-D"
		c.Model = config.Model{NumLayers: 2, NumKVHeads: 8, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: 64}
		if edit != nil {
			edit(&c)
		}
		path := filepath.Join(dir, name+".json")
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := c.Print(f); err != nil {
			t.Fatal(err)
		}
		return path
	}
	cases := []struct {
		name string
		edit func(*config.Config)
		code int
		want string // in stdout (exit 0, 1) or stderr (exit 2)
	}{
		{"matching", nil, exitOK, "compatible   yes (as prefill rank tp 0 pp 0 pcp 0)"},
		{"block_size", func(c *config.Config) { c.Model.BlockSize = 32 }, exitRuntime,
			"compatible   no: peer probe-P tp 0: block_size is 16, this decode expects 32; block_len of part 0 is 4096, this decode expects 8192"},
		{"prefill tp", func(c *config.Config) {
			c.KVTransfer.KVConnectorExtraConfig.Prefill.TPSize = 2
		}, exitRuntime, "kv_heads is 8, this decode expects 4"},
		{"prefill config", func(c *config.Config) { c.KVTransfer.KVRole = config.KVProducer }, exitUsage, "want a decode worker's configuration"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errOut := runCmd("probe", "--remote", remote, "--timeout", "2s", "--config", decodeConfig(strings.ReplaceAll(tc.name, " ", "_"), tc.edit))
			if code != tc.code {
				t.Fatalf("exit %d, want %d; stdout %q stderr %q", code, tc.code, out, errOut)
			}
			where := out
			if code == exitUsage {
				where = errOut
			}
			if !strings.Contains(where, tc.want) {
				t.Fatalf("output %q does not contain %q", where, tc.want)
			}
			if code != exitUsage && !strings.Contains(out, "cache        gqa bf16, block_size 16, kv_heads 8, head_dim 16") {
				t.Errorf("no fingerprint in %q", out)
			}
		})
	}
	// --json carries the fingerprint and the verdict.
	code, out, _ := runCmd("probe", "--remote", remote, "--json", "--config", decodeConfig("json", nil))
	var got map[string]any
	if err := json.Unmarshal([]byte(out), &got); code != exitOK || err != nil {
		t.Fatalf("exit %d, %v: %q", code, err, out)
	}
	cache, _ := got["cache"].(map[string]any)
	if got["compatible"] != true || cache["block_size"] != float64(16) || cache["num_blocks"] != float64(16) {
		t.Fatalf("json %v", got)
	}
}

// probe's text output gives round trips with their unit.
func TestProbeTextUnits(t *testing.T) {
	plain := startProbePrefill(t, config.Auth{Mode: config.AuthOff})
	code, out, errOut := runCmd("probe", "--remote", plain, "--done", "req-t")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	if !regexp.MustCompile(`(?m)^done +"req-t" acked in [0-9.]+(ns|µs|ms|s)$`).MatchString(out) ||
		!regexp.MustCompile(`(?m)^get_meta +[0-9.]+(ns|µs|ms|s)$`).MatchString(out) {
		t.Errorf("output without units:\n%s", out)
	}
}
