package plan

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// checkReads builds rd (reused from earlier calls) for the input and checks
// it against appendOpsRef: same error; on success AppendTo (after a random
// dst prefix) gives exactly the reference ops, Len is OpCount, Bytes is the
// sum of the lengths, At(i) is op i, and the Tensor x Run product walked
// tensor-major is the op list. On error rd must be empty.
func checkReads(t *testing.T, r *rand.Rand, rd *Reads, layout CacheLayout, task Task, local, remote Caches) int {
	t.Helper()
	err := rd.Build(layout, task, local, remote)
	prefix := make([]Op, r.IntN(3))
	for i := range prefix {
		prefix[i] = Op{Local: r.Uint64(), Remote: r.Uint64(), Len: r.Uint64()}
	}
	want, werr := appendOpsRef(slices.Clone(prefix), layout, task, local, remote)
	if fmt.Sprint(err) != fmt.Sprint(werr) {
		t.Fatalf("Build error %v, reference %v\nlayout %+v task %+v", err, werr, layout, task)
	}
	if err != nil {
		if rd.Len() != 0 || rd.Bytes() != 0 || rd.Tensors() != 0 || rd.Runs() != 0 || len(rd.AppendTo(nil)) != 0 {
			t.Fatalf("Reads not empty after error %v: %d ops, %d bytes", err, rd.Len(), rd.Bytes())
		}
		return 0
	}
	want = want[len(prefix):]
	got := rd.AppendTo(slices.Clone(prefix))
	if !slices.Equal(got[:len(prefix)], prefix) {
		t.Fatal("AppendTo changed dst's prefix")
	}
	got = got[len(prefix):]
	if !slices.Equal(got, want) {
		for i := range min(len(got), len(want)) {
			if got[i] != want[i] {
				t.Fatalf("op %d = %+v, reference %+v (%d vs %d ops)\nlayout %+v task %+v", i, got[i], want[i], len(got), len(want), layout, task)
			}
		}
		t.Fatalf("%d ops, reference %d\nlayout %+v task %+v", len(got), len(want), layout, task)
	}
	if rd.Len() != len(want) || OpCount(task, layout) != len(want) {
		t.Fatalf("Len %d, OpCount %d, reference %d ops", rd.Len(), OpCount(task, layout), len(want))
	}
	if rd.Tensors()*rd.Runs() != rd.Len() {
		t.Fatalf("%d tensors x %d runs != %d ops", rd.Tensors(), rd.Runs(), rd.Len())
	}
	var bytes uint64
	blocks := 0
	for j := range rd.Runs() {
		blocks += rd.Run(j).Blocks
	}
	if len(want) > 0 && (blocks != rd.Blocks() || blocks != len(task.LocalBlockIDs)) {
		t.Fatalf("runs cover %d blocks, Blocks %d, task %d", blocks, rd.Blocks(), len(task.LocalBlockIDs))
	}
	i := 0
	for k := range rd.Tensors() {
		tr := rd.Tensor(k)
		for j := range rd.Runs() {
			if op := tr.Op(rd.Run(j)); op != want[i] {
				t.Fatalf("Tensor(%d).Op(Run(%d)) = %+v, op %d is %+v", k, j, op, i, want[i])
			}
			i++
		}
	}
	for i, op := range want {
		bytes += op.Len
		if a := rd.At(i); a != op {
			t.Fatalf("At(%d) = %+v, op %+v", i, a, op)
		}
	}
	if rd.Bytes() != bytes {
		t.Fatalf("Bytes %d, ops sum to %d", rd.Bytes(), bytes)
	}
	return len(want)
}

// TestReadsMatchesReferenceRandomTasks: the compact form, rebuilt in place
// for every random task (so stale runs of a previous build would show),
// expands to exactly the reference ops.
func TestReadsMatchesReferenceRandomTasks(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	iters := 20000
	if testing.Short() {
		iters = 2000
	}
	var rd Reads
	var small [2]BlockRun
	rs := Reads{runs: small[:0]} // starts with little run storage
	nops := 0
	for it := range iters {
		layout, task, local, remote := randOpsInput(r, it)
		nops += checkReads(t, r, &rd, layout, task, local, remote)
		checkReads(t, r, &rs, layout, task, local, remote)
		var fresh Reads
		checkReads(t, r, &fresh, layout, task, local, remote)
	}
	t.Logf("%d tasks, %d ops compared", iters, nops)
}

// TestReadsMatchesReferencePlans: every task of the benchmark's 128-block
// GQA P = 4 and MLA requests, and of prefix-hit variants.
func TestReadsMatchesReferencePlans(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	var rd Reads
	for _, c := range []struct {
		name   string
		topo   Topology
		layout CacheLayout
	}{{"GQA64P4", gqa(), gqaLayout}, {"MLA64", mla(), mlaLayout}} {
		for _, nl := range []int{128, 100, 1, 0} {
			local, remote := make([]int, nl), make([]int, 128)
			for i := range local {
				local[i] = 1000 + i + i/16*3
			}
			for i := range remote {
				remote[i] = 20 + i
			}
			req := Request{ID: "cmpl-5d73b0af444ad0bf081de695914b7c9e-0", LocalBlockIDs: local, RemoteBlockIDs: remote, RemotePort: 30000}
			pl, err := PlanRequest(c.topo, Rank{TP: 1}, req)
			if err != nil {
				t.Fatal(err)
			}
			cpl := c.layout.CachesPerLayer
			lbase := randBases(r, c.topo.Model.NumLayers*cpl, false)
			n := 0
			for _, task := range pl.Tasks {
				rbase := randBases(r, (task.LayerEnd-task.LayerStart)*cpl, false)
				n += checkReads(t, r, &rd, c.layout, task, Caches{Base: lbase, NumBlocks: 2000}, Caches{Base: rbase, NumBlocks: 200})
			}
			t.Logf("%s, %d local blocks: %d tasks, %d ops", c.name, nl, len(pl.Tasks), n)
		}
	}
}

// Rebuilding a Reads allocates nothing once its run storage is big enough,
// and AppendOps allocates nothing beyond dst for up to 16 runs.
func TestReadsBuildAllocs(t *testing.T) {
	topoLayouts := []struct {
		topo   Topology
		layout CacheLayout
	}{{gqa(), gqaLayout}, {mla(), mlaLayout}}
	for _, c := range topoLayouts {
		ids := make([]int, 128)
		for i := range ids {
			ids[i] = i + i/16*3 // 8 runs
		}
		pl, err := PlanRequest(c.topo, Rank{TP: 1}, Request{ID: "r", LocalBlockIDs: ids, RemoteBlockIDs: ids, RemotePort: 30000})
		if err != nil {
			t.Fatal(err)
		}
		cpl := c.layout.CachesPerLayer
		lbase := make([]uint64, c.topo.Model.NumLayers*cpl)
		task := pl.Tasks[0]
		rbase := make([]uint64, (task.LayerEnd-task.LayerStart)*cpl)
		var rd Reads
		if err := rd.Build(c.layout, task, Caches{Base: lbase}, Caches{Base: rbase}); err != nil {
			t.Fatal(err)
		}
		if n := testing.AllocsPerRun(100, func() {
			_ = rd.Build(c.layout, task, Caches{Base: lbase}, Caches{Base: rbase})
		}); n != 0 {
			t.Errorf("P=%d: Build allocates %v times", task.P, n)
		}
		dst := make([]Op, 0, rd.Len())
		if n := testing.AllocsPerRun(100, func() {
			dst, _ = AppendOps(dst[:0], c.layout, task, Caches{Base: lbase}, Caches{Base: rbase})
		}); n != 0 {
			t.Errorf("P=%d: AppendOps allocates %v times", task.P, n)
		}
	}
}

func TestReadsAtOutOfRange(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("At(0) of an empty Reads did not panic")
		}
	}()
	var rd Reads
	rd.At(0)
}

// TestInterleaveMatchesTranspose: for random P > 1 tasks, every byte an
// interleaved op lands (its op start, then rows of row/P bytes, row bytes
// apart) is where the seed's contiguous read followed by its head
// transpose ([P][block_size][row/P] -> [block_size][P][row/P]) puts it.
// Remote addresses, lengths and the op count are unchanged.
func TestInterleaveMatchesTranspose(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	var plain, fused Reads
	for it := range 3000 {
		p := []int{2, 4, 8}[r.IntN(3)]
		bs := []int{1, 2, 16, 128}[r.IntN(4)]
		slice := uint64(2 * (1 + r.IntN(64))) // bytes of one token's slot
		parts := 1 + r.IntN(3)
		l := uint64(bs) * uint64(p) * slice
		layout := CacheLayout{CachesPerLayer: parts}
		for range parts {
			layout.BlockLen = append(layout.BlockLen, l)
		}
		layers := 1 + r.IntN(3)
		nb := 4 + r.IntN(12)
		local, remote := Caches{NumBlocks: nb}, Caches{NumBlocks: nb}
		for k := range layers * parts {
			local.Base = append(local.Base, 1<<40+uint64(k)*uint64(nb)*l)
			remote.Base = append(remote.Base, 1<<41+uint64(k)*uint64(nb)*l)
		}
		n := 1 + r.IntN(nb)
		task := Task{P: p, HeadSlot: r.IntN(p), LayerStart: 0, LayerEnd: layers,
			LocalBlockIDs: r.Perm(nb)[:n], RemoteBlockIDs: r.Perm(nb)[:n]}
		if err := plain.Build(layout, task, local, remote); err != nil {
			t.Fatal(err)
		}
		if err := fused.Build(layout, task, local, remote); err != nil {
			t.Fatal(err)
		}
		row, pitch, err := fused.Interleave(bs)
		if err != nil {
			t.Fatalf("layout %+v block_size %d P %d: %v", layout, bs, p, err)
		}
		if pitch != l/uint64(bs) || row != pitch/uint64(p) {
			t.Fatalf("stride %d/%d, want rows of %d, %d apart", row, pitch, pitch/uint64(p), l/uint64(bs))
		}
		if fused.Len() != plain.Len() || fused.Bytes() != plain.Bytes() {
			t.Fatalf("interleaving changed the reads: %d ops %d bytes, was %d %d", fused.Len(), fused.Bytes(), plain.Len(), plain.Bytes())
		}
		ops, fops := plain.AppendTo(nil), fused.AppendTo(nil)
		plane := l / uint64(p)
		for i, op := range ops {
			f := fops[i]
			if f.Remote != op.Remote || f.Len != op.Len {
				t.Fatalf("op %d: remote %#x+%d, was %#x+%d", i, f.Remote, f.Len, op.Remote, op.Len)
			}
			k := i / plain.Runs()
			blockStart := op.Local - (op.Local-local.Base[k])%l
			for _, j := range []uint64{0, op.Len - 1, r.Uint64N(op.Len)} {
				o := op.Local - blockStart + j // offset in the block, read as is
				q, rest := o/plane, o%plane
				tok, c := rest/row, rest%row
				want := blockStart + tok*pitch + q*row + c // after the transpose
				if got := f.Local + (j/row)*pitch + j%row; got != want {
					t.Fatalf("it %d op %d byte %d lands at %#x, the transpose puts it at %#x", it, i, j, got, want)
				}
			}
		}
	}
}

// TestInterleaveRejects: layouts and tasks the fused transpose cannot
// serve are refused, and the reads stay as built.
func TestInterleaveRejects(t *testing.T) {
	for _, tc := range []struct {
		name     string
		blockLen []uint64
		bs, p    int
	}{
		{"P 1", []uint64{4096}, 16, 1},
		{"block size 0", []uint64{4096}, 0, 2},
		{"rows do not divide", []uint64{4096}, 3, 2},
		{"slices do not divide", []uint64{48}, 16, 2},
		{"parts differ", []uint64{4096, 2048}, 16, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := CanInterleave(tc.blockLen, tc.bs, tc.p); err == nil {
				t.Fatal("accepted")
			}
		})
	}
	var rd Reads
	layout := CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 1}
	task := Task{P: 2, HeadSlot: 1, LayerEnd: 1, LocalBlockIDs: []int{0}, RemoteBlockIDs: []int{1}}
	caches := Caches{Base: []uint64{1 << 30}, NumBlocks: 4}
	if err := rd.Build(layout, task, caches, caches); err != nil {
		t.Fatal(err)
	}
	before := rd.AppendTo(nil)
	if _, _, err := rd.Interleave(3); err == nil {
		t.Fatal("block_size 3 accepted")
	}
	if after := rd.AppendTo(nil); !slices.Equal(before, after) {
		t.Fatalf("a refused Interleave changed the ops: %+v, was %+v", after, before)
	}
}
