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

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestStockMooncakeInitiator: Mooncake's own engine (its Python module,
// TCP transport) reads from kvflow's target, with its connection pool off
// (its default: a connection per request, the path BenchmarkOneShotRead
// measures) and on; the SHA-256 of every byte read must match. The large
// case is a decode rank's load (the seed reads layers × caches × block
// groups requests per batch_transfer_sync_read, from a thread pool): 8
// threads × 2048 requests in one batch each, every request a connection
// of its own from one address, all opened at once; the target, with its
// default caps, must refuse none. Runs only under make test-mooncake: it
// needs MOONCAKE_PY (the module's directory) and a network namespace of
// its own (KVFLOW_NETNS, set by scripts/netns-exec.sh), since Mooncake's
// listeners bind every address.
func TestStockMooncakeInitiator(t *testing.T) {
	py, mod := os.Getenv("SEED_PYTHON"), os.Getenv("MOONCAKE_PY")
	if mod == "" || os.Getenv("KVFLOW_NETNS") == "" {
		t.Skip("needs MOONCAKE_PY and a private network namespace: make test-mooncake")
	}
	if py == "" {
		py = "python3"
	}
	sizes := []int{1, 4096, 65536 + 3, 256 << 10, 1 << 20, 5<<20 + 1}
	for _, tc := range []struct {
		name                  string
		pool                  string
		block, count, threads int
	}{
		{"pool=0", "0", 64 << 10, 128, 1},
		{"pool=1", "1", 64 << 10, 128, 1},
		{"pool=0/8x2048", "0", 8 << 10, 2048, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := newEngine(t, testConfig())
			total := tc.block * tc.count
			var list []string
			for _, n := range sizes {
				total += n
				list = append(list, strconv.Itoa(n))
			}
			mem := register(t, srv, total+4096, 5)
			want := sha256.Sum256(mem[:total])
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, py, "testdata/stock_initiator.py", srv.SessionID(),
				strconv.FormatUint(AddrOf(mem), 10), strings.Join(list, ","), strconv.Itoa(tc.block),
				strconv.Itoa(tc.count), strconv.Itoa(tc.threads))
			cmd.Env = append(os.Environ(), "PYTHONPATH="+mod, "MC_TCP_ENABLE_CONNECTION_POOL="+tc.pool)
			var stderr strings.Builder
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			refused := map[string]float64{}
			for _, r := range []string{refusedPeerCap, refusedTotalCap, refusedFDReserve} {
				if n := testutil.ToFloat64(srv.m.connRefused.WithLabelValues(portData, r)); n != 0 {
					refused[r] = n
				}
			}
			if err != nil {
				t.Fatalf("stock initiator: %v (data connections refused: %v)\n%s", err, refused, tail(stderr.String(), 2000))
			}
			if got := strings.TrimSpace(string(out)); got != hex.EncodeToString(want[:]) {
				t.Fatalf("sha256 of the bytes read %s, want %s\n%s", got, hex.EncodeToString(want[:]), tail(stderr.String(), 2000))
			}
			if len(refused) != 0 {
				t.Fatalf("data connections refused: %v", refused)
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
