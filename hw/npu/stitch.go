package npu

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
)

// StitchBlock reorders one block in place from [p][rows][row/p] to
// [rows][p][row/p] (row = len(block)/rows bytes per token), using scratch
// (at least len(block) bytes) as the staging buffer. It is the per-block step
// of the seed's _transpose_kv_cache_between_head: view the block as
// [P, block_size, -1], swap the first two axes, make it contiguous.
// p == 1 leaves the block as it is.
func StitchBlock(block, scratch []byte, rows, p int) error {
	switch {
	case rows < 1 || p < 1:
		return fmt.Errorf("%w: rows %d and p %d must be >= 1", ErrInvalidStitch, rows, p)
	case len(block) == 0 || len(block)%rows != 0:
		return fmt.Errorf("%w: a block of %d bytes is not %d rows", ErrInvalidStitch, len(block), rows)
	case (len(block)/rows)%p != 0:
		return fmt.Errorf("%w: rows of %d bytes do not split into %d slices", ErrInvalidStitch, len(block)/rows, p)
	case len(scratch) < len(block):
		return fmt.Errorf("%w: scratch of %d bytes is smaller than the block (%d)", ErrInvalidStitch, len(scratch), len(block))
	}
	if p > 1 {
		stitchBlock(block, scratch, rows, p)
	}
	return nil
}

// stitchBlock is StitchBlock without the checks. The block is first copied
// whole into scratch (one sequential memmove, the only pass that may miss
// the cache), then each token row is gathered back from the p planes of the
// scratch: sequential writes, p sequential read streams, all within a block
// (64 KiB - 1 MiB) that stays in L2.
func stitchBlock(block, scratch []byte, rows, p int) {
	n := len(block)
	row := n / rows
	chunk := row / p
	plane := rows * chunk
	s := scratch[:n:n]
	copy(s, block)
	for r := range rows {
		dst := block[r*row : (r+1)*row : (r+1)*row]
		src := s[r*chunk:]
		for q := range p {
			copy(dst[q*chunk:(q+1)*chunk], src[q*plane:q*plane+chunk])
		}
	}
}

// ValidateStitch checks a stitch request against the layout without
// touching memory: p >= 1; p == 1 or a GQA layout (the seed pulls MLA and
// sparse caches whole, tp_num_need_pulls = 1); every part's row of
// heads*head_dim elements splits into p equal slices (the seed's
// view(num_blocks, P, block_size, -1)); block ids in [0, num_blocks) and
// distinct.
func (l Layout) ValidateStitch(blockIDs []int, p int) error {
	if len(l.parts) == 0 {
		return fmt.Errorf("%w: zero Layout", ErrInvalidStitch)
	}
	if p < 1 {
		return fmt.Errorf("%w: tp_num_need_pulls %d, must be >= 1", ErrInvalidStitch, p)
	}
	if p > 1 {
		if l.Kind() != GQA {
			return fmt.Errorf("%w: tp_num_need_pulls %d on a %s layout (its caches are pulled whole: P must be 1)", ErrInvalidStitch, p, l.Kind())
		}
		for _, pt := range l.parts {
			if (pt.Heads*pt.Dim)%p != 0 {
				return fmt.Errorf("%w: %s rows of %d heads x %d dims do not split into %d slices", ErrInvalidStitch, pt.Name, pt.Heads, pt.Dim, p)
			}
		}
	}
	nb := l.shape.NumBlocks
	seen := make([]uint64, (nb+63)/64)
	for i, b := range blockIDs {
		if b < 0 || b >= nb {
			return fmt.Errorf("%w: block id %d (index %d) out of range [0, %d)", ErrInvalidStitch, b, i, nb)
		}
		if seen[b/64]&(1<<(b%64)) != 0 {
			return fmt.Errorf("%w: block id %d listed twice", ErrInvalidStitch, b)
		}
		seen[b/64] |= 1 << (b % 64)
	}
	return nil
}

// StitchOptions tunes StitchMemory.
type StitchOptions struct {
	// Workers bounds the goroutines of one call; 0 means GOMAXPROCS.
	Workers int
	// Scratch supplies per-worker scratch buffers (*[]byte); nil uses a
	// package-wide pool. Buffers smaller than the layout's largest block are
	// replaced.
	Scratch *sync.Pool
}

var defaultScratch sync.Pool

// StitchMemory runs the stitch kernel over mem, the host-addressable memory
// of layout l (l.Size() bytes, caches at l.Offset): every listed block of
// every cache, with p = tp_num_need_pulls. Work items (one block of one
// cache) are shared by at most opts.Workers goroutines, all finished before
// it returns. The request is validated first (ValidateStitch); an invalid
// request or a cancelled ctx leaves memory untouched. If ctx is cancelled
// while it runs, it stops claiming items and returns an error wrapping
// ctx.Err(): every block of every cache is then either fully stitched or not
// at all, but which ones is unspecified, so the caller must treat the pull as
// failed.
func StitchMemory(ctx context.Context, l Layout, mem []byte, blockIDs []int, p int, opts StitchOptions) error {
	if err := l.ValidateStitch(blockIDs, p); err != nil {
		return err
	}
	if int64(len(mem)) < l.Size() {
		return fmt.Errorf("%w: memory of %d bytes for a layout of %d", ErrInvalidStitch, len(mem), l.Size())
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("npu: stitch not started: %w", err)
	}
	if p == 1 || len(blockIDs) == 0 {
		return nil
	}
	nb := len(blockIDs)
	items := nb * l.NumCaches()
	workers := opts.Workers
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	workers = min(workers, items)
	pool := opts.Scratch
	if pool == nil {
		pool = &defaultScratch
	}
	need := l.MaxBlockLen()
	rows := l.shape.BlockSize

	var next, done atomic.Int64
	run := func() {
		bp, _ := pool.Get().(*[]byte)
		if bp == nil || len(*bp) < need {
			b := make([]byte, need)
			bp = &b
		}
		defer pool.Put(bp)
		scratch := *bp
		for ctx.Err() == nil {
			i := int(next.Add(1) - 1)
			if i >= items {
				return
			}
			// Cache-major: consecutive items walk one cache's blocks, in the
			// order listed (usually ascending), which keeps DRAM access local.
			k, b := i/nb, blockIDs[i%nb]
			_, part := l.CacheOf(k)
			bl := l.parts[part].BlockLen
			off := l.offsets[k] + int64(b)*int64(bl)
			stitchBlock(mem[off:off+int64(bl):off+int64(bl)], scratch, rows, p)
			done.Add(1)
		}
	}
	if workers == 1 {
		run()
	} else {
		var wg sync.WaitGroup
		for range workers {
			wg.Go(run)
		}
		wg.Wait()
	}
	if n := done.Load(); n < int64(items) {
		return fmt.Errorf("npu: stitch interrupted after %d of %d block copies: %w", n, items, ctx.Err())
	}
	return nil
}
