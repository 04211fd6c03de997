package mooncake

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestStockMooncakeInitiator: Mooncake's own engine (its Python module,
// TCP transport) reads from kvflow's target, with its connection pool off
// (its default: a connection per request, the path BenchmarkOneShotRead
// measures) and on; the SHA-256 of every byte read must match. Runs only
// under make test-mooncake: it needs MOONCAKE_PY (the module's directory)
// and a network namespace of its own (KVFLOW_NETNS, set by
// scripts/netns-exec.sh), since Mooncake's listeners bind every address.
func TestStockMooncakeInitiator(t *testing.T) {
	py, mod := os.Getenv("SEED_PYTHON"), os.Getenv("MOONCAKE_PY")
	if mod == "" || os.Getenv("KVFLOW_NETNS") == "" {
		t.Skip("needs MOONCAKE_PY and a private network namespace: make test-mooncake")
	}
	if py == "" {
		py = "python3"
	}
	srv, _ := newEngine(t, testConfig())
	const block, count = 64 << 10, 128
	sizes := []int{1, 4096, 65536 + 3, 256 << 10, 1 << 20, 5<<20 + 1}
	total := block * count
	var list []string
	for _, n := range sizes {
		total += n
		list = append(list, strconv.Itoa(n))
	}
	mem := register(t, srv, total+4096, 5)
	want := sha256.Sum256(mem[:total])
	for _, pool := range []string{"0", "1"} {
		t.Run("pool="+pool, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, py, "testdata/stock_initiator.py", srv.SessionID(),
				strconv.FormatUint(AddrOf(mem), 10), strings.Join(list, ","), strconv.Itoa(block), strconv.Itoa(count))
			cmd.Env = append(os.Environ(), "PYTHONPATH="+mod, "MC_TCP_ENABLE_CONNECTION_POOL="+pool)
			var stderr strings.Builder
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("stock initiator: %v\n%s", err, tail(stderr.String(), 2000))
			}
			if got := strings.TrimSpace(string(out)); got != hex.EncodeToString(want[:]) {
				t.Fatalf("sha256 of the bytes read %s, want %s\n%s", got, hex.EncodeToString(want[:]), tail(stderr.String(), 2000))
			}
		})
	}
}

// tail is the last n bytes of s.
func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
