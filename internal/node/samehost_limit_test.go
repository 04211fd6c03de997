package node

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/hw/shm"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// TestSameHostMapLimit: the cache files a decode maps are bounded together
// (by this host's memory; here by a test limit), whatever number of
// sessions GET_META replies name: past it a claim is a counted fallback
// ("too_large") read over the network. A session's own previous file does
// not count against its new claim.
func TestSameHostMapLimit(t *testing.T) {
	dir := t.TempDir()
	shape := npu.Shape{NumLayers: 1, NumBlocks: 4, BlockSize: 2, NumKVHeads: 1, HeadDim: 4, DType: npu.BF16}
	l, err := npu.NewLayout(shape)
	if err != nil {
		t.Fatal(err)
	}
	type pf struct {
		h     *npu.Host
		claim *sidechannel.SameHost
	}
	mk := func(i int) pf {
		path := filepath.Join(dir, fmt.Sprintf("p%d.kv", i))
		h, err := npu.CreateShm(path, l, npu.HostOptions{NoLock: true, NoHugePages: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		tb, err := shm.CreateTable(path+shm.TableSuffix, shape.NumBlocks, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tb.Close(false) })
		c, err := shm.MakeClaim(path, tb)
		if err != nil {
			t.Fatal(err)
		}
		return pf{h, &sidechannel.SameHost{HostID: c.HostID, Path: c.Path, Dev: c.Dev, Ino: c.Ino, Size: c.Size, Header: c.Header,
			Grants: c.Grants, GrantsDev: c.GrantsDev, GrantsIno: c.GrantsIno, Epoch: c.Epoch}}
	}
	a, b := mk(1), mk(2)
	old := shmMapLimit
	shmMapLimit = func() uint64 { return a.claim.Size + a.claim.Size/2 }
	t.Cleanup(func() { shmMapLimit = old })

	local, err := npu.NewHost(l, npu.HostOptions{NoLock: true, NoHugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	net := read.OpsFunc(func(context.Context, string, []plan.Op) error { return nil })
	reg := prometheus.NewRegistry()
	s := newSameHost(net, local, reg, slog.New(slog.DiscardHandler))
	defer s.Close()
	meta := func(port int, p pf) sidechannel.Metadata {
		return sidechannel.Metadata{TERPCPort: port, KVCachesBaseAddr: p.h.BaseAddrs(), NumBlocks: shape.NumBlocks, Ext: sidechannel.Ext{SameHost: p.claim}}
	}
	reader := func(session string) *shm.Reader {
		s.mu.Lock()
		defer s.mu.Unlock()
		if p := s.peers[session]; p != nil {
			return p.r
		}
		return nil
	}
	s.offer("127.0.0.1:1", meta(5000, a))
	if reader("127.0.0.1:5000") == nil {
		t.Fatal("the first file under the limit was not mapped")
	}
	s.offer("127.0.0.1:1", meta(5001, b))
	if reader("127.0.0.1:5001") != nil || counter(t, reg, "kvflow_shm_fallbacks_total", map[string]string{"reason": "too_large"}) != 1 {
		t.Fatal("a second file past the limit: mapped, or not a counted fallback")
	}
	// Session 5000 now offers b: a's mapping is replaced, not added to.
	s.offer("127.0.0.1:1", meta(5000, b))
	if reader("127.0.0.1:5000") == nil {
		t.Fatal("a session's new claim counted its own previous file against the limit")
	}
}

// TestSameHostSessionConflict: the TE session a claim applies to is
// "endpoint host:te_rpc_port", the port from the metadata. A hostile
// side-channel peer on the same host naming another prefill's te_rpc_port
// must not have the decode read that prefill's session from the hostile
// file: two endpoints claiming one session with different files leave it
// on the network (counted "conflict"), whichever came first, and a
// reply without a claim from the other endpoint does not clear it.
func TestSameHostSessionConflict(t *testing.T) {
	dir := t.TempDir()
	shape := npu.Shape{NumLayers: 1, NumBlocks: 4, BlockSize: 2, NumKVHeads: 1, HeadDim: 4, DType: npu.BF16}
	l, err := npu.NewLayout(shape)
	if err != nil {
		t.Fatal(err)
	}
	mk := func(i int) (*npu.Host, *sidechannel.SameHost) {
		path := filepath.Join(dir, fmt.Sprintf("p%d.kv", i))
		h, err := npu.CreateShm(path, l, npu.HostOptions{NoLock: true, NoHugePages: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		tb, err := shm.CreateTable(path+shm.TableSuffix, shape.NumBlocks, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tb.Close(false) })
		c, err := shm.MakeClaim(path, tb)
		if err != nil {
			t.Fatal(err)
		}
		return h, &sidechannel.SameHost{HostID: c.HostID, Path: c.Path, Dev: c.Dev, Ino: c.Ino, Size: c.Size, Header: c.Header,
			Grants: c.Grants, GrantsDev: c.GrantsDev, GrantsIno: c.GrantsIno, Epoch: c.Epoch}
	}
	hl, legit := mk(1)
	hh, hostile := mk(2)
	local, err := npu.NewHost(l, npu.HostOptions{NoLock: true, NoHugePages: true})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	net := read.OpsFunc(func(context.Context, string, []plan.Op) error { return nil })
	for _, hostileFirst := range []bool{false, true} {
		t.Run(fmt.Sprint("hostile first ", hostileFirst), func(t *testing.T) {
			reg := prometheus.NewRegistry()
			s := newSameHost(net, local, reg, slog.New(slog.DiscardHandler))
			defer s.Close()
			reader := func() *shm.Reader {
				s.mu.Lock()
				defer s.mu.Unlock()
				if p := s.peers["127.0.0.1:5000"]; p != nil {
					return p.r
				}
				return nil
			}
			good := sidechannel.Metadata{TERPCPort: 5000, KVCachesBaseAddr: hl.BaseAddrs(), NumBlocks: 4, Ext: sidechannel.Ext{SameHost: legit}}
			bad := sidechannel.Metadata{TERPCPort: 5000, KVCachesBaseAddr: hh.BaseAddrs(), NumBlocks: 4, Ext: sidechannel.Ext{SameHost: hostile}}
			if hostileFirst {
				s.offer("127.0.0.1:6001", bad)
				s.offer("127.0.0.1:6000", good)
			} else {
				s.offer("127.0.0.1:6000", good)
				s.offer("127.0.0.1:6001", bad)
			}
			if r := reader(); r != nil {
				t.Fatal("a session claimed by two endpoints with two files is read from a mapped file")
			}
			if n := counter(t, reg, "kvflow_shm_fallbacks_total", map[string]string{"reason": "conflict"}); n != 1 {
				t.Fatalf("conflicts counted: %v", n)
			}
			// The hostile endpoint withdraws its claim, then offers it again.
			s.offer("127.0.0.1:6001", sidechannel.Metadata{TERPCPort: 5000})
			s.offer("127.0.0.1:6001", bad)
			s.offer("127.0.0.1:6000", good)
			if r := reader(); r != nil {
				t.Fatal("the conflict was cleared by the other endpoint")
			}
		})
	}
}
