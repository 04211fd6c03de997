package node

import (
	"testing"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/stages/read"
)

// tcpEngine is n's transfer engine as the TCP engine the default config
// picks (the tests that reach its ports or credentials directly).
func tcpEngine(t testing.TB, n *Node) *mooncake.TCPEngine {
	t.Helper()
	e, ok := n.Engine.(*mooncake.TCPEngine)
	if !ok {
		t.Fatalf("transfer engine %T, want the TCP engine", n.Engine)
	}
	return e
}

// The node holds its backends as interfaces and finds their capabilities
// once: the TCP engine the default config picks has every one the node
// wires (read grants, data-plane authentication, peer buffers) and the
// read stage's (strided local rows, gathered remote rows).
func TestDefaultBackendsCapabilities(t *testing.T) {
	cfg := baseConfig(topo{prefillTP: 1, decodeTP: 1, model: gqa(2)}, "prefill", 20000)
	n, err := Start(cfg, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close(t.Context())
	e := tcpEngine(t, n)
	var _ mooncake.Granter = e
	var _ mooncake.PeerAuthenticator = e
	if PeerBuffers(n.Engine) == nil {
		t.Error("no peer buffers")
	}
	if caps := read.Engine(n.Engine).Capabilities(); !caps.LocalStride || !caps.Gather || caps.Ledger || caps.Classify == nil {
		t.Errorf("read capabilities %+v", caps)
	}
	if _, ok := n.Device.(*npu.Host); !ok {
		t.Errorf("device %T", n.Device)
	}
}
