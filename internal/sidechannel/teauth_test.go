package sidechannel

import (
	"bytes"
	"context"
	"sync"
	"testing"

	zmq "github.com/pebbe/zmq4"

	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// TestAuthTokenBoundToClientKey: a CURVE server with AuthToken sends each
// client the token of its own CURVE public key (as the ZAP handler
// admitted it) in Ext.TEAuth; a plain server never calls AuthToken.
func TestAuthTokenBoundToClientKey(t *testing.T) {
	skipNoCurve(t)
	e := newEnv(t)
	srv, a, b := newKeyPair(t), newKeyPair(t), newKeyPair(t)
	var mu sync.Mutex
	var seen [][]byte
	token := func(key []byte) *[wire.TEAuthSize]byte {
		mu.Lock()
		seen = append(seen, bytes.Clone(key))
		mu.Unlock()
		return (*[wire.TEAuthSize]byte)(append([]byte("tok:"), key[:28]...)) // tells the key
	}
	s := e.server(t, &countingHandler{}, ServerOptions{
		Curve:     &Curve{SecretKey: srv.sec, AuthorizedClients: []string{a.pub, b.pub}},
		AuthToken: token,
	})
	for _, kp := range []keyPair{a, b} {
		c := e.client(t, allowClientOpts(&Curve{PublicKey: kp.pub, SecretKey: kp.sec, ServerPublicKey: srv.pub}))
		if c.PublicKey() != kp.pub {
			t.Fatalf("client PublicKey %q, want %q", c.PublicKey(), kp.pub)
		}
		md, err := c.GetMeta(context.Background(), s.Addr())
		if err != nil {
			t.Fatal(err)
		}
		raw := []byte(zmq.Z85decode(kp.pub))
		if want := append([]byte("tok:"), raw[:28]...); md.Ext.TEAuth == nil || !bytes.Equal(md.Ext.TEAuth[:], want) {
			t.Fatalf("client %s got token %x, want %x", kp.pub, md.Ext.TEAuth, want)
		}
		if md.Ext.BootEpoch != testMeta.Ext.BootEpoch || md.EngineID != testMeta.EngineID {
			t.Fatalf("metadata changed: %+v", md)
		}
	}
	// An ephemeral client pair is reported too (the token binds to it).
	c := e.client(t, allowClientOpts(&Curve{ServerPublicKey: srv.pub}))
	if len(c.PublicKey()) != 40 {
		t.Fatalf("ephemeral client PublicKey %q", c.PublicKey())
	}

	// Plain server: no token, AuthToken never called.
	mu.Lock()
	n := len(seen)
	mu.Unlock()
	plain := e.server(t, &countingHandler{}, ServerOptions{AuthToken: token})
	pc := e.client(t, allowClientOpts(nil))
	md, err := pc.GetMeta(context.Background(), plain.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if md.Ext.TEAuth != nil || pc.PublicKey() != "" {
		t.Fatalf("plain server sent a token %x (client key %q)", md.Ext.TEAuth, pc.PublicKey())
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != n {
		t.Fatalf("AuthToken called %d times by a plain server", len(seen)-n)
	}
}
