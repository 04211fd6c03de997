package mooncake

import (
	"context"
	"testing"
	"time"
)

// queuedBatch makes a batch of n requests of size bytes each, named by
// remote (the remote address of its requests) so takes can be told apart.
func queuedBatch(t *testing.T, q *queue, name uint64, n int, size uint64) *batch {
	t.Helper()
	b := &batch{ctx: context.Background()}
	for i := range n {
		b.tasks = append(b.tasks, task{b: b, op: i, remote: name, length: size})
	}
	if err := q.add(context.Background(), nil, b); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestQueueShortestFirst checks the peer queue's order: the batch with the
// fewest bytes not yet taken first, ties to the older batch, and every
// agingEvery-th take to the oldest batch, so large batches keep moving.
func TestQueueShortestFirst(t *testing.T) {
	q := newQueue(1<<20, 4)
	queuedBatch(t, q, 1, 40, 4<<20)  // large, oldest
	queuedBatch(t, q, 2, 40, 4<<20)  // large, as large as 1
	queuedBatch(t, q, 3, 3, 256<<10) // small
	queuedBatch(t, q, 4, 2, 256<<10) // smaller
	var got []uint64
	for {
		tk := q.take()
		if tk == nil {
			break
		}
		got = append(got, tk.remote)
	}
	// Takes 1..7: batch 4 (0.5 MiB) twice, batch 3 three times, then batch
	// 1 (the older of the two large, equal ones) while its remaining bytes
	// fall below batch 2's. Take 8 is the aging turn: the oldest, batch 1.
	want := []uint64{4, 4, 3, 3, 3, 1, 1, 1}
	for i, w := range want {
		if got[i] != w {
			t.Fatalf("take %d: batch %d, want %d (order %v)", i+1, got[i], w, got[:len(want)])
		}
	}
	if len(got) != 85 {
		t.Fatalf("%d takes, want 85", len(got))
	}
	// Batch 1 is served before batch 2 starts (shortest remaining), except
	// that aging turns also go to the oldest batch, which is batch 1 too.
	last1, first2 := 0, len(got)
	for i, g := range got {
		if g == 1 {
			last1 = i
		}
		if g == 2 && i < first2 {
			first2 = i
		}
	}
	if last1 > first2 {
		t.Errorf("batch 2 started (take %d) before batch 1 finished (take %d)", first2+1, last1+1)
	}
	if q.queued != 0 || len(q.ring) != 0 {
		t.Errorf("queue not empty: %d requests, %d batches", q.queued, len(q.ring))
	}
}

// TestQueueAgingServesOldest checks that a stream of small batches does
// not starve a large one: with small batches always queued, the large one
// still gets 1/agingEvery of the bytes (by bytes, not takes: 4 MiB
// requests against 64 KiB ones).
func TestQueueAgingServesOldest(t *testing.T) {
	q := newQueue(1<<20, 4)
	queuedBatch(t, q, 1, 1000, 4<<20)
	var large, all uint64
	turns := 0
	for i := 0; turns < 10; i++ {
		if len(q.ring) < 3 {
			queuedBatch(t, q, uint64(100+i), 4, 64<<10)
		}
		tk := q.take()
		all += tk.length
		if tk.remote == 1 {
			large += tk.length
			turns++
		}
	}
	if share := float64(large) / float64(all); share < 1.0/agingEvery-0.01 || share > 1.0/agingEvery+0.01 {
		t.Errorf("large batch got %.3f of the bytes, want %.3f", share, 1.0/agingEvery)
	}
}

// With requests of one size, aging by bytes is one take in agingEvery.
func TestQueueAgingEqualSizes(t *testing.T) {
	q := newQueue(1<<20, 4)
	queuedBatch(t, q, 1, 1000, 64<<10)
	large := 0
	const takes = 80 * agingEvery
	for i := range takes {
		if len(q.ring) < 3 {
			queuedBatch(t, q, uint64(100+i), 4, 64<<10)
		}
		if q.take().remote == 1 {
			large++
		}
	}
	if large != takes/agingEvery {
		t.Errorf("oldest batch got %d of %d takes, want %d", large, takes, takes/agingEvery)
	}
}

// TestQueueWithdraw checks that a withdrawn batch leaves no request behind
// and does not disturb the others' order.
func TestQueueWithdraw(t *testing.T) {
	q := newQueue(1<<20, 4)
	queuedBatch(t, q, 1, 4, 1<<20)
	b2 := queuedBatch(t, q, 2, 2, 1<<20)
	if tk := q.take(); tk.remote != 2 {
		t.Fatalf("first take from batch %d, want 2", tk.remote)
	}
	if rest := q.withdraw(b2); len(rest) != 1 {
		t.Fatalf("withdraw returned %d requests, want 1", len(rest))
	}
	for range 4 {
		if tk := q.take(); tk == nil || tk.remote != 1 {
			t.Fatalf("take after withdraw: %+v, want batch 1", tk)
		}
	}
	if tk := q.take(); tk != nil {
		t.Fatalf("take from an empty queue: %+v", tk)
	}
	if q.queued != 0 {
		t.Errorf("%d requests still counted", q.queued)
	}
}

// TestQueueAdmitsShortBatch: with the peer's queue full of large batches a
// batch shorter than all of them is admitted at once (the lanes would take
// it first anyway), while another large batch waits for room.
func TestQueueAdmitsShortBatch(t *testing.T) {
	q := newQueue(8, 4)
	queuedBatch(t, q, 1, 16, 4<<20) // over depth: admitted into an empty queue
	small := &batch{ctx: context.Background()}
	for i := range 2 {
		small.tasks = append(small.tasks, task{b: small, op: i, remote: 2, length: 256 << 10})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := q.add(ctx, nil, small); err != nil {
		t.Fatalf("short batch: %v", err)
	}
	if tk := q.take(); tk == nil || tk.remote != 2 {
		t.Fatalf("first take %+v, want the short batch", tk)
	}
	// A batch as large as the queued one's remainder waits for room.
	large := &batch{ctx: context.Background()}
	for i := range 16 {
		large.tasks = append(large.tasks, task{b: large, op: i, remote: 3, length: 4 << 20})
	}
	short, cancelShort := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancelShort()
	if err := q.add(short, nil, large); err == nil {
		t.Fatal("a large batch was admitted into a full queue")
	}
	// Room once the queue drains below depth.
	for q.queued >= q.depth {
		q.take()
	}
	if err := q.add(ctx, nil, large); err != nil {
		t.Fatalf("large batch after room: %v", err)
	}
}

// TestQueueAdmitsShortBatchesInTurn: two equal short batches behind a full
// queue of a large one. The second waits while the first is queued (it is
// not shorter than it) and is admitted as soon as the first has been
// taken, although the queue is still over its depth.
func TestQueueAdmitsShortBatchesInTurn(t *testing.T) {
	q := newQueue(8, 4)
	queuedBatch(t, q, 1, 16, 4<<20)
	short := func(name uint64) *batch {
		b := &batch{ctx: context.Background()}
		for i := range 2 {
			b.tasks = append(b.tasks, task{b: b, op: i, remote: name, length: 256 << 10})
		}
		return b
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := q.add(ctx, nil, short(2)); err != nil {
		t.Fatal(err)
	}
	admitted := make(chan error, 1)
	go func() { admitted <- q.add(ctx, nil, short(3)) }()
	select {
	case err := <-admitted:
		t.Fatalf("second short batch admitted beside an equal one (err %v)", err)
	case <-time.After(50 * time.Millisecond):
	}
	for range 2 {
		if tk := q.take(); tk == nil || tk.remote != 2 {
			t.Fatalf("take %+v, want the first short batch", tk)
		}
	}
	if err := <-admitted; err != nil {
		t.Fatalf("second short batch: %v", err)
	}
	if q.queued < q.depth {
		t.Fatalf("queue drained to %d: the test needs it still full", q.queued)
	}
	if tk := q.take(); tk == nil || tk.remote != 3 {
		t.Fatalf("take %+v, want the second short batch", tk)
	}
}
