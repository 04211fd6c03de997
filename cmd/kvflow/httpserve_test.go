package main

import (
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The metrics endpoint admits http_max_conns connections: one more is
// reset at accept and counted, and a closed one frees its slot. Every
// wait a client could stretch is bounded.
func TestHTTPConnLimit(t *testing.T) {
	srv := newHTTPServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok\n") }))
	if srv.ReadHeaderTimeout <= 0 || srv.ReadTimeout <= 0 || srv.IdleTimeout <= 0 || srv.MaxHeaderBytes <= 0 {
		t.Fatalf("unbounded server: %+v", srv)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	ll := newLimitListener(ln, 2, reg)
	go srv.Serve(ll)
	defer srv.Close()
	addr := ln.Addr().String()

	dial := func() net.Conn {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	a, _ := dial(), dial() // idle: they hold both slots
	waitSlots := func(n int) {
		for deadline := time.Now().Add(10 * time.Second); len(ll.sem) != n; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d slots held, want %d", len(ll.sem), n)
			}
		}
	}
	waitSlots(2)
	// The reset may already fail the connect.
	if c, err := net.DialTimeout("tcp", addr, 5*time.Second); err == nil {
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1))
		if err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("third connection not refused: %v", err)
		} else if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) {
			t.Fatalf("third connection: %v", err)
		}
	} else if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("third connection: %v", err)
	}
	// Counted once the accept loop has run.
	for deadline := time.Now().Add(10 * time.Second); testutil.ToFloat64(ll.refused) != 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("refused = %v, want 1", testutil.ToFloat64(ll.refused))
		}
	}
	a.Close()
	waitSlots(1)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + addr + "/healthz")
	if err != nil {
		t.Fatalf("GET after a slot freed: %v", err)
	}
	resp.Body.Close()
}
