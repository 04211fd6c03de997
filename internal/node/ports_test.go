package node

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

// TestFixedDataPort: prefill workers started with node.te_data_port listen
// for data there (each attempt of startCluster draws new random ports in
// testkit's window, so a port taken by someone else only costs a retry),
// and a decode reads every byte through those ports: its lanes are the
// connections established on them.
func TestFixedDataPort(t *testing.T) {
	tc := topo{name: "fixed-data-port", prefillTP: 2, decodeTP: 1, model: gqa(3),
		mutate: func(role string, c *config.Config) {
			if role == "prefill" {
				c.Node.TEDataPort = testkit.RandomPort()
			}
		}}
	c := runEndToEnd(t, tc)
	for _, p := range c.prefill {
		want := p.Config.Node.TEDataPort
		if want == 0 {
			t.Fatal("no data port configured")
		}
		dp, ok := p.Engine.(interface{ DataPort() int })
		if !ok {
			t.Fatalf("engine %T has no data port", p.Engine)
		}
		if got := dp.DataPort(); got != want {
			t.Errorf("prefill rank %d: data port %d, configured %d", p.Config.Rank.TP, got, want)
		}
		if served := counter(t, c.regs[p], "kvflow_transfer_bytes_total", map[string]string{"direction": "serve_read"}); served == 0 {
			t.Errorf("prefill rank %d served no bytes", p.Config.Rank.TP)
		}
		n, err := establishedOn(want)
		if err != nil {
			t.Logf("cannot list connections: %v", err)
			continue
		}
		if n == 0 {
			t.Errorf("prefill rank %d: no connection established on data port %d after the reads", p.Config.Rank.TP, want)
		}
	}
}

// establishedOn counts the established TCP connections whose local port is
// port (/proc/net/tcp and tcp6): a listener's accepted connections.
func establishedOn(port int) (int, error) {
	n := 0
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		fh, err := os.Open(f)
		if err != nil {
			return 0, err
		}
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			// sl local_address rem_address st ...; addresses are HEXIP:HEXPORT.
			fields := strings.Fields(sc.Text())
			if len(fields) < 4 || fields[3] != "01" { // 01: ESTABLISHED
				continue
			}
			i := strings.LastIndexByte(fields[1], ':')
			if p, err := strconv.ParseUint(fields[1][i+1:], 16, 16); err == nil && int(p) == port {
				n++
			}
		}
		fh.Close()
		if err := sc.Err(); err != nil {
			return 0, err
		}
	}
	return n, nil
}

// TestDataPortTaken: a node whose node.te_data_port is in use fails to
// start with an error naming the key.
func TestDataPortTaken(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	busy := ln.Addr().(*net.TCPAddr).Port
	tc := topo{name: "data-port-taken", prefillTP: 1, decodeTP: 1, model: gqa(2)}
	cfg := baseConfig(tc, "prefill", testkit.RandomPort())
	cfg.Node.TEDataPort = busy
	n, err := Start(cfg, Deps{})
	if err == nil {
		n.Close(t.Context())
		t.Fatal("started on a data port in use")
	}
	if want := fmt.Sprintf("node.te_data_port %d", busy); !strings.Contains(err.Error(), want) ||
		!strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("error %q does not name %q and the cause", err, want)
	}
}

// TestSideChannelLimitsDefault: node.limits' side-channel caps default to
// the side channel's own (config cannot import that cgo package).
func TestSideChannelLimitsDefault(t *testing.T) {
	l := config.Default().Node.Limits
	d := sidechannel.DefaultLimits
	if l.SideChannelMaxConns != d.MaxConns || l.SideChannelMaxConnsPerPeer != d.MaxConnsPerPeer || l.FDReserve != d.FDReserve {
		t.Errorf("config defaults %d/%d/%d, sidechannel.DefaultLimits %d/%d/%d", l.SideChannelMaxConns, l.SideChannelMaxConnsPerPeer,
			l.FDReserve, d.MaxConns, d.MaxConnsPerPeer, d.FDReserve)
	}
}

// TestSideChannelLimits: a prefill worker with lowered
// node.limits.side_channel_max_conns(_per_peer) closes, over real sockets,
// a connection to its side-channel port beyond the per-address cap and one
// beyond the total, counts each in
// kvflow_sidechannel_connections_refused_total, and serves a decode once
// the intruders are gone.
func TestSideChannelLimits(t *testing.T) {
	tc := topo{name: "side-channel-limits", prefillTP: 1, decodeTP: 1, model: gqa(2),
		mutate: func(role string, c *config.Config) {
			c.Node.Limits.SideChannelMaxConns, c.Node.Limits.SideChannelMaxConnsPerPeer = 6, 4
		}}
	c := startCluster(t, tc)
	p := c.prefill[0]
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p.Config.HandshakePort()))
	refused := func(reason string) float64 {
		return counter(t, c.regs[p], "kvflow_sidechannel_connections_refused_total", map[string]string{"reason": reason})
	}
	var held []net.Conn
	dial := func(src string) net.Conn {
		t.Helper()
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		conn, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		// One byte, the start of a ZMTP greeting: past the first-byte
		// deadline, libzmq waits for the rest.
		if _, err := conn.Write([]byte{0xff}); err != nil {
			t.Fatal(err)
		}
		held = append(held, conn)
		return conn
	}
	for _, step := range []struct {
		src    string
		n      int    // connections dialed from src
		reason string // "": all admitted; else the last is refused for it
	}{
		{"127.0.0.1", 4, ""},
		{"127.0.0.1", 1, "max_conns_per_peer"},
		{"127.0.0.2", 2, ""},
		{"127.0.0.3", 1, "max_conns"},
	} {
		var last net.Conn
		for range step.n {
			last = dial(step.src)
		}
		if step.reason == "" {
			continue
		}
		// The front accepts in arrival order: once the last is closed,
		// every earlier one has been admitted or refused, and counted.
		if !closedByPeer(last, 10*time.Second) {
			t.Fatalf("a connection from %s over the cap (%s) was kept", step.src, step.reason)
		}
	}
	// Exactly one refusal each: every other connection was admitted.
	if n := refused("max_conns_per_peer"); n != 1 {
		t.Errorf("max_conns_per_peer refusals %v, want 1", n)
	}
	if n := refused("max_conns"); n != 1 {
		t.Errorf("max_conns refusals %v, want 1", n)
	}
	// The caps bound intruders, not the service: with them gone, a
	// decode's GET_META and DONEs go through the same caps.
	for _, conn := range held {
		conn.Close()
	}
	moveAndCheck(t, c, tc)
}

// closedByPeer reports whether the other end closed conn within wait, a
// bound for a refusal that is due, not a measure.
func closedByPeer(conn net.Conn, wait time.Duration) bool {
	conn.SetReadDeadline(time.Now().Add(wait))
	buf := make([]byte, 64)
	for {
		if _, err := conn.Read(buf); err != nil {
			ne, ok := err.(net.Error)
			return !(ok && ne.Timeout())
		}
	}
}
