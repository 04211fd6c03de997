package sidechannel

import (
	"testing"
	"time"
)

// TestFrontInnerPortKeepsCurve: with a front, the ROUTER listens on a
// loopback port anyone on the host can reach, past the front's caps. With
// CURVE that port must authenticate exactly like the public one: a client
// without keys, or with an unauthorized key, gets nothing from it, and
// the handler never sees it.
func TestFrontInnerPortKeepsCurve(t *testing.T) {
	skipNoCurve(t)
	srv, authorized, stranger := newKeyPair(t), newKeyPair(t), newKeyPair(t)
	e := newEnv(t)
	h := &countingHandler{}
	lim := DefaultLimits
	s := e.server(t, h, ServerOptions{Addr: "127.0.0.1:0", Limits: &lim,
		Curve: &Curve{PublicKey: srv.pub, SecretKey: srv.sec, AuthorizedClients: []string{authorized.pub}}})
	if s.front == nil {
		t.Fatal("no front with Limits")
	}
	inner := s.front.upstream
	if inner == s.Addr() {
		t.Fatalf("inner port %s is the public one", inner)
	}
	good := &Curve{PublicKey: authorized.pub, SecretKey: authorized.sec, ServerPublicKey: srv.pub}
	mustWork(t, e, s.Addr(), allowClientOpts(good), "public")
	mustFail(t, e, inner, denyClientOpts(nil), "inner-plain")
	mustFail(t, e, inner, denyClientOpts(&Curve{PublicKey: stranger.pub, SecretKey: stranger.sec, ServerPublicKey: srv.pub}), "inner-stranger")
	if got := h.doneIDs(); len(got) != 1 || got[0] != "public" {
		t.Fatalf("handler saw DONE %v: a client on the inner port got through", got)
	}
}

// TestFrontReleasesClosedRelays: a peer that opens its share of
// connections and closes them (mid-handshake) gets its slots back, so
// neither the per-peer count nor the relays' goroutines (TestMain checks
// none is left) outlive the connections.
func TestFrontReleasesClosedRelays(t *testing.T) {
	e := newEnv(t)
	h := &recorder{md: Metadata{EngineID: "P", TERPCPort: 1234, KVCachesBaseAddr: []uint64{1 << 20}, NumBlocks: 4}}
	lim := Limits{MaxConns: 16, MaxConnsPerPeer: 3, FirstByteTimeout: 5 * time.Second}
	s := e.server(t, h, ServerOptions{Limits: &lim})
	for round := range 5 {
		for range 3 {
			c := dialFrom(t, "127.0.0.6", s.Addr(), true)
			c.Close()
		}
		// Wait until the front has released them.
		deadline := time.Now().Add(5 * time.Second)
		for {
			s.front.mu.Lock()
			n := s.front.perIP["127.0.0.6"]
			s.front.mu.Unlock()
			if n == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("round %d: %d relays from a peer that closed every connection", round, n)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	c := e.client(t, fastClientOpts())
	if _, err := c.GetMeta(t.Context(), s.Addr()); err != nil {
		t.Fatal(err)
	}
	s.Close()
}
