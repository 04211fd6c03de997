package demo

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// The Python package's suite (clients/python/tests: the cache-file writer
// against a real kvflow serve, the scheduler rules, the vLLM connector and
// the tiny engine's monolithic-vs-disaggregated equality) runs under go
// test, so make test covers it. It needs Debian's python3 with zmq,
// msgpack, numpy and torch (scripts/deps.sh installs them); without the first
// three it skips, saying why; without torch the engine tests skip (logged).
const systemPython = "/usr/bin/python3"

func TestPythonPackage(t *testing.T) {
	if out, err := exec.Command(systemPython, "-c", "import zmq, msgpack, numpy").CombinedOutput(); err != nil {
		t.Skipf("Python package tests skipped: %s with zmq, msgpack and numpy is not available (%v: %s); "+
			"run scripts/deps.sh", systemPython, err, bytes.TrimSpace(out))
	}
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	bin := filepath.Join(t.TempDir(), "kvflow")
	build := exec.CommandContext(ctx, runtime.GOROOT()+"/bin/go", "build", "-o", bin, "./cmd/kvflow")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/kvflow: %v\n%s", err, out)
	}
	cmd := exec.CommandContext(ctx, systemPython, "-m", "unittest", "discover", "-s", filepath.Join(root, "clients", "python", "tests"), "-v")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "KVFLOW_BIN="+bin, "PYTHONDONTWRITEBYTECODE=1",
		"PYTHONPATH="+filepath.Join(root, "clients", "python"))
	out, err := cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("python unittest: %v", err)
	}
}
