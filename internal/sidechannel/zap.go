package sidechannel

import (
	"fmt"
	"sync"
	"time"

	zmq "github.com/pebbe/zmq4"
)

// zapEndpoint is where libzmq looks for the ZAP handler (RFC 27), per ZMQ
// context: pebbe/zmq4's AuthStart binds it on the package's default context
// only, so it never sees the sockets of a Context (they would admit any
// client key). Each Context therefore runs its own handler.
const zapEndpoint = "inproc://zeromq.zap.01"

// zapPolicy is one CURVE server's admission rule; keys nil admits any
// client key (CURVE has already proved the client knows the server key).
type zapPolicy struct {
	keys map[string]struct{} // raw 32-byte public keys
}

// zapHandler answers the ZAP requests of every CURVE server on a Context.
// Each server has its own ZAP domain ("kvflow-N") naming its policy; a
// request for an unknown domain, or by another mechanism, is denied. The
// handler starts with the first CURVE server and stops at Context.Close.
type zapHandler struct {
	zctx  *Context
	sock  *zmq.Socket // ROUTER bound at zapEndpoint; loop goroutine only
	wakeR *zmq.Socket // PAIR; loop goroutine only
	wakeS *zmq.Socket // PAIR; stop only
	done  chan struct{}

	mu       sync.Mutex
	policies map[string]zapPolicy
	seq      uint64

	// Denial log rate limit; loop goroutine only.
	lastLog    time.Time
	suppressed int
}

// ZAP status codes (RFC 27).
const (
	zapOK     = "200"
	zapDenied = "400"
	zapError  = "500"
)

// zapAdd registers a CURVE server's policy (keys nil: any client key),
// starting the context's ZAP handler if needed, and returns the ZAP domain
// the server's socket must use.
func (c *Context) zapAdd(keys map[string]struct{}) (string, error) {
	c.zapMu.Lock()
	defer c.zapMu.Unlock()
	if c.zap == nil {
		z, err := startZAP(c)
		if err != nil {
			return "", err
		}
		c.zap = z
	}
	z := c.zap
	z.mu.Lock()
	defer z.mu.Unlock()
	z.seq++
	domain := fmt.Sprintf("kvflow-%d", z.seq)
	z.policies[domain] = zapPolicy{keys: keys}
	return domain, nil
}

// zapRemove forgets a closed server's domain.
func (c *Context) zapRemove(domain string) {
	c.zapMu.Lock()
	z := c.zap
	c.zapMu.Unlock()
	if z == nil || domain == "" {
		return
	}
	z.mu.Lock()
	delete(z.policies, domain)
	z.mu.Unlock()
}

// stopZAP stops the handler (Context.Close, after every server is closed).
func (c *Context) stopZAP() {
	c.zapMu.Lock()
	z := c.zap
	c.zap = nil
	c.zapMu.Unlock()
	if z == nil {
		return
	}
	if _, err := z.wakeS.SendBytes([]byte{0}, zmq.DONTWAIT); err != nil {
		c.log.Error("zap handler: wake-up send failed", "err", err)
	}
	<-z.done
	c.closeSocket(z.wakeS)
}

func startZAP(c *Context) (_ *zapHandler, err error) {
	z := &zapHandler{zctx: c, policies: map[string]zapPolicy{}, done: make(chan struct{})}
	defer func() {
		if err != nil {
			c.closeSocket(z.wakeS)
			c.closeSocket(z.wakeR)
			c.closeSocket(z.sock)
		}
	}()
	if z.sock, err = c.newSocket(zmq.ROUTER); err != nil {
		return nil, err
	}
	if err = z.sock.Bind(zapEndpoint); err != nil {
		return nil, fmt.Errorf("sidechannel: zap handler: bind %s: %w", zapEndpoint, err)
	}
	wake := c.inprocAddr("zap-wake")
	if z.wakeR, err = c.newSocket(zmq.PAIR); err != nil {
		return nil, err
	}
	if err = z.wakeR.Bind(wake); err != nil {
		return nil, fmt.Errorf("sidechannel: zap handler: bind %s: %w", wake, err)
	}
	if z.wakeS, err = c.newSocket(zmq.PAIR); err != nil {
		return nil, err
	}
	if err = z.wakeS.Connect(wake); err != nil {
		return nil, fmt.Errorf("sidechannel: zap handler: connect %s: %w", wake, err)
	}
	go z.loop()
	return z, nil
}

func (z *zapHandler) loop() {
	defer close(z.done)
	defer func() {
		z.zctx.closeSocket(z.sock)
		z.zctx.closeSocket(z.wakeR)
	}()
	poller := zmq.NewPoller()
	poller.Add(z.sock, zmq.POLLIN)
	poller.Add(z.wakeR, zmq.POLLIN)
	for {
		polled, err := poller.Poll(-1)
		if err != nil {
			if zmq.AsErrno(err) == zmq.ETERM {
				return
			}
			z.zctx.log.Error("zap handler: poll failed", "err", err)
			time.Sleep(10 * time.Millisecond) // never spin on a persistent error
			continue
		}
		for _, pd := range polled {
			if pd.Socket == z.wakeR {
				return
			}
		}
		for range maxBatch {
			frames, err := z.sock.RecvMessageBytes(zmq.DONTWAIT)
			if err != nil {
				if !isEAGAIN(err) {
					z.zctx.log.Error("zap handler: recv failed", "err", err)
				}
				break
			}
			z.handle(frames)
		}
	}
}

// handle answers one ZAP request: [routing id, "", "1.0", request id,
// domain, address, identity, mechanism, credentials...] with [routing id,
// "", "1.0", request id, status, text, user id, metadata].
func (z *zapHandler) handle(frames [][]byte) {
	if len(frames) < 8 || len(frames[1]) != 0 {
		z.zctx.log.Error("zap handler: malformed request", "frames", len(frames))
		return // libzmq never sends one; nothing to answer
	}
	rid, version, reqID := frames[0], frames[2], frames[3]
	domain, address, mechanism := string(frames[4]), string(frames[5]), string(frames[7])
	creds := frames[8:]
	code, text, userID, reason := z.decide(string(version), domain, mechanism, creds)
	if code != zapOK {
		z.zctx.metrics.authDenied.WithLabelValues(reason).Inc()
		z.logDenied(reason, domain, address, mechanism, creds)
	}
	if _, err := z.sock.SendMessageDontwait(rid, []byte{}, "1.0", reqID, code, text, userID, []byte{}); err != nil {
		z.zctx.log.Error("zap handler: reply failed", "err", err)
	}
}

func (z *zapHandler) decide(version, domain, mechanism string, creds [][]byte) (code, text, userID, reason string) {
	if version != "1.0" {
		return zapError, "unsupported ZAP version", "", authDeniedBadRequest
	}
	z.mu.Lock()
	pol, ok := z.policies[domain]
	z.mu.Unlock()
	switch {
	case !ok:
		return zapDenied, "unknown domain", "", authDeniedUnknownDomain
	case mechanism != "CURVE" || len(creds) != 1 || len(creds[0]) != 32:
		return zapDenied, "CURVE required", "", authDeniedMechanism
	}
	key := string(creds[0])
	if pol.keys != nil {
		if _, ok := pol.keys[key]; !ok {
			return zapDenied, "client key not authorized", "", authDeniedKey
		}
	}
	return zapOK, "OK", zmq.Z85encode(key), ""
}

func (z *zapHandler) logDenied(reason, domain, address, mechanism string, creds [][]byte) {
	now := time.Now()
	if now.Sub(z.lastLog) < badLogEvery {
		z.suppressed++
		return
	}
	attrs := []any{"reason", reason, "domain", domain, "address", address, "mechanism", mechanism, "suppressed", z.suppressed}
	if len(creds) == 1 && len(creds[0]) == 32 {
		attrs = append(attrs, "client_key", zmq.Z85encode(string(creds[0])))
	}
	z.zctx.log.Warn("side channel: client denied", attrs...)
	z.lastLog, z.suppressed = now, 0
}
