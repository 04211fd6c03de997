package control

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvflow/kvflow/hw/npu"
)

// The Python client's tests. They need Debian's python3 with pyzmq, msgpack
// and numpy (apt-get install python3-zmq python3-msgpack python3-numpy):
// /usr/bin/python3, not whatever python3 is first on PATH (often a pyenv or
// venv without them). Without it they skip, saying why.
const systemPython = "/usr/bin/python3"

var clientDir = filepath.Join("..", "..", "clients", "python")

func python(t *testing.T) string {
	t.Helper()
	out, err := exec.Command(systemPython, "-c", "import zmq, msgpack, numpy").CombinedOutput()
	if err != nil {
		t.Skipf("Python client tests skipped: %s with zmq, msgpack and numpy is not available (%v: %s); "+
			"apt-get install python3-zmq python3-msgpack python3-numpy", systemPython, err, bytes.TrimSpace(out))
	}
	return systemPython
}

// runPython runs a script with clients/python on PYTHONPATH and fails the
// test with its output if it exits non-zero.
func runPython(t *testing.T, args ...string) string {
	t.Helper()
	py := python(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	abs, err := filepath.Abs(clientDir)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, py, args...)
	cmd.Env = append(cmd.Environ(), "PYTHONPATH="+abs, "PYTHONDONTWRITEBYTECODE=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", py, args, err, out)
	}
	return string(out)
}

// TestPythonUnittest runs clients/python's own unittest suite, so that
// go test ./... (and make test) covers it.
func TestPythonUnittest(t *testing.T) {
	out := runPython(t, "-m", "unittest", "discover", "-s", clientDir, "-p", "test_*.py", "-v")
	t.Log(out)
}

// TestPythonClientAgainstServe: kvflow_client calls every op against the
// real control socket (Serve on ipc://) backed by the fake Backend.
func TestPythonClientAgainstServe(t *testing.T) {
	python(t)
	for _, role := range []string{"decode", "prefill"} {
		t.Run(role, func(t *testing.T) {
			f := &fakeBackend{}
			ep := serve(t, f.backend(role))
			runPython(t, filepath.Join("testdata", "client_ops.py"), ep, role)
			f.mu.Lock()
			defer f.mu.Unlock()
			// What the backend saw is what the Python client meant.
			if role == "decode" {
				if len(f.loads) != 2 || len(f.loads[0]) != 2 || len(f.loads[1]) != 0 {
					t.Fatalf("loads %+v", f.loads)
				}
				r := f.loads[0][0]
				p := r.Params
				if r.RequestID != "r1" || len(r.LocalBlockIDs) != 3 || r.LocalBlockIDs[2] != 3 ||
					len(p.RemoteBlockIDs) != 3 || p.RemoteBlockIDs[0] != 7 || p.RemoteEngineID != "p-engine" ||
					p.RemoteHost != "10.0.0.2" || p.RemotePort != 30001 || p.RemotePCPSize != 1 || p.RemoteDCPSize != 2 {
					t.Fatalf("load decoded as %+v", r)
				}
				if len(f.sends) != 0 {
					t.Fatalf("sends reached a decode backend: %+v", f.sends)
				}
			} else {
				if len(f.sends) != 1 || len(f.sends[0]) != 2 || len(f.loads) != 0 {
					t.Fatalf("sends %+v loads %+v", f.sends, f.loads)
				}
				s := f.sends[0][0]
				if s.RequestID != "s1" || s.DelayStartTime != 1712345678.25 || len(s.BlockIDs) != 2 || s.BlockIDs[1] != 5 ||
					f.sends[0][1].DelayStartTime != 0 || f.sends[0][1].BlockIDs != nil {
					t.Fatalf("send decoded as %+v", f.sends[0])
				}
			}
			if len(f.aborts) != 1 || len(f.aborts[0]) != 3 || f.aborts[0][1] != "other" {
				t.Fatalf("aborts %+v", f.aborts)
			}
		})
	}
}

// TestPythonAttachCache: attach_cache reads a cache file made by
// npu.CreateShm exactly as kvflow laid it out, and writes land in
// kvflow's memory.
func TestPythonAttachCache(t *testing.T) {
	python(t)
	shapes := []struct {
		name    string
		s       npu.Shape
		npDType string
		shape   func(p npu.Part) []int
	}{
		{"gqa bf16", npu.Shape{NumLayers: 2, NumBlocks: 3, BlockSize: 4, DType: npu.BF16, NumKVHeads: 2, HeadDim: 8},
			"<u2", func(p npu.Part) []int { return []int{3, 4, p.Heads, p.Dim} }},
		{"gqa flat fp16", npu.Shape{NumLayers: 3, NumBlocks: 5, BlockSize: 16, DType: npu.FP16, NumKVHeads: 4, HeadDim: 64, Flat: true},
			"<f2", func(p npu.Part) []int { return []int{5, 16, p.Heads * p.Dim} }},
		{"gqa fp32 unaligned", npu.Shape{NumLayers: 2, NumBlocks: 3, BlockSize: 3, DType: npu.FP32, NumKVHeads: 3, HeadDim: 5},
			"<f4", func(p npu.Part) []int { return []int{3, 3, p.Heads, p.Dim} }},
		{"mla fp32", npu.Shape{NumLayers: 2, NumBlocks: 4, BlockSize: 8, DType: npu.FP32, MLA: true, KVLoraRank: 32, QKRopeHeadDim: 8},
			"<f4", func(p npu.Part) []int { return []int{4, 8, 1, p.Dim} }},
		{"sparse int8", npu.Shape{NumLayers: 2, NumBlocks: 4, BlockSize: 8, DType: npu.INT8, MLA: true, KVLoraRank: 32, QKRopeHeadDim: 8, Sparse: true, IndexerDim: 16},
			"|i1", func(p npu.Part) []int { return []int{4, 8, 1, p.Dim} }},
		{"mla fp8", npu.Shape{NumLayers: 1, NumBlocks: 2, BlockSize: 4, DType: npu.FP8, MLA: true, KVLoraRank: 16, QKRopeHeadDim: 16},
			"|u1", func(p npu.Part) []int { return []int{2, 4, 1, p.Dim} }},
	}
	for _, c := range shapes {
		t.Run(c.name, func(t *testing.T) {
			l, err := npu.NewLayout(c.s)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "cache")
			h, err := npu.CreateShm(path, l, npu.HostOptions{NoHugePages: true, RemoveOnClose: true})
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			type cacheSpec struct {
				K       int    `json:"k"`
				Layer   int    `json:"layer"`
				Part    int    `json:"part"`
				Shape   []int  `json:"shape"`
				NPDType string `json:"np_dtype"`
				Offset  int64  `json:"offset"`
			}
			var caches []cacheSpec
			for k := range l.NumCaches() {
				layer, part := l.CacheOf(k)
				b := h.Bytes(layer, part)
				for i := range b {
					b[i] = byte(k*37 + i*7 + i/251)
				}
				caches = append(caches, cacheSpec{K: k, Layer: layer, Part: part, Shape: c.shape(l.Part(part)),
					NPDType: c.npDType, Offset: l.Offset(layer, part)})
			}
			spec, _ := json.Marshal(map[string]any{
				"path": path, "kind": l.Kind().String(), "dtype": c.s.DType.String(), "num_layers": c.s.NumLayers,
				"num_parts": l.NumParts(), "block_lens": l.BlockLens(), "caches": caches,
			})
			runPython(t, filepath.Join("testdata", "attach_cache.py"), string(spec))
			// Python wrote block 1 of the last cache, and nothing else.
			last := caches[len(caches)-1]
			for k := range l.NumCaches() {
				layer, part := l.CacheOf(k)
				b := h.Bytes(layer, part)
				bl := l.BlockLen(part)
				for i := range b {
					want := byte(k*37 + i*7 + i/251)
					if k == last.K && i >= bl && i < 2*bl {
						want = 0xAB
					}
					if b[i] != want {
						t.Fatalf("cache %d byte %d = %#x, want %#x", k, i, b[i], want)
					}
				}
			}
		})
	}
}
