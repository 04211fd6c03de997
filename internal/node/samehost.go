package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/hw/shm"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/plan"
	"github.com/kvflow/kvflow/stages/read"
)

// node.te_backend shm: the TCP engine, plus same-host reads by mapping a
// peer's cache file (hw/shm).
//
// Prefill side: a grant table next to the cache file (<cache>.grants),
// kept with the TCP engine's grants (tableGrants), and the claim in the
// metadata (Ext.SameHost).
//
// Decode side: sameHost, a read.Transfer in front of the TCP one. Every
// GET_META reply passes through it (fetcher.sh): a reply with a claim is
// opened (shm.Open checks it against the files) and the peer's batches
// are then copies; a claim that does not hold is counted
// (kvflow_shm_fallbacks_total{reason}), logged at warn (at debug when the
// peer is simply on another host), and the peer is read over TCP.

// fallback reasons, the label values of kvflow_shm_fallbacks_total.
var shmFallbackReasons = []string{"other_host", "mismatch", "owner_gone", "no_local_memory", "too_large", "conflict", "error"}

// shmMapLimit bounds the bytes of every same-host peer's mapped cache file
// together (tests shrink it).
var shmMapLimit = shm.HostMemory

type shmMetrics struct {
	fallbacks *prometheus.CounterVec
	batches   *prometheus.CounterVec
	bytes     prometheus.Counter
}

func newShmMetrics(reg prometheus.Registerer) *shmMetrics {
	f := promauto.With(reg)
	m := &shmMetrics{
		fallbacks: f.NewCounterVec(prometheus.CounterOpts{Name: "kvflow_shm_fallbacks_total",
			Help: "Peers whose same-host claim did not hold (or could not be used), read over the network instead, by reason."}, []string{"reason"}),
		batches: f.NewCounterVec(prometheus.CounterOpts{Name: "kvflow_shm_batches_total",
			Help: "Read batches of a node.te_backend shm decode worker, by path (shm: copied from a mapped same-host cache file; network: the TCP engine)."}, []string{"path"}),
		bytes: f.NewCounter(prometheus.CounterOpts{Name: "kvflow_shm_read_bytes_total",
			Help: "Bytes copied from same-host peers' mapped cache files."}),
	}
	for _, r := range shmFallbackReasons {
		m.fallbacks.WithLabelValues(r)
	}
	m.batches.WithLabelValues("shm")
	m.batches.WithLabelValues("network")
	return m
}

// sameHost is the decode side's read.Transfer with node.te_backend shm.
type sameHost struct {
	net   read.Transfer
	caps  read.Capabilities
	local [][]byte
	log   *slog.Logger
	m     *shmMetrics

	mu    sync.Mutex
	peers map[string]*shmPeer // by session "host:te_rpc_port"
}

// shmPeer is what a session's latest metadata offered: the claim and the
// reader opened from it (nil: read over the network).
type shmPeer struct {
	endpoint string // the side-channel endpoint that first named the session
	conflict bool   // another endpoint named it too: network only, for good
	claim    sidechannel.SameHost
	base     []uint64
	r        *shm.Reader
}

func newSameHost(net read.Transfer, d npu.Device, reg prometheus.Registerer, log *slog.Logger) *sameHost {
	s := &sameHost{net: net, log: log.With("component", "hw/shm"), m: newShmMetrics(reg), peers: map[string]*shmPeer{}}
	l := d.Layout()
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		b := d.Bytes(layer, part)
		if b == nil {
			s.local = nil
			break
		}
		s.local = append(s.local, b)
	}
	caps := net.Capabilities()
	classify := caps.Classify
	caps.Classify = func(err error) read.Failure {
		switch {
		case errors.Is(err, shm.ErrOwnerGone), errors.Is(err, shm.ErrClosed), errors.Is(err, shm.ErrFault):
			// The peer exited or restarted, its files changed under the
			// mapping, or a newer claim replaced this reader: like a lost
			// connection, re-fetch its metadata (and claim) and retry if
			// the read stage's rules allow.
			return read.Failure{ConnLost: true}
		case errors.Is(err, shm.ErrNotGranted):
			return read.Failure{Refused: true}
		case classify != nil:
			return classify(err)
		}
		return read.Failure{}
	}
	s.caps = caps
	return s
}

func (s *sameHost) Capabilities() read.Capabilities { return s.caps }

// offer takes the metadata a GET_META to endpoint returned: its claim, if
// any, replaces the session's previous one.
//
// The session is endpoint's host with the metadata's te_rpc_port, which
// the peer names: a hostile side-channel peer on a prefill's host could
// name that prefill's port, and with a claim of its own have the decode
// read the prefill's requests from the hostile file. So each session
// remembers the endpoint that first named it (claim or not); another
// endpoint naming it, unless with a claim of the very file already
// mapped, puts the session on the network for good (counted "conflict":
// which one is the session's prefill cannot be told here; the network
// path reaches whoever listens on the port).
func (s *sameHost) offer(endpoint string, m sidechannel.Metadata) {
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return
	}
	session := net.JoinHostPort(host, strconv.Itoa(m.TERPCPort))
	c := m.Ext.SameHost
	s.mu.Lock()
	old := s.peers[session]
	switch {
	case old != nil && old.conflict:
		s.mu.Unlock()
		return
	case old != nil && old.endpoint != endpoint:
		if c != nil && old.r != nil && sameFile(&old.claim, c) {
			s.mu.Unlock()
			return // the file already mapped, named through another port
		}
		s.peers[session] = &shmPeer{endpoint: old.endpoint, conflict: true}
		s.mu.Unlock()
		s.m.fallbacks.WithLabelValues("conflict").Inc()
		s.log.Warn("same-host: two side-channel endpoints name one transfer session; reading it over the network from now on",
			"session", session, "first", old.endpoint, "now", endpoint)
		closeReader(old)
		return
	case c == nil:
		s.peers[session] = &shmPeer{endpoint: endpoint}
		stale := append(s.evictLocked(session), old)
		s.mu.Unlock()
		for _, q := range stale {
			closeReader(q)
		}
		return
	case old != nil && old.r != nil && sameClaim(&old.claim, c) && slices.Equal(old.base, m.KVCachesBaseAddr):
		s.mu.Unlock()
		return
	}
	// Every mapped file spends address space: together at most what
	// this host's memory could hold (real caches live in it), whatever
	// number of sessions hostile metadata names.
	var mapped uint64
	for k, q := range s.peers {
		if k != session && q.r != nil && !(q.claim.Path == c.Path && q.claim.HostID == c.HostID) {
			mapped += q.claim.Size
		}
	}
	s.mu.Unlock()
	p := &shmPeer{endpoint: endpoint, claim: *c, base: m.KVCachesBaseAddr}
	if lim := shmMapLimit(); mapped > lim || c.Size > lim-mapped {
		s.m.fallbacks.WithLabelValues("too_large").Inc()
		s.log.Warn("same-host peer read over the network: its cache file would take the mapped files past this host's memory",
			"session", session, "path", c.Path, "size", c.Size, "mapped", mapped, "limit", lim)
	} else {
		p.r = s.open(session, c, m.KVCachesBaseAddr)
	}
	s.mu.Lock()
	if cur := s.peers[session]; cur != nil && (cur.conflict || cur.endpoint != endpoint) {
		// Another endpoint named the session meanwhile.
		s.mu.Unlock()
		closeReader(p)
		s.offer(endpoint, m)
		return
	}
	stale := []*shmPeer{s.peers[session]}
	s.peers[session] = p
	// The same file under another session is the same prefill rank's
	// earlier run (restarted on another port): its reader is dead weight.
	for k, q := range s.peers {
		if k != session && !q.conflict && q.r != nil && q.claim.Path == c.Path && q.claim.HostID == c.HostID {
			delete(s.peers, k)
			stale = append(stale, q)
		}
	}
	stale = append(stale, s.evictLocked(session)...)
	s.mu.Unlock()
	for _, q := range stale {
		closeReader(q)
	}
}

// evictLocked drops sessions past maxShmPeers, but session, plain ones
// (no conflict) first; they are remembered again from the next GET_META
// reply that names them. s.mu held.
func (s *sameHost) evictLocked(session string) []*shmPeer {
	var out []*shmPeer
	for _, conflicts := range []bool{false, true} {
		for k, q := range s.peers {
			if len(s.peers) <= maxShmPeers {
				return out
			}
			if k != session && q.conflict == conflicts {
				delete(s.peers, k)
				out = append(out, q)
			}
		}
	}
	return out
}

func sameFile(a, b *sidechannel.SameHost) bool {
	return a.HostID == b.HostID && a.Path == b.Path && a.Dev == b.Dev && a.Ino == b.Ino
}

// maxShmPeers bounds the sessions sameHost remembers: far above the prefill
// ranks one decode rank reads from (at most a few hundred), so only churn
// (peers restarting on new ports) ever reaches it.
const maxShmPeers = 1024

// open opens a claim, or counts and logs why it cannot be used (nil).
func (s *sameHost) open(session string, c *sidechannel.SameHost, base []uint64) *shm.Reader {
	log := s.log.With("session", session, "path", c.Path)
	if s.local == nil {
		s.m.fallbacks.WithLabelValues("no_local_memory").Inc()
		log.Warn("same-host peer read over the network: this worker's cache memory is not host-addressable")
		return nil
	}
	r, err := shm.Open(shm.Claim{HostID: c.HostID, Path: c.Path, Dev: c.Dev, Ino: c.Ino, Size: c.Size, Header: c.Header,
		Grants: c.Grants, GrantsDev: c.GrantsDev, GrantsIno: c.GrantsIno, Epoch: c.Epoch},
		shm.Options{BaseAddrs: base, Local: s.local})
	if err == nil {
		log.Info("same-host peer: reading its cache file directly")
		return r
	}
	reason := "error"
	switch {
	case errors.Is(err, shm.ErrNotSameHost):
		s.m.fallbacks.WithLabelValues("other_host").Inc()
		log.Debug("peer on another host: reading over the network", "err", err)
		return nil
	case errors.Is(err, shm.ErrMismatch):
		reason = "mismatch"
	case errors.Is(err, shm.ErrOwnerGone):
		reason = "owner_gone"
	}
	s.m.fallbacks.WithLabelValues(reason).Inc()
	log.Warn("same-host claim does not hold: reading this peer over the network", "reason", reason, "err", err)
	return nil
}

func sameClaim(a, b *sidechannel.SameHost) bool {
	return a.HostID == b.HostID && a.Path == b.Path && a.Dev == b.Dev && a.Ino == b.Ino && a.Size == b.Size &&
		string(a.Header) == string(b.Header) && a.Grants == b.Grants && a.GrantsDev == b.GrantsDev &&
		a.GrantsIno == b.GrantsIno && a.Epoch == b.Epoch
}

func closeReader(p *shmPeer) {
	if p != nil && p.r != nil {
		p.r.Close() // waits for its running reads
	}
}

// BatchRead copies from the session's mapped file when its claim held,
// and reads over the network otherwise.
func (s *sameHost) BatchRead(ctx context.Context, session string, b *read.Batch) error {
	s.mu.Lock()
	p := s.peers[session]
	s.mu.Unlock()
	if p == nil || p.r == nil {
		s.m.batches.WithLabelValues("network").Inc()
		return s.net.BatchRead(ctx, session, b)
	}
	var st shm.Stride
	var src []plan.Op
	switch {
	case b.Gather && b.Reads != nil:
		row, pitch, ok := b.Reads.GatherStride()
		if !ok {
			return errors.New("node: same-host gather of reads with no strided form")
		}
		st = shm.Stride{Row: row, Pitch: pitch, Gather: true}
		src = b.Reads.AppendGather(make([]plan.Op, 0, b.Reads.GatherLen()))
	case b.Gather:
		return errors.New("node: same-host gather of an op list")
	default:
		st = shm.Stride{Row: b.Row, Pitch: b.Pitch}
		src = b.AppendTo(make([]plan.Op, 0, b.Len()))
	}
	ops := make([]shm.Op, len(src))
	var n uint64
	for i, op := range src {
		ops[i] = shm.Op{Local: op.Local, Remote: op.Remote, Len: op.Len}
		n += op.Len
	}
	s.m.batches.WithLabelValues("shm").Inc()
	if err := p.r.Read(ctx, b.Request, ops, st); err != nil {
		return fmt.Errorf("same-host read from %s: %w", p.claim.Path, err)
	}
	s.m.bytes.Add(float64(n))
	for i := range b.Landed {
		b.Landed[i] = b.At(i).Len
	}
	return nil
}

// Close closes every reader.
func (s *sameHost) Close() error {
	s.mu.Lock()
	peers := s.peers
	s.peers = map[string]*shmPeer{}
	s.mu.Unlock()
	for _, p := range peers {
		closeReader(p)
	}
	return nil
}

// tableGrants keeps the shm grant table with the TCP engine's grants
// (next, nil with read.grants off): granted in the table first, revoked
// in the table first, so a same-host reader's check fails before the
// prefill can report a block free.
type tableGrants struct {
	t    *shm.Table
	next prefill.Grants
}

func (g tableGrants) Grant(blocks []int) error {
	if err := g.t.Grant(blocks); err != nil {
		return err
	}
	if g.next == nil {
		return nil
	}
	if err := g.next.Grant(blocks); err != nil {
		g.t.Revoke(blocks)
		return err
	}
	return nil
}

func (g tableGrants) Revoke(blocks []int) (<-chan struct{}, error) {
	terr := g.t.Revoke(blocks)
	if g.next == nil {
		c := make(chan struct{})
		close(c)
		return c, terr
	}
	done, err := g.next.Revoke(blocks)
	return done, errors.Join(terr, err)
}

// GrantRequest grants blocks bound to request id in the table (so a
// same-host reader that names id is refused once id is freed, whatever
// happened to the blocks since) and plainly on the engine.
func (g tableGrants) GrantRequest(id string, blocks []int) error {
	if err := g.t.GrantRequest(id, blocks); err != nil {
		return err
	}
	if g.next == nil {
		return nil
	}
	if err := g.next.Grant(blocks); err != nil {
		g.t.RevokeRequest(id, blocks)
		return err
	}
	return nil
}

// RevokeRequest ends one GrantRequest, in the table first.
func (g tableGrants) RevokeRequest(id string, blocks []int) (<-chan struct{}, error) {
	terr := g.t.RevokeRequest(id, blocks)
	if g.next == nil {
		c := make(chan struct{})
		close(c)
		return c, terr
	}
	done, err := g.next.Revoke(blocks)
	return done, errors.Join(terr, err)
}

var _ prefill.RequestGrants = tableGrants{}

func (g tableGrants) GrantAll() error {
	if err := g.t.GrantAll(); err != nil {
		return err
	}
	if g.next == nil {
		return nil
	}
	if err := g.next.GrantAll(); err != nil {
		g.t.RevokeAll()
		return err
	}
	return nil
}

func (g tableGrants) RevokeAll() error {
	terr := g.t.RevokeAll()
	if g.next == nil {
		return terr
	}
	return errors.Join(terr, g.next.RevokeAll())
}

// openGrantTable creates the prefill's grant table next to its cache file
// and the claim it publishes. With grants off (next nil) every block is
// granted for good, as the TCP engine serves every block then.
func (n *Node) openGrantTable(next prefill.Grants, log *slog.Logger) (prefill.Grants, *sidechannel.SameHost, error) {
	path := n.Config.CachePath()
	t, err := shm.CreateTable(path+shm.TableSuffix, n.Shape.NumBlocks, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("node: te_backend shm: %w", err)
	}
	remove := n.Config.Cache.RemoveOnClose
	n.closers = append(n.closers, func(context.Context) error { return t.Close(remove) })
	c, err := shm.MakeClaim(path, t)
	if err != nil {
		return nil, nil, fmt.Errorf("node: te_backend shm: %w", err)
	}
	claim := &sidechannel.SameHost{HostID: c.HostID, Path: c.Path, Dev: c.Dev, Ino: c.Ino, Size: c.Size, Header: c.Header,
		Grants: c.Grants, GrantsDev: c.GrantsDev, GrantsIno: c.GrantsIno, Epoch: c.Epoch}
	log.Info("same-host reads offered (node.te_backend shm)", "cache", path, "grant_table", t.Path())
	if next == nil {
		if err := t.GrantAll(); err != nil {
			return nil, nil, err
		}
		return nil, claim, nil
	}
	return tableGrants{t: t, next: next}, claim, nil
}
