package pipeline

import (
	"sync"
	"time"
)

// blockedClock accumulates the time senders spend blocked on a stage's full
// queue. Unlike a counter bumped when a send completes, it also counts the
// time of sends still blocked, so a stalled stage shows up on the next scrape
// rather than when (if ever) it unblocks.
//
// It reads time.Now (not nanotime) so that tests under testing/synctest see
// fake time; it is only on the slow path, when a send has to block.
type blockedClock struct {
	epoch    time.Time
	mu       sync.Mutex
	acc      time.Duration // finished blocked periods
	n        int64         // senders blocked now
	startSum time.Duration // sum of their start offsets from epoch
}

func (b *blockedClock) begin() time.Duration {
	t := time.Since(b.epoch)
	b.mu.Lock()
	b.n++
	b.startSum += t
	b.mu.Unlock()
	return t
}

func (b *blockedClock) end(start time.Duration) {
	t := time.Since(b.epoch)
	b.mu.Lock()
	b.n--
	b.startSum -= start
	b.acc += t - start
	b.mu.Unlock()
}

// seconds is the total blocked time up to now, including ongoing blocks.
func (b *blockedClock) seconds() float64 {
	t := time.Since(b.epoch)
	b.mu.Lock()
	d := b.acc + time.Duration(b.n)*t - b.startSum
	b.mu.Unlock()
	return d.Seconds()
}
