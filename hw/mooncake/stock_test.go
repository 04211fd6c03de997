package mooncake

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net"
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

// TestStockMooncakeBench: Mooncake's transfer_engine_bench as initiator
// (TCP, P2P handshake, connection pool off, its default 12 threads ×
// batch 128: ~1500 one-shot connections at once from one address) reads
// from kvflow's target with its default caps, which must refuse none.
// Runs only under make test-mooncake (MOONCAKE_BENCH, a private network
// namespace).
func TestStockMooncakeBench(t *testing.T) {
	bench := os.Getenv("MOONCAKE_BENCH")
	if bench == "" || os.Getenv("KVFLOW_NETNS") == "" {
		t.Skip("needs MOONCAKE_BENCH and a private network namespace: make test-mooncake")
	}
	srv, _ := newEngine(t, testConfig())
	const buffer = 32 << 20                                            // ≥ 12 threads × 128 × 16 KiB
	mem := mmap(t, buffer)                                             // outside the Go heap: the engine keeps only its address
	if err := srv.Register(AddrOf(mem), buffer, "cpu:0"); err != nil { // the bench's first DRAM buffer
		t.Fatal(err)
	}
	// The initiator's own RPC port: free now in this namespace.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bench, "--mode=initiator", "--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
		"--local_server_name=127.0.0.1:"+strconv.Itoa(port), "--segment_id="+srv.SessionID(), "--operation=read",
		"--block_size=16384", "--buffer_size="+strconv.Itoa(buffer), "--duration=2")
	cmd.Dir = t.TempDir() // glog writes next to the working directory
	cmd.Env = append(os.Environ(), "MC_TCP_ENABLE_CONNECTION_POOL=0")
	out, err := cmd.CombinedOutput()
	refused := map[string]float64{}
	for _, r := range []string{refusedPeerCap, refusedTotalCap, refusedFDReserve} {
		if n := testutil.ToFloat64(srv.m.connRefused.WithLabelValues(portData, r)); n != 0 {
			refused[r] = n
		}
	}
	if err != nil || strings.Contains(string(out), "FAILED") {
		t.Fatalf("transfer_engine_bench: %v (data connections refused: %v)\n%s", err, refused, tail(string(out), 2000))
	}
	if len(refused) != 0 {
		t.Fatalf("data connections refused: %v", refused)
	}
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "throughput") {
			t.Log(strings.TrimSpace(l[max(0, strings.Index(l, "]")+1):]))
		}
	}
}
