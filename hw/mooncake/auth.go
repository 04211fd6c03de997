package mooncake

// Data-plane authentication between kvflow peers (kvflow only; see doc.go,
// "Data-plane authentication"). A target with TCPConfig.RequireAuth makes
// every connection to its RPC and data ports prove, before anything else
// is read or served, that the initiator holds a credential the target
// issued: a token bound to the initiator's CURVE public key, handed out
// over the (CURVE-encrypted) side channel. The exchange is a
// challenge-response, so a proof seen on the wire is worth nothing on
// another connection:
//
//	initiator → target  hello      "KVFAUTH1" (8) | client public key (32)
//	target → initiator  challenge  "KVFAUTH1" (8) | nonce (32, fresh per connection)
//	initiator → target  proof      HMAC-SHA256(token, "kvflow te proof v1\x00" | port | nonce | key) (32)
//	target → initiator  status     8 bytes: StatusOK, or StatusRejected then close
//
// where token = HMAC-SHA256(secret, "kvflow te token v1\x00" | key), secret
// being 32 random bytes the target draws at start and never sends, and
// port the byte 'r' (RPC port) or 'd' (data port). After StatusOK the
// connection speaks Mooncake's protocol unchanged. The magic, read as the
// first 8 bytes of a Mooncake frame length or data header size, is a
// length no Mooncake peer sends (0x3148545541465648), so the two can never
// be confused: a target refuses a plain first frame at its first 8 bytes.

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Sizes of the authentication exchange.
const (
	AuthKeySize   = 32 // a CURVE public key, raw
	AuthTokenSize = 32 // HMAC-SHA256
	authNonceSize = 32
	authMagic     = "KVFAUTH1"
	authHelloSize = len(authMagic) + AuthKeySize
	authChalSize  = len(authMagic) + authNonceSize
	authProofSize = sha256.Size

	authTokenLabel = "kvflow te token v1\x00"
	authProofLabel = "kvflow te proof v1\x00"
)

// Port bytes bound into a proof.
const (
	authPortRPC  byte = 'r'
	authPortData byte = 'd'
)

// Outcomes of kvflow_transfer_auth_total.
const (
	authOK       = "ok"
	authNoHello  = "no_hello"   // the first bytes were not a hello (a plain Mooncake peer, a scanner)
	authBadProof = "bad_proof"  // wrong token, or a proof for another nonce, key or port
	authCut      = "incomplete" // closed or timed out before finishing the exchange
)

// ErrAuthRefused: a peer refused this engine's data-plane credential (or
// is not a kvflow target that authenticates).
var ErrAuthRefused = errors.New("mooncake: peer refused authentication")

// ErrBadAuth: a malformed authentication frame.
var ErrBadAuth = errors.New("mooncake: malformed authentication frame")

// Credential is what an initiator presents to a target that requires
// authentication: its CURVE public key (raw) and the token the target
// issued for that key (Ext.TEAuth of its GET_META reply).
type Credential struct {
	Key   [AuthKeySize]byte
	Token [AuthTokenSize]byte
}

// AuthToken returns the token of key under secret.
func AuthToken(secret *[32]byte, key []byte) [AuthTokenSize]byte {
	m := hmac.New(sha256.New, secret[:])
	m.Write([]byte(authTokenLabel))
	m.Write(key)
	var t [AuthTokenSize]byte
	m.Sum(t[:0])
	return t
}

// AuthProof is an initiator's answer to nonce on port (authPortRPC or
// authPortData).
func AuthProof(token *[AuthTokenSize]byte, port byte, nonce, key []byte) [authProofSize]byte {
	m := hmac.New(sha256.New, token[:])
	m.Write([]byte(authProofLabel))
	m.Write([]byte{port})
	m.Write(nonce)
	m.Write(key)
	var p [authProofSize]byte
	m.Sum(p[:0])
	return p
}

// AppendAuthHello appends the hello of key.
func AppendAuthHello(dst []byte, key *[AuthKeySize]byte) []byte {
	return append(append(dst, authMagic...), key[:]...)
}

// ParseAuthHello decodes a hello into the client's key.
func ParseAuthHello(b []byte) ([AuthKeySize]byte, error) {
	var k [AuthKeySize]byte
	if len(b) != authHelloSize || string(b[:len(authMagic)]) != authMagic {
		return k, fmt.Errorf("%w: hello of %d bytes starting %q", ErrBadAuth, len(b), b[:min(len(b), len(authMagic))])
	}
	copy(k[:], b[len(authMagic):])
	return k, nil
}

// AppendAuthChallenge appends a challenge with nonce.
func AppendAuthChallenge(dst []byte, nonce *[authNonceSize]byte) []byte {
	return append(append(dst, authMagic...), nonce[:]...)
}

// ParseAuthChallenge decodes a challenge into its nonce.
func ParseAuthChallenge(b []byte) ([authNonceSize]byte, error) {
	var n [authNonceSize]byte
	if len(b) != authChalSize || string(b[:len(authMagic)]) != authMagic {
		return n, fmt.Errorf("%w: challenge of %d bytes starting %q", ErrBadAuth, len(b), b[:min(len(b), len(authMagic))])
	}
	copy(n[:], b[len(authMagic):])
	return n, nil
}

// authServer is a target's authentication state (TCPConfig.RequireAuth).
type authServer struct {
	secret [32]byte
	total  *prometheus.CounterVec // kvflow_transfer_auth_total{port,outcome}
	log    logEvery
}

func newAuthServer(reg prometheus.Registerer) (*authServer, error) {
	a := &authServer{}
	if _, err := rand.Read(a.secret[:]); err != nil {
		return nil, fmt.Errorf("mooncake: auth secret: %w", err)
	}
	a.total = registerCollector(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvflow_transfer_auth_total",
		Help: "Connections to the transfer engine's ports that had to authenticate (auth.mode curve), by port (data, rpc) and outcome (ok, no_hello, bad_proof, incomplete).",
	}, []string{"port", "outcome"}))
	for _, p := range []string{portData, portRPC} {
		for _, o := range []string{authOK, authNoHello, authBadProof, authCut} {
			a.total.WithLabelValues(p, o)
		}
	}
	return a, nil
}

// AuthToken returns the token this engine issues for a client's CURVE
// public key (32 bytes), for the side channel to send it (Ext.TEAuth);
// nil when the engine does not require authentication or key is not 32
// bytes.
func (e *TCPEngine) AuthToken(key []byte) *[AuthTokenSize]byte {
	if e.auth == nil || len(key) != AuthKeySize {
		return nil
	}
	t := AuthToken(&e.auth.secret, key)
	return &t
}

// authenticate runs the target's side of the exchange on a new
// connection of port (portRPC: within the deadline serveRPC already set;
// portData: within the lesser of FirstByteTimeout and HandshakeTimeout).
// It reports whether the peer proved itself; otherwise the caller closes
// the connection without reading or answering anything else.
func (e *TCPEngine) authenticate(c net.Conn, port string) bool {
	pb := authPortRPC
	if port == portData {
		pb = authPortData
		c.SetDeadline(time.Now().Add(min(e.cfg.FirstByteTimeout, e.cfg.HandshakeTimeout)))
	}
	outcome, err := e.authExchange(c, pb)
	e.auth.total.WithLabelValues(port, outcome).Inc()
	if outcome == authOK {
		return true
	}
	if ok, n := e.auth.log.ok(time.Now(), 10*time.Second); ok {
		e.log.Warn("connection refused: not authenticated", "port", port, "reason", outcome,
			"peer", c.RemoteAddr().String(), "err", err, "refused_since_last_log", n)
	}
	return false
}

func (e *TCPEngine) authExchange(c net.Conn, port byte) (string, error) {
	var hello [authHelloSize]byte
	// The magic first: a plain Mooncake frame or header (8 bytes of
	// length or size) is refused at once instead of waiting for bytes
	// its sender will never send.
	if _, err := io.ReadFull(c, hello[:len(authMagic)]); err != nil {
		return authCut, err
	}
	if string(hello[:len(authMagic)]) != authMagic {
		return authNoHello, fmt.Errorf("%w: first bytes %x", ErrBadAuth, hello[:len(authMagic)])
	}
	if _, err := io.ReadFull(c, hello[len(authMagic):]); err != nil {
		return authCut, err
	}
	key, _ := ParseAuthHello(hello[:]) // the magic was checked
	var nonce [authNonceSize]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return authCut, fmt.Errorf("nonce: %w", err)
	}
	if _, err := c.Write(AppendAuthChallenge(nil, &nonce)); err != nil {
		return authCut, err
	}
	var proof [authProofSize]byte
	if _, err := io.ReadFull(c, proof[:]); err != nil {
		return authCut, err
	}
	token := AuthToken(&e.auth.secret, key[:])
	want := AuthProof(&token, port, nonce[:], key[:])
	var st [StatusSize]byte
	if subtle.ConstantTimeCompare(proof[:], want[:]) != 1 {
		PutStatus(&st, StatusRejected)
		c.Write(st[:])
		return authBadProof, fmt.Errorf("%w: wrong proof", ErrAuthRefused)
	}
	PutStatus(&st, StatusOK)
	if _, err := c.Write(st[:]); err != nil {
		return authCut, err
	}
	return authOK, nil
}

// credStore holds the credentials an initiator presents, per session.
type credStore struct {
	mu sync.Mutex
	m  map[string]Credential
}

// SetPeerCredential makes this engine authenticate to session's target
// with cred (the session id "host:rpc_port" as BatchRead names it); nil
// forgets it: the session speaks Mooncake's plain protocol again. A
// kvflow decode worker sets it from each GET_META reply (Ext.TEAuth), so
// it never sends the exchange to a peer that did not ask for it.
// Connections already open are not affected; the next handshake or data
// connection uses the new setting.
func (e *TCPEngine) SetPeerCredential(session string, cred *Credential) error {
	host, port, err := parseSession(session)
	if err != nil {
		return err
	}
	key := net.JoinHostPort(host, strconv.Itoa(port))
	e.creds.mu.Lock()
	defer e.creds.mu.Unlock()
	if cred == nil {
		delete(e.creds.m, key)
		return nil
	}
	if e.creds.m == nil {
		e.creds.m = map[string]Credential{}
	}
	e.creds.m[key] = *cred
	return nil
}

// credential returns the credential for the session of host and port.
func (e *TCPEngine) credential(host string, port int) (Credential, bool) {
	key := net.JoinHostPort(host, strconv.Itoa(port))
	e.creds.mu.Lock()
	defer e.creds.mu.Unlock()
	c, ok := e.creds.m[key]
	return c, ok
}

// authenticateTo runs the initiator's side of the exchange on c, a new
// connection to port (authPortRPC or authPortData), within c's deadline.
func authenticateTo(c net.Conn, cred *Credential, port byte) error {
	if _, err := c.Write(AppendAuthHello(nil, &cred.Key)); err != nil {
		return fmt.Errorf("authenticate: send hello: %w", err)
	}
	var chal [authChalSize]byte
	if _, err := io.ReadFull(c, chal[:]); err != nil {
		return fmt.Errorf("authenticate: read challenge (%w): %w", ErrAuthRefused, err)
	}
	nonce, err := ParseAuthChallenge(chal[:])
	if err != nil {
		return fmt.Errorf("authenticate: %w: %w", ErrAuthRefused, err)
	}
	proof := AuthProof(&cred.Token, port, nonce[:], cred.Key[:])
	if _, err := c.Write(proof[:]); err != nil {
		return fmt.Errorf("authenticate: send proof: %w", err)
	}
	var st [StatusSize]byte
	if _, err := io.ReadFull(c, st[:]); err != nil {
		return fmt.Errorf("authenticate: read status (%w): %w", ErrAuthRefused, err)
	}
	if err := ParseStatus(&st); err != nil {
		return fmt.Errorf("authenticate: %w: %w", ErrAuthRefused, err)
	}
	return nil
}

// authenticate runs the exchange on a lane's new data connection when its
// session has a credential, within HandshakeTimeout (and ctx), and leaves
// c without a deadline.
func (l *lane) authenticate(ctx context.Context, c net.Conn) error {
	e := l.p.e
	cred, ok := e.credential(l.p.host, l.p.rpcPort)
	if !ok {
		return nil
	}
	c.SetDeadline(time.Now().Add(e.cfg.HandshakeTimeout))
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	err := authenticateTo(c, &cred, authPortData)
	if !stop() && err != nil {
		err = fmt.Errorf("%w (%w)", err, context.Cause(ctx))
	}
	c.SetDeadline(time.Time{})
	return err
}
