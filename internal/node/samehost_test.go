package node

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvflow/kvflow/internal/config"
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
