package node

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/tooling/testkit"
)

// TestDataPlaneAuth: with auth.mode curve, the transfer engines of both
// roles give an outsider speaking Mooncake's protocol (a raw TCP client)
// no segment descriptor and no byte; a decode worker with the keys reads
// byte for byte, authenticating on the handshake and data ports with the
// credential its GET_META reply carried. A decode worker whose key is not
// in authorized_keys gets nothing (its side channel is refused, so it
// never holds a credential); without authorized_keys, any decode that
// knows the prefill's public key is served, as the docs say. Before the
// data plane was authenticated, the raw client got the descriptor and the
// bytes.
func TestDataPlaneAuth(t *testing.T) {
	dir := t.TempDir()
	keys := func(name string) (sec, pub string) {
		sec, pub = filepath.Join(dir, name+".key"), filepath.Join(dir, name+".pub")
		if _, err := os.Stat(sec); err == nil {
			return sec, pub
		}
		if _, err := sidechannel.WriteKeyPair(sec, pub); err != nil {
			t.Fatal(err)
		}
		return sec, pub
	}
	pSec, pPub := keys("prefill")
	dSec, dPub := keys("decode")
	sSec, sPub := keys("stranger")
	authorized := filepath.Join(dir, "authorized_keys")
	pubKey, err := os.ReadFile(dPub)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(authorized, pubKey, 0o644); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name            string
		authorizedKeys  string
		strangerAllowed bool
	}{
		{"authorized-keys", authorized, false},
		{"any-client-with-server-key", "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
			c := &cluster{t: t, results: make(chan decode.Result, 8), regs: map[*Node]*prometheus.Registry{}}
			start := func(cfg config.Config) (*Node, error) {
				reg := prometheus.NewRegistry()
				n, err := Start(cfg, Deps{Registerer: reg, OnFinish: func(r decode.Result) { c.results <- r }})
				if err == nil {
					c.regs[n] = reg
					t.Cleanup(func() { n.Close(context.Background()) })
				}
				return n, err
			}
			var p *Node
			for range 8 {
				c.kvPort = testkit.RandomPort()
				pc := baseConfig(tp, "prefill", c.kvPort)
				pc.Auth = config.Auth{Mode: config.AuthCurve, SecretKeyFile: pSec, PublicKeyFile: pPub, AuthorizedKeysFile: tc.authorizedKeys}
				var err error
				if p, err = start(pc); err == nil {
					break
				}
			}
			if p == nil {
				t.Fatal("prefill did not start")
			}
			c.prefill = []*Node{p}
			decodeCfg := func(sec, pub string, port int) config.Config {
				dc := baseConfig(tp, "decode", port)
				dc.Auth = config.Auth{Mode: config.AuthCurve, SecretKeyFile: sec, PublicKeyFile: pub, ServerPublicKeyFile: pPub}
				return dc
			}
			good, err := start(decodeCfg(dSec, dPub, c.kvPort+1000))
			if err != nil {
				t.Fatal(err)
			}
			c.decode = []*Node{good}
			stranger, err := start(decodeCfg(sSec, sPub, c.kvPort+1001))
			if err != nil {
				t.Fatal(err)
			}

			// The outsider, before any legitimate traffic and after it.
			outsider(t, p)
			outsider(t, good)

			if r := pull(t, c, p, "good", []int{1, 2}, []int{3, 4}, true); r.Err != nil {
				t.Fatalf("authorized decode: %v", r.Err)
			}
			checkBytes(t, c, "good", []int{1, 2}, []int{3, 4})
			preg := c.regs[p]
			if n := counter(t, preg, "kvflow_transfer_auth_total", map[string]string{"port": "rpc", "outcome": "ok"}); n < 1 {
				t.Errorf("prefill rpc auth ok = %v", n)
			}
			if n := counter(t, preg, "kvflow_transfer_auth_total", map[string]string{"port": "data", "outcome": "ok"}); n < 1 {
				t.Errorf("prefill data auth ok = %v", n)
			}

			// Sent first: with read grants (the default) a request's blocks
			// are served from its send on.
			if err := p.Prefill.Send([]prefill.SendRequest{{RequestID: "stranger", BlockIDs: []int{6}}})[0]; err != nil {
				t.Fatal(err)
			}
			if err := load(t, stranger, "stranger", []int{5}, []int{6}, c.kvPort, "P"); err != nil {
				t.Fatal(err)
			}
			r := waitResult(t, c, 30*time.Second)
			if r.RequestID != "stranger" {
				t.Fatalf("result of %s", r.RequestID)
			}
			switch {
			case tc.strangerAllowed && r.Err != nil:
				t.Fatalf("decode knowing the server key, no authorized_keys: %v", r.Err)
			case !tc.strangerAllowed && (r.Err == nil || !strings.Contains(r.Err.Error(), "handshake")):
				t.Fatalf("decode not in authorized_keys: %v, want a handshake failure", r.Err)
			}
			outsider(t, p)
			if n := counter(t, preg, "kvflow_transfer_auth_total", map[string]string{"outcome": "no_hello"}); n < 6 {
				t.Errorf("prefill no_hello = %v, want ≥ 6 (2 outsiders × rpc + 2 data)", n)
			}
		})
	}
}

// outsider speaks Mooncake's plain protocol to n's transfer engine, as a
// scanner on the network would: a handshake, then a READ of registered
// memory with each framing. It must get nothing back.
func outsider(t *testing.T, n *Node) {
	t.Helper()
	raw := func(port int, req []byte) []byte {
		c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(req); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("outsider: no close within 10 s (%d bytes)", len(got))
		}
		return got
	}
	desc := &mooncake.SegmentDesc{Name: "outsider:1", Protocol: "tcp", TCPDataPort: 1, TCPProtoVersion: 2}
	if got := raw(n.Engine.RPCPort(), mooncake.AppendFrame(nil, mooncake.FrameMetadata, mooncake.EncodeSegment(desc))); len(got) != 0 {
		t.Fatalf("outsider handshake got %d bytes: %.200q", len(got), got)
	}
	for _, v2 := range []bool{true, false} {
		var hb [mooncake.HeaderSize]byte
		mooncake.PutHeader(&hb, mooncake.Header{Size: 4096, Addr: n.Device.BaseAddrs()[0], Opcode: mooncake.OpcodeRead, V2: v2})
		if got := raw(tcpEngine(t, n).DataPort(), hb[:]); len(got) != 0 {
			t.Fatalf("outsider READ (v2 %v) got %d bytes", v2, len(got))
		}
	}
}

// TestDataPlanePlain: with auth.mode off, and with curve and
// auth.data_plane open, the transfer engine speaks Mooncake's plain
// protocol to anyone (a Mooncake peer handshakes and reads as before) and
// the metadata carries no credential.
func TestDataPlanePlain(t *testing.T) {
	dir := t.TempDir()
	sec, pub := filepath.Join(dir, "p.key"), filepath.Join(dir, "p.pub")
	if _, err := sidechannel.WriteKeyPair(sec, pub); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		auth config.Auth
	}{
		{"off", config.Auth{Mode: config.AuthOff}},
		{"curve-open", config.Auth{Mode: config.AuthCurve, SecretKeyFile: sec, PublicKeyFile: pub, DataPlane: config.DataPlaneOpen}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tp := topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}
			var p *Node
			for range 8 {
				pc := baseConfig(tp, "prefill", testkit.RandomPort())
				pc.Auth = tc.auth
				var err error
				if p, err = Start(pc, Deps{}); err == nil {
					break
				}
			}
			if p == nil {
				t.Fatal("prefill did not start")
			}
			t.Cleanup(func() { p.Close(context.Background()) })
			if md := p.Prefill.Metadata(); md.Ext.TEAuth != nil {
				t.Fatal("metadata carries a credential")
			}
			if tcpEngine(t, p).AuthToken(make([]byte, mooncake.AuthKeySize)) != nil {
				t.Fatal("engine issues credentials")
			}
			// A Mooncake initiator (another engine, no credential).
			m, err := mooncake.NewTCPEngine(mooncake.DefaultTCPConfig(), nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			bufs, err := m.PeerBuffers(ctx, p.Engine.SessionID())
			if err != nil || len(bufs) != len(p.Device.BaseAddrs()) {
				t.Fatalf("plain handshake: %d buffers, %v", len(bufs), err)
			}
			// The read is of block 0 of a held request (read grants are on
			// by default).
			if err := p.Prefill.Send([]prefill.SendRequest{{RequestID: "plain", BlockIDs: []int{0}}})[0]; err != nil {
				t.Fatal(err)
			}
			dst := make([]byte, 4096)
			if err := m.Register(mooncake.AddrOf(dst), uint64(len(dst)), ""); err != nil {
				t.Fatal(err)
			}
			if err := m.BatchRead(ctx, p.Engine.SessionID(), []mooncake.Op{{Local: mooncake.AddrOf(dst), Remote: p.Device.BaseAddrs()[0], Length: 4096}}); err != nil {
				t.Fatalf("plain read: %v", err)
			}
		})
	}
}
