package node

import (
	"context"
	"strings"
	"sync"
	"testing"

	zmq "github.com/pebbe/zmq4"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// recordingCreds is the engine's credential table, as the fetcher sets it.
type recordingCreds struct {
	mu sync.Mutex
	m  map[string]mooncake.Credential
}

func (r *recordingCreds) SetPeerCredential(session string, cred *mooncake.Credential) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if cred == nil {
		delete(r.m, session)
	} else {
		r.m[session] = *cred
	}
	return nil
}

func (r *recordingCreds) get(session string) (mooncake.Credential, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c, ok := r.m[session]
	return c, ok
}

// TestCredentialSessionConflict: over real CURVE side channels, a hostile
// endpoint whose GET_META reply names another prefill's transfer session
// (its te_rpc_port) neither clears nor replaces that prefill's data-plane
// credential: its reply is refused naming both endpoints and counted
// (reason session_conflict). The prefill restarting on its own endpoint
// (new token, same or new port) still refreshes its credential, and a
// session it gave up is forgotten. Sessions without credentials are not
// owned.
func TestCredentialSessionConflict(t *testing.T) {
	if !zmq.HasCurve() {
		t.Skip("libzmq built without CURVE")
	}
	reg := prometheus.NewRegistry()
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{Registerer: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Close()
	srvPub, srvSec, err := sidechannel.GenerateKeyPair()
	if err != nil {
		t.Fatal(err)
	}
	c, err := sidechannel.NewClient(zctx, sidechannel.ClientOptions{Attempts: 1,
		Curve: &sidechannel.Curve{ServerPublicKey: srvPub}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	// serve starts a side channel whose metadata names *port with token *tok
	// (nil: no credential).
	type peer struct {
		mu   sync.Mutex
		port int
		tok  *[wire.TEAuthSize]byte
		addr string
	}
	serve := func(port int, tok byte, withTok bool) *peer {
		p := &peer{port: port}
		if withTok {
			p.tok = &[wire.TEAuthSize]byte{tok}
		}
		s, err := sidechannel.NewServer(zctx, sidechannel.ServerOptions{Addr: "127.0.0.1:0",
			Curve: &sidechannel.Curve{SecretKey: srvSec},
			AuthToken: func([]byte) *[wire.TEAuthSize]byte {
				p.mu.Lock()
				defer p.mu.Unlock()
				return p.tok
			}}, sidechannel.HandlerFuncs{MetadataFunc: func() sidechannel.Metadata {
			p.mu.Lock()
			defer p.mu.Unlock()
			return sidechannel.Metadata{EngineID: "P", TERPCPort: p.port, KVCachesBaseAddr: []uint64{1}, NumBlocks: 1}
		}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		p.addr = s.Addr()
		return p
	}
	creds := &recordingCreds{m: map[string]mooncake.Credential{}}
	f := fetcher{c: c, creds: creds, owners: newCredOwners(reg, nil)}
	ctx := context.Background()
	const session = "127.0.0.1:41000"

	legit := serve(41000, 1, true)
	if _, err := f.GetMeta(ctx, legit.addr); err != nil {
		t.Fatal(err)
	}
	if cr, ok := creds.get(session); !ok || cr.Token[0] != 1 {
		t.Fatalf("legit credential not set: %v %v", cr.Token[0], ok)
	}

	for _, tc := range []struct {
		name    string
		withTok bool
	}{{"clears", false}, {"replaces", true}} {
		hostile := serve(41000, 9, tc.withTok)
		_, err := f.GetMeta(ctx, hostile.addr)
		if err == nil || !strings.Contains(err.Error(), legit.addr) || !strings.Contains(err.Error(), hostile.addr) || !strings.Contains(err.Error(), session) {
			t.Fatalf("%s: hostile reply: %v, want a refusal naming both endpoints and the session", tc.name, err)
		}
		if cr, ok := creds.get(session); !ok || cr.Token[0] != 1 {
			t.Fatalf("%s: hostile endpoint changed the legit credential (token %v, set %v)", tc.name, cr.Token[0], ok)
		}
	}
	if n := counter(t, reg, "kvflow_handshake_meta_refusals_total", map[string]string{"reason": "session_conflict"}); n != 2 {
		t.Errorf("session_conflict refusals = %v, want 2", n)
	}

	// The legit prefill restarts on its endpoint: new token, then new port.
	legit.mu.Lock()
	legit.tok = &[wire.TEAuthSize]byte{2}
	legit.mu.Unlock()
	if _, err := f.GetMeta(ctx, legit.addr); err != nil {
		t.Fatal(err)
	}
	if cr, _ := creds.get(session); cr.Token[0] != 2 {
		t.Fatalf("restarted prefill's token not refreshed: %v", cr.Token[0])
	}
	legit.mu.Lock()
	legit.port = 41001
	legit.mu.Unlock()
	if _, err := f.GetMeta(ctx, legit.addr); err != nil {
		t.Fatal(err)
	}
	if _, ok := creds.get(session); ok {
		t.Fatal("the session the prefill gave up kept its credential")
	}
	if cr, ok := creds.get("127.0.0.1:41001"); !ok || cr.Token[0] != 2 {
		t.Fatal("credential of the prefill's new session not set")
	}
	// The session given up may be named by another endpoint now.
	if _, err := f.GetMeta(ctx, serve(41000, 3, true).addr); err != nil {
		t.Fatalf("a session given up: %v", err)
	}
	// Without credentials (auth off, open ports) nothing is owned: two
	// endpoints naming one session are both served.
	for range 2 {
		if _, err := f.GetMeta(ctx, serve(41005, 0, false).addr); err != nil {
			t.Fatalf("session without a credential: %v", err)
		}
	}
	// The owner dropping its credential gives the session up.
	legit.mu.Lock()
	legit.tok = nil
	legit.mu.Unlock()
	if _, err := f.GetMeta(ctx, legit.addr); err != nil {
		t.Fatal(err)
	}
	if _, ok := creds.get("127.0.0.1:41001"); ok {
		t.Fatal("credential kept after the owner's reply carried none")
	}
	if _, err := f.GetMeta(ctx, serve(41001, 4, true).addr); err != nil {
		t.Fatalf("a session whose owner dropped its credential: %v", err)
	}
}

// TestCredOwnersBounded: churn through many endpoints keeps at most
// maxCredSessions sessions, forgetting the least recently named.
func TestCredOwnersBounded(t *testing.T) {
	defer func(n int) { maxCredSessions = n }(maxCredSessions)
	maxCredSessions = 4
	o := newCredOwners(prometheus.NewRegistry(), nil)
	var forgot []string
	for i := range 10 {
		f, err := o.claim(string(rune('a'+i))+":1", string(rune('a'+i))+":2", true)
		if err != nil {
			t.Fatal(err)
		}
		forgot = append(forgot, f...)
	}
	if len(o.bySession) != 4 || len(o.byEndpoint) != 4 || o.lru.Len() != 4 || len(forgot) != 6 || forgot[0] != "a:2" {
		t.Fatalf("sessions %d endpoints %d lru %d forgot %v", len(o.bySession), len(o.byEndpoint), o.lru.Len(), forgot)
	}
}
