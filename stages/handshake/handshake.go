package handshake

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/singleflight"

	"github.com/kvflow/kvflow/stages/job"
)

// Fetcher fetches a side channel's metadata at endpoint "host:port".
type Fetcher interface {
	GetMeta(ctx context.Context, endpoint string) (job.Meta, error)
}

// FetcherFunc adapts a function to Fetcher.
type FetcherFunc func(ctx context.Context, endpoint string) (job.Meta, error)

// GetMeta calls f.
func (f FetcherFunc) GetMeta(ctx context.Context, endpoint string) (job.Meta, error) {
	return f(ctx, endpoint)
}

// Reacher is an optional capability of a Fetcher (discovered once, in
// NewCache): Reach opens a connection to endpoint's port and closes it at
// once, and returns an error wrapping job.ErrRefused when the port refused
// it (nothing listens there). The cache reaches for the peer alongside
// every fetch, so that a fetch from a closed port fails at once instead of
// after all its attempts' timeouts, while a peer that accepts and is slow
// to answer keeps every attempt.
type Reacher interface {
	Reach(ctx context.Context, endpoint string) error
}

// Key names a remote rank's side channel.
type Key struct {
	EngineID string
	Endpoint string // host:handshake_port
}

// Options configures a Cache.
type Options struct {
	// Size bounds the number of cached peers. 4096: a decode worker talks
	// to at most prefill instances × their workers; metadata of one peer is
	// a few KiB.
	Size int
	// Timeout bounds one fetch (including the client's own retries).
	// 5 s: the side channel's client retries 3 × 1 s.
	Timeout time.Duration
	// LocalEngineID is this worker's engine id; a peer claiming it is
	// rejected (the seed asserts the same).
	LocalEngineID string
	// Now is the clock (tests); nil: time.Now.
	Now        func() time.Time
	Registerer prometheus.Registerer
}

// Errors.
var (
	ErrEngineMismatch = errors.New("handshake: engine id mismatch")
	ErrBadMeta        = errors.New("handshake: bad metadata")
)

// Cache is the bounded, deduplicating metadata cache.
type Cache struct {
	f    Fetcher
	r    Reacher // f's, or nil
	opts Options
	sf   singleflight.Group

	mu    sync.Mutex
	lru   *list.List // of *entry, most recent first
	idx   map[Key]*list.Element
	fails map[Key]failure // each peer's last failed fetch (at most Size)
	// refused holds, per peer, the metadata a compat check refused and
	// why (at most Size): a fetch that returns the same metadata again
	// fails with that reason instead of caching it.
	refused map[Key]refusal

	hits, misses, invalidations, errs prometheus.Counter
	recentFail, restarts              prometheus.Counter
}

// failure is a peer's last failed fetch and when it failed.
type failure struct {
	err error
	at  time.Time
}

// ErrFailedWhileWaiting marks an error returned to a request that was
// already waiting when its peer's fetch failed (GetSince): the failure of
// that fetch, not of one of its own.
var ErrFailedWhileWaiting = errors.New("handshake: peer's fetch failed while the request waited")

// refusal is metadata a compat check refused, and the check's error.
type refusal struct {
	meta job.Meta
	err  error
}

type entry struct {
	key   Key
	meta  job.Meta
	stale bool      // invalidated: a miss, kept to compare the next boot epoch
	at    time.Time // when meta was fetched (Refetch)
}

// NewCache makes a cache over f.
func NewCache(f Fetcher, opts Options) (*Cache, error) {
	if f == nil {
		return nil, errors.New("handshake: nil fetcher")
	}
	if opts.Size <= 0 {
		opts.Size = 4096
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	c := &Cache{f: f, opts: opts, lru: list.New(), idx: map[Key]*list.Element{}, fails: map[Key]failure{}, refused: map[Key]refusal{}}
	c.r, _ = f.(Reacher)
	lookups := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_handshake_cache_lookups_total",
		Help: "Metadata cache lookups by result (hit, miss, failed_while_waiting: the peer's fetch failed after the request was admitted).",
	}, []string{"result"})
	c.hits, c.misses = lookups.WithLabelValues("hit"), lookups.WithLabelValues("miss")
	c.recentFail = lookups.WithLabelValues("failed_while_waiting")
	inv := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_handshake_cache_invalidations_total",
		Help: "Cached metadata dropped because a read failed, the peer's boot epoch changed or its cache did not match this worker's (compat check).",
	})
	fe := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_handshake_fetch_errors_total",
		Help: "Metadata fetches that failed.",
	})
	c.invalidations, c.errs = inv, fe
	c.restarts = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvflow_handshake_peer_restarts_total",
		Help: "Re-fetched metadata whose boot epoch differed from the cached one: the prefill peer restarted.",
	})
	size := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvflow_handshake_cache_entries",
		Help: "Peers whose metadata is cached.",
	}, func() float64 { return float64(c.Len()) })
	if opts.Registerer != nil {
		for _, col := range []prometheus.Collector{lookups, inv, fe, size, c.restarts} {
			if err := opts.Registerer.Register(col); err != nil {
				return nil, fmt.Errorf("handshake: register metrics: %w", err)
			}
		}
	}
	return c, nil
}

// Len is the number of peers with valid cached metadata.
func (c *Cache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for el := c.lru.Front(); el != nil; el = el.Next() {
		if !el.Value.(*entry).stale {
			n++
		}
	}
	return n
}

// Get returns k's metadata, fetching it on a miss.
func (c *Cache) Get(ctx context.Context, k Key) (job.Meta, error) {
	return c.GetSince(ctx, k, c.opts.Now())
}

// GetSince is Get for a request admitted at since: if k's last fetch
// failed after since, the request was already waiting while it failed and
// gets that failure at once (wrapped in ErrFailedWhileWaiting), as it
// would have had it joined that fetch, instead of a fetch of its own. So
// the requests queued behind a dead or silent peer cost one fetch timeout
// between them, not one each, while a request admitted after the failure
// tries again.
func (c *Cache) GetSince(ctx context.Context, k Key, since time.Time) (job.Meta, error) {
	if m, ok := c.lookup(k); ok {
		c.hits.Inc()
		return m, nil
	}
	if err := c.failedSince(k, since); err != nil {
		c.recentFail.Inc()
		return job.Meta{}, err
	}
	c.misses.Inc()
	ch := c.sf.DoChan(k.EngineID+"\x00"+k.Endpoint, func() (any, error) {
		// A fetch that landed between the lookup above and this flight
		// is this caller's answer too (one fetch per miss, not two).
		if m, ok := c.lookup(k); ok {
			return m, nil
		}
		// The fetch must not die with the first caller's context: others
		// share it. It is bounded by the timeout instead.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.opts.Timeout)
		defer cancel()
		m, err := c.getMeta(fctx, k.Endpoint)
		if err != nil && errors.Is(fctx.Err(), context.DeadlineExceeded) {
			// The fetch's bound is its attempts' timeouts: none answered.
			err = job.Mark(err, job.ErrNoReply)
		}
		if err != nil {
			c.errs.Inc()
			err = fmt.Errorf("handshake engine %q at %s: %w", k.EngineID, k.Endpoint, err)
			c.fail(k, err)
			return job.Meta{}, err
		}
		if err := c.check(k, m); err != nil {
			c.errs.Inc()
			c.fail(k, err)
			return job.Meta{}, err
		}
		if err := c.refusedBefore(k, m); err != nil {
			c.fail(k, err)
			return job.Meta{}, err
		}
		c.store(k, m)
		return m, nil
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return job.Meta{}, r.Err
		}
		return r.Val.(job.Meta), nil
	case <-ctx.Done():
		return job.Meta{}, fmt.Errorf("handshake engine %q at %s: %w", k.EngineID, k.Endpoint, context.Cause(ctx))
	}
}

// getMeta is one fetch from endpoint. With a Reacher the peer's port is
// reached alongside: when it refuses the connection the fetch is canceled
// and fails at once with that refusal (job.ErrRefused); any other outcome
// of the reach (connected, a timeout, an unreachable network) leaves the
// fetch to its own attempts and timeouts.
func (c *Cache) getMeta(ctx context.Context, endpoint string) (job.Meta, error) {
	if c.r == nil {
		return c.f.GetMeta(ctx, endpoint)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	var wg sync.WaitGroup
	defer func() {
		cancel(nil) // a reach still dialing ends with ctx
		wg.Wait()
	}()
	wg.Go(func() {
		if err := c.r.Reach(ctx, endpoint); errors.Is(err, job.ErrRefused) {
			cancel(err)
		}
	})
	m, err := c.f.GetMeta(ctx, endpoint)
	if err != nil {
		if cause := context.Cause(ctx); errors.Is(cause, job.ErrRefused) {
			return job.Meta{}, cause
		}
	}
	return m, err
}

// Cached returns k's metadata if it is cached and valid, without fetching
// and without counting a lookup (a peek, for callers that only act on
// what is already known: the decode worker leases a request at admission
// with it).
func (c *Cache) Cached(k Key) (job.Meta, bool) {
	return c.lookup(k)
}

func (c *Cache) check(k Key, m job.Meta) error {
	switch {
	case c.opts.LocalEngineID != "" && m.EngineID == c.opts.LocalEngineID:
		return fmt.Errorf("handshake %s: %w: peer claims the local engine id %q", k.Endpoint, ErrEngineMismatch, m.EngineID)
	case k.EngineID != "" && m.EngineID != k.EngineID:
		return fmt.Errorf("handshake %s: %w: request names %q, peer is %q", k.Endpoint, ErrEngineMismatch, k.EngineID, m.EngineID)
	case m.TERPCPort <= 0 || m.TERPCPort > 65535:
		return fmt.Errorf("handshake %s: %w: te_rpc_port %d", k.Endpoint, ErrBadMeta, m.TERPCPort)
	case len(m.BaseAddrs) == 0:
		return fmt.Errorf("handshake %s: %w: no kv_caches_base_addr", k.Endpoint, ErrBadMeta)
	case m.NumBlocks <= 0:
		return fmt.Errorf("handshake %s: %w: num_blocks %d", k.Endpoint, ErrBadMeta, m.NumBlocks)
	}
	return nil
}

// failedSince returns k's last failed fetch, wrapped in
// ErrFailedWhileWaiting, if it failed after since.
func (c *Cache) failedSince(k Key, since time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	f, ok := c.fails[k]
	if !ok || !f.at.After(since) {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrFailedWhileWaiting, f.err)
}

// fail records k's failed fetch; at most Size peers are remembered (the
// oldest failure is dropped first).
func (c *Cache) fail(k Key, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.fails[k]; !ok && len(c.fails) >= c.opts.Size {
		var oldest Key
		first := true
		for key, f := range c.fails {
			if first || f.at.Before(c.fails[oldest].at) {
				oldest, first = key, false
			}
		}
		delete(c.fails, oldest)
	}
	c.fails[k] = failure{err: err, at: c.opts.Now()}
}

func (c *Cache) lookup(k Key) (job.Meta, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.idx[k]
	if !ok || el.Value.(*entry).stale {
		return job.Meta{}, false
	}
	c.lru.MoveToFront(el)
	return el.Value.(*entry).meta, true
}

func (c *Cache) store(k Key, m job.Meta) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.fails, k)
	if el, ok := c.idx[k]; ok {
		e := el.Value.(*entry)
		if old := e.meta.BootEpoch; old != 0 && m.BootEpoch != 0 && old != m.BootEpoch {
			c.restarts.Inc() // the peer restarted: its addresses are new
		}
		e.meta, e.stale, e.at = m, false, c.opts.Now()
		c.lru.MoveToFront(el)
		return
	}
	c.idx[k] = c.lru.PushFront(&entry{key: k, meta: m, at: c.opts.Now()})
	for c.lru.Len() > c.opts.Size {
		old := c.lru.Back()
		c.lru.Remove(old)
		delete(c.idx, old.Value.(*entry).key)
	}
}

// Refuse drops k's cached metadata m, which a compat check refused with
// err, and remembers it: until k's metadata changes (a restart with
// another shape, boot epoch or addresses), fetching it again fails with
// err (from any caller: a prefetch must not cache it either).
func (c *Cache) Refuse(k Key, m job.Meta, err error) {
	c.Invalidate(k)
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.refused[k]; !ok && len(c.refused) >= c.opts.Size {
		for old := range c.refused { // any one: refusals are rare
			delete(c.refused, old)
			break
		}
	}
	c.refused[k] = refusal{meta: m, err: err}
}

// refusedBefore returns the refusal of k's metadata when m is the same
// metadata; a different m clears it.
func (c *Cache) refusedBefore(k Key, m job.Meta) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.refused[k]
	if !ok {
		return nil
	}
	if sameMeta(r.meta, m) {
		return r.err
	}
	delete(c.refused, k)
	return nil
}

func sameMeta(a, b job.Meta) bool {
	if a.EngineID != b.EngineID || a.TERPCPort != b.TERPCPort || a.NumBlocks != b.NumBlocks ||
		a.BootEpoch != b.BootEpoch || !slices.Equal(a.BaseAddrs, b.BaseAddrs) || (a.Cache == nil) != (b.Cache == nil) {
		return false
	}
	return a.Cache == nil || reflect.DeepEqual(*a.Cache, *b.Cache)
}

// Invalidate drops k's cached metadata (a read failed; the peer may have
// restarted). It reports whether an entry was dropped.
func (c *Cache) Invalidate(k Key) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.idx[k]
	if !ok || el.Value.(*entry).stale {
		return false
	}
	el.Value.(*entry).stale = true
	c.invalidations.Inc()
	return true
}

// Stage fetches (or finds cached) metadata for every task of a job, all
// tasks concurrently, then, with Compat set, checks every task's peer
// against the cache the read assumes: a peer that differs fails the job
// (before any byte moves) and its metadata is dropped from the cache. With
// Leases set, a job whose metadata is known is then leased at exactly the
// ranks that advertised leases. The read stage reaches the same cache
// through Invalidate and Refetch (read.Peers).
type Stage struct {
	Cache  *Cache
	Compat *Compat // nil: no check
	Leases Leaser  // nil: no leases
}

// Leaser takes a job whose handshake ended (lease.Keeper.Add): from then
// on its request is leased at exactly the ranks whose metadata advertised
// leases.
type Leaser interface {
	Add(j *job.Job)
}

// Process fills j.Metas.
func (s Stage) Process(ctx context.Context, j *job.Job) error {
	ctx, stop := j.Context(ctx)
	defer stop()
	g, gctx := errgroup.WithContext(ctx)
	for i := range j.Plan.Tasks {
		k := Key{EngineID: j.Plan.RemoteEngineID, Endpoint: j.HandshakeEndpoint(i)}
		if i > 0 && j.HandshakeEndpoint(i-1) == k.Endpoint {
			continue // same rank as the previous task: filled below
		}
		g.Go(func() error {
			m, err := s.Cache.GetSince(gctx, k, j.Submitted)
			j.Metas[i] = m
			return job.AtPeer(job.HopHandshake, k.Endpoint, err)
		})
	}
	if err := g.Wait(); err != nil {
		s.Compat.observe(err) // a peer refused before
		return err
	}
	for i := 1; i < len(j.Plan.Tasks); i++ {
		if j.Metas[i].TERPCPort == 0 && j.HandshakeEndpoint(i-1) == j.HandshakeEndpoint(i) {
			j.Metas[i] = j.Metas[i-1]
		}
	}
	if err := s.checkEpochs(ctx, j); err != nil {
		return err
	}
	if s.Compat != nil {
		for i := range j.Plan.Tasks {
			if err := s.CheckTask(ctx, j, i); err != nil {
				return err
			}
		}
	}
	if s.Leases != nil {
		s.Leases.Add(j)
	}
	return nil
}

// checkEpochs compares each task's metadata with the boot epoch the
// request's kv_transfer_params give for its rank (kvflow_boot_epochs,
// job.Job.CheckBootEpoch; a request without them passes as before).
// Metadata cached before the request was admitted may be older than the
// request (the prefill restarted and the request came from the new
// process): on a mismatch it is fetched again, once for all the tasks
// that share it (Cache.Refetch; metadata fetched after the admission is
// taken as current). A mismatch that remains fails the job before any
// byte is read, with the rank, both epochs and why (job.BootEpochError).
// j.Metas keeps the answering process's metadata, so notify sends that
// process no DONE (job.Job.OwesDone); when the re-fetch itself fails,
// the stale metadata stays there and that rank gets no DONE either (it
// frees at its abort timeout or lease expiry: never a DONE to a process
// that may not own the request).
func (s Stage) checkEpochs(ctx context.Context, j *job.Job) error {
	if len(j.Req.BootEpochs) == 0 {
		return nil
	}
	if err := j.CheckBootEpochs(); err != nil {
		return err
	}
	for i := range j.Plan.Tasks {
		m := j.Metas[i]
		if j.CheckBootEpoch(i, m) == nil {
			continue
		}
		fresh, err := s.Cache.Refetch(ctx, KeyOf(j, i), m, j.Submitted)
		if err != nil {
			return fmt.Errorf("handshake engine %q at %s: metadata of boot epoch %d, the request's is %d; re-fetching it: %w",
				j.Plan.RemoteEngineID, j.HandshakeEndpoint(i), m.BootEpoch, j.RequestEpoch(i), err)
		}
		j.Metas[i] = fresh
		if err := j.CheckBootEpoch(i, fresh); err != nil {
			return fmt.Errorf("handshake engine %q: %w", j.Plan.RemoteEngineID, err)
		}
	}
	return nil
}

// Invalidate drops the cached metadata of task i of j (a read of it
// failed: the peer may have restarted, or its metadata is wrong).
func (s Stage) Invalidate(j *job.Job, i int) { s.Cache.Invalidate(KeyOf(j, i)) }

// Refetch is task i's metadata as it is now, for a read with used that
// failed at failedAt because its peer may have restarted: one fetch for
// all the reads that failed on the same metadata (Cache.Refetch). A
// restarted peer's metadata is checked like any other before a byte of it
// is read (CheckTask): it may have come back with another cache.
func (s Stage) Refetch(ctx context.Context, j *job.Job, i int, used job.Meta, failedAt time.Time) (job.Meta, error) {
	fresh, err := s.Cache.Refetch(ctx, KeyOf(j, i), used, failedAt)
	if err != nil || s.Compat == nil {
		return fresh, err
	}
	held := j.Metas[i]
	j.Metas[i] = fresh
	err = s.CheckTask(ctx, j, i)
	j.Metas[i] = held
	if err != nil {
		return job.Meta{}, err
	}
	return fresh, nil
}

// CheckTask checks task i's peer (j.Metas[i]) with Compat (nil: no check)
// and, when it differs, drops its metadata from the cache. The read
// stage's re-fetch after a peer restart calls it too, so metadata from a
// restarted peer is checked before any byte of it is read.
func (s Stage) CheckTask(ctx context.Context, j *job.Job, i int) error {
	if s.Compat == nil {
		return nil
	}
	err := s.Compat.Check(ctx, j, i)
	if err == nil {
		return nil
	}
	ep := j.HandshakeEndpoint(i)
	err = job.AtPeer(job.HopHandshake, ep, fmt.Errorf("handshake engine %q at %s: %w", j.Plan.RemoteEngineID, ep, err))
	if s.Compat.observe(err) {
		// Not cached as good: fetching it again fails the same
		// way until the peer's metadata changes.
		s.Cache.Refuse(KeyOf(j, i), j.Metas[i], err)
	} else {
		// The peer's transfer engine could not be listed: its
		// cached metadata (te_rpc_port) may be stale.
		s.Cache.Invalidate(KeyOf(j, i))
	}
	return err
}

// KeyOf is the cache key of task i of j.
func KeyOf(j *job.Job, i int) Key {
	return Key{EngineID: j.Plan.RemoteEngineID, Endpoint: j.HandshakeEndpoint(i)}
}
