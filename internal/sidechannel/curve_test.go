package sidechannel

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
)

func skipNoCurve(t *testing.T) {
	t.Helper()
	if !zmq.HasCurve() {
		t.Skip("libzmq built without CURVE")
	}
}

type keyPair struct{ pub, sec string }

func newKeyPair(t *testing.T) keyPair {
	t.Helper()
	pub, sec, err := GenerateKeyPair()
	if err != nil {
		t.Fatal(err)
	}
	return keyPair{pub, sec}
}

// authTimeout bounds calls that must fail: an unauthenticated peer never
// gets a reply, so they end by timing out.
const authTimeout = 300 * time.Millisecond

func denyClientOpts(c *Curve) ClientOptions {
	return ClientOptions{AttemptTimeout: authTimeout, Attempts: 1, Curve: c}
}

func allowClientOpts(c *Curve) ClientOptions {
	return ClientOptions{AttemptTimeout: 2 * time.Second, Attempts: 1, Curve: c}
}

// countingHandler counts handler calls, so tests can prove a rejected peer
// never reached it.
type countingHandler struct {
	meta  atomic.Int64
	mu    sync.Mutex
	dones []string
}

func (h *countingHandler) Metadata() Metadata { h.meta.Add(1); return testMeta }

func (h *countingHandler) Done(id string) error {
	h.mu.Lock()
	h.dones = append(h.dones, id)
	h.mu.Unlock()
	return nil
}

func (h *countingHandler) doneIDs() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.dones...)
}

// mustWork fetches metadata and sends DONE id through a new client.
func mustWork(t *testing.T, e *testEnv, addr string, opts ClientOptions, id string) {
	t.Helper()
	c := e.client(t, opts)
	md, err := c.GetMeta(context.Background(), addr)
	if err != nil {
		t.Fatalf("authorized GetMeta: %v", err)
	}
	if md.EngineID != testMeta.EngineID {
		t.Fatalf("GetMeta: %+v", md)
	}
	if err := c.SendDone(context.Background(), addr, id); err != nil {
		t.Fatalf("authorized SendDone: %v", err)
	}
}

// mustFail checks that a client with opts can neither fetch metadata nor
// send DONE (both time out).
func mustFail(t *testing.T, e *testEnv, addr string, opts ClientOptions, id string) {
	t.Helper()
	c := e.client(t, opts)
	if md, err := c.GetMeta(context.Background(), addr); !errors.Is(err, ErrTimeout) {
		t.Errorf("GetMeta: got %+v, %v; want ErrTimeout", md, err)
	}
	if err := c.SendDone(context.Background(), addr, id); !errors.Is(err, ErrTimeout) {
		t.Errorf("SendDone: got %v; want ErrTimeout", err)
	}
}

func authDenied(t *testing.T, e *testEnv, reason string) float64 {
	t.Helper()
	return metric(t, e, "kvflow_sidechannel_auth_denied_total", map[string]string{"reason": reason})
}

func TestCurveAuth(t *testing.T) {
	skipNoCurve(t)
	srv, authorized, stranger, other := newKeyPair(t), newKeyPair(t), newKeyPair(t), newKeyPair(t)

	for _, tc := range []struct {
		name       string
		authorized []string
	}{
		{"authorized-keys", []string{authorized.pub, other.pub}},
		{"any-client", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			h := &countingHandler{}
			s := e.server(t, h, ServerOptions{Curve: &Curve{PublicKey: srv.pub, SecretKey: srv.sec, AuthorizedClients: tc.authorized}})

			good := &Curve{PublicKey: authorized.pub, SecretKey: authorized.sec, ServerPublicKey: srv.pub}
			mustWork(t, e, s.Addr(), allowClientOpts(good), "ok-1")

			bad := map[string]ClientOptions{
				"no-keys":          denyClientOpts(nil),
				"wrong-server-key": denyClientOpts(&Curve{PublicKey: authorized.pub, SecretKey: authorized.sec, ServerPublicKey: other.pub}),
			}
			if tc.authorized != nil {
				bad["unauthorized-key"] = denyClientOpts(&Curve{PublicKey: stranger.pub, SecretKey: stranger.sec, ServerPublicKey: srv.pub})
				bad["ephemeral-key"] = denyClientOpts(&Curve{ServerPublicKey: srv.pub})
			} else {
				// Any client that knows the server key, even with a
				// throw-away pair, is admitted.
				mustWork(t, e, s.Addr(), allowClientOpts(&Curve{ServerPublicKey: srv.pub}), "ok-ephemeral")
			}
			var wg sync.WaitGroup
			for name, opts := range bad {
				wg.Go(func() { mustFail(t, e, s.Addr(), opts, "bad-"+name) })
			}
			wg.Wait()

			// The server keeps serving authorized clients (a new socket
			// and the pooled one).
			mustWork(t, e, s.Addr(), allowClientOpts(good), "ok-2")
			want := []string{"ok-1", "ok-2"}
			if tc.authorized == nil {
				want = []string{"ok-1", "ok-ephemeral", "ok-2"}
			}
			if got := h.doneIDs(); strings.Join(got, ",") != strings.Join(want, ",") {
				t.Errorf("handler saw DONE %v, want %v (a rejected peer reached it)", got, want)
			}
			if n := h.meta.Load(); n != int64(len(want)) {
				t.Errorf("handler served metadata %d times, want %d", n, len(want))
			}
			if tc.authorized != nil {
				if n := authDenied(t, e, authDeniedKey); n < 2 {
					t.Errorf("auth_denied_total{unauthorized_key} = %v, want ≥ 2", n)
				}
			} else if n := authDenied(t, e, authDeniedKey); n != 0 {
				t.Errorf("auth_denied_total{unauthorized_key} = %v with no key list", n)
			}
		})
	}
}

// A CURVE client never downgrades to a plain server, and plain servers keep
// working on a context whose ZAP handler runs.
func TestCurveMixedContext(t *testing.T) {
	skipNoCurve(t)
	e := newEnv(t)
	srvA, srvB, keyA, keyB := newKeyPair(t), newKeyPair(t), newKeyPair(t), newKeyPair(t)
	hA, hB, hPlain := &countingHandler{}, &countingHandler{}, &countingHandler{}
	a := e.server(t, hA, ServerOptions{Curve: &Curve{SecretKey: srvA.sec, AuthorizedClients: []string{keyA.pub}}})
	b := e.server(t, hB, ServerOptions{Curve: &Curve{SecretKey: srvB.sec, AuthorizedClients: []string{keyB.pub}}})
	plain := e.server(t, hPlain, ServerOptions{})

	mustWork(t, e, plain.Addr(), allowClientOpts(nil), "plain")
	mustWork(t, e, a.Addr(), allowClientOpts(&Curve{PublicKey: keyA.pub, SecretKey: keyA.sec, ServerPublicKey: srvA.pub}), "a")
	mustWork(t, e, b.Addr(), allowClientOpts(&Curve{SecretKey: keyB.sec, ServerPublicKey: srvB.pub}), "b")

	var wg sync.WaitGroup
	// Each server has its own key list: A's client is not B's.
	wg.Go(func() {
		mustFail(t, e, b.Addr(), denyClientOpts(&Curve{PublicKey: keyA.pub, SecretKey: keyA.sec, ServerPublicKey: srvB.pub}), "a-on-b")
	})
	// CURVE client, plain server: no handshake, no plaintext fallback.
	wg.Go(func() {
		mustFail(t, e, plain.Addr(), denyClientOpts(&Curve{PublicKey: keyA.pub, SecretKey: keyA.sec, ServerPublicKey: srvA.pub}), "curve-on-plain")
	})
	wg.Wait()
	for name, h := range map[string]*countingHandler{"A": hA, "B": hB, "plain": hPlain} {
		if got := h.doneIDs(); len(got) != 1 {
			t.Errorf("server %s saw DONE %v, want exactly its own", name, got)
		}
	}

	// A closed server's domain is forgotten.
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	e.zctx.zapMu.Lock()
	z := e.zctx.zap
	e.zctx.zapMu.Unlock()
	z.mu.Lock()
	_, still := z.policies[a.zap]
	n := len(z.policies)
	z.mu.Unlock()
	if still || n != 1 {
		t.Errorf("after closing A: A's domain kept=%v, %d domains (want B's only)", still, n)
	}
}

// reqOnce sends payload on a fresh REQ socket (CURVE client when c != nil)
// and returns the reply, or an error after authTimeout.
func reqOnce(t *testing.T, e *testEnv, endpoint string, c *Curve, payload []byte) ([]byte, error) {
	t.Helper()
	return routerCall(t, e, endpoint, c, payload, authTimeout)
}

func TestCurveRouter(t *testing.T) {
	skipNoCurve(t)
	dir, err := os.MkdirTemp("", "kvsc") // short: ipc paths are limited to ~100 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	srv, client, stranger := newKeyPair(t), newKeyPair(t), newKeyPair(t)
	for _, addr := range []string{"tcp://127.0.0.1:0", "ipc://" + filepath.Join(dir, "ctl.sock")} {
		t.Run(strings.SplitN(addr, ":", 2)[0], func(t *testing.T) {
			e := newEnv(t)
			var calls atomic.Int64
			r, err := NewRouter(e.zctx, ServerOptions{Addr: addr, Curve: &Curve{PublicKey: srv.pub, SecretKey: srv.sec, AuthorizedClients: []string{client.pub}}},
				func(p []byte) []byte { calls.Add(1); return append([]byte("re:"), p...) })
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = r.Close() })
			ep := addr
			if strings.HasPrefix(addr, "tcp://") {
				ep = "tcp://" + r.Addr()
			}
			good := &Curve{PublicKey: client.pub, SecretKey: client.sec, ServerPublicKey: srv.pub}
			if got, err := reqOnce(t, e, ep, good, []byte("status")); err != nil || string(got) != "re:status" {
				t.Fatalf("authorized: %q, %v", got, err)
			}
			for name, c := range map[string]*Curve{
				"no-keys":          nil,
				"wrong-server-key": {PublicKey: client.pub, SecretKey: client.sec, ServerPublicKey: stranger.pub},
				"unauthorized-key": {PublicKey: stranger.pub, SecretKey: stranger.sec, ServerPublicKey: srv.pub},
			} {
				if got, err := reqOnce(t, e, ep, c, []byte("abort")); !errors.Is(err, ErrTimeout) {
					t.Errorf("%s: got %q, %v; want no reply", name, got, err)
				}
			}
			if got, err := reqOnce(t, e, ep, good, []byte("again")); err != nil || string(got) != "re:again" {
				t.Fatalf("authorized after rejections: %q, %v", got, err)
			}
			if n := calls.Load(); n != 2 {
				t.Errorf("handler called %d times, want 2 (authorized only)", n)
			}
		})
	}
}

func TestCurveOptions(t *testing.T) {
	skipNoCurve(t)
	srv, cl := newKeyPair(t), newKeyPair(t)
	e := newEnv(t)
	h := &countingHandler{}
	for name, c := range map[string]*Curve{
		"no-secret":      {PublicKey: srv.pub},
		"pair-mismatch":  {PublicKey: cl.pub, SecretKey: srv.sec},
		"short-secret":   {SecretKey: srv.sec[:39]},
		"bad-authorized": {SecretKey: srv.sec, AuthorizedClients: []string{cl.pub, "not a key"}},
		"non-z85-secret": {SecretKey: strings.Repeat("~", 40)},
	} {
		if s, err := NewServer(e.zctx, ServerOptions{Addr: "127.0.0.1:0", Curve: c}, h); err == nil {
			_ = s.Close()
			t.Errorf("server %s: accepted", name)
		} else if !errors.Is(err, ErrBadKey) {
			t.Errorf("server %s: %v, want ErrBadKey", name, err)
		}
	}
	for name, c := range map[string]*Curve{
		"no-server-key":   {PublicKey: cl.pub, SecretKey: cl.sec},
		"public-only":     {PublicKey: cl.pub, ServerPublicKey: srv.pub},
		"pair-mismatch":   {PublicKey: srv.pub, SecretKey: cl.sec, ServerPublicKey: srv.pub},
		"bad-server-key":  {ServerPublicKey: "short"},
		"ephemeral-nokey": {},
	} {
		opts := ClientOptions{Curve: c}
		if err := opts.Validate(); !errors.Is(err, ErrBadKey) {
			t.Errorf("client %s: Validate = %v, want ErrBadKey", name, err)
		}
		if cli, err := NewClient(e.zctx, opts); err == nil {
			_ = cli.Close()
			t.Errorf("client %s: NewClient accepted", name)
		}
	}
	for name, c := range map[string]*Curve{
		"full":      {PublicKey: cl.pub, SecretKey: cl.sec, ServerPublicKey: srv.pub},
		"derived":   {SecretKey: cl.sec, ServerPublicKey: srv.pub},
		"ephemeral": {ServerPublicKey: srv.pub},
	} {
		if err := (ClientOptions{Curve: c}).Validate(); err != nil {
			t.Errorf("client %s: %v", name, err)
		}
	}
	// The server's public key, when given, is derived-checked; a server
	// without AuthorizedClients admits any key-holding client.
	s := e.server(t, h, ServerOptions{Curve: &Curve{SecretKey: srv.sec}})
	if s.zap == "" {
		t.Error("CURVE server without ZAP domain")
	}
}

func TestCurveKeyFiles(t *testing.T) {
	skipNoCurve(t)
	dir := t.TempDir()
	p := func(n string) string { return filepath.Join(dir, n) }

	pub, err := WriteKeyPair(p("w.key"), p("w.pub"))
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(p("w.key")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("secret key file: %v, %v; want mode 0600", fi.Mode(), err)
	}
	if _, err := WriteKeyPair(p("w.key"), p("w2.pub")); err == nil {
		t.Error("WriteKeyPair overwrote an existing secret key")
	}
	if _, err := os.Stat(p("w2.pub")); !os.IsNotExist(err) {
		t.Errorf("failed WriteKeyPair left a public key file: %v", err)
	}
	srv := newKeyPair(t)
	if err := WriteKeyFile(p("srv.pub"), srv.pub, false); err != nil {
		t.Fatal(err)
	}
	if err := WriteKeyFile(p("x.pub"), "short", false); !errors.Is(err, ErrBadKey) {
		t.Errorf("WriteKeyFile(bad key) = %v", err)
	}
	a, b := newKeyPair(t), newKeyPair(t)
	auth := "# decode workers\n\n" + a.pub + "  decode-0\n" + b.pub + "\n" + a.pub + "\n#" + strings.Repeat("x", 10) + "\n"
	if err := os.WriteFile(p("authorized"), []byte(auth), 0o644); err != nil {
		t.Fatal(err)
	}

	c, err := LoadCurveKeys(p("w.key"), p("w.pub"), p("srv.pub"), p("authorized"))
	if err != nil {
		t.Fatal(err)
	}
	if c.PublicKey != pub || c.ServerPublicKey != srv.pub || len(c.SecretKey) != 40 {
		t.Errorf("loaded %v", c)
	}
	if strings.Join(c.AuthorizedClients, ",") != a.pub+","+b.pub {
		t.Errorf("authorized %v, want [a b] (deduplicated)", c.AuthorizedClients)
	}
	if s := c.String(); strings.Contains(s, c.SecretKey) {
		t.Errorf("String leaks the secret key: %s", s)
	}
	if c, err := LoadCurveKeys("", "", p("srv.pub"), ""); err != nil || c.ServerPublicKey != srv.pub || c.SecretKey != "" {
		t.Errorf("server key only: %v, %v", c, err)
	}

	write := func(name, body string) string {
		if err := os.WriteFile(p(name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p(name)
	}
	for name, args := range map[string][4]string{
		"pair-mismatch":  {p("w.key"), p("srv.pub"), "", ""},
		"two-keys":       {write("two", a.pub+"\n"+b.pub+"\n"), "", "", ""},
		"empty-key-file": {"", write("empty", "# nothing\n"), "", ""},
		"garbage":        {"", "", write("garbage", "hello world\n"), ""},
		"empty-authz":    {"", "", "", write("authz-empty", "\n# none\n")},
		"bad-authz-line": {"", "", "", write("authz-bad", a.pub+"\nnot-a-key\n")},
	} {
		if _, err := LoadCurveKeys(args[0], args[1], args[2], args[3]); !errors.Is(err, ErrBadKey) {
			t.Errorf("%s: %v, want ErrBadKey", name, err)
		}
	}
	if _, err := LoadCurveKeys(p("missing"), "", "", ""); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
}
