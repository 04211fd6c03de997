package sidechannel

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/internal/sidechannel/wire"
)

// gatedHandler records DONEs; while gate is set, Done signals entered and
// waits for the gate (so a test can hold a message in flight).
type gatedHandler struct {
	md Metadata

	mu      sync.Mutex
	dones   []string
	gate    chan struct{}
	entered chan string
}

func (h *gatedHandler) Metadata() Metadata { return h.md }

func (h *gatedHandler) Done(id string) error {
	h.mu.Lock()
	gate, entered := h.gate, h.entered
	h.mu.Unlock()
	if gate != nil {
		entered <- id
		<-gate
	}
	h.mu.Lock()
	h.dones = append(h.dones, id)
	h.mu.Unlock()
	return nil
}

func (h *gatedHandler) hold() (release func()) {
	gate := make(chan struct{})
	h.mu.Lock()
	h.gate, h.entered = gate, make(chan string, 1)
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		h.gate = nil
		h.mu.Unlock()
		close(gate)
	}
}

func (h *gatedHandler) doneIDs() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.dones)
}

// pendingDones is how many SendDoneBatched callers wait unsent for addr.
func pendingDones(c *Client, addr string) int {
	c.mu.Lock()
	p := c.peers[addr]
	c.mu.Unlock()
	if p == nil {
		return 0
	}
	p.bmu.Lock()
	defer p.bmu.Unlock()
	return len(p.pending)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestDoneBatchServer drives the server with raw done_batch_msg frames:
// every id is handed to Done once, in order (duplicates twice), one ACK per
// message; bad payloads get "ERR" and the server keeps serving.
func TestDoneBatchServer(t *testing.T) {
	e := newEnv(t)
	h := &recorder{md: testMeta}
	s := e.server(t, h, ServerOptions{})
	d := e.dealer(t, s.Addr(), nil)
	roundTrip := func(payload []byte) string {
		t.Helper()
		if _, err := d.SendMessage([]byte{}, payload); err != nil {
			t.Fatal(err)
		}
		got, err := d.RecvMessageBytes(0)
		if err != nil || len(got) != 2 || len(got[0]) != 0 {
			t.Fatalf("reply %q %v", got, err)
		}
		return string(got[1])
	}
	ids := []string{"a", "b", "", "héllo", "a"}
	if r := roundTrip(wire.EncodeDoneBatch(ids)); r != "ACK" {
		t.Fatalf("reply %q", r)
	}
	if got := h.doneIDs(); !reflect.DeepEqual(got, ids) {
		t.Fatalf("Done calls %q, want %q", got, ids)
	}
	tag := []byte("\xc4\x0edone_batch_msg")
	for name, payload := range map[string][]byte{
		"empty":     wire.EncodeDoneBatch(nil),
		"no ids":    append([]byte{0x91}, tag...),
		"str ids":   append(append([]byte{0x92}, tag...), 0xa1, 'r'),
		"int id":    append(append([]byte{0x92}, tag...), 0x91, 0x05),
		"bin id":    append(append([]byte{0x92}, tag...), 0x91, 0xc4, 0x01, 'r'),
		"too many":  wire.EncodeDoneBatch(make([]string, wire.MaxDoneBatchIDs+1)),
		"truncated": wire.EncodeDoneBatch([]string{"abc"})[:19],
	} {
		if r := roundTrip(payload); !strings.HasPrefix(r, "ERR decode") {
			t.Errorf("%s: reply %q", name, r)
		}
	}
	if got := h.doneIDs(); len(got) != len(ids) {
		t.Fatalf("bad messages reached the handler: %q", got)
	}
	if v := metric(t, e, "kvflow_sidechannel_bad_messages_total", map[string]string{"reason": "decode"}); v != 7 {
		t.Errorf("bad decode messages %v, want 7", v)
	}
	c := e.client(t, fastClientOpts())
	if _, err := c.GetMeta(context.Background(), s.Addr()); err != nil {
		t.Fatalf("server must keep serving: %v", err)
	}
	if err := c.SendDoneBatched(context.Background(), s.Addr(), "after"); err != nil {
		t.Fatal(err)
	}

	// A Done error is ACKed; a panic answers ERR, and the other ids of the
	// message are still handed over.
	h.mu.Lock()
	h.err = errors.New("unknown request")
	h.mu.Unlock()
	if r := roundTrip(wire.EncodeDoneBatch([]string{"x", "y"})); r != "ACK" {
		t.Fatalf("handler error: reply %q", r)
	}
	s2 := e.server(t, HandlerFuncs{DoneFunc: func(id string) error {
		if id == "boom" {
			panic("boom")
		}
		h.mu.Lock()
		h.dones = append(h.dones, id)
		h.mu.Unlock()
		return nil
	}}, ServerOptions{})
	var re *RemoteError
	if err := c.SendDoneBatched(context.Background(), s2.Addr(), "boom"); !errors.As(err, &re) || re.Reason != "internal error" {
		t.Fatalf("panicking handler: %v", err)
	}
	d2 := e.dealer(t, s2.Addr(), nil)
	if _, err := d2.SendMessage([]byte{}, wire.EncodeDoneBatch([]string{"p", "boom", "q"})); err != nil {
		t.Fatal(err)
	}
	if got, err := d2.RecvMessageBytes(0); err != nil || string(got[1]) != "ERR internal error" {
		t.Fatalf("panic mid-batch: %q %v", got, err)
	}
	if got := h.doneIDs(); !reflect.DeepEqual(got[len(got)-2:], []string{"p", "q"}) {
		t.Fatalf("Done calls %q: the ids around a panic must still be handed over", got)
	}
	if _, err := c.GetMeta(context.Background(), s2.Addr()); err != nil {
		t.Fatalf("server must survive a handler panic: %v", err)
	}
	if v := serverRequests(t, e, "done_batch", "ok", 2); v != 2 {
		t.Errorf("server done_batch ok %v, want 2", v)
	}
	if v := serverRequests(t, e, "done_batch", "handler_error", 3); v != 3 {
		t.Errorf("server done_batch handler_error %v, want 3", v)
	}
	if v := metric(t, e, "kvflow_sidechannel_done_batch_ids", map[string]string{"role": "server"}); v != 5 {
		t.Errorf("server batch-size samples %v, want 5", v)
	}
}

// TestDoneBatchGroupCommit: while one message is in flight, DONEs to the
// same peer queue and go out together in the next; every caller gets the
// ACK of its message; nothing is delivered twice.
func TestDoneBatchGroupCommit(t *testing.T) {
	e := newEnv(t)
	h := &gatedHandler{md: testMeta}
	s := e.server(t, h, ServerOptions{})
	opts := fastClientOpts()
	opts.AttemptTimeout = 10 * time.Second // the held message must not time out
	opts.MaxDoneBatchesPerPeer = 1
	c := e.client(t, opts)
	ctx := context.Background()

	release := h.hold()
	first := make(chan error, 1)
	go func() { first <- c.SendDoneBatched(ctx, s.Addr(), "first") }()
	if id := <-h.entered; id != "first" {
		t.Fatalf("entered %q", id)
	}
	const n = 100
	errs := make(chan error, n)
	for i := range n {
		go func() { errs <- c.SendDoneBatched(ctx, s.Addr(), fmt.Sprint("r", i)) }()
	}
	waitFor(t, "callers to queue", func() bool { return pendingDones(c, s.Addr()) == n })
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for range n {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	got := h.doneIDs()
	if len(got) != n+1 || got[0] != "first" {
		t.Fatalf("%d DONEs delivered, first %q", len(got), got[0])
	}
	seen := map[string]int{}
	for _, id := range got {
		seen[id]++
	}
	for id, k := range seen {
		if k != 1 {
			t.Errorf("%s delivered %d times", id, k)
		}
	}
	if v := requests(t, e, "client", "done_batch", "ok"); v != 2 {
		t.Errorf("client messages %v, want 2 (one, then the %d queued)", v, n)
	}
	if v := serverRequests(t, e, "done_batch", "ok", 2); v != 2 {
		t.Errorf("server messages %v, want 2", v)
	}
	if v := requests(t, e, "client", "done", "ok"); v != 0 {
		t.Errorf("plain DONEs %v", v)
	}
}

// TestDoneBatchConcurrent: many concurrent callers to one peer, with the
// default limit of messages in flight: every id arrives exactly once, in
// fewer messages than ids.
func TestDoneBatchConcurrent(t *testing.T) {
	e := newEnv(t)
	h := &recorder{md: testMeta}
	s := e.server(t, h, ServerOptions{})
	opts := fastClientOpts()
	opts.AttemptTimeout = 5 * time.Second
	c := e.client(t, opts)
	const workers, per = 32, 50
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range per {
				if err := c.SendDoneBatched(context.Background(), s.Addr(), fmt.Sprintf("w%d-%d", w, i)); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	got := h.doneIDs()
	if len(got) != workers*per {
		t.Fatalf("%d DONEs delivered, want %d", len(got), workers*per)
	}
	seen := map[string]bool{}
	for _, id := range got {
		if seen[id] {
			t.Fatalf("%s delivered twice", id)
		}
		seen[id] = true
	}
	msgs := requests(t, e, "client", "done_batch", "ok")
	t.Logf("%d DONEs in %v messages", workers*per, msgs)
	if msgs >= workers*per || msgs < 1 {
		t.Errorf("%v messages for %d DONEs: no batching", msgs, workers*per)
	}
	if v := metric(t, e, "kvflow_sidechannel_done_batch_ids", map[string]string{"role": "client"}); v != msgs {
		t.Errorf("batch-size samples %v, messages %v", v, msgs)
	}
}

// TestDoneBatchCancel: a caller whose ctx ends returns at once (while its
// message is still held by the server); if its id was not yet sent it
// never is; one already on the wire may still be delivered; the other
// callers are unaffected.
func TestDoneBatchCancel(t *testing.T) {
	e := newEnv(t)
	h := &gatedHandler{md: testMeta}
	s := e.server(t, h, ServerOptions{})
	opts := fastClientOpts()
	// Only release() or this timeout can end the held message: a call that
	// waited for its message instead of its ctx would hang past the check
	// below rather than pass.
	opts.AttemptTimeout = time.Minute
	opts.MaxDoneBatchesPerPeer = 1
	c := e.client(t, opts)

	release := h.hold()
	ctxA, cancelA := context.WithCancel(context.Background())
	errA := make(chan error, 1)
	go func() { errA <- c.SendDoneBatched(ctxA, s.Addr(), "a") }()
	<-h.entered // "a" is on the wire, held by the server
	ctxB, cancelB := context.WithCancel(context.Background())
	errB, errC := make(chan error, 1), make(chan error, 1)
	go func() { errB <- c.SendDoneBatched(ctxB, s.Addr(), "b") }()
	go func() { errC <- c.SendDoneBatched(context.Background(), s.Addr(), "c") }()
	waitFor(t, "b and c to queue", func() bool { return pendingDones(c, s.Addr()) == 2 })

	// b is canceled (and has returned) before a's slot frees: it was never
	// sent, so it must never be. Cancelling a first would free the slot,
	// and the batcher could rightly put b on the wire before b's ctx ended.
	cancelB()
	wantCanceled := func(name string, ch chan error) {
		t.Helper()
		select {
		case err := <-ch:
			if !errors.Is(err, context.Canceled) {
				t.Fatalf("%s: want context.Canceled, got %v", name, err)
			}
		case <-time.After(opts.AttemptTimeout / 2):
			t.Fatalf("%s: cancel not prompt (still waiting on the held message)", name)
		}
	}
	wantCanceled("b", errB)
	cancelA()
	wantCanceled("a", errA)
	release()
	if err := <-errC; err != nil {
		t.Fatalf("c: %v", err)
	}
	// a was already sent (delivered anyway); b was not (dropped).
	if got := h.doneIDs(); !reflect.DeepEqual(got, []string{"a", "c"}) {
		t.Fatalf("delivered %q, want [a c]", got)
	}
	// a's message was its own (sent inline, as SendDone): counted canceled.
	if ok, canceled := requests(t, e, "client", "done_batch", "ok"), requests(t, e, "client", "done_batch", "canceled"); ok != 1 || canceled != 1 {
		t.Errorf("messages ok %v canceled %v, want 1 and 1", ok, canceled)
	}
}

// TestTakeBatchDropsEndedCtx: a queued caller whose ctx has ended is never
// taken into a batch, even before its goroutine wakes to mark itself
// abandoned (the batcher may run first); the live ones keep their order.
func TestTakeBatchDropsEndedCtx(t *testing.T) {
	live := context.Background()
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name    string
		pending []*doneWaiter
		want    []string
	}{
		{"ended in the middle", []*doneWaiter{{id: "a", ctx: live}, {id: "b", ctx: ended}, {id: "c", ctx: live}}, []string{"a", "c"}},
		{"abandoned", []*doneWaiter{{id: "a", ctx: live, abandoned: true}, {id: "c", ctx: live}}, []string{"c"}},
		{"all ended", []*doneWaiter{{id: "a", ctx: ended}, {id: "b", ctx: ended}}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &peer{pending: tc.pending, batchers: 1}
			var got []string
			for _, w := range p.takeBatch() {
				got = append(got, w.id)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("batch %q, want %q", got, tc.want)
			}
			if len(p.pending) != 0 {
				t.Errorf("%d left pending", len(p.pending))
			}
			if wantBatchers := map[bool]int{true: 1, false: 0}[len(tc.want) > 0]; p.batchers != wantBatchers {
				t.Errorf("batchers %d, want %d (an empty take counts its batcher out)", p.batchers, wantBatchers)
			}
		})
	}
}

// TestDoneBatchClose: Close fails every waiting caller (sent or queued)
// with ErrClosed, promptly, and leaves no goroutine behind (TestMain).
func TestDoneBatchClose(t *testing.T) {
	e := newEnv(t)
	addr := e.blackHole(t)
	opts := fastClientOpts()
	opts.AttemptTimeout = 30 * time.Second
	opts.MaxDoneBatchesPerPeer = 1
	c, err := NewClient(e.zctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	const n = 10
	errs := make(chan error, n)
	go func() { errs <- c.SendDoneBatched(context.Background(), addr, "first") }()
	waitFor(t, "the first message", func() bool { return pendingDones(c, addr) == 0 && peerBatchers(c, addr) == 1 })
	for i := range n - 1 {
		go func() { errs <- c.SendDoneBatched(context.Background(), addr, fmt.Sprint(i)) }()
	}
	waitFor(t, "callers to queue", func() bool { return pendingDones(c, addr) == n-1 })
	start := time.Now()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	for range n {
		if err := <-errs; !errors.Is(err, ErrClosed) {
			t.Fatalf("want ErrClosed, got %v", err)
		}
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Close took %v", d)
	}
	if err := c.SendDoneBatched(context.Background(), addr, "late"); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

func peerBatchers(c *Client, addr string) int {
	c.mu.Lock()
	p := c.peers[addr]
	c.mu.Unlock()
	if p == nil {
		return 0
	}
	p.bmu.Lock()
	defer p.bmu.Unlock()
	return p.batchers
}

// TestDoneBatchAdvertised: the flag travels in GET_META; a batch never
// exceeds the wire limit.
func TestDoneBatchAdvertised(t *testing.T) {
	e := newEnv(t)
	md := testMeta
	md.Ext = Ext{BatchDone: true}
	h := &gatedHandler{md: md}
	s := e.server(t, h, ServerOptions{})
	opts := fastClientOpts()
	opts.AttemptTimeout = 10 * time.Second
	opts.MaxDoneBatchesPerPeer = 1
	c := e.client(t, opts)
	got, err := c.GetMeta(context.Background(), s.Addr())
	if err != nil || !got.Ext.BatchDone {
		t.Fatalf("GetMeta: %+v %v", got.Ext, err)
	}
	release := h.hold()
	errs := make(chan error, 1)
	go func() { errs <- c.SendDoneBatched(context.Background(), s.Addr(), "first") }()
	<-h.entered
	n := wire.MaxDoneBatchIDs + 10
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			if err := c.SendDoneBatched(context.Background(), s.Addr(), fmt.Sprint(i)); err != nil {
				t.Error(err)
			}
		})
	}
	waitFor(t, "callers to queue", func() bool { return pendingDones(c, s.Addr()) == n })
	release()
	wg.Wait()
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if d := len(h.doneIDs()); d != n+1 {
		t.Fatalf("%d delivered, want %d", d, n+1)
	}
	if v := requests(t, e, "client", "done_batch", "ok"); v != 3 {
		t.Errorf("messages %v, want 3 (1, %d, 10)", v, wire.MaxDoneBatchIDs)
	}
}

// BenchmarkDone: DONEs from many concurrent callers (64, as a busy decode
// worker's notify stage) to one loopback peer, plain (one REQ/REP each,
// MaxConnsPerPeer sockets) against batched with 1, 2 or 4 messages in
// flight. msgs/op is round trips per DONE.
func BenchmarkDone(b *testing.B) {
	for _, callers := range []int{1, 4, 16, 64} {
		for _, bc := range []struct {
			name     string
			inFlight int // 0: plain SendDone
		}{{"plain", 0}, {"batched-1", 1}, {"batched-2", 2}, {"batched-4", 4}} {
			b.Run(fmt.Sprintf("callers-%d/%s", callers, bc.name), func(b *testing.B) { benchDone(b, callers, bc.inFlight) })
		}
	}
}

func benchDone(b *testing.B, callers, inFlight int) {
	zctx, err := NewContext(ContextOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer zctx.Close()
	s, err := NewServer(zctx, ServerOptions{Addr: "127.0.0.1:0"}, HandlerFuncs{})
	if err != nil {
		b.Fatal(err)
	}
	c, err := NewClient(zctx, ClientOptions{MaxDoneBatchesPerPeer: max(1, inFlight)})
	if err != nil {
		b.Fatal(err)
	}
	send, op := c.SendDone, opDone
	if inFlight > 0 {
		send, op = c.SendDoneBatched, opDoneBatch
	}
	ctx := context.Background()
	sent := zctx.metrics.requests.WithLabelValues(roleClient, op, outcomeOK)
	before := testutil.ToFloat64(sent)
	cpu0 := cpuTime()
	defer func() { b.ReportMetric(float64(cpuTime()-cpu0)/float64(b.N), "cpu-ns/op") }()
	b.ResetTimer()
	if callers == 1 {
		for b.Loop() {
			if err := send(ctx, s.Addr(), "cmpl-359143a23f6db725c026160f3cc404bf-0"); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric((testutil.ToFloat64(sent)-before)/float64(b.N), "msgs/op")
		return
	}
	b.SetParallelism(max(1, callers/runtime.GOMAXPROCS(0)))
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := send(ctx, s.Addr(), "cmpl-359143a23f6db725c026160f3cc404bf-0"); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	b.ReportMetric((testutil.ToFloat64(sent)-before)/float64(b.N), "msgs/op")
}

// cpuTime is the process's user+system CPU time (client and server both
// run in the benchmark's process).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func TestDoneBatchOptions(t *testing.T) {
	if err := (ClientOptions{MaxConnsPerPeer: 1}).Validate(); err != nil {
		t.Fatalf("default batches clamp to MaxConnsPerPeer: %v", err)
	}
	if o := (ClientOptions{}).withDefaults(); o.MaxDoneBatchesPerPeer != 2 {
		t.Fatalf("default MaxDoneBatchesPerPeer %d", o.MaxDoneBatchesPerPeer)
	}
	for _, o := range []ClientOptions{{MaxConnsPerPeer: 2, MaxDoneBatchesPerPeer: 3}, {MaxDoneBatchesPerPeer: -1}} {
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), "MaxDoneBatchesPerPeer") {
			t.Errorf("%+v: %v", o, err)
		}
	}
}

// TestDoneBatchRetryCountedOnce: a DONE batch whose ACK came too late is
// sent again with the same message id, and the server ACKs the repeat
// without handing its ids over twice (a prefill rank expecting DONEs from
// two decode ranks must not free on one rank's retry). Over real sockets:
// the client's retry, and the same bytes sent twice by hand.
func TestDoneBatchRetryCountedOnce(t *testing.T) {
	e := newEnv(t)
	// The duplicate series exists from the start (every label value is
	// initialised to zero), so a dashboard sees it and serverRequests can
	// poll it before the server has counted the first one.
	if v := requests(t, e, "server", "done_batch", "duplicate"); v != 0 {
		t.Fatalf("server done_batch duplicate %v before any message", v)
	}
	gate := make(chan struct{})
	h := &recorder{md: testMeta, gate: gate}
	s := e.server(t, h, ServerOptions{})
	// Attempts is large so that the client keeps retrying however long this
	// goroutine takes to see the timeout and open the gate (with 5, a
	// starved test goroutine let every attempt time out: a flake, not a
	// finding). The assertions below do not depend on how many retries ran.
	c := e.client(t, ClientOptions{AttemptTimeout: 200 * time.Millisecond, Attempts: 100, RetryBackoff: 10 * time.Millisecond})
	// The first attempt's Done is held until the client has timed out on
	// it, so the client sends the message again while the server still
	// holds the first.
	sent := make(chan error, 1)
	go func() { sent <- c.SendDoneBatched(context.Background(), s.Addr(), "r1") }()
	deadline := time.Now().Add(10 * time.Second)
	for metric(t, e, "kvflow_sidechannel_socket_resets_total", map[string]string{"reason": resetTimeout}) < 1 {
		if time.Now().After(deadline) {
			t.Fatal("the client never timed out on the held DONE")
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(gate)
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	if got := h.doneIDs(); !reflect.DeepEqual(got, []string{"r1"}) {
		t.Fatalf("Done calls %q, want [r1] once", got)
	}
	if v := serverRequests(t, e, "done_batch", "duplicate", 1); v < 1 {
		t.Errorf("server done_batch duplicate %v, want >= 1", v)
	}

	// A message whose first handling panicked: its repeat gets the same
	// "ERR internal error", not an ACK that would report it delivered.
	s2 := e.server(t, HandlerFuncs{DoneFunc: func(id string) error { panic("boom") }}, ServerOptions{})
	d2 := e.dealer(t, s2.Addr(), nil)
	boom := wire.AppendDoneBatchMsg(nil, []string{"p"}, 7)
	for i := range 2 {
		if _, err := d2.SendMessage([]byte{}, boom); err != nil {
			t.Fatal(err)
		}
		if got, err := d2.RecvMessageBytes(0); err != nil || len(got) != 2 || string(got[1]) != "ERR internal error" {
			t.Fatalf("send %d of a panicking batch: reply %q %v", i+1, got, err)
		}
	}

	d := e.dealer(t, s.Addr(), nil)
	send := func(payload []byte) {
		t.Helper()
		if _, err := d.SendMessage([]byte{}, payload); err != nil {
			t.Fatal(err)
		}
		if got, err := d.RecvMessageBytes(0); err != nil || len(got) != 2 || string(got[1]) != "ACK" {
			t.Fatalf("reply %q %v", got, err)
		}
	}
	msg := wire.AppendDoneBatchMsg(nil, []string{"a", "b"}, 42)
	send(msg)
	send(msg)
	send(wire.AppendDoneBatchMsg(nil, []string{"a"}, 43)) // another message: counted
	send(wire.EncodeDoneBatch([]string{"b"}))             // no id: counted, as before
	if got, want := h.doneIDs(), []string{"r1", "a", "b", "a", "b"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("Done calls %q, want %q", got, want)
	}
}

func TestSeenIDsBounded(t *testing.T) {
	var s seenIDs
	for id := uint64(1); id <= seenCap+10; id++ {
		if _, seen := s.check(id); seen {
			t.Fatalf("id %d reported seen", id)
		}
	}
	if len(s.reply) != seenCap || len(s.ring) != seenCap {
		t.Fatalf("remembers %d ids (ring %d), want %d", len(s.reply), len(s.ring), seenCap)
	}
	if _, seen := s.check(1); seen { // evicted, oldest first
		t.Error("id 1 should have been forgotten")
	}
	s.answered(seenCap+10, []byte("ERR x"))
	if r, seen := s.check(seenCap + 10); !seen || string(r) != "ERR x" {
		t.Errorf("the newest id: seen %v, reply %q", seen, r)
	}
	s.answered(2, []byte("ERR y")) // forgotten: not brought back
	if len(s.reply) != seenCap {
		t.Errorf("answered re-added a forgotten id: %d remembered", len(s.reply))
	}
}
