package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/hw/shm"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/verify"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// shmConfig sets node.te_backend shm and a cache file per worker when tp
// asks for it.
func shmConfig(t *testing.T, tp topo, cfg *config.Config) {
	if !tp.shm {
		return
	}
	cfg.Node.TEBackend = config.BackendShm
	cfg.Cache.Mode = config.CacheShm
	cfg.Cache.Path = filepath.Join(t.TempDir(), fmt.Sprintf("%s-pp%d-tp%d.kv", cfg.Role(), cfg.Rank.PP, cfg.Rank.TP))
}

// replaceCacheFiles puts another file at every prefill's cache path: the
// same header and size (a copy of the first page, the rest zero), another
// inode. A decode that mapped it would read zeros; it must refuse the
// claim and read over TCP.
func replaceCacheFiles(t *testing.T, c *cluster) {
	t.Helper()
	for _, p := range c.prefill {
		path := p.Config.CachePath()
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		head := make([]byte, 4096)
		f, err := os.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.ReadAt(head, 0); err != nil {
			t.Fatal(err)
		}
		f.Close()
		if err := os.Rename(path, path+".moved"); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, head, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(path, st.Size()); err != nil {
			t.Fatal(err)
		}
	}
}

// checkSameHostPath: every decode read batch went over shared memory and
// no claim failed; or, with the files replaced, every batch went over
// TCP and each decode counted the mismatch.
func checkSameHostPath(t *testing.T, c *cluster, mismatch bool) {
	t.Helper()
	for _, d := range c.decode {
		reg := c.regs[d]
		viaShm := counter(t, reg, "kvflow_shm_batches_total", map[string]string{"path": "shm"})
		viaNet := counter(t, reg, "kvflow_shm_batches_total", map[string]string{"path": "network"})
		mism := counter(t, reg, "kvflow_shm_fallbacks_total", map[string]string{"reason": "mismatch"})
		all := counter(t, reg, "kvflow_shm_fallbacks_total", nil)
		switch {
		case mismatch && (viaShm != 0 || viaNet == 0 || mism == 0):
			t.Errorf("decode rank %d: claims of replaced files: %v batches over shm, %v over tcp, %v mismatches", d.Config.Rank.TP, viaShm, viaNet, mism)
		case !mismatch && (viaShm == 0 || viaNet != 0 || all != 0):
			t.Errorf("decode rank %d: %v batches over shm, %v over tcp, %v fallbacks", d.Config.Rank.TP, viaShm, viaNet, all)
		}
	}
}

// TestSameHostFreedAndRegrantedNeverRead: a request freed early (an
// outsider's DONE) whose blocks the engine has already reused for another
// request, sent and granted, is refused over shm: the grant table binds
// each grant to its request, and the decode's read names its own. (The
// TCP engine's grants are per range: there the read would be served.)
func TestSameHostFreedAndRegrantedNeverRead(t *testing.T) {
	c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2), shm: true})
	p := c.prefill[0]
	blocks := []int{3, 4}
	fill := func(id string) {
		verify.FillBlocks(p.Device, p.Shape.NumLayers, p.Device.Layout().NumParts(), 0, blocks, plan.StringToInt64Hash(id))
	}
	send := func(id string) {
		if err := p.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: blocks}})[0]; err != nil {
			t.Fatal(err)
		}
	}
	fill("victim")
	send("victim")
	outsiderDone(t, p, "victim")
	deadline := time.Now().Add(10 * time.Second)
	for freed := false; !freed; {
		freed = slices.Contains(p.Prefill.Finished(), "victim")
		if !freed && time.Now().After(deadline) {
			t.Fatal("the forged DONE never freed the request")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// The engine reuses the blocks for another request, held and granted.
	fill("someone-else")
	send("someone-else")
	if err := load(t, c.decode[0], "victim", blocks, blocks, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	r := waitResult(t, c, 30*time.Second)
	if r.Err == nil {
		t.Fatal("the decode read blocks freed and re-granted to another request, and reported them done")
	}
	if !strings.Contains(r.Err.Error(), `request "victim"`) {
		t.Errorf("refused for another reason: %v", r.Err)
	}
	t.Logf("failed, as it should: %v", r.Err)
	// The other request reads its own blocks.
	if err := load(t, c.decode[0], "someone-else", blocks, blocks, c.kvPort, "P"); err != nil {
		t.Fatal(err)
	}
	if r := waitResult(t, c, 30*time.Second); r.Err != nil {
		t.Fatalf("the request now holding the blocks: %v", r.Err)
	}
	checkBytes(t, c, "someone-else", blocks, blocks)
	if n := counter(t, c.regs[c.decode[0]], "kvflow_shm_batches_total", map[string]string{"path": "network"}); n != 0 {
		t.Errorf("%v batches over the network", n)
	}
}

// TestSameHostOffer: what each GET_META reply's claim does to a session:
// none or another host's → the network (the latter counted); a claim that
// holds → shared memory, kept while the replies repeat it, replaced (the
// old reader closed) when the claim changes; the same file under another
// session (the rank restarted on another port) drops the old session.
func TestSameHostOffer(t *testing.T) {
	dir := t.TempDir()
	shape := npu.Shape{NumLayers: 1, NumBlocks: 4, BlockSize: 2, NumKVHeads: 1, HeadDim: 4, DType: npu.BF16}
	l, err := npu.NewLayout(shape)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "p.kv")
	h, err := npu.CreateShm(path, l, npu.HostOptions{NoLock: true, NoHugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	tb, err := shm.CreateTable(path+".grants", shape.NumBlocks, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer tb.Close(false)
	c, err := shm.MakeClaim(path, tb)
	if err != nil {
		t.Fatal(err)
	}
	claim := &sidechannel.SameHost{HostID: c.HostID, Path: c.Path, Dev: c.Dev, Ino: c.Ino, Size: c.Size, Header: c.Header,
		Grants: c.Grants, GrantsDev: c.GrantsDev, GrantsIno: c.GrantsIno, Epoch: c.Epoch}
	local, err := npu.NewHost(l, npu.HostOptions{NoLock: true, NoHugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	var netBatches int
	net := read.OpsFunc(func(context.Context, string, []plan.Op) error { netBatches++; return nil })
	reg := prometheus.NewRegistry()
	s := newSameHost(net, local, reg, slog.New(slog.DiscardHandler))
	defer s.Close()
	meta := func(port int, c *sidechannel.SameHost) sidechannel.Metadata {
		return sidechannel.Metadata{TERPCPort: port, KVCachesBaseAddr: h.BaseAddrs(), NumBlocks: shape.NumBlocks, Ext: sidechannel.Ext{SameHost: c}}
	}
	reader := func(session string) *shm.Reader {
		s.mu.Lock()
		defer s.mu.Unlock()
		if p := s.peers[session]; p != nil {
			return p.r
		}
		return nil
	}
	s.offer("127.0.0.1:1", meta(5000, nil))
	if reader("127.0.0.1:5000") != nil {
		t.Fatal("a reply without a claim opened a reader")
	}
	other := *claim
	other.HostID = "boot:elsewhere"
	s.offer("127.0.0.1:1", meta(5000, &other))
	if reader("127.0.0.1:5000") != nil || counter(t, reg, "kvflow_shm_fallbacks_total", map[string]string{"reason": "other_host"}) != 1 {
		t.Fatal("another host's claim: not a counted fallback")
	}
	s.offer("127.0.0.1:1", meta(5000, claim))
	r1 := reader("127.0.0.1:5000")
	if r1 == nil {
		t.Fatal("a claim that holds opened no reader")
	}
	s.offer("127.0.0.1:1", meta(5000, claim))
	if reader("127.0.0.1:5000") != r1 {
		t.Fatal("the same claim re-opened the reader")
	}
	// Batches go to the reader (refused: nothing granted) or the network.
	b := &read.Batch{List: []plan.Op{{Local: local.BaseAddrs()[0], Remote: h.BaseAddrs()[0], Len: 16}}, Request: "x"}
	if err := s.BatchRead(t.Context(), "127.0.0.1:5000", b); !errors.Is(err, shm.ErrNotGranted) || !s.caps.Classify(err).Refused {
		t.Fatalf("ungranted same-host batch: %v", err)
	}
	if err := tb.GrantRequest("x", []int{0}); err != nil {
		t.Fatal(err)
	}
	if err := s.BatchRead(t.Context(), "127.0.0.1:5000", b); err != nil {
		t.Fatal(err)
	}
	if err := s.BatchRead(t.Context(), "127.0.0.1:5001", b); err != nil || netBatches != 1 {
		t.Fatalf("unknown session: %v, %d network batches", err, netBatches)
	}
	// The rank restarted on another port: the old session is dropped and
	// its reader closed.
	s.offer("127.0.0.1:1", meta(5002, claim))
	if reader("127.0.0.1:5002") == nil || reader("127.0.0.1:5000") != nil {
		t.Fatal("same file under a new session: old session kept")
	}
	if err := r1.Read(t.Context(), "x", nil, shm.Stride{}); !errors.Is(err, shm.ErrClosed) || !s.caps.Classify(err).ConnLost {
		t.Fatalf("the replaced reader: %v", err)
	}
	// A stale claim (another epoch): counted, read over the network.
	stale := *claim
	stale.Epoch++
	s.offer("127.0.0.1:1", meta(5002, &stale))
	if reader("127.0.0.1:5002") != nil || counter(t, reg, "kvflow_shm_fallbacks_total", map[string]string{"reason": "owner_gone"}) != 1 {
		t.Fatal("a stale claim: not a counted fallback")
	}
}
