package mooncake

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// authTarget starts a target that requires authentication, with 1 MiB
// registered (grants off: every registered byte is readable by whoever
// passes), and returns it, its memory and its registry.
func authTarget(t *testing.T) (*TCPEngine, []byte, *prometheus.Registry) {
	t.Helper()
	cfg := testConfig()
	cfg.RequireAuth = true
	e, reg := newEngine(t, cfg)
	return e, register(t, e, 1<<20, 0x5a), reg
}

func authCount(t *testing.T, e *TCPEngine, port, outcome string) float64 {
	t.Helper()
	return testutil.ToFloat64(e.auth.total.WithLabelValues(port, outcome))
}

// credFor is the credential target issues for a fresh key.
func credFor(t *testing.T, target *TCPEngine) *Credential {
	t.Helper()
	var c Credential
	rand.Read(c.Key[:])
	tok := target.AuthToken(c.Key[:])
	if tok == nil {
		t.Fatal("AuthToken nil on a target that requires auth")
	}
	c.Token = *tok
	return &c
}

func dialRaw(t *testing.T, port int) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(5 * time.Second))
	return c
}

// readAll reads what the target sends until it closes.
func readAll(t *testing.T, c net.Conn) []byte {
	t.Helper()
	b, err := io.ReadAll(c)
	if err != nil && !errors.Is(err, net.ErrClosed) && !isReset(err) {
		t.Fatalf("read: %v", err)
	}
	return b
}

func isReset(err error) bool {
	var ne *net.OpError
	return errors.As(err, &ne) && !ne.Timeout()
}

// TestAuthOutsiderGetsNothing: a target with RequireAuth answers a plain
// Mooncake handshake with no segment descriptor and a plain READ of
// registered memory with no byte, on fresh connections; both are closed
// and counted. Before RequireAuth, both were served.
func TestAuthOutsiderGetsNothing(t *testing.T) {
	target, mem, _ := authTarget(t)
	desc := &SegmentDesc{Name: "scanner:1", Protocol: "tcp", TCPDataPort: 1, TCPProtoVersion: 2}

	c := dialRaw(t, target.RPCPort())
	if _, err := c.Write(AppendFrame(nil, FrameMetadata, EncodeSegment(desc))); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, c); len(got) != 0 {
		t.Fatalf("plain handshake got %d bytes: %q", len(got), got)
	}

	for _, v2 := range []bool{true, false} {
		c := dialRaw(t, target.DataPort())
		var hb [HeaderSize]byte
		PutHeader(&hb, Header{Size: 4096, Addr: AddrOf(mem), Opcode: OpcodeRead, V2: v2})
		if _, err := c.Write(hb[:]); err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, c); len(got) != 0 {
			t.Fatalf("plain READ (v2 %v) got %d bytes", v2, len(got))
		}
	}
	if n := authCount(t, target, portRPC, authNoHello); n != 1 {
		t.Errorf("rpc no_hello = %v, want 1", n)
	}
	waitFor(t, func() bool { return authCount(t, target, portData, authNoHello) == 2 })
	if n := testutil.ToFloat64(target.m.serveReadOps); n != 0 {
		t.Errorf("served %v reads", n)
	}
}

// TestAuthInitiator: an engine with the credential the target issued
// handshakes and reads byte-exact; one without a credential, with a
// token of another target, or with a token for another key gets neither
// the descriptor nor a byte.
func TestAuthInitiator(t *testing.T) {
	target, mem, _ := authTarget(t)
	other, _, _ := authTarget(t) // another process: another secret
	session := target.SessionID()
	good := credFor(t, target)
	foreign := credFor(t, other)
	stolen := *good
	rand.Read(stolen.Key[:]) // someone else's key with good's token

	for _, tc := range []struct {
		name string
		cred *Credential
	}{
		{"none", nil},
		{"other-target", foreign},
		{"token-of-another-key", &stolen},
	} {
		t.Run(tc.name, func(t *testing.T) {
			init, _ := newEngine(t, testConfig())
			dst := mmap(t, 1<<16)
			if err := init.Register(AddrOf(dst), uint64(len(dst)), ""); err != nil {
				t.Fatal(err)
			}
			if tc.cred != nil {
				if err := init.SetPeerCredential(session, tc.cred); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if bufs, err := init.PeerBuffers(ctx, session); err == nil {
				t.Fatalf("got the segment descriptor: %+v", bufs)
			} else if tc.cred != nil && !errors.Is(err, ErrAuthRefused) {
				t.Fatalf("PeerBuffers: %v, want ErrAuthRefused", err)
			}
			err := init.BatchRead(ctx, session, []Op{{Local: AddrOf(dst), Remote: AddrOf(mem), Length: 4096}})
			if err == nil {
				t.Fatal("read without a valid credential succeeded")
			}
			if bytes.Count(dst[:4096], []byte{0}) != 4096 {
				t.Fatal("bytes landed")
			}
		})
	}
	if n := authCount(t, target, portRPC, authBadProof); n != 4 {
		t.Errorf("rpc bad_proof = %v, want 4 (2 initiators × PeerBuffers and BatchRead)", n)
	}

	init, _ := newEngine(t, testConfig())
	dst := mmap(t, 1<<20)
	if err := init.Register(AddrOf(dst), uint64(len(dst)), ""); err != nil {
		t.Fatal(err)
	}
	if err := init.SetPeerCredential(session, good); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	bufs, err := init.PeerBuffers(ctx, session)
	if err != nil || len(bufs) != 1 || bufs[0].Addr != AddrOf(mem) {
		t.Fatalf("PeerBuffers: %+v %v", bufs, err)
	}
	ops := []Op{{Local: AddrOf(dst), Remote: AddrOf(mem), Length: 1 << 19}, {Local: AddrOf(dst) + 1<<19, Remote: AddrOf(mem) + 1<<19, Length: 1 << 19}}
	if err := init.BatchRead(ctx, session, ops); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, mem) {
		t.Fatal("read bytes differ")
	}
	if n := authCount(t, target, portRPC, authOK); n != 1 {
		t.Errorf("rpc ok = %v, want 1", n)
	}
	if n := authCount(t, target, portData, authOK); n < 1 {
		t.Errorf("data ok = %v, want ≥ 1", n)
	}
	// Forgetting the credential: plain protocol again, refused.
	if err := init.SetPeerCredential(session, nil); err != nil {
		t.Fatal(err)
	}
	if _, ok := init.credential(target.host, target.RPCPort()); ok {
		t.Fatal("credential still set")
	}
}

// TestAuthReplay: a proof sniffed from one connection is refused on
// another (each connection's nonce is fresh), on both ports.
func TestAuthReplay(t *testing.T) {
	target, _, _ := authTarget(t)
	cred := credFor(t, target)
	for _, tc := range []struct {
		port     int
		pb       byte
		portName string
	}{{target.RPCPort(), authPortRPC, portRPC}, {target.DataPort(), authPortData, portData}} {
		// A legitimate exchange, recorded.
		c := dialRaw(t, tc.port)
		if _, err := c.Write(AppendAuthHello(nil, &cred.Key)); err != nil {
			t.Fatal(err)
		}
		var chal [authChalSize]byte
		if _, err := io.ReadFull(c, chal[:]); err != nil {
			t.Fatal(err)
		}
		nonce, err := ParseAuthChallenge(chal[:])
		if err != nil {
			t.Fatal(err)
		}
		proof := AuthProof(&cred.Token, tc.pb, nonce[:], cred.Key[:])
		c.Write(proof[:])
		var st [StatusSize]byte
		if _, err := io.ReadFull(c, st[:]); err != nil || ParseStatus(&st) != nil {
			t.Fatalf("legitimate exchange: %v %v", err, ParseStatus(&st))
		}
		c.Close()

		// The replay: same hello, same proof, then a READ.
		r := dialRaw(t, tc.port)
		r.Write(AppendAuthHello(nil, &cred.Key))
		if _, err := io.ReadFull(r, chal[:]); err != nil {
			t.Fatal(err)
		}
		r.Write(proof[:])
		if _, err := io.ReadFull(r, st[:]); err != nil || !errors.Is(ParseStatus(&st), ErrRejected) {
			t.Fatalf("replayed proof: status %x %v, want rejected", st, err)
		}
		if rest := readAll(t, r); len(rest) != 0 {
			t.Fatalf("replay got %d more bytes", len(rest))
		}
		if n := authCount(t, target, tc.portName, authBadProof); n != 1 {
			t.Errorf("%s bad_proof = %v, want 1", tc.portName, n)
		}
	}
	if n := testutil.ToFloat64(target.m.serveReadOps); n != 0 {
		t.Errorf("served %v reads", n)
	}
}

// TestAuthPlainTarget: a target without RequireAuth issues no token, and
// an initiator holding a (stale) credential for it fails clearly instead
// of hanging; without one it reads as before (Mooncake's protocol).
func TestAuthPlainTarget(t *testing.T) {
	target, _ := newEngine(t, testConfig())
	mem := register(t, target, 1<<16, 3)
	if target.AuthToken(make([]byte, AuthKeySize)) != nil {
		t.Fatal("plain target issued a token")
	}
	init, _ := newEngine(t, testConfig())
	dst := mmap(t, 1<<16)
	if err := init.Register(AddrOf(dst), uint64(len(dst)), ""); err != nil {
		t.Fatal(err)
	}
	var cred Credential
	if err := init.SetPeerCredential(target.SessionID(), &cred); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := init.PeerBuffers(ctx, target.SessionID()); !errors.Is(err, ErrAuthRefused) {
		t.Fatalf("PeerBuffers with a credential to a plain target: %v, want ErrAuthRefused", err)
	}
	init.SetPeerCredential(target.SessionID(), nil)
	if err := init.BatchRead(ctx, target.SessionID(), []Op{{Local: AddrOf(dst), Remote: AddrOf(mem), Length: 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, mem) {
		t.Fatal("bytes differ")
	}
	if err := init.SetPeerCredential("nohost", &cred); !errors.Is(err, ErrSession) {
		t.Fatalf("bad session: %v", err)
	}
}

// TestAuthTimeout: a data connection that sends half a hello is cut
// within the first-byte bound and counted.
func TestAuthTimeout(t *testing.T) {
	cfg := testConfig()
	cfg.RequireAuth = true
	cfg.FirstByteTimeout = 200 * time.Millisecond
	target, _ := newEngine(t, cfg)
	c := dialRaw(t, target.DataPort())
	c.Write([]byte(authMagic))
	if got := readAll(t, c); len(got) != 0 {
		t.Fatalf("got %d bytes", len(got))
	}
	waitFor(t, func() bool { return authCount(t, target, portData, authCut) == 1 })
}

func TestAuthFrames(t *testing.T) {
	var key [AuthKeySize]byte
	rand.Read(key[:])
	h := AppendAuthHello(nil, &key)
	if len(h) != authHelloSize || string(h[:8]) != "KVFAUTH1" {
		t.Fatalf("hello %x", h)
	}
	if got, err := ParseAuthHello(h); err != nil || got != key {
		t.Fatalf("hello round trip: %x %v", got, err)
	}
	for _, bad := range [][]byte{nil, h[:39], append(bytes.Clone(h), 0), append([]byte("KVFAUTH2"), key[:]...)} {
		if _, err := ParseAuthHello(bad); !errors.Is(err, ErrBadAuth) {
			t.Errorf("hello %x: %v", bad, err)
		}
		if _, err := ParseAuthChallenge(bad); !errors.Is(err, ErrBadAuth) {
			t.Errorf("challenge %x: %v", bad, err)
		}
	}
	// The magic, read as a frame length or a data header size, is far
	// beyond anything a Mooncake peer sends.
	var prefix [8]byte
	copy(prefix[:], authMagic)
	if _, err := ParseFrameLength(prefix, 128<<20); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("magic as a frame length: %v", err)
	}
	// Proofs differ by port, nonce, key and token.
	var tok [AuthTokenSize]byte
	n := make([]byte, authNonceSize)
	base := AuthProof(&tok, authPortRPC, n, key[:])
	if AuthProof(&tok, authPortData, n, key[:]) == base {
		t.Fatal("proof does not bind the port")
	}
	n[0] = 1
	if AuthProof(&tok, authPortRPC, n, key[:]) == base {
		t.Fatal("proof does not bind the nonce")
	}
	var s1, s2 [32]byte
	s2[0] = 1
	if AuthToken(&s1, key[:]) == AuthToken(&s2, key[:]) {
		t.Fatal("token does not bind the secret")
	}
}

// FuzzAuthExchange feeds any bytes to a target's side of the exchange:
// it never panics, never accepts, and writes at most a challenge and a
// status; and to an initiator's side, which never panics.
func FuzzAuthExchange(f *testing.F) {
	var key [AuthKeySize]byte
	f.Add(AppendAuthHello(nil, &key))
	f.Add(append(AppendAuthHello(nil, &key), make([]byte, authProofSize)...))
	f.Add([]byte(authMagic))
	f.Add(AppendFrame(nil, FrameMetadata, []byte("{}")))
	f.Add([]byte{})
	a, err := newAuthServer(nil)
	if err != nil {
		f.Fatal(err)
	}
	e := &TCPEngine{auth: a}
	f.Fuzz(func(t *testing.T, in []byte) {
		c := &memConn{r: bytes.NewReader(in)}
		if outcome, _ := e.authExchange(c, authPortData); outcome == authOK {
			t.Fatalf("accepted %x", in)
		}
		if n := c.w.Len(); n > authChalSize+StatusSize {
			t.Fatalf("wrote %d bytes", n)
		}
		// The initiator's side reads the same bytes as a target's answers.
		var cred Credential
		authenticateTo(&memConn{r: bytes.NewReader(in)}, &cred, authPortRPC)
	})
}

// memConn is a net.Conn reading from r and writing to w.
type memConn struct {
	net.Conn
	r *bytes.Reader
	w bytes.Buffer
}

func (c *memConn) Read(b []byte) (int, error)  { return c.r.Read(b) }
func (c *memConn) Write(b []byte) (int, error) { return c.w.Write(b) }

func TestParseAuthSizes(t *testing.T) {
	if len(authMagic) != 8 || authHelloSize != 40 || authChalSize != 40 || authProofSize != 32 {
		t.Fatal("sizes changed: the wire format is fixed")
	}
}

// BenchmarkAuthConnect: a new data connection and its first 4 KiB READ,
// plain and authenticated (the exchange adds one round trip and two
// HMACs per connection; requests after it cost the same).
func BenchmarkAuthConnect(b *testing.B) {
	for _, auth := range []bool{false, true} {
		b.Run(map[bool]string{false: "plain", true: "auth"}[auth], func(b *testing.B) {
			cfg := testConfig()
			cfg.RequireAuth = auth
			target, _ := newEngine(b, cfg)
			mem := register(b, target, 1<<16, 1)
			var cred Credential
			if auth {
				cred.Token = *target.AuthToken(cred.Key[:])
			}
			var hb [HeaderSize]byte
			PutHeader(&hb, Header{Size: 4096, Addr: AddrOf(mem), Opcode: OpcodeRead, V2: true})
			buf := make([]byte, StatusSize+4096)
			addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(target.DataPort()))
			for b.Loop() {
				c, err := net.Dial("tcp", addr)
				if err != nil {
					b.Fatal(err)
				}
				if auth {
					if err := authenticateTo(c, &cred, authPortData); err != nil {
						b.Fatal(err)
					}
				}
				c.Write(hb[:])
				if _, err := io.ReadFull(c, buf); err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
		})
	}
}
