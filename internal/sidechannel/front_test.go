package sidechannel

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"
)

// dialFrom opens a TCP connection to addr from the loopback address src
// and, with hello, sends one byte (so it passes the first-byte deadline).
func dialFrom(t *testing.T, src, addr string, hello bool) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if hello {
		// The start of a ZMTP greeting: libzmq waits for the rest.
		if _, err := c.Write([]byte{0xff}); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// closedByServer reports whether the server closed c within wait.
func closedByServer(c net.Conn, wait time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, 64)
	for {
		if _, err := c.Read(buf); err != nil {
			ne, ok := err.(net.Error)
			return !(ok && ne.Timeout())
		}
	}
}

// TestFrontLimits: a server with Limits bounds connections per peer and in
// all, cuts one that sends nothing within the first-byte timeout, refuses
// new ones under descriptor pressure, counts each refusal, and keeps
// serving legitimate clients (their bytes relayed unchanged to the ROUTER).
func TestFrontLimits(t *testing.T) {
	e := newEnv(t)
	h := &recorder{md: Metadata{EngineID: "P", TERPCPort: 1234, KVCachesBaseAddr: []uint64{1 << 20}, NumBlocks: 4}}
	lim := Limits{MaxConns: 6, MaxConnsPerPeer: 3, FirstByteTimeout: 300 * time.Millisecond, FDReserve: 1}
	s := e.server(t, h, ServerOptions{Limits: &lim})
	c := e.client(t, fastClientOpts())
	ctx := context.Background()
	get := func() error {
		md, err := c.GetMeta(ctx, s.Addr())
		if err == nil && md.EngineID != "P" {
			t.Fatalf("metadata through the front: %+v", md)
		}
		return err
	}
	if err := get(); err != nil { // one pooled connection from 127.0.0.1
		t.Fatal(err)
	}
	refused := func(reason string) float64 {
		return metric(t, e, "kvflow_sidechannel_connections_refused_total", map[string]string{"reason": reason})
	}

	// Per peer: 127.0.0.1 holds the client's connection and two more.
	for range 2 {
		dialFrom(t, "127.0.0.1", s.Addr(), true)
	}
	if over := dialFrom(t, "127.0.0.1", s.Addr(), true); !closedByServer(over, 2*time.Second) {
		t.Fatal("a fourth connection from one address was kept (cap 3)")
	}
	if n := refused(refusedPeer); n != 1 {
		t.Errorf("max_conns_per_peer refusals %v, want 1", n)
	}
	// In all: three more from another address fill the cap of 6.
	for range 3 {
		dialFrom(t, "127.0.0.2", s.Addr(), true)
	}
	if over := dialFrom(t, "127.0.0.3", s.Addr(), true); !closedByServer(over, 2*time.Second) {
		t.Fatal("a seventh connection was kept (cap 6)")
	}
	if n := refused(refusedTotal); n != 1 {
		t.Errorf("max_conns refusals %v, want 1", n)
	}
	// The legitimate client's pooled connection still works.
	if err := get(); err != nil {
		t.Fatalf("client under the caps: %v", err)
	}

	// Silent connections are cut at the first-byte deadline.
	s2 := e.server(t, h, ServerOptions{Limits: &lim})
	silent := dialFrom(t, "127.0.0.4", s2.Addr(), false)
	if !closedByServer(silent, 5*time.Second) {
		t.Fatal("a connection that sent nothing was kept past the first-byte timeout")
	}
	if n := refused(timedOutFirstB); n != 1 {
		t.Errorf("first_byte cuts %v, want 1", n)
	}

	// Descriptor pressure: fewer left than the reserve, new connections
	// are refused; once there is room again they are served.
	s2.front.mu.Lock()
	s2.front.headroom = func() (int, error) { return 2, nil }
	s2.front.countedAt = time.Time{}
	s2.front.mu.Unlock()
	if c := dialFrom(t, "127.0.0.5", s2.Addr(), true); !closedByServer(c, 2*time.Second) {
		t.Fatal("a connection was kept under descriptor pressure")
	}
	if n := refused(refusedFDs); n != 1 {
		t.Errorf("fd_reserve refusals %v, want 1", n)
	}
	s2.front.mu.Lock()
	s2.front.headroom = func() (int, error) { return 1000, nil }
	s2.front.countedAt = time.Time{}
	s2.front.mu.Unlock()
	c2 := e.client(t, fastClientOpts())
	if _, err := c2.GetMeta(ctx, s2.Addr()); err != nil {
		t.Fatalf("client after the pressure ended: %v", err)
	}
	// Close cuts every relay and waits for them (TestMain checks that no
	// goroutine is left).
	s.Close()
	s2.Close()
}

// TestFrontPortInUse: a front on a port already bound fails like a
// ROUTER bind does, naming the address in use.
func TestFrontPortInUse(t *testing.T) {
	e := newEnv(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	_, err = NewServer(e.zctx, ServerOptions{Addr: ln.Addr().String(), Limits: &DefaultLimits}, &recorder{})
	if err == nil || !strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("NewServer on a port in use: %v", err)
	}
}
