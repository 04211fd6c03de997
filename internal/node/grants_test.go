package node

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/control"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/sidechannel/wire"
	"github.com/kvflow/kvflow/internal/verify"
	"github.com/kvflow/kvflow/stages/notify/tracker"
	"github.com/kvflow/kvflow/stages/plan"
)

// outsiderDone sends DONE_RECVING for id to p's side channel from a
// client of its own, as any host that reaches the port can.
func outsiderDone(t *testing.T, p *Node, id string) {
	t.Helper()
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer zctx.Close()
	c, err := sidechannel.NewClient(zctx, sidechannel.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.SendDone(ctx, net.JoinHostPort("127.0.0.1", strconv.Itoa(p.Config.HandshakePort())), id); err != nil {
		t.Fatalf("outsider DONE %s: %v", id, err)
	}
}

// TestOutsiderDoneNeverWrongBytes (#19 hole 2, real sockets, default
// config): an outsider's DONE for a request, before or after the engine's
// send, frees its blocks before the decode reads them; the engine reuses
// them for another request. The decode must then fail the request — with
// read grants off (the old default) it read the other request's bytes and
// reported done.
//
// With node.te_backend shm the decode reads the mapped cache file, and the
// grant table refuses the freed blocks the same way.
func TestOutsiderDoneNeverWrongBytes(t *testing.T) {
	for _, tc := range []struct{ early, shm bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		early := tc.early
		t.Run(fmt.Sprintf("done-before-send=%v/shm=%v", early, tc.shm), func(t *testing.T) {
			c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2), shm: tc.shm}) // read.grants: the default
			p := c.prefill[0]
			blocks := []int{3, 4}
			fill := func(tag uint64) {
				verify.FillBlocks(p.Device, p.Shape.NumLayers, p.Device.Layout().NumParts(), 0, blocks, tag)
			}
			fill(plan.StringToInt64Hash("victim"))
			send := func() {
				if err := p.Prefill.Send([]prefill.SendRequest{{RequestID: "victim", BlockIDs: blocks}})[0]; err != nil {
					t.Fatal(err)
				}
			}
			if !early {
				send()
			}
			outsiderDone(t, p, "victim")
			if early {
				send()
			}
			// The engine collects the freed request and reuses its blocks.
			deadline := time.Now().Add(10 * time.Second)
			for freed := false; !freed; {
				for _, id := range p.Prefill.Finished() {
					freed = freed || id == "victim"
				}
				if !freed && time.Now().After(deadline) {
					t.Fatal("the forged DONE never freed the request")
				}
				time.Sleep(5 * time.Millisecond)
			}
			fill(plan.StringToInt64Hash("someone-else"))
			if err := load(t, c.decode[0], "victim", blocks, blocks, c.kvPort, "P"); err != nil {
				t.Fatal(err)
			}
			r := waitResult(t, c, 30*time.Second)
			if r.Err == nil {
				t.Fatal("the decode read blocks freed by a forged DONE and reused, and reported them done")
			}
			t.Logf("failed, as it should: %v", r.Err)
			if tc.shm {
				if n := counter(t, c.regs[c.decode[0]], "kvflow_shm_batches_total", map[string]string{"path": "shm"}); n == 0 {
					t.Error("the refused read did not go over shared memory")
				}
			}
		})
	}
}

// ctlClient is the engine's side of a prefill worker's control socket.
type ctlClient struct {
	t    *testing.T
	sock *zmq.Socket
}

func serveControl(t *testing.T, n *Node) *ctlClient {
	t.Helper()
	w := n.Prefill
	b := control.Backend{Role: "prefill", Send: w.Send, Abort: w.Abort, Status: w.Status,
		Finished: func() ([]string, []string, []decode.Failure) { return w.Finished(), nil, nil }}
	ctx, cancel := context.WithCancel(context.Background())
	ep := "ipc://" + filepath.Join(t.TempDir(), "ctl.sock")
	srv, err := control.Serve(ctx, n.ZMQ, ep, b, nil)
	if err != nil {
		t.Fatal(err)
	}
	zc, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	s, err := zc.NewSocket(zmq.REQ)
	if err != nil {
		t.Fatal(err)
	}
	s.SetLinger(0)
	s.SetRcvtimeo(60 * time.Second)
	if err := s.Connect(ep); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(); zc.Term(); cancel(); srv.Close() })
	return &ctlClient{t: t, sock: s}
}

// call sends msg and returns the reply and its round trip.
func (c *ctlClient) call(msg map[string]any) (control.Reply, time.Duration) {
	c.t.Helper()
	b, err := msgpack.Marshal(msg)
	if err != nil {
		c.t.Fatal(err)
	}
	start := time.Now()
	if _, err := c.sock.SendBytes(b, 0); err != nil {
		c.t.Fatal(err)
	}
	rep, err := c.sock.RecvBytes(0)
	if err != nil {
		c.t.Fatalf("control %v: no reply: %v", msg["op"], err)
	}
	rt := time.Since(start)
	var r control.Reply
	if err := msgpack.Unmarshal(rep, &r); err != nil {
		c.t.Fatal(err)
	}
	if !r.OK {
		c.t.Fatalf("control %v: %s", msg["op"], r.Error)
	}
	return r, rt
}

// stallRead asks p's data port for size bytes at addr and never reads
// the answer; it returns once the server is serving it (its socket
// buffers full).
func stallRead(t *testing.T, p *Node, addr, size uint64) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(tcpEngine(t, p).DataPort())))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.(*net.TCPConn).SetReadBuffer(4096)
	var hb [mooncake.HeaderSize]byte
	mooncake.PutHeader(&hb, mooncake.Header{Size: size, Addr: addr, Opcode: mooncake.OpcodeRead, V2: true})
	if _, err := conn.Write(hb[:]); err != nil {
		t.Fatal(err)
	}
	// The status frame and the first bytes arrive: the read is granted
	// and being served (the rest waits on this reader).
	var first [64]byte
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Read(first[:]); err != nil {
		t.Fatalf("stalled read not served: %v", err)
	}
	return conn
}

// TestStalledReaderNeverBlocksControl (#19 hole 3, real sockets, default
// config): a peer holds a granted range without reading it while its
// request is freed (aborted). The prefill's control socket keeps
// answering (every round trip measured; old code: silent for the whole
// I/O timeout, 10 s, twice as long for blocks two held requests share),
// an unrelated send succeeds meanwhile, and each freed request's
// done_sending arrives exactly once — after the stalled reader was cut,
// never while it could still read the blocks.
func TestStalledReaderNeverBlocksControl(t *testing.T) {
	// 256 KiB blocks: a read of 32 of them (8 MiB) outlasts every socket
	// buffer on the way.
	model := gqa(2)
	model.HeadDim, model.BlockSize = 128, 128
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprintf("shared=%v", shared), func(t *testing.T) {
			c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: model})
			p := c.prefill[0]
			ctl := serveControl(t, p)
			blocks := make([]int, 32)
			for i := range blocks {
				blocks[i] = i
			}
			reqs := []any{map[string]any{"request_id": "held", "delay_start_time": 0, "block_ids": blocks}}
			ids := []string{"held"}
			if shared {
				reqs = append(reqs, map[string]any{"request_id": "sharer", "delay_start_time": 0, "block_ids": blocks})
				ids = append(ids, "sharer")
			}
			if r, _ := ctl.call(map[string]any{"op": "send", "requests": reqs}); r.Errors != nil && r.Errors[0] != nil {
				t.Fatalf("send: %s", *r.Errors[0])
			}
			bl := uint64(p.Device.Layout().BlockLen(0))
			stallRead(t, p, p.Device.BaseAddrs()[0], bl*uint64(len(blocks)))

			ctl.call(map[string]any{"op": "abort", "request_ids": ids})
			var worst time.Duration
			got := map[string]int{}
			sent := false
			deadline := time.Now().Add(30 * time.Second)
			for len(got) < len(ids) {
				if time.Now().After(deadline) {
					t.Fatalf("done_sending %v after 30 s, want %v", got, ids)
				}
				r, rt := ctl.call(map[string]any{"op": "finished"})
				worst = max(worst, rt)
				for _, id := range r.DoneSending {
					got[id]++
				}
				// The last request holding the blocks is reported only once
				// the stalled reader is cut (an earlier one frees blocks the
				// other still holds, so the engine keeps them).
				if len(r.DoneSending) > 0 && len(got) == len(ids) {
					if n := counter(t, c.regs[p], "kvflow_transfer_grant_reads_cut_total", nil); n != 1 {
						t.Fatalf("done_sending %v while the stalled reader was still connected (cut %v)", r.DoneSending, n)
					}
				}
				if !sent {
					r, rt := ctl.call(map[string]any{"op": "send", "requests": []any{
						map[string]any{"request_id": "unrelated", "delay_start_time": 0, "block_ids": []int{40}}}})
					worst = max(worst, rt)
					if r.Errors != nil && r.Errors[0] != nil {
						t.Fatalf("unrelated send during the stall: %s", *r.Errors[0])
					}
					sent = true
				}
				time.Sleep(10 * time.Millisecond)
			}
			for _, id := range ids {
				if got[id] != 1 {
					t.Errorf("done_sending of %s: %d times, want 1", id, got[id])
				}
			}
			t.Logf("worst control round trip during the stall: %v", worst)
			// Generous: the old code answered after the 10 s I/O timeout.
			if worst > 2*time.Second {
				t.Errorf("control socket silent for %v while a reader stalled", worst)
			}
		})
	}
}

// TestUnknownDoneFloodOverSideChannel (real sockets, default config):
// done_batch_msgs naming 8,192 ids the engine never sent are ACKed; none of
// them reaches the engine as done_sending, the worker keeps at most
// tracker.DefaultMaxEarly of them, and the rest are counted as dropped. A
// request the engine does send afterwards still frees normally.
func TestUnknownDoneFloodOverSideChannel(t *testing.T) {
	c := startCluster(t, topo{prefillTP: 1, decodeTP: 1, model: gqa(2)})
	p := c.prefill[0]
	ids := make([]string, 8192)
	for i := range ids {
		ids[i] = fmt.Sprintf("forged-%d", i)
	}
	zc, err := zmq.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	s, err := zc.NewSocket(zmq.REQ)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { s.Close(); zc.Term() }()
	s.SetLinger(0)
	s.SetRcvtimeo(10 * time.Second)
	if err := s.Connect(fmt.Sprintf("tcp://127.0.0.1:%d", p.Config.HandshakePort())); err != nil {
		t.Fatal(err)
	}
	// A done_batch_msg carries at most 4096 ids (wire): two of them.
	for i := 0; i < len(ids); i += 4096 {
		if _, err := s.SendBytes(wire.EncodeDoneBatch(ids[i:i+4096]), 0); err != nil {
			t.Fatal(err)
		}
		if rep, err := s.RecvBytes(0); err != nil || string(rep) != "ACK" {
			t.Fatalf("reply to the batch: %q %v", rep, err)
		}
	}
	if got := p.Prefill.Finished(); len(got) != 0 {
		t.Fatalf("%d DONEs for ids never sent reached the engine as done_sending", len(got))
	}
	if st := p.Prefill.Status(); st["early_dones"] != tracker.DefaultMaxEarly {
		t.Fatalf("early DONEs kept: %v, want %d", st["early_dones"], tracker.DefaultMaxEarly)
	}
	if n := counter(t, c.regs[p], "kvflow_prefill_early_dones_dropped_total", map[string]string{"reason": "capacity"}); n != float64(len(ids)-tracker.DefaultMaxEarly) {
		t.Fatalf("dropped %v, want %d", n, len(ids)-tracker.DefaultMaxEarly)
	}
	if r := pull(t, c, p, "real", []int{5}, []int{5}, true); r.Err != nil {
		t.Fatalf("a request sent after the flood: %v", r.Err)
	}
	checkBytes(t, c, "real", []int{5}, []int{5})
}
