package sidechannel

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// ClientOptions configures a Client. Zero fields take the defaults of
// DefaultClientOptions.
type ClientOptions struct {
	// AttemptTimeout bounds the wait for one reply. 1 s: the seed's
	// timeout; loopback and LAN replies take well under 1 ms.
	AttemptTimeout time.Duration
	// Attempts is the number of tries per call (1 = no retry). 3: the seed's
	// max_retries. Only timeouts and socket errors are retried (GET_META and
	// DONE_RECVING are idempotent at the prefill side); a reply that is
	// malformed, an error reply or a wrong ACK is final.
	Attempts int
	// RetryBackoff is the pause before a retry. 100 ms: the seed's sleep;
	// long enough for ZMQ's 100 ms reconnect interval to act.
	RetryBackoff time.Duration
	// MaxConnsPerPeer bounds concurrent requests (sockets) to one peer;
	// further callers wait (ctx-aware) for a free socket. 16: the decode
	// pipeline's notify workers (16) each hold one DONE in flight, and over
	// a WAN round trip those waits, not the peer's ROUTER, are what bound
	// DONEs per second.
	MaxConnsPerPeer int
	// MaxIdlePerPeer is how many sockets per peer are kept for reuse (a new
	// REQ socket costs ~0.5 ms on loopback). 16, as MaxConnsPerPeer: with
	// fewer, every burst of concurrent DONEs beyond it closes sockets and
	// makes new ones on the next burst (measured: notify p50 1-10 ms on
	// loopback with 2); IdleTimeout sheds them once traffic stops. Zero
	// means MaxConnsPerPeer.
	MaxIdlePerPeer int
	// IdleTimeout closes sockets unused this long, so dead peers' sockets do
	// not reconnect forever. 2 min: longer than the gap between requests
	// of a busy deployment, short enough to shed departed peers.
	IdleTimeout time.Duration
	// MaxDoneBatchesPerPeer bounds the done_batch_msg messages in flight
	// to one peer (SendDoneBatched): while that many are unanswered, new
	// DONEs queue and go out together in the next message. At most
	// MaxConnsPerPeer. 2: measured with BenchmarkDone (loopback, client
	// and server on 2 cores) at 16 concurrent callers, the notify
	// stage's default workers: 0.43 messages and 34 µs of CPU per DONE
	// (plain: 1 and 46 µs) at plain's throughput; at 64 callers 0.16
	// messages per DONE and 2.6× plain's throughput. 1 batches more
	// under heavy load but at 4 callers serialises DONEs that could have
	// gone in parallel (-30 % vs plain; 2: -25 %); 4 matches plain at 4
	// callers but sends ~0.7 messages per DONE at 16.
	MaxDoneBatchesPerPeer int
	// MaxReplyBytes is ZMQ_MAXMSGSIZE for replies (a bigger one drops the
	// connection and the attempt times out). 16 MiB: metadata of thousands
	// of caches is < 100 KiB.
	MaxReplyBytes int64
	// Curve, when set, makes every socket a CURVE client of servers with
	// public key Curve.ServerPublicKey, using Curve's key pair (an ephemeral
	// one if it has none). Nil: no authentication (the seed's protocol). A
	// client and server that disagree (one on, one off, or wrong keys)
	// never complete the handshake: calls time out.
	Curve *Curve
	// Logger overrides the context's logger.
	Logger *slog.Logger
}

// DefaultClientOptions returns the defaults (see each field for why).
func DefaultClientOptions() ClientOptions {
	return ClientOptions{
		AttemptTimeout:        time.Second,
		Attempts:              3,
		RetryBackoff:          100 * time.Millisecond,
		MaxConnsPerPeer:       16,
		MaxIdlePerPeer:        16, // 0 in ClientOptions: MaxConnsPerPeer
		IdleTimeout:           2 * time.Minute,
		MaxReplyBytes:         16 << 20,
		MaxDoneBatchesPerPeer: 2,
	}
}

func (o ClientOptions) withDefaults() ClientOptions {
	d := DefaultClientOptions()
	if o.AttemptTimeout == 0 {
		o.AttemptTimeout = d.AttemptTimeout
	}
	if o.Attempts == 0 {
		o.Attempts = d.Attempts
	}
	if o.RetryBackoff == 0 {
		o.RetryBackoff = d.RetryBackoff
	}
	if o.MaxConnsPerPeer == 0 {
		o.MaxConnsPerPeer = d.MaxConnsPerPeer
	}
	if o.MaxIdlePerPeer == 0 {
		o.MaxIdlePerPeer = o.MaxConnsPerPeer
	}
	if o.IdleTimeout == 0 {
		o.IdleTimeout = d.IdleTimeout
	}
	if o.MaxReplyBytes == 0 {
		o.MaxReplyBytes = d.MaxReplyBytes
	}
	if o.MaxDoneBatchesPerPeer == 0 {
		o.MaxDoneBatchesPerPeer = min(d.MaxDoneBatchesPerPeer, o.MaxConnsPerPeer)
	}
	return o
}

// Validate reports every invalid field (after defaults are applied).
func (o ClientOptions) Validate() error {
	o = o.withDefaults()
	var errs []error
	if o.AttemptTimeout < time.Millisecond {
		errs = append(errs, fmt.Errorf("sidechannel: AttemptTimeout %v: want ≥ 1ms", o.AttemptTimeout))
	}
	if o.Attempts < 1 || o.Attempts > 100 {
		errs = append(errs, fmt.Errorf("sidechannel: Attempts %d: want 1..100", o.Attempts))
	}
	if o.RetryBackoff < 0 {
		errs = append(errs, fmt.Errorf("sidechannel: RetryBackoff %v: want ≥ 0", o.RetryBackoff))
	}
	if o.MaxConnsPerPeer < 1 {
		errs = append(errs, fmt.Errorf("sidechannel: MaxConnsPerPeer %d: want ≥ 1", o.MaxConnsPerPeer))
	}
	if o.MaxIdlePerPeer < 0 || o.MaxIdlePerPeer > o.MaxConnsPerPeer {
		errs = append(errs, fmt.Errorf("sidechannel: MaxIdlePerPeer %d: want 0..MaxConnsPerPeer", o.MaxIdlePerPeer))
	}
	if o.IdleTimeout < time.Second {
		errs = append(errs, fmt.Errorf("sidechannel: IdleTimeout %v: want ≥ 1s", o.IdleTimeout))
	}
	if o.MaxDoneBatchesPerPeer < 1 || o.MaxDoneBatchesPerPeer > o.MaxConnsPerPeer {
		errs = append(errs, fmt.Errorf("sidechannel: MaxDoneBatchesPerPeer %d: want 1..MaxConnsPerPeer", o.MaxDoneBatchesPerPeer))
	}
	if o.MaxReplyBytes < 64 {
		errs = append(errs, fmt.Errorf("sidechannel: MaxReplyBytes %d: want ≥ 64", o.MaxReplyBytes))
	}
	if o.Curve != nil {
		if err := o.Curve.validate(roleClient); err != nil {
			errs = append(errs, fmt.Errorf("sidechannel: Curve: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Client makes side-channel requests (the decode side). It is safe for
// concurrent use. Each call checks a REQ socket out of the peer's pool for
// its sole use, waits on that socket alone, and returns it to the pool only
// after a clean reply; on a timeout, error or cancellation the socket is
// closed and a later call makes a fresh one. Peers are independent: a slow
// peer only delays calls to itself.
type Client struct {
	zctx  *Context
	opts  ClientOptions
	curve *Curve // resolved keys (own copy), nil without CURVE
	log   *slog.Logger
	m     *metrics

	base   context.Context // cancelled by Close: aborts in-flight waits
	cancel context.CancelFunc

	mu       sync.Mutex
	closed   bool
	peers    map[string]*peer
	inflight sync.WaitGroup

	closeOnce   sync.Once
	janitorStop chan struct{}
	janitorDone chan struct{}
}

// NewClient makes a client on zctx.
func NewClient(zctx *Context, opts ClientOptions) (*Client, error) {
	if zctx == nil {
		return nil, errors.New("sidechannel: NewClient: nil Context")
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	var curve *Curve
	if opts.Curve != nil {
		var err error
		if curve, err = opts.Curve.client(); err != nil {
			return nil, fmt.Errorf("sidechannel: client: %w", err)
		}
		opts.Curve = nil // keep only the resolved copy
	}
	log := opts.Logger
	if log == nil {
		log = zctx.log
	}
	c := &Client{
		zctx:        zctx,
		opts:        opts,
		curve:       curve,
		log:         log.With("side", roleClient),
		m:           zctx.metrics,
		peers:       map[string]*peer{},
		janitorStop: make(chan struct{}),
		janitorDone: make(chan struct{}),
	}
	c.base, c.cancel = context.WithCancel(context.Background())
	if err := zctx.register(c); err != nil {
		c.cancel()
		return nil, err
	}
	go c.janitor()
	return c, nil
}

// GetMeta fetches the agent metadata of the side channel at endpoint
// ("host:port"), sending [b"get_meta_msg", ""].
func (c *Client) GetMeta(ctx context.Context, endpoint string) (Metadata, error) {
	var md Metadata
	err := c.call(ctx, opGetMeta, endpoint, wire.EncodeGetMeta(), func(reply []byte) error {
		var err error
		md, err = wire.DecodeMetadata(reply)
		return err
	})
	if err != nil {
		return Metadata{}, err
	}
	return md, nil
}

// SendDone sends [b"done_recving_msg", reqID] to endpoint and waits for
// "ACK".
func (c *Client) SendDone(ctx context.Context, endpoint, reqID string) error {
	return c.call(ctx, opDone, endpoint, wire.EncodeDoneRecving(reqID), wire.DecodeAck)
}

// SendDoneBatched delivers DONE_RECVING for reqID to endpoint like
// SendDone, but in kvflow's done_batch_msg, together with the DONEs of
// other callers for the same endpoint (group commit). Use it only for a
// peer whose metadata advertised Ext.BatchDone: a seed peer would drop the
// message and the call would time out.
//
// There is no timer. If fewer than MaxDoneBatchesPerPeer messages are in
// flight to endpoint and no DONE waits, the call sends a message of its
// one id itself, at once, exactly as SendDone would (same latency, same
// ctx handling). Otherwise the id queues, and a batcher goroutine of the
// peer sends every queued id (at most wire.MaxDoneBatchIDs and about
// 256 KiB of ids per message) as soon as a message slot frees up. The
// call returns the result of the message that carried reqID: nil after
// its "ACK", else that message's error, shared by every id in it. Retries,
// timeouts and socket replacement are as for SendDone; a shared message
// is bounded by the client's options and Close, never by one caller's
// ctx.
//
// If ctx ends first the call returns ctx's cause at once; reqID is then
// dropped if it was still queued, but may still be delivered if its
// message was already on the wire (as with SendDone). Other callers' ids
// are never affected. Close fails waiting calls with ErrClosed.
func (c *Client) SendDoneBatched(ctx context.Context, endpoint, reqID string) error {
	p, err := c.peerFor(opDoneBatch, endpoint)
	if err != nil {
		return err
	}
	defer c.release(p)
	ep := p.ep
	p.bmu.Lock()
	if p.batchers < c.opts.MaxDoneBatchesPerPeer && len(p.pending) == 0 {
		// Nothing waits and a message may go out: send ours now, on this
		// goroutine and under our ctx (it carries no other caller's id),
		// as SendDone would. Those who queue meanwhile go out after it.
		p.batchers++
		p.bmu.Unlock()
		start := time.Now()
		c.m.batchIDs.WithLabelValues(roleClient).Observe(1)
		err := c.callOn(ctx, opDoneBatch, p, wire.AppendDoneBatchMsg(nil, []string{reqID}, newMsgID()), wire.DecodeAck, start)
		p.bmu.Lock()
		if len(p.pending) == 0 {
			p.batchers--
			p.bmu.Unlock()
			return err
		}
		p.bmu.Unlock()
		c.startBatcher(p) // hands our slot to a batcher for the queued ids
		return err
	}
	w := &doneWaiter{id: reqID, ctx: ctx, done: make(chan struct{})}
	p.pending = append(p.pending, w)
	start := p.batchers < c.opts.MaxDoneBatchesPerPeer
	if start {
		p.batchers++
	}
	p.bmu.Unlock()
	if start {
		c.startBatcher(p)
	}
	select {
	case <-w.done:
		return w.err
	case <-ctx.Done():
	case <-c.base.Done():
	}
	p.bmu.Lock()
	select {
	case <-w.done: // answered meanwhile: report it
		p.bmu.Unlock()
		return w.err
	default:
	}
	w.abandoned = true // not sent yet: never will be; sent: result ignored
	p.bmu.Unlock()
	if ctx.Err() == nil {
		return fmt.Errorf("sidechannel %s %s: %w", opDoneBatch, ep.key, ErrClosed)
	}
	return fmt.Errorf("sidechannel %s %s: %w", opDoneBatch, ep.key, context.Cause(ctx))
}

// doneWaiter is one SendDoneBatched caller. id, ctx and done are set at
// creation; err is written once by the batcher before it closes done;
// abandoned is guarded by peer.bmu.
type doneWaiter struct {
	id        string
	ctx       context.Context // the caller's: once it ends, id is never taken into a batch
	done      chan struct{}
	err       error
	abandoned bool
}

// maxDoneBatchBytes bounds the ids of one done_batch_msg (bytes of id
// text): a quarter of a server's default 1 MiB message limit, so a batch
// never trips it where one DONE would not.
const maxDoneBatchBytes = 256 << 10

// startBatcher runs a batcher for p, counted as a user of p and as in
// flight, like a call (the caller is both, so Close cannot have finished
// waiting).
func (c *Client) startBatcher(p *peer) {
	c.mu.Lock()
	p.users++
	c.inflight.Add(1)
	c.mu.Unlock()
	go c.batcher(p)
}

// batcher sends p's pending DONEs, one done_batch_msg at a time, until none
// are pending; then it exits (the next caller starts a new one).
func (c *Client) batcher(p *peer) {
	defer c.release(p)
	var ids []string
	for {
		batch := p.takeBatch()
		if len(batch) == 0 {
			return
		}
		ids = ids[:0]
		for _, w := range batch {
			ids = append(ids, w.id)
		}
		c.m.batchIDs.WithLabelValues(roleClient).Observe(float64(len(ids)))
		// Bound by the client's attempts and Close, not by any caller's ctx:
		// the message carries every caller's id.
		err := c.callOn(context.Background(), opDoneBatch, p, wire.AppendDoneBatchMsg(nil, ids, newMsgID()), wire.DecodeAck, time.Now())
		for _, w := range batch {
			w.err = err
			close(w.done)
		}
	}
}

// Renew sends kvflow's [b"renew_msg", [reqIDs...]] to endpoint and waits
// for "ACK", in batches of at most wire.MaxRenewIDs ids (one round trip
// each, in order; the first failure ends the call). Send it only to a peer
// whose metadata advertised Ext.LeaseTTL: a seed peer would drop it and the
// call would time out. Like DONE_RECVING it is idempotent, so timeouts are
// retried.
func (c *Client) Renew(ctx context.Context, endpoint string, reqIDs []string) error {
	for len(reqIDs) > 0 {
		n := min(len(reqIDs), wire.MaxRenewIDs)
		if err := c.call(ctx, opRenew, endpoint, wire.EncodeRenew(reqIDs[:n]), wire.DecodeAck); err != nil {
			return err
		}
		reqIDs = reqIDs[n:]
	}
	return nil
}

// PublicKey is the CURVE public key (Z85) every socket of c presents: the
// configured one, or the ephemeral pair NewClient made. "" without CURVE.
// A server binds the data-plane credential it sends in GET_META replies
// (Ext.TEAuth) to this key.
func (c *Client) PublicKey() string {
	if c.curve == nil {
		return ""
	}
	return c.curve.PublicKey
}

// Close aborts in-flight calls (they return ErrClosed), waits for them, and
// closes every pooled socket. It is idempotent.
func (c *Client) Close() error {
	c.closeOnce.Do(func() {
		c.mu.Lock()
		c.closed = true
		c.mu.Unlock()
		c.cancel()
		c.inflight.Wait()
		close(c.janitorStop)
		<-c.janitorDone
		c.mu.Lock()
		peers := c.peers
		c.peers = map[string]*peer{}
		c.mu.Unlock()
		for _, p := range peers {
			p.closeIdle(time.Time{})
		}
		c.zctx.unregister(c)
	})
	return nil
}

// permanentError marks a failure that retrying will not fix (the peer
// answered, but not acceptably).
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// newMsgID is a DONE batch's message id: random, never 0, made once per
// message so every retry of it carries the same one (the server ACKs a
// repeat without counting its DONEs twice). Ids of different messages
// collide with probability ~2^-48 within a server's memory of 2^16.
func newMsgID() uint64 {
	for {
		if id := rand.Uint64(); id != 0 {
			return id
		}
	}
}

// resolveProblem is the DNS failure of hostPort's host, or nil when it is
// an IP address or resolves (within 2 s).
func resolveProblem(ctx context.Context, hostPort string) error {
	host, _, err := net.SplitHostPort(hostPort)
	if err != nil || net.ParseIP(host) != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if _, err := net.DefaultResolver.LookupHost(ctx, host); err != nil {
		var dns *net.DNSError
		if errors.As(err, &dns) && dns.IsTimeout {
			return nil // DNS slow, not known bad: keep the timeout
		}
		return err
	}
	return nil
}

// errAttemptTimeout: one attempt got no reply in time (retryable).
var errAttemptTimeout = errors.New("no reply within attempt timeout")

func (c *Client) call(ctx context.Context, op, epStr string, payload []byte, check func([]byte) error) error {
	start := time.Now()
	p, err := c.peerFor(op, epStr)
	if err != nil {
		return err
	}
	defer c.release(p)
	return c.callOn(ctx, op, p, payload, check, start)
}

// peerFor parses endpoint and acquires its peer for op (the caller
// releases it); a bad endpoint or a closed client is counted and returned
// as op's error.
func (c *Client) peerFor(op, endpoint string) (*peer, error) {
	ep, err := parseEndpoint(endpoint, false)
	if err != nil {
		c.m.requests.WithLabelValues(roleClient, op, outcomeInvalid).Inc()
		return nil, fmt.Errorf("sidechannel %s: %w", op, err)
	}
	p, err := c.acquire(ep)
	if err != nil {
		c.m.requests.WithLabelValues(roleClient, op, outcomeClosed).Inc()
		return nil, fmt.Errorf("sidechannel %s %s: %w", op, ep.key, err)
	}
	return p, nil
}

// callOn makes one request to p (which the caller holds), with the
// client's retries, and counts it.
func (c *Client) callOn(ctx context.Context, op string, p *peer, payload []byte, check func([]byte) error, start time.Time) error {
	ep := p.ep
	outcome := outcomeOK
	defer func() {
		c.m.requests.WithLabelValues(roleClient, op, outcome).Inc()
		c.m.duration.WithLabelValues(roleClient, op).Observe(time.Since(start).Seconds())
	}()
	if c.base.Err() != nil {
		outcome = outcomeClosed
		return fmt.Errorf("sidechannel %s %s: %w", op, ep.key, ErrClosed)
	}

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := context.AfterFunc(c.base, func() { cancel(ErrClosed) })
	defer stop()

	var last error
	attempts := 0
	for attempts < c.opts.Attempts {
		if attempts > 0 {
			if sleepCtx(ctx, c.opts.RetryBackoff) != nil {
				break
			}
		}
		attempts++
		last = c.attempt(ctx, p, payload, check)
		if last == nil {
			return nil
		}
		var perm permanentError
		if errors.As(last, &perm) {
			var re *RemoteError
			if errors.As(last, &re) {
				outcome = outcomeRemoteError
			} else {
				outcome = outcomeBadReply
			}
			return fmt.Errorf("sidechannel %s %s: %w", op, ep.key, perm.err)
		}
		if ctx.Err() != nil || errors.Is(last, ErrClosed) {
			break
		}
		c.log.Debug("side-channel attempt failed", "op", op, "endpoint", ep.key, "attempt", attempts, "err", last)
	}
	if ctx.Err() != nil {
		cause := context.Cause(ctx)
		if errors.Is(cause, ErrClosed) {
			outcome = outcomeClosed
		} else {
			outcome = outcomeCanceled
		}
		return fmt.Errorf("sidechannel %s %s: %w", op, ep.key, cause)
	}
	if errors.Is(last, errAttemptTimeout) {
		outcome = outcomeTimeout
		// ZMQ resolves a host name in the background and retries
		// forever, so a name that does not resolve looks like a silent
		// peer: on this (slow) path only, ask DNS and name its failure.
		if dnsErr := resolveProblem(ctx, ep.key); dnsErr != nil {
			return fmt.Errorf("sidechannel %s %s: %w: host does not resolve: %w (no reply after %d attempts of %v)",
				op, ep.key, ErrTimeout, dnsErr, attempts, c.opts.AttemptTimeout)
		}
		return fmt.Errorf("sidechannel %s %s: %w: no reply after %d attempts of %v", op, ep.key, ErrTimeout, attempts, c.opts.AttemptTimeout)
	}
	if errors.Is(last, ErrClosed) {
		outcome = outcomeClosed
	} else {
		outcome = outcomeTransport
	}
	return fmt.Errorf("sidechannel %s %s: after %d attempts: %w", op, ep.key, attempts, last)
}

// attempt runs one request on a checked-out socket. The socket goes back to
// the pool only after a reply that check accepts.
func (c *Client) attempt(ctx context.Context, p *peer, payload []byte, check func([]byte) error) error {
	cn, err := p.get(ctx, c)
	if err != nil {
		return err
	}
	reply, err := cn.roundTrip(ctx, payload, time.Now().Add(c.opts.AttemptTimeout))
	if err == nil {
		if cerr := check(reply); cerr != nil {
			err = permanentError{cerr}
		}
	}
	switch {
	case err == nil && !cn.dirty:
		p.put(cn, c.opts.MaxIdlePerPeer)
		return nil
	case errors.Is(err, errAttemptTimeout):
		c.m.resets.WithLabelValues(resetTimeout).Inc()
	case ctx.Err() != nil || cn.dirty:
		c.m.resets.WithLabelValues(resetCanceled).Inc()
	default:
		c.m.resets.WithLabelValues(resetError).Inc()
	}
	p.discard(cn)
	return err
}

// acquire returns the peer for ep and counts the call in flight.
func (c *Client) acquire(ep endpoint) (*peer, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	p := c.peers[ep.key]
	if p == nil {
		p = &peer{ep: ep, slots: make(chan struct{}, c.opts.MaxConnsPerPeer)}
		c.peers[ep.key] = p
	}
	p.users++
	c.inflight.Add(1)
	return p, nil
}

func (c *Client) release(p *peer) {
	c.mu.Lock()
	p.users--
	c.mu.Unlock()
	c.inflight.Done()
}

// janitor closes sockets idle longer than IdleTimeout and forgets peers
// with no sockets and no callers.
func (c *Client) janitor() {
	defer close(c.janitorDone)
	every := max(c.opts.IdleTimeout/4, time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-c.janitorStop:
			return
		case now := <-t.C:
			c.mu.Lock()
			for key, p := range c.peers {
				if p.closeIdle(now.Add(-c.opts.IdleTimeout)) == 0 && p.users == 0 {
					delete(c.peers, key)
				}
			}
			c.mu.Unlock()
		}
	}
}

// peer is the socket pool of one endpoint.
type peer struct {
	ep    endpoint
	slots chan struct{} // one token per socket in use (MaxConnsPerPeer)
	users int           // calls holding this peer; guarded by Client.mu

	mu   sync.Mutex
	idle []*conn // most recently used last

	// Batched DONEs (SendDoneBatched). Never held with Client.mu or mu.
	bmu      sync.Mutex
	pending  []*doneWaiter // not yet sent, in arrival order
	batchers int           // running batchers (≤ MaxDoneBatchesPerPeer)
}

// takeBatch removes and returns the next batch of pending, live waiters
// (at most wire.MaxDoneBatchIDs, about maxDoneBatchBytes of ids, at least
// one). With none pending it returns nil and the calling batcher counts
// itself out under the same lock, so a caller that queues after this sees
// batchers below the limit and starts one.
func (p *peer) takeBatch() []*doneWaiter {
	p.bmu.Lock()
	defer p.bmu.Unlock()
	var batch []*doneWaiter
	size, i := 0, 0
	for ; i < len(p.pending) && len(batch) < wire.MaxDoneBatchIDs; i++ {
		w := p.pending[i]
		// A caller whose ctx has ended is dropped even if its goroutine has
		// not yet woken to mark itself abandoned: "not yet sent when ctx
		// ended" must not depend on which goroutine runs first.
		if w.abandoned || w.ctx.Err() != nil {
			continue
		}
		if len(batch) > 0 && size+len(w.id) > maxDoneBatchBytes {
			break
		}
		size += len(w.id)
		batch = append(batch, w)
	}
	n := copy(p.pending, p.pending[i:])
	clear(p.pending[n:])
	p.pending = p.pending[:n]
	if len(batch) == 0 {
		p.batchers--
	}
	return batch
}

// get waits for a free slot, then reuses an idle socket or makes one. The
// caller owns the returned conn until put or discard.
func (p *peer) get(ctx context.Context, c *Client) (*conn, error) {
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	p.mu.Lock()
	if n := len(p.idle); n > 0 {
		cn := p.idle[n-1]
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		return cn, nil
	}
	p.mu.Unlock()
	cn, err := newConn(c.zctx, p.ep, c.opts.MaxReplyBytes, c.curve)
	if err != nil {
		<-p.slots
		return nil, err
	}
	return cn, nil
}

func (p *peer) put(cn *conn, maxIdle int) {
	cn.idleSince = time.Now()
	p.mu.Lock()
	if len(p.idle) < maxIdle {
		p.idle = append(p.idle, cn)
		cn = nil
	}
	p.mu.Unlock()
	if cn != nil {
		cn.close()
	}
	<-p.slots
}

func (p *peer) discard(cn *conn) {
	cn.close()
	<-p.slots
}

// closeIdle closes idle sockets unused since before cutoff (all of them for
// the zero time) and returns how many remain idle.
func (p *peer) closeIdle(cutoff time.Time) int {
	p.mu.Lock()
	var old []*conn
	keep := p.idle[:0]
	for _, cn := range p.idle {
		if cutoff.IsZero() || cn.idleSince.Before(cutoff) {
			old = append(old, cn)
		} else {
			keep = append(keep, cn)
		}
	}
	clear(p.idle[len(keep):])
	p.idle = keep
	n := len(p.idle)
	p.mu.Unlock()
	for _, cn := range old {
		cn.close()
	}
	return n
}

// conn is one REQ socket to a peer plus the inproc PAIR that wakes its poll
// when the caller's context ends. All three sockets belong to whoever has
// the conn checked out; the wake sender is used only by the context.AfterFunc
// of the current wait, which roundTrip waits for before returning.
type conn struct {
	zctx      *Context
	sock      *zmq.Socket // REQ, connected to the peer
	wakeR     *zmq.Socket // PAIR, bound inproc; polled with sock
	wakeS     *zmq.Socket // PAIR, connected to wakeR
	poller    *zmq.Poller // this conn's own: sock + wakeR
	idleSince time.Time
	dirty     bool // a wake-up was sent: never reuse
}

func newConn(zctx *Context, ep endpoint, maxReply int64, curve *Curve) (_ *conn, err error) {
	// cn is not the named result: a `return nil, err` below must still
	// close the sockets opened so far (it once closed a nil conn instead,
	// and a remote_host libzmq cannot connect to crashed the process).
	cn := &conn{zctx: zctx}
	defer func() {
		if err != nil {
			cn.close()
		}
	}()
	if cn.sock, err = zctx.newSocket(zmq.REQ); err != nil {
		return nil, err
	}
	if err = cn.sock.SetMaxmsgsize(maxReply); err != nil {
		return nil, fmt.Errorf("sidechannel: set maxmsgsize: %w", err)
	}
	if ep.ipv6 {
		if err = cn.sock.SetIpv6(true); err != nil {
			return nil, fmt.Errorf("sidechannel: set ipv6: %w", err)
		}
	}
	if curve != nil {
		if err = setCurveClient(cn.sock, curve); err != nil {
			return nil, err
		}
	}
	if err = cn.sock.Connect(ep.zmq); err != nil {
		return nil, fmt.Errorf("sidechannel: connect %s: %w", ep.zmq, err)
	}
	if cn.wakeR, cn.wakeS, err = zctx.newPair("wake"); err != nil {
		return nil, err
	}
	cn.poller = zmq.NewPoller()
	cn.poller.Add(cn.sock, zmq.POLLIN)
	cn.poller.Add(cn.wakeR, zmq.POLLIN)
	return cn, nil
}

// setCurveClient makes s a CURVE client (before connect).
func setCurveClient(s *zmq.Socket, c *Curve) error {
	if err := s.SetCurveServerkey(c.ServerPublicKey); err != nil {
		return fmt.Errorf("sidechannel: set curve server key: %w", err)
	}
	if err := s.SetCurvePublickey(c.PublicKey); err != nil {
		return fmt.Errorf("sidechannel: set curve public key: %w", err)
	}
	if err := s.SetCurveSecretkey(c.SecretKey); err != nil {
		return fmt.Errorf("sidechannel: set curve secret key: %w", err)
	}
	return nil
}

func (cn *conn) close() {
	cn.zctx.closeSocket(cn.wakeS)
	cn.zctx.closeSocket(cn.wakeR)
	cn.zctx.closeSocket(cn.sock)
	cn.wakeS, cn.wakeR, cn.sock = nil, nil, nil
}

// roundTrip sends payload and waits for one single-frame reply until
// deadline or until ctx ends, whichever is first.
func (cn *conn) roundTrip(ctx context.Context, payload []byte, deadline time.Time) ([]byte, error) {
	if _, err := cn.sock.SendBytes(payload, zmq.DONTWAIT); err != nil {
		return nil, fmt.Errorf("send: %w", err)
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		_, _ = cn.wakeS.SendBytes([]byte{0}, zmq.DONTWAIT)
	})
	defer func() {
		if !stop() {
			<-fired // the wake sender is ours again; its byte may be unread
			cn.dirty = true
		}
	}()
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return nil, errAttemptTimeout
		}
		// Round up: the poll works in whole milliseconds and truncates.
		polled, err := cn.poller.Poll((left + time.Millisecond - 1).Truncate(time.Millisecond))
		if err != nil {
			return nil, fmt.Errorf("poll: %w", err)
		}
		for _, pd := range polled {
			switch pd.Socket {
			case cn.sock:
				frames, err := cn.sock.RecvMessageBytes(zmq.DONTWAIT)
				if err != nil {
					return nil, fmt.Errorf("recv: %w", err)
				}
				if len(frames) != 1 {
					return nil, permanentError{fmt.Errorf("%w: %d frames, want 1", ErrUnexpectedReply, len(frames))}
				}
				return frames[0], nil
			case cn.wakeR:
				if err := context.Cause(ctx); err != nil {
					return nil, err
				}
				return nil, context.Canceled
			}
		}
	}
}

// sleepCtx sleeps for d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
