package mooncake

import (
	"bytes"
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestPeerRestartSameRPCPort: a target engine restarts on the same RPC
// port (same session id; new buffers, new data port). The first batch
// after the restart may fail (its lane's connection reached the old
// process), and marks the peer for a new handshake; the next batches must
// read the new process's bytes on every lane. Before lanes redialed on a
// re-handshake, the lanes that had not failed kept their connections to
// the old process and the next batch failed on them.
func TestPeerRestartSameRPCPort(t *testing.T) {
	ccfg := testConfig()
	ccfg.Pipeline = 1 // spread the tasks over the lanes
	cli, _ := newEngine(t, ccfg)
	local := register(t, cli, 1<<20, 1)

	const opLen, gap, nops = 4 << 10, 8 << 10, 32
	ops := func(remote []byte) []Op {
		var out []Op
		for i := range nops {
			// Gaps keep the ops from merging: one task each.
			out = append(out, Op{Local: AddrOf(local[i*opLen:]), Remote: AddrOf(remote[i*gap:]), Length: opLen})
		}
		return out
	}
	check := func(what string, remote []byte) {
		t.Helper()
		for i := range nops {
			if !bytes.Equal(local[i*opLen:(i+1)*opLen], remote[i*gap:i*gap+opLen]) {
				t.Fatalf("%s: op %d: bytes differ", what, i)
			}
		}
	}

	srv1, _ := newEngine(t, testConfig())
	remote1 := register(t, srv1, nops*gap, 2)
	session := srv1.SessionID()
	// Read until every lane holds a connection to the first process.
	conns := func() float64 { return testutil.ToFloat64(cli.m.conns.WithLabelValues(roleInitiator)) }
	waitFor(t, func() bool {
		if err := cli.BatchRead(context.Background(), session, ops(remote1)); err != nil {
			t.Fatalf("read before the restart: %v", err)
		}
		return conns() == float64(ccfg.Lanes)
	})
	check("before the restart", remote1)

	port := srv1.RPCPort()
	if err := srv1.Close(); err != nil {
		t.Fatal(err)
	}
	scfg := testConfig()
	scfg.RPCPort = port
	srv2, _ := newEngine(t, scfg)
	if srv2.SessionID() != session {
		t.Fatalf("restarted session %s, want %s", srv2.SessionID(), session)
	}
	remote2 := register(t, srv2, nops*gap, 3)

	// One op: fails on its lane's old connection (or not, if that lane
	// redialed), and marks the peer stale.
	err := cli.BatchRead(context.Background(), session, ops(remote2)[:1])
	t.Logf("first read after the restart: %v", err)
	for i := range 3 {
		if err := cli.BatchRead(context.Background(), session, ops(remote2)); err != nil {
			t.Fatalf("read %d after the restart: %v", i, err)
		}
		check("after the restart", remote2)
	}
}
