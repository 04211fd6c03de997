package sidechannel

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"syscall"
	"time"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// Handler answers side-channel requests (the prefill side). Both methods are
// called on the server's single socket goroutine, one request at a time:
// they must be quick and must not call back into the Server.
type Handler interface {
	// Metadata returns the metadata to send for GET_META (encoded afresh for
	// every request).
	Metadata() Metadata
	// Done records a DONE_RECVING for reqID. The server replies "ACK" even
	// when Done returns an error (the message was received; an unknown or
	// already finished request id is the tracker's business, as in the
	// seed); the error is logged and counted as outcome "handler_error".
	// A done_batch_msg (kvflow) calls Done once per id, in order, then
	// replies once: "ACK", or "ERR internal error" if any call panicked;
	// a repeat of a message id already handed over calls nothing and gets
	// the first one's reply.
	Done(reqID string) error
}

// Renewer is the optional Handler method for kvflow's RENEW (leases). A
// Handler without it answers RENEW like an unknown message ("ERR ...");
// one whose Metadata advertises Ext.LeaseTTL must have it. The server
// replies "ACK" even when Renew returns an error (logged and counted as
// outcome "handler_error"), as for DONE_RECVING.
type Renewer interface {
	// Renew extends the holds of reqIDs (called on the socket goroutine,
	// like the Handler's methods). Ids not held are the handler's
	// business, not an error.
	Renew(reqIDs []string) error
}

// HandlerFuncs adapts functions to Handler (and Renewer); a nil func
// returns zero, except a nil RenewFunc, which refuses RENEW.
type HandlerFuncs struct {
	MetadataFunc func() Metadata
	DoneFunc     func(reqID string) error
	RenewFunc    func(reqIDs []string) error
}

// errNoRenew: the handler does not take RENEW (no leases).
var errNoRenew = errors.New("renew_msg not supported (no leases)")

// Renew calls h.RenewFunc.
func (h HandlerFuncs) Renew(reqIDs []string) error {
	if h.RenewFunc == nil {
		return errNoRenew
	}
	return h.RenewFunc(reqIDs)
}

// Metadata calls h.MetadataFunc.
func (h HandlerFuncs) Metadata() Metadata {
	if h.MetadataFunc == nil {
		return Metadata{}
	}
	return h.MetadataFunc()
}

// Done calls h.DoneFunc.
func (h HandlerFuncs) Done(reqID string) error {
	if h.DoneFunc == nil {
		return nil
	}
	return h.DoneFunc(reqID)
}

// ServerOptions configures a Server.
type ServerOptions struct {
	// Addr is the "host:port" to bind (tcp). Port 0 picks a free port (see
	// Server.Addr); an empty host or "*" binds all interfaces.
	Addr string
	// MaxMessageBytes is ZMQ_MAXMSGSIZE for requests: a peer sending more is
	// disconnected by libzmq. 0 means 1 MiB (requests are tens of bytes; a
	// request id of a few hundred).
	MaxMessageBytes int64
	// DropBadMessages restores the seed's behaviour for bad requests: log
	// and drop, leaving a REQ peer to time out. By default kvflow answers
	// them with "ERR <reason>" so a REQ peer fails at once and stays usable.
	DropBadMessages bool
	// Curve, when set, makes the socket a CURVE server: only clients that
	// know its public key (and, with Curve.AuthorizedClients, hold an
	// authorized key) can connect; traffic is encrypted. Nil: no
	// authentication (the seed's protocol, which seed peers speak).
	Curve *Curve
	// Logger overrides the context's logger.
	Logger *slog.Logger
	// Name is what the socket is called in its log lines ("side channel
	// listening"); the control socket, which is a router of this package
	// too, is "control socket". Empty: "side channel".
	Name string
	// Limits, for a tcp endpoint, puts a front on the port that bounds
	// the connections it takes (see Limits); nil: libzmq accepts alone,
	// without bound.
	Limits *Limits
	// AuthToken (with Curve only), when set, is called for every GET_META
	// with the requesting client's CURVE public key (32 bytes, as the ZAP
	// handler admitted it) and its result is sent as Ext.TEAuth: the
	// client's credential for this worker's transfer engine (package
	// mooncake, data-plane authentication). Without Curve it is never
	// called (no identity to bind, and the reply would travel in the
	// clear).
	AuthToken func(clientKey []byte) *[wire.TEAuthSize]byte
	// Background (NewRouter only), when set, picks the requests that may
	// block (a load waiting for room in a full pipeline): they are served
	// one at a time, in arrival order, on a goroutine of their own, and
	// each reply is sent as soon as it is ready. The other requests (a
	// finished poll) are served at once on the socket's goroutine, so they
	// never wait behind a blocked one. Requests Background picks keep
	// their order among themselves (a load is always handled before an
	// abort that arrived after it). Nil: every request on the socket's
	// goroutine, one at a time.
	Background func(payload []byte) bool
}

// Server is the ROUTER side of the side channel. One goroutine owns the
// socket: it receives, calls the Handler, replies, and exits on Close.
type Server struct {
	zctx *Context
	opts ServerOptions
	h    Handler
	raw  RawHandler // set for NewRouter: payloads are not the seed's messages
	log  *slog.Logger
	name string // in log lines: "side channel" or ServerOptions.Name
	m    *metrics
	addr string
	zap  string // ZAP domain of a CURVE server, "" otherwise
	// seen: ids of DONE batches already handed over, so a retried one is
	// ACKed without counting its DONEs twice.
	seen seenIDs

	front *front      // with ServerOptions.Limits on a tcp endpoint
	sock  *zmq.Socket // ROUTER; owned by the loop goroutine
	wakeR *zmq.Socket // PAIR; owned by the loop goroutine
	wakeS *zmq.Socket // PAIR; owned by Close

	// Background requests (opts.Background): the loop appends them to bg
	// and kicks the background goroutine, which serves them in order,
	// queues each reply in ready and pokes the loop through the inproc
	// PAIR readyS (guarded by readyMu, which also hands the socket between
	// goroutines); the loop owns readyR and sends the queued replies.
	readyR  *zmq.Socket
	readyS  *zmq.Socket
	readyMu sync.Mutex
	ready   [][2][]byte // (identity, reply) waiting to be sent; readyMu
	bgMu    sync.Mutex
	bg      [][2][]byte // (identity, payload) waiting to be served; bgMu
	bgKick  chan struct{}
	bgStop  chan struct{}
	bgDone  chan struct{}

	done      chan struct{}
	closeOnce sync.Once

	// Bad-message log rate limit; loop goroutine only.
	lastBadLog time.Time
	suppressed int
}

// maxBatch is how many queued requests the loop handles before it polls
// again (and so notices Close).
const maxBatch = 256

// badLogEvery limits bad-message logs to one per interval (the rest are
// counted in kvflow_sidechannel_bad_messages_total and summarised).
const badLogEvery = time.Second

// NewServer binds a ROUTER on opts.Addr and starts serving h.
func NewServer(zctx *Context, opts ServerOptions, h Handler) (_ *Server, err error) {
	if zctx == nil || h == nil {
		return nil, errors.New("sidechannel: NewServer: nil Context or Handler")
	}
	ep, err := parseEndpoint(opts.Addr, true)
	if err != nil {
		return nil, fmt.Errorf("sidechannel: server: %w", err)
	}
	return newServer(zctx, opts, ep, h, nil)
}

// RawHandler answers one request payload with one reply payload. It is
// called one request at a time on the socket's goroutine, except for the
// requests ServerOptions.Background picks, which are called one at a time
// on the background goroutine: the two may run at once.
type RawHandler func(payload []byte) []byte

// NewRouter binds a ROUTER on a full ZMQ endpoint (tcp://host:port or
// ipc://path) and answers each REQ-style request [identity, "", payload]
// with [identity, "", h(payload)]. It shares the side channel's socket
// ownership, wake-up and shutdown rules, on the one process context; the
// control socket uses it. opts.Addr is the endpoint.
func NewRouter(zctx *Context, opts ServerOptions, h RawHandler) (*Server, error) {
	if zctx == nil || h == nil {
		return nil, errors.New("sidechannel: NewRouter: nil Context or handler")
	}
	ep := endpoint{key: opts.Addr, zmq: opts.Addr}
	switch {
	case strings.HasPrefix(opts.Addr, "ipc://") && len(opts.Addr) > len("ipc://"):
	case strings.HasPrefix(opts.Addr, "tcp://"):
		var err error
		if ep, err = parseEndpoint(opts.Addr, true); err != nil {
			return nil, fmt.Errorf("sidechannel: router: %w", err)
		}
	default:
		return nil, fmt.Errorf("sidechannel: router: %w %q: want tcp://host:port or ipc://path", ErrEndpoint, opts.Addr)
	}
	return newServer(zctx, opts, ep, nil, h)
}

func newServer(zctx *Context, opts ServerOptions, ep endpoint, h Handler, raw RawHandler) (_ *Server, err error) {
	if opts.MaxMessageBytes == 0 {
		opts.MaxMessageBytes = 1 << 20
	}
	if opts.MaxMessageBytes < 64 {
		return nil, fmt.Errorf("sidechannel: server: MaxMessageBytes %d: want ≥ 64", opts.MaxMessageBytes)
	}
	log := opts.Logger
	if log == nil {
		log = zctx.log
	}
	s := &Server{zctx: zctx, opts: opts, h: h, raw: raw, m: zctx.metrics, done: make(chan struct{})}
	defer func() {
		if err != nil {
			zctx.closeSocket(s.readyS)
			zctx.closeSocket(s.readyR)
			zctx.closeSocket(s.wakeS)
			zctx.closeSocket(s.wakeR)
			zctx.closeSocket(s.sock)
			zctx.zapRemove(s.zap)
			if s.front != nil {
				s.front.close()
			}
		}
	}()
	if s.sock, err = zctx.newSocket(zmq.ROUTER); err != nil {
		return nil, err
	}
	if opts.Curve != nil {
		if err = s.setCurve(opts.Curve); err != nil {
			return nil, err
		}
	}
	if err = s.sock.SetMaxmsgsize(opts.MaxMessageBytes); err != nil {
		return nil, fmt.Errorf("sidechannel: server: set maxmsgsize: %w", err)
	}
	if ep.ipv6 {
		if err = s.sock.SetIpv6(true); err != nil {
			return nil, fmt.Errorf("sidechannel: server: set ipv6: %w", err)
		}
	}
	var ln net.Listener
	bind := ep.zmq
	if opts.Limits != nil && strings.HasPrefix(ep.zmq, "tcp://") {
		// The public port is the front's; the ROUTER listens on loopback.
		host, port, _ := net.SplitHostPort(ep.key)
		if host == "*" {
			host = ""
		}
		if ln, err = net.Listen("tcp", net.JoinHostPort(host, port)); err != nil {
			return nil, fmt.Errorf("sidechannel: server: bind %s: %w", ep.zmq, err)
		}
		bind = "tcp://127.0.0.1:*"
	}
	if err = s.sock.Bind(bind); err != nil {
		if ln != nil {
			ln.Close()
		}
		return nil, fmt.Errorf("sidechannel: server: bind %s: %w", bind, err)
	}
	last, err := s.sock.GetLastEndpoint()
	if err != nil {
		if ln != nil {
			ln.Close()
		}
		return nil, fmt.Errorf("sidechannel: server: last endpoint: %w", err)
	}
	s.addr = strings.TrimPrefix(last, "tcp://")
	if ln != nil {
		s.front = newFront(ln, s.addr, *opts.Limits, log.With("side", roleServer, "addr", ln.Addr().String()), s.m.connRefused)
		s.addr = ln.Addr().String()
	}
	s.name = opts.Name
	if s.name == "" {
		s.name = "side channel"
	}
	if s.wakeR, s.wakeS, err = zctx.newPair("server-wake"); err != nil {
		return nil, err
	}
	if raw != nil && opts.Background != nil {
		if s.readyR, s.readyS, err = zctx.newPair("server-ready"); err != nil {
			return nil, err
		}
		s.bgKick, s.bgStop, s.bgDone = make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
		go s.background()
	}
	s.log = log.With("side", roleServer, "addr", s.addr)
	if err = zctx.register(s); err != nil {
		return nil, err
	}
	go s.loop()
	auth := "off"
	if opts.Curve != nil {
		auth = "curve"
		if len(opts.Curve.AuthorizedClients) > 0 {
			auth = fmt.Sprintf("curve, %d authorized client keys", len(opts.Curve.AuthorizedClients))
		}
	}
	s.log.Info(s.name+" listening", "auth", auth)
	return s, nil
}

// setCurve makes s.sock a CURVE server with its own ZAP domain (before
// bind, so every connection is authenticated).
func (s *Server) setCurve(c *Curve) error {
	keys, err := c.server()
	if err != nil {
		return fmt.Errorf("sidechannel: server: %w", err)
	}
	if s.zap, err = s.zctx.zapAdd(keys); err != nil {
		return fmt.Errorf("sidechannel: server: start zap handler: %w", err)
	}
	if err := s.sock.SetCurveServer(1); err != nil {
		return fmt.Errorf("sidechannel: server: set curve server: %w", err)
	}
	if err := s.sock.SetCurveSecretkey(c.SecretKey); err != nil {
		return fmt.Errorf("sidechannel: server: set curve secret key: %w", err)
	}
	if err := s.sock.SetZapDomain(s.zap); err != nil {
		return fmt.Errorf("sidechannel: server: set zap domain: %w", err)
	}
	return nil
}

// Addr returns the bound "host:port" (with the real port when Addr had 0).
func (s *Server) Addr() string { return s.addr }

// Close stops the server: it wakes the socket goroutine, waits for it to
// close its sockets, and returns. Requests not yet received are dropped
// (their REQ peers time out and retry elsewhere). Idempotent.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		if _, err := s.wakeS.SendBytes([]byte{0}, zmq.DONTWAIT); err != nil {
			// Cannot happen on a connected inproc PAIR with an empty pipe;
			// if it did, the loop would never wake: say so loudly.
			s.log.Error(s.name+": wake-up send failed", "err", err)
		}
		<-s.done
		if s.front != nil {
			s.front.close()
		}
		s.zctx.closeSocket(s.wakeS)
		s.wakeS = nil
		s.zctx.zapRemove(s.zap)
		s.zctx.unregister(s)
		s.log.Info(s.name + " closed")
	})
	return nil
}

func (s *Server) loop() {
	defer close(s.done)
	defer func() {
		// A background request still running finishes first (its reply
		// is dropped; those not started are dropped unanswered): nothing
		// may use readyS once it is closed.
		if s.bgStop != nil {
			close(s.bgStop)
			<-s.bgDone
		}
		s.zctx.closeSocket(s.readyS)
		s.zctx.closeSocket(s.readyR)
		s.zctx.closeSocket(s.sock)
		s.zctx.closeSocket(s.wakeR)
	}()
	poller := zmq.NewPoller()
	poller.Add(s.sock, zmq.POLLIN)
	poller.Add(s.wakeR, zmq.POLLIN)
	if s.readyR != nil {
		poller.Add(s.readyR, zmq.POLLIN)
	}
	for {
		polled, err := poller.Poll(-1)
		if err != nil {
			if zmq.AsErrno(err) == zmq.ETERM {
				return
			}
			s.log.Error(s.name+" poll failed", "err", err)
			time.Sleep(10 * time.Millisecond) // never spin on a persistent error
			continue
		}
		for _, pd := range polled {
			switch pd.Socket {
			case s.wakeR:
				return
			case s.readyR:
				s.sendReady()
			}
		}
		for range maxBatch {
			frames, client, err := s.recv()
			if err != nil {
				if !isEAGAIN(err) {
					s.log.Error(s.name+" recv failed", "err", err)
				}
				break
			}
			s.handle(frames, client)
		}
	}
}

// recv receives one message and, when the server hands out data-plane
// credentials, the sender's CURVE public key (32 bytes; nil otherwise):
// libzmq attaches the ZAP handler's User-Id (the key in Z85, see zap.go)
// to every frame of a CURVE connection.
func (s *Server) recv() ([][]byte, []byte, error) {
	if s.opts.Curve == nil || s.opts.AuthToken == nil {
		frames, err := s.sock.RecvMessageBytes(zmq.DONTWAIT)
		return frames, nil, err
	}
	// The ROUTER's routing-id frame carries no metadata: read it from the
	// frames the peer sent (pebbe/zmq4's RecvMessageBytesWithMetadata
	// looks at the first frame only).
	id, err := s.sock.RecvBytes(zmq.DONTWAIT)
	if err != nil {
		return nil, nil, err
	}
	frames := [][]byte{id}
	var userID string
	for {
		more, err := s.sock.GetRcvmore()
		if err != nil || !more {
			return frames, clientKey(userID), err
		}
		f, md, err := s.sock.RecvBytesWithMetadata(zmq.DONTWAIT, "User-Id")
		if err != nil {
			return frames, nil, err
		}
		frames = append(frames, f)
		if u := md["User-Id"]; u != "" {
			userID = u
		}
	}
}

// clientKey decodes a Z85 User-Id into the 32-byte key (nil if it is not one).
func clientKey(userID string) []byte {
	if checkKey("", userID) != nil {
		return nil
	}
	return []byte(keyBytes(userID))
}

func isEAGAIN(err error) bool {
	return zmq.AsErrno(err) == zmq.Errno(syscall.EAGAIN)
}

// handle processes one ROUTER message: [identity, (""), payload]. Like the
// seed, empty frames after the identity are ignored and exactly one
// non-empty payload frame must remain; the reply is always
// [identity, "", reply] (what a REQ peer expects). client is the sender's
// CURVE public key when known (see recv).
func (s *Server) handle(frames [][]byte, client []byte) {
	if len(frames) < 2 {
		s.bad(frames, badEnvelope, "too few frames", nil)
		return
	}
	id := frames[0]
	var payload [][]byte
	for _, f := range frames[1:] {
		if len(f) > 0 {
			payload = append(payload, f)
		}
	}
	if len(payload) != 1 {
		s.bad(frames, badEnvelope, fmt.Sprintf("%d payload frames, want 1", len(payload)), nil)
		return
	}
	if s.raw != nil {
		s.handleRaw(id, payload[0])
		return
	}
	req, err := wire.DecodeRequest(payload[0])
	if err != nil {
		reason := badDecode
		if errors.Is(err, wire.ErrUnknownMessage) {
			reason = badUnknown
		}
		s.bad(frames, reason, err.Error(), err)
		return
	}
	start := time.Now()
	op := req.Kind.String()
	outcome := outcomeOK
	var reply []byte
	switch req.Kind {
	case wire.KindGetMeta:
		md, err := s.callMetadata()
		if err != nil {
			outcome = outcomeHandlerError
			s.log.Error("metadata handler failed", "err", err)
			reply = wire.EncodeErrorReply("internal error")
		} else {
			if s.opts.Curve != nil && s.opts.AuthToken != nil {
				s.teAuth(&md, client)
			}
			reply = wire.EncodeMetadata(md)
		}
	case wire.KindRenew:
		rn, ok := s.h.(Renewer)
		if !ok {
			s.bad(frames, badUnknown, "renew_msg: "+errNoRenew.Error(), nil)
			return
		}
		s.log.Debug("got RENEW", "requests", len(req.RequestIDs))
		reply = []byte(wire.AckReply)
		if err := s.callRenew(rn, req.RequestIDs); err != nil {
			var p panicError
			switch {
			case errors.Is(err, errNoRenew):
				outcome = outcomeHandlerError
				reply = wire.EncodeErrorReply(err.Error())
			case errors.As(err, &p):
				outcome = outcomeHandlerError
				reply = wire.EncodeErrorReply("internal error")
				s.log.Error("renew handler panicked", "requests", len(req.RequestIDs), "err", err)
			default:
				outcome = outcomeHandlerError
				s.log.Warn("renew handler error (ACKed anyway)", "requests", len(req.RequestIDs), "err", err)
			}
		}
	case wire.KindDoneBatch:
		s.log.Debug("got DONE_BATCH", "requests", len(req.RequestIDs), "msg_id", req.MsgID)
		reply = []byte(wire.AckReply)
		if req.MsgID != 0 {
			if prev, dup := s.seen.check(req.MsgID); dup {
				// A retry of a message already handed over (its reply was
				// lost or late): the first one's reply again, no Done
				// called twice.
				outcome = outcomeDuplicate
				if prev != nil {
					reply = prev
				}
				break
			}
		}
		s.m.batchIDs.WithLabelValues(roleServer).Observe(float64(len(req.RequestIDs)))
		if failed, panicked, first := s.callDoneBatch(req.RequestIDs); failed > 0 {
			outcome = outcomeHandlerError
			if panicked > 0 {
				reply = wire.EncodeErrorReply("internal error")
				s.log.Error("done handler panicked", "requests", len(req.RequestIDs), "failed", failed, "panicked", panicked, "err", first)
			} else {
				s.log.Warn("done handler error (ACKed anyway)", "requests", len(req.RequestIDs), "failed", failed, "err", first)
			}
		}
		if req.MsgID != 0 && string(reply) != wire.AckReply {
			s.seen.answered(req.MsgID, reply)
		}
	case wire.KindDoneRecving:
		s.log.Debug("got DONE_RECVING", "request_id", req.RequestID)
		reply = []byte(wire.AckReply)
		if err := s.callDone(req.RequestID); err != nil {
			outcome = outcomeHandlerError
			var p panicError
			if errors.As(err, &p) {
				reply = wire.EncodeErrorReply("internal error")
				s.log.Error("done handler panicked", "request_id", req.RequestID, "err", err)
			} else {
				s.log.Warn("done handler error (ACKed anyway)", "request_id", req.RequestID, "err", err)
			}
		}
	}
	if err := s.reply(id, reply); err != nil {
		outcome = outcomeSendError
		s.log.Warn(s.name+" reply failed", "op", op, "err", err)
	}
	s.m.requests.WithLabelValues(roleServer, op, outcome).Inc()
	s.m.duration.WithLabelValues(roleServer, op).Observe(time.Since(start).Seconds())
}

// reply queues [id, "", payload]. It never blocks: a ROUTER drops messages
// to peers that are gone or over their high-water mark (the seed's ACK
// busy-retry loop is not needed).
func (s *Server) reply(id, payload []byte) error {
	_, err := s.sock.SendMessageDontwait(id, []byte{}, payload)
	return err
}

// bad counts and (rate-limited) logs a bad message and, unless
// DropBadMessages, answers it with "ERR <reason>".
func (s *Server) bad(frames [][]byte, reason, detail string, err error) {
	s.m.badMessages.WithLabelValues(reason).Inc()
	now := time.Now()
	if now.Sub(s.lastBadLog) >= badLogEvery {
		attrs := []any{"reason", reason, "detail", detail, "frames", len(frames), "suppressed", s.suppressed}
		for i, f := range frames {
			if i >= 4 {
				break
			}
			attrs = append(attrs, fmt.Sprintf("frame%d", i), wire.Quote(f))
		}
		s.log.Warn(s.name+": bad message", attrs...)
		s.lastBadLog, s.suppressed = now, 0
	} else {
		s.suppressed++
	}
	if s.opts.DropBadMessages || len(frames) == 0 {
		return
	}
	msg := reason
	if err != nil {
		msg = reason + ": " + err.Error()
	} else if detail != "" {
		msg = reason + ": " + detail
	}
	if e := s.reply(frames[0], wire.EncodeErrorReply(msg)); e != nil {
		s.log.Debug("error reply failed", "err", e)
	}
}

// teAuth sets md's data-plane credential for client. A client whose key
// is unknown gets none (it cannot authenticate to the transfer engine);
// that cannot happen on a CURVE socket, whose ZAP handler always names the
// key, but is logged if it does.
func (s *Server) teAuth(md *Metadata, client []byte) {
	if client == nil {
		s.log.Warn("side channel: GET_META without a client key: no data-plane credential sent")
		return
	}
	md.Ext.TEAuth = s.opts.AuthToken(client)
}

type panicError struct{ v any }

func (p panicError) Error() string { return fmt.Sprintf("panic: %v", p.v) }

func (s *Server) callMetadata() (md Metadata, err error) {
	defer func() {
		if v := recover(); v != nil {
			err = panicError{v}
		}
	}()
	return s.h.Metadata(), nil
}

func (s *Server) callDone(reqID string) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = panicError{v}
		}
	}()
	return s.h.Done(reqID)
}

// callDoneBatch calls Done for every id in order, even after one fails or
// panics (the others are independent requests), and returns how many
// failed, how many of those panicked, and the first failure (naming its id).
func (s *Server) callDoneBatch(ids []string) (failed, panicked int, first error) {
	for _, id := range ids {
		err := s.callDone(id)
		if err == nil {
			continue
		}
		failed++
		var p panicError
		if errors.As(err, &p) {
			panicked++
		}
		if first == nil {
			first = fmt.Errorf("request %q: %w", id, err)
		}
	}
	return failed, panicked, first
}

func (s *Server) callRenew(rn Renewer, ids []string) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = panicError{v}
		}
	}()
	return rn.Renew(ids)
}

func (s *Server) handleRaw(id, payload []byte) {
	if s.bgKick != nil && s.opts.Background(payload) {
		s.bgMu.Lock()
		s.bg = append(s.bg, [2][]byte{id, payload})
		s.bgMu.Unlock()
		select {
		case s.bgKick <- struct{}{}:
		default: // a kick is pending: the goroutine takes all queued
		}
		return
	}
	if err := s.reply(id, s.callRaw(payload)); err != nil {
		s.log.Warn("router reply failed", "err", err)
	}
}

// background serves the background requests in arrival order until the
// loop stops it. It is started and waited for by the loop.
func (s *Server) background() {
	defer close(s.bgDone)
	for {
		select {
		case <-s.bgStop:
			return
		case <-s.bgKick:
		}
		for {
			s.bgMu.Lock()
			if len(s.bg) == 0 {
				s.bgMu.Unlock()
				break
			}
			r := s.bg[0]
			s.bg[0] = [2][]byte{}
			s.bg = s.bg[1:]
			s.bgMu.Unlock()
			select {
			case <-s.bgStop:
				return
			default:
			}
			reply := s.callRaw(r[1])
			s.readyMu.Lock()
			s.ready = append(s.ready, [2][]byte{r[0], reply})
			// A poke that does not fit is not needed: one is pending,
			// and the loop takes every queued reply when it wakes.
			s.readyS.SendBytes([]byte{0}, zmq.DONTWAIT)
			s.readyMu.Unlock()
		}
	}
}

// sendReady drains the ready PAIR's pokes and sends every queued reply.
// Called on the loop's goroutine.
func (s *Server) sendReady() {
	for {
		if _, err := s.readyR.RecvBytes(zmq.DONTWAIT); err != nil {
			break
		}
	}
	s.readyMu.Lock()
	ready := s.ready
	s.ready = nil
	s.readyMu.Unlock()
	for _, r := range ready {
		if err := s.reply(r[0], r[1]); err != nil {
			s.log.Warn("router reply failed", "err", err)
		}
	}
}

// callRaw runs the raw handler on payload, turning a panic into an error
// reply.
func (s *Server) callRaw(payload []byte) (reply []byte) {
	defer func() {
		if v := recover(); v != nil {
			s.log.Error("router handler panicked", "panic", v)
			reply = wire.EncodeErrorReply("internal error")
		}
	}()
	return s.raw(payload)
}
