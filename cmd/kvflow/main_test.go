package main

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
)

// The test binary doubles as the kvflow binary: the demo re-executes
// os.Executable() as `kvflow serve`, and so do the process tests.
func TestMain(m *testing.M) {
	if os.Getenv("KVFLOW_AS_MAIN") == "1" {
		main()
		return
	}
	os.Setenv("KVFLOW_AS_MAIN", "1") // children of this process run main
	code := m.Run()
	os.Exit(code)
}

func runCmd(args ...string) (code int, stdout, stderr string) {
	var o, e bytes.Buffer
	code = run(context.Background(), args, &o, &e)
	return code, o.String(), e.String()
}

func TestUsage(t *testing.T) {
	cases := []struct {
		args []string
		code int
		want string
	}{
		{nil, exitUsage, "usage: kvflow"},
		{[]string{"help"}, exitOK, "commands:"},
		{[]string{"nope"}, exitUsage, `unknown command "nope"`},
		{[]string{"version"}, exitOK, "kvflow"},
		{[]string{"serve"}, exitUsage, "kv_transfer_config.kv_role"},
		{[]string{"serve", "--tp-rank", "x"}, exitUsage, "tp-rank"},
		{[]string{"serve", "--config", "/nonexistent.json"}, exitUsage, "nonexistent"},
		{[]string{"serve", "extra-arg", "--print-config"}, exitUsage, "unexpected arguments"},
		{[]string{"probe"}, exitUsage, "--remote"},
		{[]string{"bench"}, exitUsage, "subcommand"},
		{[]string{"bench", "xx"}, exitUsage, "unknown subcommand"},
		{[]string{"demo", "--requests", "0"}, exitUsage, "requests"},
		{[]string{"demo", "--preset", "gpt9"}, exitUsage, "preset"},
		{[]string{"plan", "--request-id", "r"}, exitUsage, "invalid configuration"},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, out, errOut := runCmd(tc.args...)
			if code != tc.code || !strings.Contains(out+errOut, tc.want) {
				t.Errorf("exit %d (want %d), output %q does not contain %q", code, tc.code, out+errOut, tc.want)
			}
		})
	}
}

func TestPrintConfig(t *testing.T) {
	code, out, errOut := runCmd("serve", "--config", "../../internal/config/testdata/example-decode.json", "--tp-rank", "0", "--print-config")
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	cfg, err := config.FromJSON([]byte(out))
	if err != nil {
		t.Fatalf("printed config does not load: %v", err)
	}
	if cfg.Rank.TP != 0 || cfg.KVTransfer.EngineID != "decode-0" {
		t.Errorf("flag did not override the file: %+v", cfg.Rank)
	}
}

// A small demo, end to end, in processes: what `make demo` runs.
func TestDemoSmall(t *testing.T) {
	if testing.Short() {
		t.Skip("-short")
	}
	code, out, errOut := runCmd("demo", "--requests", "12", "--max-blocks", "4", "--layers", "4", "--num-blocks", "16",
		"--block-size", "16", "--timeout", "90s")
	if code != exitOK || !strings.Contains(out, "OK: every request done, every byte matched") {
		t.Fatalf("demo exit %d\n%s\n%s", code, out, errOut)
	}
}

// SIGTERM to a serving worker: it drains, reports and exits 0 in time.
func TestServeSIGTERM(t *testing.T) {
	dir := t.TempDir()
	cfg := config.Example(config.Decode)
	cfg.Model.NumBlocks, cfg.Model.NumLayers, cfg.Model.BlockSize = 8, 2, 16
	cfg.KVTransfer.KVPort = config.Port(20000 + os.Getpid()%20000)
	cfg.Node.Control = "ipc://" + filepath.Join(dir, "d.sock")
	cfg.Cache.NoHugePages = true
	cfg.Shutdown.DrainTimeout = config.Duration(3 * time.Second)
	cfgPath := filepath.Join(dir, "d.json")
	f, _ := os.Create(cfgPath)
	cfg.Print(f)
	f.Close()
	exe, _ := os.Executable()
	cmd := exec.Command(exe, "serve", "--config", cfgPath, "--log-format", "json")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			ready <- sc.Text()
		}
	}()
	select {
	case line := <-ready:
		if !strings.HasPrefix(line, "kvflow ready") {
			t.Fatalf("first line %q", line)
		}
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatalf("not ready: %s", stderr.String())
	}
	start := time.Now()
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit: %v\n%s", err, stderr.String())
		}
	case <-time.After(15 * time.Second):
		cmd.Process.Kill()
		t.Fatal("no exit after SIGTERM")
	}
	t.Logf("exited %v after SIGTERM", time.Since(start))
	if !strings.Contains(stderr.String(), "stopped") {
		t.Errorf("no clean stop logged: %s", stderr.String())
	}
}
