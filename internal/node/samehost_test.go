package node

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/verify"
	"github.com/kvflow/kvflow/stages/plan"
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
