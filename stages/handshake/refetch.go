package handshake

import (
	"context"
	"slices"
	"time"

	"github.com/kvflow/kvflow/stages/job"
)

// Refetch returns k's metadata as it is now, for a read that failed at
// failedAt with used (the metadata it read with): the read stage's
// recovery when a peer may have restarted. It fetches at most once for
// all the reads that fail together:
//   - cached metadata other than used, or fetched at or after failedAt,
//     is already fresher than the failed read's: it is returned as is
//     (another read that failed re-fetched it);
//   - otherwise the entry is invalidated and fetched again through Get's
//     singleflight, so concurrent callers share one fetch;
//   - a fetch of k that failed after failedAt is returned to the caller
//     at once (GetSince): reads that failed while it ran share its
//     failure instead of each waiting for one of their own.
func (c *Cache) Refetch(ctx context.Context, k Key, used job.Meta, failedAt time.Time) (job.Meta, error) {
	c.mu.Lock()
	if el, ok := c.idx[k]; ok {
		e := el.Value.(*entry)
		if !e.stale && (!SameMeta(e.meta, used) || !e.at.Before(failedAt)) {
			c.lru.MoveToFront(el)
			m := e.meta
			c.mu.Unlock()
			c.hits.Inc()
			return m, nil
		}
		if !e.stale {
			e.stale = true
			c.invalidations.Inc()
		}
	}
	c.mu.Unlock()
	return c.GetSince(ctx, k, failedAt)
}

// SameMeta reports whether a and b are the same metadata: the same
// engine, transfer-engine port, cache addresses, block count and boot
// epoch.
func SameMeta(a, b job.Meta) bool {
	return a.EngineID == b.EngineID && a.TERPCPort == b.TERPCPort && a.NumBlocks == b.NumBlocks &&
		a.BootEpoch == b.BootEpoch && slices.Equal(a.BaseAddrs, b.BaseAddrs)
}
