package read

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/lease"
)

// Errors of the stale-read guard.
var (
	// ErrStaleRead fails a request whose read would start past the
	// prefill's abort timeout at a rank without a lease (Guard.AbortTimeout).
	ErrStaleRead = errors.New("read: stale read refused")
	// ErrLeaseLost fails a request whose lease at a prefill rank this
	// worker renews cannot be shown to hold: no RENEW of it was
	// acknowledged for the lease TTL less a margin, or an ACK came back
	// only after that (the prefill frees a renewed request one TTL after
	// its last renewal). It is an ErrStaleRead.
	ErrLeaseLost = fmt.Errorf("%w: lease not renewed", ErrStaleRead)
)

// LeaseView is what the stale-read guard asks of the leases this worker
// renews (lease.Keeper).
type LeaseView interface {
	// LeaseOf reports request id's lease at endpoint; false when this
	// worker does not renew it there.
	LeaseOf(id, endpoint string) (lease.Hold, bool)
}

// Guard is the stale-read guard: the abort timeout at ranks without a
// lease this worker renews, the lease at the others. A read is refused
// when it would start past either; one that started in time and ended past
// a lease fails too (the prefill may have freed and reused the blocks while
// it ran). Notify still sends the DONEs. A retried read (a peer restart) is
// checked again before it starts, with the re-fetched metadata.
type Guard struct {
	// AbortTimeout is the prefill side's abort timeout (its
	// tracker.abort_request_timeout), which the metadata does not carry:
	// a read that would start more than this after the request's admission
	// from a rank without a lease renewed here is refused (ErrStaleRead).
	// 0: no abort-timeout check (the seed's behaviour).
	AbortTimeout time.Duration
	// Leases, if set, are the leases this worker renews: a rank that
	// advertised one and where the request is renewed is checked by its
	// lease instead (ErrLeaseLost), whatever AbortTimeout says.
	Leases LeaseView
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// on reports whether g checks anything.
func (g *Guard) on() bool { return g != nil && (g.AbortTimeout > 0 || g.Leases != nil) }

func (g *Guard) now() time.Time {
	if g.Now != nil {
		return g.Now()
	}
	return time.Now()
}

// checkTask is the guard for task i alone (a read retried after its peer
// restarted: j.Metas[i] is the re-fetched metadata), counted.
func (s *Stage) checkTask(j *job.Job, i int) error {
	g := s.opts.Guard
	return s.countStale(staleTask(j, i, g.AbortTimeout, g.now(), g.Leases, "started"))
}

// checkStale is the guard for every task of j when its read starts (when
// "started") or ends ("ended": only leases are checked again), counted.
func (s *Stage) checkStale(j *job.Job, when string) error {
	g := s.opts.Guard
	if when != "started" && g.Leases == nil {
		return nil
	}
	return s.countStale(staleRead(j, g.AbortTimeout, g.now(), g.Leases, when))
}

func (s *Stage) countStale(err error) error {
	switch {
	case err == nil:
	case errors.Is(err, ErrLeaseLost):
		s.m.leaseLost.Inc()
	default:
		s.m.staleRefused.Inc()
	}
	return err
}

// staleRead is ErrStaleRead, with its reason, if j's read starting (or,
// when is "ended", ending) at now cannot be trusted at some task's rank
// (staleTask).
func staleRead(j *job.Job, abort time.Duration, now time.Time, leases LeaseView, when string) error {
	for i := range j.Plan.Tasks {
		if err := staleTask(j, i, abort, now, leases, when); err != nil {
			return err
		}
	}
	return nil
}

// staleTask is the guard for task i at now:
//   - a rank that advertised a lease and where this worker renews j's
//     request (leases knows it): ErrLeaseLost once its hold ends — the
//     send time of the last acknowledged RENEW (before any, the lease
//     start) plus the TTL less lease.Margin — or once an ACK came back
//     after that (it may have been an ACK of a request already freed);
//   - any other rank, when read starts: ErrStaleRead once now is past
//     abort after j's admission: the prefill may have force-freed the
//     blocks (it started its own timer before j was admitted here) and
//     given them to another request. When a read ends it is not checked
//     again (no lease says more).
func staleTask(j *job.Job, i int, abort time.Duration, now time.Time, leases LeaseView, when string) error {
	if leases != nil && j.Metas[i].LeaseTTL > 0 {
		if h, ok := leases.LeaseOf(j.Req.ID, j.HandshakeEndpoint(i)); ok {
			return holdErr(h, now, i, j.HandshakeEndpoint(i), when)
		}
	}
	if when != "started" {
		return nil
	}
	age := now.Sub(j.Submitted)
	if abort <= 0 || age <= abort {
		return nil
	}
	return fmt.Errorf("%w: task %d (%s): read started %v after admission, past the prefill's abort timeout %v; blocks may have been freed",
		ErrStaleRead, i, j.HandshakeEndpoint(i), age.Round(time.Millisecond), abort)
}

// holdErr is ErrLeaseLost, with its reason, if h does not hold at now.
func holdErr(h lease.Hold, now time.Time, i int, endpoint, when string) error {
	end := h.Until()
	var why string
	switch {
	case h.Lapsed:
		why = "a RENEW was acknowledged only after the lease may have run out"
	case now.After(end) && h.Acked.IsZero():
		why = fmt.Sprintf("no RENEW acknowledged in the %v since the lease started", now.Sub(h.Since).Round(time.Millisecond))
	case now.After(end):
		why = fmt.Sprintf("no RENEW acknowledged in the %v since the last acknowledged one was sent", now.Sub(h.Acked).Round(time.Millisecond))
	default:
		return nil
	}
	return fmt.Errorf("%w: task %d (%s): read %s when %s (lease ttl %v, trusted for %v of it); the prefill may have freed the blocks",
		ErrLeaseLost, i, endpoint, when, why, h.TTL, h.TTL-lease.Margin(h.TTL))
}
